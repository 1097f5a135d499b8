"""Expert parallelism on 4 engines: equality with one process, bytes per all-to-all against the
balanced-routing formula, step time against replicated experts (ep=1) at the same batch, and
the all-to-all the two-micro-batch overlap hides.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_expert.py        # ~3 minutes

Exactness: the largest parameter and loss difference from ``labkit.reference`` after 3 SGD
steps (balance loss on), for ep = 2 and 4 beside dp = 4, ep = 2 inside each stage of pp = 2 and
beside tp = 2, ``ep_overlap`` off and on, top-1 and top-2; beside it the tolerance the tests
hold them to (a pipeline's reported loss leaves out the balance loss, so only its parameters
are compared).
Bytes (GShard, Lepikhin et al. 2020; DeepSeek-V3, arXiv 2412.19437, §3.2.2): a rank's dispatch carries each of its
tokens' top_k rows to the experts' ranks; with routing spread evenly, (ep−1)/ep of them leave
the rank, so one dispatch (and one combine) sends tokens × top_k × hidden × element size ×
(ep−1)/ep. Measured: the ``bytes`` labkit.comm recorded for each forward dispatch of step 0
(averaged over ranks and layers); the ratio shows how uneven the router is (1 = balanced).
Step time: median over steps 1.. of the slowest rank's step (the lab's own harness included),
against ep=1 (every expert on every rank, all-reduced) at the same global batch.
Overlap: per rank and step, the all-to-all spans' union less the compute spans (the time the
compute lane waited on an all-to-all; ``labkit.view.experts.all_to_all_ms``), median over
steps 1.., mean over ranks; beside it the run's ``exposed_comm_fraction`` (all comm, the
gradients' all-reduce included), for ``ep_overlap`` "none" and "microbatch", on raw gloo and
on an emulated link (``labkit.Link``, ``--link BANDWIDTH,LATENCY``, default 3 MB/s and 0.1 ms,
notebook 14's) with 4 experts of width 2048 (``--link-ffn``) so there is expert compute to
hide behind: the link's time is waited off the CPU, so an async all-to-all can run under the
experts as on a GPU's copy engines, which raw gloo on shared cores cannot do.
Imbalance (notebook 14's runs): a router skewed to expert 0 (``router_skew``), top-1, ep=4: the
tokens each ep rank receives and each rank's time in the combine and the dispatch's backward
(the others wait for the loaded rank); then top-2 at ep=2 over 40 AdamW steps, the balance
loss off and on: the ep ranks' max/mean every 5 steps and over the last 15.
"""
from __future__ import annotations

import argparse
from statistics import mean, median

import labkit
from labkit.parallel.expert import imbalance
from labkit.view.experts import all_to_all_ms

TOL = 1e-5               # tests/test_expert.py's float32 tolerance


def llama(data, **kw):
    return labkit.models.llama(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=data.vocab_size, **kw)


def exactness(lab, data, kw, experts: int) -> None:
    print(f"{'strategy':<52} {'top_k':>5} {'max |Δparam|':>13} {'max |Δloss|':>12} {'tolerance':>10}")
    three = {**kw, "steps": 3}
    for top_k in (1, 2):
        model = llama(data, n_experts=experts, top_k=top_k, aux_loss_coef=0.01, norm_topk_prob=top_k > 1)
        one = labkit.reference(model, **three)
        for layout in (dict(dp=4, ep=2), dict(dp=4, ep=4), dict(dp=2, pp=2, ep=2, microbatches=2),
                       dict(dp=2, tp=2, ep=2)):
            for overlap in ("none", "microbatch"):
                s = labkit.Strategy(**layout, ep_overlap=overlap)
                run = lab.run(s, model=model, **three)
                # a pipeline reports its last stage's cross-entropy, without the balance loss
                loss = f"{max(abs(a - b) for a, b in zip(run.losses, one.losses)):>12.2e}" if s.pp == 1 else \
                    f"{'(pp)':>12}"
                print(f"{s.label():<52} {top_k:>5} {run.max_diff(one):>13.2e} {loss} {TOL:>10.0e}")


def bytes_and_step_time(lab, data, kw, experts: int, top_k: int) -> None:
    model = llama(data, n_experts=experts, top_k=top_k, aux_loss_coef=0.01)
    dp, hidden, tokens = 4, 64, kw["batch"] // 4 * 32              # tokens per rank per step
    print(f"{'ep':>3} {'measured B/dispatch':>20} {'formula B':>10} {'ratio':>6} {'step ms':>8} {'vs ep=1':>7}")
    base = None
    for ep in (1, 2, 4):
        run = lab.run(labkit.Strategy(dp=dp, ep=ep), model=model, **kw)
        sent = [e["bytes"] for e in run.timeline.events
                if e["kind"] == "all_to_all" and e["step"] == 0 and e["name"].endswith("mlp dispatch")]
        formula = tokens * top_k * hidden * 4 * (ep - 1) / ep
        measured = mean(sent) if sent else 0.0
        ratio = f"{measured / formula:6.3f}" if formula else "     -"
        step = median(run.step_times[1:])
        base = base or step
        print(f"{ep:>3} {measured:>20.0f} {formula:>10.0f} {ratio} {1e3 * step:>8.1f} {step / base:>7.2f}")


def overlap(lab, data, kw, experts: int, top_k: int, link_arg: str, ffn: int) -> None:
    bandwidth, latency = map(float, link_arg.split(","))
    for link, model in ((None, llama(data, n_experts=experts, top_k=top_k, aux_loss_coef=0.01)),
                        (labkit.Link(bandwidth=bandwidth, latency=latency, name="emulated"),
                         llama(data, n_experts=4, top_k=top_k, aux_loss_coef=0.01, ffn_hidden=ffn))):
        lab.link = link
        where = "raw gloo" if link is None else \
            f"link {bandwidth / 1e6:g} MB/s, {latency * 1e3:g} ms; 4 experts, ffn_hidden={ffn}"
        print(f"\n{where}\n{'ep':>3} {'ep_overlap':>10} {'exposed a2a ms':>14} {'a2a ms':>7} {'exposed comm':>12} "
              f"{'step ms':>8} {'max |Δparam|':>13}")
        one = labkit.reference(model, **kw)
        for ep in (2, 4):
            for mode in ("none", "microbatch"):
                run = lab.run(labkit.Strategy(dp=4, ep=ep, ep_overlap=mode), model=model, **kw)
                print(f"{ep:>3} {mode:>10} {mean(all_to_all_ms(run, exposed=True)):>14.2f} "
                      f"{mean(all_to_all_ms(run)):>7.2f} {run.metrics['exposed_comm_fraction']:>12.3f} "
                      f"{1e3 * median(run.step_times[1:]):>8.1f} {run.max_diff(one):>13.2e}")
    lab.link = None


def skew(lab, data, kw) -> None:
    """Notebook 14's straggler and balance-loss runs, as numbers."""
    model = llama(data, ffn_hidden=4096, n_experts=4, top_k=1, norm_topk_prob=False, aux_loss_coef=0, router_skew=2.0)
    run = lab.run(labkit.Strategy(dp=4, ep=4), model=model, **{**kw, "steps": 4})
    waits = [a + b for a, b in zip(all_to_all_ms(run, "mlp combine"), all_to_all_ms(run, "dispatch backward"))]
    print(f"\nrouter_skew=2.0, top-1, ep=4: tokens per ep rank {run.metrics['tokens_per_ep_rank'][0]['layers.0.mlp']}; "
          f"ms per step in the combine + dispatch backward, per rank: {' '.join(f'{w:.1f}' for w in waits)}")
    print(f"\nrouter_skew=1.0, top-2, ep=2, AdamW lr 3e-3, 40 steps: tokens per ep rank max/mean (mean over layers)\n"
          f"{'aux':>5} {'steps 0, 5, 10, ..., 35':<44} {'steps 25-39 mean':>16}")
    for aux in (0.0, 0.1):
        model = llama(data, ffn_hidden=128, n_experts=4, top_k=2, aux_loss_coef=aux, router_skew=1.0)
        run = lab.run(labkit.Strategy(dp=4, ep=2), model=model, **{**kw, "steps": 40, "lr": 3e-3, "optimizer": "adamw"})
        curve = [mean(imbalance(c) for c in step.values()) for step in run.metrics["tokens_per_ep_rank"]]
        print(f"{aux:>5} {' '.join(f'{c:.2f}' for c in curve[::5]):<44} {mean(curve[-15:]):>16.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--link", default="3e6,1e-4", help="emulated link: bytes/s,seconds per message")
    parser.add_argument("--link-ffn", type=int, default=2048, help="the experts' width on the emulated link")
    args = parser.parse_args()
    data = labkit.data.text(batch=16, block_size=32)
    kw = dict(data=data, loss="cross_entropy", batch=16, steps=args.steps, lr=0.1, seed=0)
    lab = labkit.Lab.start(engines=4, timeout=60, progress=False)
    try:
        exactness(lab, data, kw, args.experts)
        print()
        bytes_and_step_time(lab, data, kw, args.experts, args.top_k)
        overlap(lab, data, kw, args.experts, args.top_k, args.link, args.link_ffn)
        skew(lab, data, kw)
    finally:
        lab.close()


if __name__ == "__main__":
    main()
