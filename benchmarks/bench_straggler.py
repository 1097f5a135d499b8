"""A planted slow rank at cluster scale: does ``timeline.stragglers()`` name it, and why?

Starts `engines` local CPU engines, runs a tiny mlp under a dp (or dp × pp) strategy with
``lab.straggler(rank, seconds)`` on one rank, and prints the straggler report, whether the
planted rank comes first with cause "compute", and how long each part took. Too slow for the
test suite at 32 engines on a small machine (tests/test_scale.py does 16 and 8).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_straggler.py --engines 32 --rank 21
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_straggler.py --engines 32 --pp 2 --rank 10
"""
from __future__ import annotations

import argparse
import time
import warnings

import matplotlib

matplotlib.use("Agg")

import labkit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=32)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (dp = engines / pp)")
    p.add_argument("--rank", type=int, default=21, help="the planted slow rank")
    p.add_argument("--seconds", type=float, default=0.02, help="extra seconds per layer forward on it")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if args.engines % args.pp:
        raise ValueError(f"--pp {args.pp} must divide --engines {args.engines}")
    dp = args.engines // args.pp
    strategy = labkit.Strategy(dp=dp, pp=args.pp, microbatches=2) if args.pp > 1 else labkit.Strategy(dp=dp)
    kw = dict(model=labkit.models.mlp(width=16, depth=4), batch=4 * dp, steps=args.steps, lr=0.1, seed=0)

    t0 = time.perf_counter()
    with warnings.catch_warnings():     # "32 engines on 2 cores": known, and the point here
        warnings.filterwarnings("ignore", message=r".*engines on \d+ cores")
        lab = labkit.Lab.start(engines=args.engines, timeout=120, start_timeout=300, progress=False)
    with lab:
        t1 = time.perf_counter()
        with lab.straggler(rank=args.rank, seconds=args.seconds):
            run = lab.run(strategy, **kw)
        t2 = time.perf_counter()
        found = run.timeline.stragglers()
        t3 = time.perf_counter()
    named = bool(len(found)) and found[0].rank == args.rank and found[0].cause == "compute"
    print(f"{args.engines} engines, {strategy.label()}, mlp(16, 4), batch {kw['batch']}, {args.steps} steps; "
          f"rank {args.rank} planted +{args.seconds:g} s per layer forward")
    print(repr(found))
    print(f"planted rank named first with cause compute: {'yes' if named else 'NO'}")
    print(f"start {t1 - t0:.1f} s · run {t2 - t1:.1f} s · stragglers() {t3 - t2:.3f} s")


if __name__ == "__main__":
    main()
