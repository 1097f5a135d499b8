"""Expert parallelism on 4 engines: equality with one process, bytes per all-to-all against the
balanced-routing formula, step time against replicated experts (ep=1) at the same batch, and
the all-to-all the two-micro-batch overlap hides.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_expert.py        # ~1 minute

Bytes (GShard, Lepikhin et al. 2020; DeepSeek-V3 §3.2): a rank's dispatch carries each of its
tokens' top_k rows to the experts' ranks; with routing spread evenly, (ep−1)/ep of them leave
the rank, so one dispatch (and one combine) sends tokens × top_k × hidden × element size ×
(ep−1)/ep. Measured: the ``bytes`` labkit.comm recorded for each forward dispatch of step 0
(averaged over ranks and layers); the ratio shows how uneven the router is (1 = balanced).
Step time: median over steps 1.. of the slowest rank's step (the lab's own harness included).
Exactness: the largest parameter and loss difference from ``labkit.reference`` after 3 SGD
steps, for ep = 2 and 4 beside dp = 4, top-1 and top-2, balance loss off and on.
Overlap: per rank and step, the all-to-all spans' union less the compute spans (the time the
compute lane waited on an all-to-all), median over steps 1.., mean over ranks; beside it the
run's ``exposed_comm_fraction`` (all comm, the dense gradients' all-reduce included) and the
step time against ep=1, for ``ep_overlap`` "none" and "microbatch", on raw gloo and on an
emulated link (``labkit.Link``, ``--link BANDWIDTH,LATENCY``, default 2 MB/s and 0.1 ms) with
experts 16× wider (``--link-ffn``, 1024) so there is expert compute to hide behind: the link's
time is waited off the CPU, so an async all-to-all can run under the experts as on a GPU's
copy engines, which raw gloo on shared cores cannot do.
Imbalance: a router skewed to expert 0 (``router_skew``) under ep=2; per step the max/mean of
the tokens each ep rank received (layer 0) and each rank's exposed all-to-all (the others wait
for the loaded rank in the combine), with the balance loss off and on.
"""
from __future__ import annotations

import argparse
from statistics import mean, median

from labkit.parallel.expert import imbalance

import labkit
from labkit.analysis.metrics import difference_length


def exposed_per_rank_ms(run) -> list[float]:
    """Per rank, the compute lane's wait on all-to-alls per step (ms), median over steps 1.."""
    per_step = {}
    for e in run.timeline.events:
        if e["step"] >= 1:
            spans = per_step.setdefault((e["step"], e["rank"]), ([], []))
            if e["kind"] == "all_to_all":
                spans[0].append((e["start"], e["end"]))
            elif e["stream"] == "compute":
                spans[1].append((e["start"], e["end"]))
    ranks = sorted({r for _, r in per_step})
    return [1e3 * median(difference_length(*per_step[k]) for k in per_step if k[1] == r) for r in ranks]


def exposed_all_to_all_ms(run) -> float:
    """The compute lane's wait on all-to-alls per step (ms): median over steps 1.., mean over ranks."""
    return mean(exposed_per_rank_ms(run))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--link", default="2e6,1e-4", help="emulated link: bytes/s,seconds per message")
    parser.add_argument("--link-ffn", type=int, default=1024, help="the experts' width on the emulated link")
    args = parser.parse_args()
    data = labkit.data.text(batch=16, block_size=32)
    model = labkit.models.llama(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=data.vocab_size,
                                n_experts=args.experts, top_k=args.top_k, aux_loss_coef=0.01)
    kw = dict(data=data, loss="cross_entropy", batch=16, steps=args.steps, lr=0.1, seed=0)
    ref = labkit.reference(model, **kw)
    dp, hidden, tokens = 4, 64, 16 // 4 * 32              # tokens per rank per step
    lab = labkit.Lab.start(engines=dp, timeout=60, progress=False)
    try:
        print(f"{'ep':>3} {'measured B/dispatch':>20} {'formula B':>10} {'ratio':>6} {'step ms':>8} "
              f"{'max |Δparam| vs 1 proc':>23}")
        for ep in (1, 2, 4):
            run = lab.run(labkit.Strategy(dp=dp, ep=ep), model=model, **kw)
            sent = [e["bytes"] for e in run.timeline.events
                    if e["kind"] == "all_to_all" and e["step"] == 0 and e["name"].endswith("mlp dispatch")]
            formula = tokens * args.top_k * hidden * 4 * (ep - 1) / ep
            measured = mean(sent) if sent else 0.0
            ratio = f"{measured / formula:6.3f}" if formula else "     -"
            print(f"{ep:>3} {measured:>20.0f} {formula:>10.0f} {ratio} "
                  f"{1e3 * median(run.step_times[1:]):>8.1f} {run.max_diff(ref):>23.2e}")
        bandwidth, latency = map(float, args.link.split(","))
        wide = labkit.models.llama(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=data.vocab_size,
                                   n_experts=args.experts, top_k=args.top_k, aux_loss_coef=0.01, ffn_hidden=args.link_ffn)
        for link, net in ((None, model), (labkit.Link(bandwidth=bandwidth, latency=latency, name="emulated"), wide)):
            lab.link = link
            one = ref if link is None else labkit.reference(net, **kw)
            where = "raw gloo" if link is None else \
                f"link {bandwidth / 1e6:g} MB/s, {latency * 1e3:g} ms; experts ffn_hidden={args.link_ffn}"
            print(f"\n{where}\n{'ep':>3} {'ep_overlap':>10} {'exposed a2a ms':>14} {'a2a ms':>7} {'exposed comm':>12} "
                  f"{'step ms':>8} {'vs ep=1':>7} {'max |Δparam|':>13}")
            base = None
            for ep, overlap in ((1, "none"), (2, "none"), (2, "microbatch"), (4, "none"), (4, "microbatch")):
                run = lab.run(labkit.Strategy(dp=dp, ep=ep, ep_overlap=overlap), model=net, **kw)
                a2a = [e["end"] - e["start"] for e in run.timeline.events
                       if e["kind"] == "all_to_all" and e["step"] >= 1]
                step = median(run.step_times[1:])
                base = base or step
                print(f"{ep:>3} {overlap:>10} {exposed_all_to_all_ms(run):>14.2f} "
                      f"{1e3 * sum(a2a) / dp / (args.steps - 1):>7.2f} {run.metrics['exposed_comm_fraction']:>12.3f} "
                      f"{1e3 * step:>8.1f} {step / base:>7.2f} {run.max_diff(one):>13.2e}")
        lab.link = None
        print(f"\n{'ep':>3} {'top_k':>5} {'aux':>5} {'max |Δparam|':>13} {'max |Δloss|':>12}")
        for ep in (2, 4):
            for top_k in (1, 2):
                for aux in (0.0, 0.01):
                    small = labkit.models.llama(n_layer=2, n_head=4, n_embd=64, block_size=32,
                                                vocab_size=data.vocab_size, n_experts=args.experts, top_k=top_k,
                                                aux_loss_coef=aux, norm_topk_prob=top_k > 1)
                    three = {**kw, "steps": 3}
                    run, one = lab.run(labkit.Strategy(dp=dp, ep=ep), model=small, **three), \
                        labkit.reference(small, **three)
                    loss = max(abs(a - b) for a, b in zip(run.losses, one.losses))
                    print(f"{ep:>3} {top_k:>5} {aux:>5} {run.max_diff(one):>13.2e} {loss:>12.2e}")
        print(f"\n{'aux':>5} {'ep-rank max/mean per step (layer 0)':<60} {'exposed a2a ms per rank':<28}")
        for aux in (0.0, 0.1):
            skewed = labkit.models.llama(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=data.vocab_size,
                                         n_experts=args.experts, top_k=args.top_k, aux_loss_coef=aux, router_skew=0.5)
            run = lab.run(labkit.Strategy(dp=dp, ep=2), model=skewed, **{**kw, "steps": 2 * args.steps})
            ratios = " ".join(f"{imbalance(s['layers.0.mlp']):.2f}" for s in run.metrics["tokens_per_ep_rank"])
            ranks = " ".join(f"{v:.1f}" for v in exposed_per_rank_ms(run))
            print(f"{aux:>5} {ratios:<60} {ranks:<28}")
    finally:
        lab.close()


if __name__ == "__main__":
    main()
