"""labkit's hand-written ring all-reduce against torch's, and int8 gradient compression's step time.

    .venv/bin/python benchmarks/bench_comm.py                       # 2 and 4 engines, ~2 minutes
    .venv/bin/python benchmarks/bench_comm.py --engines 2 --rounds 5

1. busbw (nccl-tests' definition, 2(n-1)/n · S/t) of an all-reduce of ``--mb`` MiB by
   ``labkit.collectives.ring_all_reduce`` and by torch's all_reduce (gloo on CPU, NCCL on
   GPU), interleaved round by round; the median busbw of each, and their ratio.
2. The data-parallel step time with compression="int8" against "none" (same model, bucket
   and mode), median over measured steps of all rounds; and the bytes each rank sent.
"""
from __future__ import annotations

import argparse
from statistics import median

import labkit
from labkit import bench


def ring_vs_torch(lab, nbytes: int, rounds: int) -> dict:
    busbw = {"ring": [], "torch": []}
    for _ in range(rounds):
        sweep = bench.comm_sweep(lab, sizes=[nbytes], collectives=["all_reduce"], algorithms=["ring"],
                                 seconds_per_point=0.5, max_iters=10)
        for row in sweep.rows:
            busbw[row["algorithm"]].append(row["busbw"])
    return {k: median(v) for k, v in busbw.items()}


def int8_vs_none(lab, args) -> dict:
    out = {}
    model = labkit.models.mlp(width=args.width, depth=args.depth)
    times = {"none": [], "int8": []}
    sent = {}
    for _ in range(args.rounds):
        for compression in times:
            strategy = labkit.Strategy(dp=lab.world_size, dp_mode=args.mode, bucket_mb=args.bucket_mb,
                                       compression=compression)
            run = lab.run(strategy, model=model, batch=args.batch, steps=args.steps)
            times[compression] += run.step_times[1:]
            sent[compression] = run.metrics["bytes_sent"][0]
    for compression, t in times.items():
        out[compression] = (median(t), sent[compression])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mb", type=float, default=16.0, help="all-reduce size, MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mode", default="overlap")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    args = p.parse_args()

    results = []
    for n in args.engines:
        with labkit.Lab.start(engines=n, timeout=120) as lab:
            device = lab.ranks[0]["device"]
            bw = ring_vs_torch(lab, int(args.mb * 2 ** 20), args.rounds)
            dp = int8_vs_none(lab, args)
        results.append((n, device, bw, dp))
        print(f"{n} engines done")

    print(f"\nall-reduce of {args.mb:g} MiB, median of {args.rounds} rounds; busbw in GB/s")
    print(f"{'engines':>7} {'device':>7} {'ring busbw':>11} {'torch busbw':>12} {'ring ÷ torch':>13}")
    for n, device, bw, _ in results:
        print(f"{n:>7} {device:>7} {bw['ring'] / 1e9:11.3f} {bw['torch'] / 1e9:12.3f} {bw['ring'] / bw['torch']:13.2f}")
    print(f"\nDP step, mlp width {args.width} depth {args.depth}, batch {args.batch}, {args.mode}, "
          f"bucket {args.bucket_mb} MiB, {args.rounds}×{args.steps - 1} measured steps")
    print(f"{'engines':>7} {'none ms':>9} {'int8 ms':>9} {'int8 ÷ none':>12} {'none B/rank':>12} {'int8 B/rank':>12} "
          f"{'bytes ratio':>12}")
    for n, _, _, dp in results:
        (t0, b0), (t1, b1) = dp["none"], dp["int8"]
        print(f"{n:>7} {1e3 * t0:9.2f} {1e3 * t1:9.2f} {t1 / t0:12.2f} {b0:12.0f} {b1:12.0f} {b1 / b0:12.3f}")


if __name__ == "__main__":
    main()
