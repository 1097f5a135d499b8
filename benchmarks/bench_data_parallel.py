"""Data-parallel step time: labkit's naive, bucketed and overlap modes against torch's DDP,
and the cost of recording the timeline.

    .venv/bin/python benchmarks/bench_data_parallel.py              # 2 engines, ~1 minute
    .venv/bin/python benchmarks/bench_data_parallel.py --rounds 5 --steps 30

Modes are interleaved round by round (so drift in machine load hits all of them alike) and
each figure is the median step wall time over all measured steps of all rounds (the first
step of each run is warm-up). Ratios are to DDP's median step time.
"""
from __future__ import annotations

import argparse
from statistics import median

import labkit

MODES = ("naive", "bucketed", "overlap", "ddp")


def measure(lab, mode: str, args, record: bool) -> list[float]:
    strategy = labkit.Strategy(dp=lab.world_size, dp_mode=mode, bucket_mb=args.bucket_mb)
    model = labkit.models.mlp(width=args.width, depth=args.depth)
    run = lab.run(strategy, model=model, batch=args.batch, steps=args.steps, record=record)
    return run.step_times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    times = {(m, rec): [] for m in MODES for rec in (True, False)}
    with labkit.Lab.start(engines=args.engines, timeout=120) as lab:
        for r in range(args.rounds):
            for mode in MODES:
                for record in (True, False):
                    times[(mode, record)] += measure(lab, mode, args, record)
            print(f"round {r + 1}/{args.rounds} done")
    med = {k: median(v) for k, v in times.items()}
    ddp = med[("ddp", True)]
    print(f"\n{args.engines} engines, mlp width {args.width} depth {args.depth}, batch {args.batch}, "
          f"bucket {args.bucket_mb} MiB, {args.rounds}×{args.steps - 1} measured steps per mode")
    print(f"{'mode':>9} {'step ms':>9} {'÷ DDP':>7} {'no-record ms':>13} {'recording cost':>15}")
    for mode in MODES:
        on, off = med[(mode, True)], med[(mode, False)]
        print(f"{mode:>9} {1e3 * on:9.2f} {on / ddp:7.3f} {1e3 * off:13.2f} {100 * (on / off - 1):+14.1f}%")


if __name__ == "__main__":
    main()
