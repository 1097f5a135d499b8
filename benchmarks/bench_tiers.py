"""Two tiers on the emulated link: where each axis sits, and HSDP against ZeRO-3, run after run.

    .venv/bin/python benchmarks/bench_tiers.py              # 10 runs on 4 engines, ~4 minutes
    .venv/bin/python benchmarks/bench_tiers.py --runs 3

Two emulated nodes of two engines, 400 MB/s inside a node and 20 MB/s between (notebook 04's
cluster). Each run, on one lab:

1. ``Strategy(dp=2, tp=2)`` with tp inside the nodes (the default order) and across them
   (``order="dp,tp,cp,pp"``), on 2,048 rows, where tp's activations outweigh dp's gradients:
   bytes each rank sent on each tier and the median step.
2. ``Strategy(dp=4, zero=3)`` against HSDP ``Strategy(dp=4, zero=3, dp_shard=2)``: bytes between
   nodes, parameters a rank holds, the median step, and max |Δ| against one process.

The last lines count the runs in which tp inside beat tp across and HSDP beat ZeRO-3 (the
notebook claims both); the bytes are checked against their formulas in every run.
"""
from __future__ import annotations

import argparse
import labkit
from labkit.models import mlp

LINK = labkit.Link(bandwidth=400e6, latency=100e-6, gpus_per_node=2, inter_bandwidth=20e6)
TP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


MODEL = mlp(width=256, depth=4)       # a factory, as lab.run takes it


def median_step(run) -> float:
    return run.metrics["step_time_s"]          # the median over the run's steps


def bytes_as_formulas(r) -> bool:
    """Per rank and step: placement swaps the tiers, nothing else; HSDP's inter-node bytes are the
    all-reduce of its shard over 2 replicas, 2(2-1)/2 · S/2 = its parameters; ZeRO-3's two
    all-gathers and reduce-scatter over 4 are 3 · 3/4 · S = 9 times its quarter of S."""
    tier = {name: r[name].metrics["bytes_sent_by_tier"] for name in ("tp inside", "tp across", "ZeRO-3", "HSDP")}
    held = {name: r[name].metrics["memory_bytes"][0]["params"] for name in ("ZeRO-3", "HSDP")}
    return (tier["tp across"]["inter"][0] == tier["tp inside"]["intra"][0]
            and tier["tp across"]["intra"][0] == tier["tp inside"]["inter"][0]
            and tier["HSDP"]["inter"][0] == held["HSDP"]
            and tier["ZeRO-3"]["inter"][0] == 9 * held["ZeRO-3"])


def one_run(lab, reference) -> dict:
    out = {}
    for where, order in (("tp inside", "tp,cp,pp,dp"), ("tp across", "dp,tp,cp,pp")):
        run = lab.run(labkit.Strategy(dp=2, tp=2, order=order), model=MODEL, batch=2048, steps=4, tp_plan=TP_PLAN)
        out[where] = run
    for name, s in (("ZeRO-3", labkit.Strategy(dp=4, zero=3)), ("HSDP", labkit.Strategy(dp=4, zero=3, dp_shard=2))):
        run = lab.run(s, model=MODEL, batch=32, steps=4)
        out[name] = run
        out[name + " diff"] = float(run.max_diff(reference))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    reference = labkit.reference(MODEL, batch=32, steps=4)
    wins, formulas = {"tp inside": 0, "HSDP": 0}, 0
    with labkit.Lab.start(engines=4) as lab:
        lab.link = LINK
        print(f"link: {LINK}")
        print(f"{'run':>3} {'case':>10} {'intra MB':>9} {'inter MB':>9} {'params MB':>9} {'step ms':>8} {'max |Δ|':>8}")
        for i in range(args.runs):
            r = one_run(lab, reference)
            for name in ("tp inside", "tp across", "ZeRO-3", "HSDP"):
                m = r[name].metrics
                tiers = m["bytes_sent_by_tier"]
                diff = f"{r[name + ' diff']:8.1e}" if name + " diff" in r else " " * 8
                print(f"{i:>3} {name:>10} {tiers['intra'][0] / 1e6:9.3f} {tiers['inter'][0] / 1e6:9.3f} "
                      f"{m['memory_bytes'][0]['params'] / 1e6:9.3f} {1e3 * median_step(r[name]):8.1f} {diff}", flush=True)
            formulas += bytes_as_formulas(r)
            wins["tp inside"] += median_step(r["tp inside"]) < median_step(r["tp across"])
            wins["HSDP"] += median_step(r["HSDP"]) < median_step(r["ZeRO-3"])
    print(f"bytes per tier as the formulas say: {formulas} of {args.runs} runs")
    print(f"tp inside the nodes faster than across: {wins['tp inside']} of {args.runs} runs")
    print(f"HSDP faster than ZeRO-3 over all four: {wins['HSDP']} of {args.runs} runs")


if __name__ == "__main__":
    main()
