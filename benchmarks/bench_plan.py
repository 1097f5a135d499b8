"""Predicted against measured step time on local CPU engines, out of sample: the planner's accuracy here.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_plan.py --engines 2               # ~5 minutes
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_plan.py --engines 2 --link 50e6,200e-6
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_plan.py --engines 4 --cases pp

The machine is measured once (``labkit.plan.measure``: matmuls, an elementwise loop, tiny
autograd ops, collectives, a trivial model's host costs; no model of the cases, no strategy of
the cases), and each case's model has its pieces timed in sequence on this process, one
thread, at the case's micro-batch size (``labkit.plan.local.profile.profile``: the model alone, no
strategy, no engine); then every case (strategies, model widths and depths, micro-batch counts, degrees
a Llama model that no measurement ran, its sequence over cp ranks and its MoE twin's experts
over ep ranks, and a transformers LlamaForCausalLM from a config under dp, a pipeline and cp, and a transformers Mixtral's
fused experts over ep) is simulated from it and run on the lab, twice.
The two runs ``measure`` itself takes of a trivial model (its host cost per action) are
repeated as the in-sample cases; every other case is held out. Prints, per case,
the measured step time (median of the two runs), the predicted, their ratio, the second run
over the first (how far a measurement predicts itself: the floor under the ratio), and the
exposed-comm fraction measured/predicted; then how many cases meet the targets (step time
within 15 % on 2 engines, 20 % on 4; exposed comm within 0.07); then the ablation: the
held-out error with each host term of the machine switched off (:data:`TERMS`, each set to
nothing) and with the model's timed pieces left out (``profile``: the ops' table prices alone),
so a term that does not make the held-out cases better shows it; and the host's load average (``os.getloadavg``), since the engines share their cores
with whatever else runs; ``--remeasure`` measures the machine again before each case, so a
drift of that load between the measurement and the case is taken out.
Each case's model has its pieces timed between its two runs, not once for the round: this
host's own speed drifts (one fixed 4-layer forward and backward, timed every second for four
minutes: 1.84–4.07 ms, p10–p90 2.16–2.87, its 10-second medians wandering 2.05 → 2.90), so a
profile taken minutes before a case prices it at another moment's speed.
``--link bandwidth,latency``: the lab runs on an emulated link (``labkit.Link``), whose α and
β the machine takes as they are imposed.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from statistics import median

os.environ.setdefault("OMP_NUM_THREADS", "1")

import labkit  # noqa: E402
from labkit import plan  # noqa: E402


def mlp_tp_plan(depth: int) -> dict:
    """Megatron's MLP split for labkit.models.mlp: Linear layers (even blocks) alternately
    column- and row-parallel, so each pair needs one g forward and one f backward."""
    return {str(2 * i): "colwise" if i % 2 == 0 else "rowwise" for i in range(depth)}


def _mlp(width: int, depth: int, batch: int = 64) -> dict:
    return {"model": labkit.models.mlp(width=width, depth=depth), "batch": batch, "tp_plan": mlp_tp_plan(depth),
            "label": f"mlp{width}x{depth}"}


def _llama(batch: int = 8) -> dict:
    data = labkit.data.text(batch=batch, block_size=64)
    model = labkit.models.llama(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=data.vocab_size)
    return {"model": model, "batch": batch, "data": data, "loss": "cross_entropy", "label": "llama4x128"}


def _moe(batch: int = 8) -> dict:
    data = labkit.data.text(batch=batch, block_size=64)
    model = labkit.models.llama(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=data.vocab_size,
                                n_experts=4, top_k=2)
    return {"model": model, "batch": batch, "data": data, "loss": "cross_entropy", "label": "moe4x128e4"}


def _hf_llama(batch: int = 8) -> dict:
    """A transformers LlamaForCausalLM from a config, as a user brings one: its own attention
    (routed through labkit's under cp), its own blocks and tensor plan."""
    from transformers import LlamaConfig
    data = labkit.data.text(batch=batch, block_size=64)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, vocab_size=data.vocab_size)
    return {"model": labkit.models.from_hf(config), "batch": batch, "data": data, "loss": "cross_entropy",
            "label": "hf-llama4x128"}


def _hf_mixtral(batch: int = 8) -> dict:
    """A transformers MixtralForCausalLM from a config: its sparse blocks' fused experts, which
    ep spreads as they are (the model's own router and experts code)."""
    from transformers import MixtralConfig
    data = labkit.data.text(batch=batch, block_size=64)
    config = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, vocab_size=data.vocab_size,
                           num_local_experts=4, num_experts_per_tok=2)
    return {"model": labkit.models.from_hf(config), "batch": batch, "data": data, "loss": "cross_entropy",
            "label": "hf-mixtral4x128e4"}


def in_sample(engines: int) -> list[tuple[str, labkit.Strategy, dict]]:
    """The runs labkit.plan.measure takes itself (its host cost per action comes from them)."""
    S, n = labkit.Strategy, engines
    spec = {"model": labkit.models.mlp(width=8, depth=2), "batch": 8 * n, "label": "mlp8x2", "in_sample": True}
    return [(f"dp{n} bucketed m{m}", S(dp=n, microbatches=m, dp_mode="bucketed"), spec) for m in (1, 8)]


def cases(engines: int) -> list[tuple[str, labkit.Strategy, dict]]:
    S, out = labkit.Strategy, in_sample(engines)
    base, wide, deep = _mlp(512, 8), _mlp(1024, 4), _mlp(256, 16)
    n = engines
    for m in ("naive", "bucketed", "overlap", "ddp"):
        out.append((f"dp{n} {m}", S(dp=n, dp_mode=m), base))
    for z in (1, 2, 3):
        out.append((f"dp{n} zero{z}", S(dp=n, zero=z), base))
    out.append((f"dp{n} zero3 prefetch1", S(dp=n, zero=3, prefetch=1), base))
    dp = n // 2
    pre = f" dp{dp}" if dp > 1 else ""
    for sched, chunks, split in (("gpipe", 1, ()), ("1f1b", 1, ()), ("interleaved", 2, (4, 8, 12)),
                                 ("zb-h1", 1, ()), ("zbv", 2, (4, 8, 12))):
        out.append((f"pp2{pre} {sched} m4", S(dp=dp, pp=2, schedule=sched, chunks=chunks, microbatches=4,
                                               split_at=split, dp_mode="overlap"), base))
    out.append(("tp2" if n == 2 else f"dp{dp} tp2 overlap", S(dp=dp, tp=2, dp_mode="overlap"), base))
    # other widths, depths and micro-batch counts
    out += [(f"dp{n} overlap", S(dp=n, dp_mode="overlap"), wide),
            (f"pp2{pre} 1f1b m8", S(dp=dp, pp=2, schedule="1f1b", microbatches=8, dp_mode="overlap"), wide),
            (f"dp{n} bucketed", S(dp=n, dp_mode="bucketed"), deep),
            (f"pp2{pre} gpipe m2", S(dp=dp, pp=2, schedule="gpipe", microbatches=2, dp_mode="overlap"), deep),
            (f"dp{n} zero3", S(dp=n, zero=3), deep),
            (f"dp{n} overlap", S(dp=n, dp_mode="overlap"), _llama()),
            ("tp2" if n == 2 else f"dp{dp} tp2", S(dp=dp, tp=2, dp_mode="overlap"), _llama())]
    if n >= 4:
        out += [("pp4 1f1b m8", S(pp=4, schedule="1f1b", microbatches=8), base),
                ("pp2 tp2 1f1b m4", S(dp=n // 4, pp=2, tp=2, schedule="1f1b", microbatches=4), base)]
    # context parallelism: a llama's sequence over 2 (and 4) ranks, each cp mode the planner models
    llama, dp2, dp4 = _llama(), f"dp{n // 2} " if n > 2 else "", f"dp{n // 4} " if n > 4 else ""
    for mode in ("ring", "allgather"):
        out.append((f"{dp2}cp2 {mode}", S(dp=n // 2, cp=2, cp_mode=mode), llama))
        if n >= 4:
            out.append((f"{dp4}cp4 {mode}", S(dp=n // 4, cp=4, cp_mode=mode), llama))
    out.append((f"{dp2}cp2 ulysses", S(dp=n // 2, cp=2, cp_mode="ulysses"), llama))
    # a transformers model as it is: data parallel, a pipeline, its sequence over cp ranks
    hf = _hf_llama()
    out += [(f"dp{n} overlap", S(dp=n, dp_mode="overlap"), hf),
            (f"pp2{pre} 1f1b m4", S(dp=dp, pp=2, schedule="1f1b", microbatches=4, dp_mode="overlap"), hf),
            (f"{dp2}cp2 ring", S(dp=n // 2, cp=2), hf)]
    # expert parallelism: a MoE llama's experts over 2 (and 4) of the dp ranks, with and without overlap
    out += [(f"dp{n} ep{ep}{' overlap' if o != 'none' else ''}", S(dp=n, ep=ep, ep_overlap=o), _moe())
            for ep in (2, 4) if ep <= n for o in ("none", "microbatch")]
    out.append((f"dp{n} ep2", S(dp=n, ep=2), _hf_mixtral()))      # a transformers MoE as it is
    return out


KEYS = ("step_time_s", "exposed_comm_fraction", "bubble_fraction")
TERMS = ("call_s", "message_s", "action_s", "wake", "refetch")
"""The machine's host terms and the compute table's refinements that the ablation switches off
one at a time (each set to nothing), beside the model's own pieces timed (``profile``): a term
whose removal leaves the held-out cases as good is not earning its place. Those the machine no
longer has went when this ablation on the emulated link showed them earning nothing
(``labkit.plan.local.machine.DELETED``)."""


def without(machine, term: str):
    """``machine`` with ``term`` switched off: a number 0, a table empty."""
    value = getattr(machine, term)
    off = type(value)() if isinstance(value, (dict, tuple)) else 0.0
    if hasattr(machine.host, term):
        return replace(machine, host=replace(machine.host, **{term: off}))
    if hasattr(machine.memory, term):
        return replace(machine, memory=replace(machine.memory, **{term: off}))
    return replace(machine, **{term: off})


def terms(machine) -> list[str]:
    return [t for t in TERMS if hasattr(machine, t)]


def one_case(lab, machine, strategy, spec: dict, steps: int) -> dict:
    kw = {k: spec[k] for k in ("data", "loss") if k in spec}
    tp_plan = spec.get("tp_plan") if strategy.tp > 1 else None
    def run():
        return lab.run(strategy, model=spec["model"], batch=spec["batch"], steps=steps, tp_plan=tp_plan, **kw).metrics
    runs = [run()]
    # the model's pieces timed between the two runs (the host's own speed drifts over minutes:
    # a profile kept from an earlier case would price this one at another moment's speed)
    plan.local.physical.forget_profiles()
    sim = dict(kw, steps=steps)          # the run's steps: an MoE's routes move as its router trains
    pred = plan.simulate(strategy, machine, model=spec["model"], batch=spec["batch"], tp_plan=tp_plan, **sim)
    ablated = {t: plan.simulate(strategy, without(machine, t), model=spec["model"], batch=spec["batch"],
                                tp_plan=tp_plan, **sim).metrics["step_time_s"] for t in terms(machine)}
    ablated["profile"] = plan.simulate(strategy, machine, model=spec["model"], batch=spec["batch"], tp_plan=tp_plan,
                                       profile=False, **sim).metrics["step_time_s"]
    runs.append(run())
    row = {f"predicted_{k}": pred.metrics[k] for k in KEYS}
    row["without"] = ablated
    row["in_sample"] = bool(spec.get("in_sample"))
    for k in KEYS:
        row[f"measured_{k}"] = median(r[k] for r in runs)
        row[f"runs_{k}"] = [r[k] for r in runs]
    row["load"] = os.getloadavg()[0]
    return row


def summarise(rows: list[dict], engines: int) -> str:
    target = 0.15 if engines <= 2 else 0.20
    lines = [f"{'case':>34} {'measured ms':>11} {'predicted ms':>12} {'ratio':>6} {'2nd/1st':>7} "
             f"{'exposed m/p':>11} {'bubble m/p':>11} {'load':>5}"]
    for r in rows:
        ratio = r["predicted_step_time_s"] / r["measured_step_time_s"]
        a, b = r["runs_step_time_s"]
        lines.append(f"{r['case']:>34} {1e3 * r['measured_step_time_s']:>11.2f} {1e3 * r['predicted_step_time_s']:>12.2f} "
                     f"{ratio:>6.2f} "
                     f"{b / a:>7.2f} "
                     f"{r['measured_exposed_comm_fraction']:>5.2f}/{r['predicted_exposed_comm_fraction']:<5.2f} "
                     f"{r['measured_bubble_fraction']:>5.2f}/{r['predicted_bubble_fraction']:<5.2f} {r['load']:>5.1f}")
    for label, part in (("in sample", [r for r in rows if r["in_sample"]]),
                        ("held out", [r for r in rows if not r["in_sample"]])):
        if not part:
            continue
        hit_t = sum(abs(r["predicted_step_time_s"] / r["measured_step_time_s"] - 1) <= target for r in part)
        floor_t = sum(abs(r["runs_step_time_s"][1] / r["runs_step_time_s"][0] - 1) <= target for r in part)
        hit_x = sum(abs(r["measured_exposed_comm_fraction"] - r["predicted_exposed_comm_fraction"]) <= 0.07
                    for r in part)
        lines.append(f"{label} ({len(part)} cases): step time within ±{100 * target:.0f} %: {hit_t}; exposed comm within ±0.07: {hit_x}; the second run within "
                     f"±{100 * target:.0f} % of the first: {floor_t}")
    return "\n".join(lines + ablation(rows, target))


def _errors(rows, key=None) -> list[float]:
    return sorted(abs((r["without"][key] if key else r["predicted_step_time_s"]) / r["measured_step_time_s"] - 1)
                  for r in rows)


def ablation(rows: list[dict], target: float) -> list[str]:
    """The held-out cases' error with each term off beside all terms on: median and worst |error|
    and the cases within ``target``; a term whose removal leaves them as good is not earning its place."""
    held = [r for r in rows if not r["in_sample"]]
    if not held:
        return []
    lines = [f"ablation, held out ({len(held)} cases): {'term off':>16} {'median |err|':>12} {'worst':>6} "
             f"{'within':>6}"]

    def line(label, errs):
        return (f"{'':>34} {label:>16} {100 * errs[len(errs) // 2]:>11.1f}% {100 * errs[-1]:>5.0f}% "
                f"{sum(e <= target for e in errs):>6}")
    lines.append(line("(all on)", _errors(held)))
    common = [t for t in held[0]["without"] if all(t in r["without"] for r in held)]
    lines += [line(t, _errors(held, t)) for t in common]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cases", default="", help="only the cases whose name (or model label) contains this")
    p.add_argument("--link", default="", help="bandwidth,latency of an emulated link, e.g. 50e6,200e-6")
    p.add_argument("--machine", help="load this saved Machine instead of measuring")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the machine again just before each case (a host whose load drifts)")
    p.add_argument("--json")
    p.add_argument("--pool", nargs="+", metavar="JSON",
                   help="print the tables of the rows of these saved runs (--json) together, running nothing: "
                        "rounds on a loaded host pooled")
    args = p.parse_args()
    if args.pool:
        rows = [r for path in args.pool for r in json.load(open(path))["rows"]]
        print(f"{len(args.pool)} rounds pooled")
        print(summarise(rows, args.engines))
        return
    link = None
    if args.link:
        bw, lat = (float(x) for x in args.link.split(","))
        link = labkit.Link(bandwidth=bw, latency=lat)
    with labkit.Lab.start(engines=args.engines, timeout=120, progress=False, link=link) as lab:
        load0 = os.getloadavg()[0]
        machine = plan.Machine.load(args.machine) if args.machine else plan.measure(lab)
        print(machine)
        print(f"load average at measurement: {load0:.1f} on {os.cpu_count()} CPUs")
        rows = []
        for name, s, spec in cases(lab.world_size):
            name = f"{spec['label']} {name}"
            if args.cases not in name:
                continue
            if args.remeasure:
                machine = plan.measure(lab)
            rows.append({"case": name, **one_case(lab, machine, s, spec, args.steps)})
            print(f"  {name}: measured {[round(1e3 * t, 1) for t in rows[-1]['runs_step_time_s']]} ms, "
                  f"predicted {1e3 * rows[-1]['predicted_step_time_s']:.1f} ms", flush=True)
    print(f"{args.engines} engines{f', link {link}' if link else ''}, {args.steps} steps per run, two runs per case")
    print(summarise(rows, args.engines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": str(machine), "numbers": machine.numbers(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
