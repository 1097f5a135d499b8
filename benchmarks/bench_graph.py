"""The step as a graph, measured: the critical path on planted stragglers, and what-if replays
against real runs on the emulated link.

Prints, for a run of local CPU engines:

1. **A planted straggler** (``lab.straggler``) on dp=4: the planted rank's share of the critical
   path's compute, whether ``bound_by()`` names it first, and ``straggler_scores()``'s worst rank.
2. **A slow pipeline stage** under GPipe (dp=2 × pp=2, the straggler on stage 1): whether every
   micro-batch's forward of that stage lies on the path.
3. **Coverage**: the path's length against the step, every step of every run above.
4. **What if**: each case run at 50 MB/s on the emulated link, replayed at 10 and 200 MB/s
   (``run.whatif(link=…)``), and run again at those links; predicted ÷ measured step time, the
   50 MB/s run replayed on its own link, and each real run's spread of step times. The
   cases use a model the project's tests do not (an ordinary ``nn.Module`` with a residual
   block, width 192, five blocks): dp overlap, ZeRO-3, 1F1B, and tp (2 engines) or dp×tp (4).
   Then dp overlap's buckets rebuilt at 0.05 and 1 MiB (``run.whatif(bucket_mb=…)``) against runs
   at those sizes, and from a raw-gloo run to the 50 MB/s link: how far a replay goes without the
   link's view.
5. **Scale**: ``critical_path`` on synthetic 1,024 ranks × 400 spans, seconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_graph.py            # 2 engines for 4.
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_graph.py --engines 4
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from statistics import median

import numpy as np
import torch
from torch import nn

import labkit

LINK = dict(latency=2e-4)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """A model written the way users write them: residual blocks in a ModuleList, its own forward."""

    pp_plan = ["blocks", "head"]

    def __init__(self, width: int = 192, depth: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def planted(lab4) -> None:
    """Parts 1–3 (4 engines)."""
    model = labkit.models.mlp(width=64, depth=4)
    with lab4.straggler(rank=2, seconds=0.004):
        run = lab4.run(labkit.Strategy(dp=4, dp_mode="overlap", bucket_mb=0.05), model=model, batch=32, steps=4)
    shares, covers = [], []
    for s in run.timeline.steps[1:]:
        path = run.timeline.critical_path(s)
        compute = [e for e in path.events if e["stream"] == "compute" and e["kind"] != "untraced"]
        total = sum(e["end"] - e["start"] for e in compute)
        shares.append(sum(e["end"] - e["start"] for e in compute if e["rank"] == 2) / total)
        covers.append(sum(e["end"] - e["start"] for e in path.events) / run.timeline.step_durations()[s])
    print(f"1. dp=4, rank 2 planted +4 ms per layer forward: its share of the path's compute "
          f"{min(shares):.0%}–{max(shares):.0%} (target ≥ 60 %)")
    print(f"   bound_by: {run.timeline.bound_by()}")
    print(f"   worst by straggler_scores: rank {run.timeline.straggler_scores().worst().rank}")
    with lab4.straggler(rank=1, seconds=0.004):
        run = lab4.run(labkit.Strategy(dp=2, pp=2, schedule="gpipe", microbatches=4), model=model, batch=32, steps=3)
    every = []
    for s in run.timeline.steps[1:]:
        path = run.timeline.critical_path(s)
        every.append({e["microbatch"] for e in path.events if e["rank"] == 1 and e["kind"] == "fwd"} == set(range(4)))
        covers.append(sum(e["end"] - e["start"] for e in path.events) / run.timeline.step_durations()[s])
    print(f"2. GPipe dp=2×pp=2, stage-1 rank 1 slow: every micro-batch's forward on the path in "
          f"{sum(every)}/{len(every)} steps")
    print(f"3. path length ÷ step: {min(covers):.3f}–{max(covers):.3f}")


def whatif(lab, engines: int) -> None:
    """Part 4: replay at 10 and 200 MB/s a run measured at 50, against runs at those links."""
    cases = {"dp overlap": labkit.Strategy(dp=engines, dp_mode="overlap", bucket_mb=0.25),
             "zero-3": labkit.Strategy(dp=engines, zero=3),
             "1f1b": labkit.Strategy(dp=engines // 2, pp=2, schedule="1f1b", microbatches=4)}
    if engines == 2:
        cases["tp"] = labkit.Strategy(tp=2)
    else:
        cases["dp×tp"] = labkit.Strategy(dp=2, tp=2)
    tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    kw = dict(model=Residual, batch=32, steps=4, data=_data, tp_plan=tp_plan)
    print(f"4. what if, {engines} engines, a residual nn.Module (width 192, 5 blocks): predicted ÷ measured step "
          f"(load {open('/proc/loadavg').read().split()[0]})")
    print(f"   {'case':<12} {'at 50 MB/s':>11} {'replayed':>9} {'10 MB/s':>20} {'200 MB/s':>20}   real runs' steps, min–max")
    errors = []
    for name, strategy in cases.items():
        runs = {}
        for bw in (50e6, 10e6, 200e6):
            lab.link = labkit.Link(bandwidth=bw, **LINK)
            lab.run(strategy, **{**kw, "steps": 1})              # groups and caches made
            runs[bw] = lab.run(strategy, **kw)
        base = runs[50e6]
        cells = []
        for bw in (10e6, 200e6):
            pred = base.whatif(link=labkit.Link(bandwidth=bw, **LINK)).step_time_s
            real = runs[bw].metrics["step_time_s"]
            errors.append(pred / real - 1)
            cells.append(f"{pred * 1e3:6.1f}/{real * 1e3:6.1f} ms {pred / real:5.2f}")
        spread = "  ".join(f"{min(r.timeline.step_durations().values()) * 1e3:.0f}–"
                           f"{max(r.timeline.step_durations().values()) * 1e3:.0f}" for r in runs.values())
        print(f"   {name:<12} {base.metrics['step_time_s'] * 1e3:8.1f} ms {base.whatif().step_time_s * 1e3:6.1f} ms "
              f"{cells[0]:>20} {cells[1]:>20}   {spread}")
    within = sum(abs(e) <= 0.15 for e in errors)
    print(f"   within 15 %: {within}/{len(errors)}; median |error| {median(abs(e) for e in errors):.1%}")
    rebuckets(lab, cases["dp overlap"], kw)
    lab.link = None
    print("   from raw gloo to the 50 MB/s link (the replay cannot see gloo under a link):")
    for name, strategy in cases.items():
        lab.run(strategy, **{**kw, "steps": 1})
        raw = lab.run(strategy, **kw)
        lab.link = labkit.Link(bandwidth=50e6, **LINK)
        real = lab.run(strategy, **kw).metrics["step_time_s"]
        lab.link = None
        pred = raw.whatif(link=labkit.Link(bandwidth=50e6, **LINK)).step_time_s
        print(f"   {name:<12} raw {raw.metrics['step_time_s'] * 1e3:6.1f} ms → predicted {pred * 1e3:6.1f}, "
              f"measured {real * 1e3:6.1f} ms ({pred / real:.2f})")


def rebuckets(lab, strategy, kw) -> None:
    """Part 4b: dp overlap's buckets rebuilt at another size (run.whatif(bucket_mb=…)) against runs at it."""
    print(f"   buckets rebuilt from {strategy.bucket_mb} MiB at 50 MB/s: predicted / measured step")
    lab.link = labkit.Link(bandwidth=50e6, **LINK)
    base = lab.run(strategy, **kw)
    for mb in (0.05, 1.0):
        other = replace(strategy, bucket_mb=mb)
        lab.run(other, **{**kw, "steps": 1})
        real = lab.run(other, **kw).metrics["step_time_s"]
        pred = base.whatif(bucket_mb=mb).step_time_s
        print(f"   bucket_mb={mb:<5} {pred * 1e3:6.1f}/{real * 1e3:6.1f} ms {pred / real:5.2f} "
              f"(measured at {strategy.bucket_mb}: {base.metrics['step_time_s'] * 1e3:.1f} ms)")


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 192, generator=g), torch.randn(32, 192, generator=g)


def scale() -> None:
    """Part 5: 1,024 ranks × 400 spans (200 forwards, each followed by a world all-reduce)."""
    rng = np.random.default_rng(0)
    world, everyone, events = 1024, ",".join(map(str, range(1024))), []
    for r in range(world):
        t = 0.0
        for k in range(200):
            d = 1e-3 * (1 + 0.1 * rng.random())
            events.append({"rank": r, "stream": "compute", "kind": "fwd", "name": f"F{k}", "step": 0,
                           "microbatch": k, "start": t, "end": t + d, "bytes": 0, "peer": None})
            events.append({"rank": r, "stream": "comm", "kind": "allreduce", "name": f"sync {k}", "step": 0,
                           "microbatch": None, "start": t + d, "end": t + d + 1e-4, "bytes": 64, "peer": None,
                           "group": everyone})
            t += d + 1e-4
    tl = labkit.Timeline(events)
    t0 = time.perf_counter()
    path = tl.critical_path()
    print(f"5. critical_path on {world} ranks × 400 spans: {time.perf_counter() - t0:.2f} s "
          f"({len(path)} spans on the path; target ≤ 5 s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2, choices=(2, 4))
    p.add_argument("--skip", default="", help="parts to skip, e.g. 1,5")
    args = p.parse_args()
    skip = set(args.skip.split(","))
    if "5" not in skip:
        scale()
    if not {"1", "2", "3"} <= skip:
        with labkit.Lab.start(engines=4, progress=False) as lab4:
            planted(lab4)
    if "4" not in skip:
        with labkit.Lab.start(engines=args.engines, progress=False) as lab:
            whatif(lab, args.engines)


if __name__ == "__main__":
    main()
