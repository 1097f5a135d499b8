"""Incast on the emulated link: the parameter server against the ring, and a skewed all-to-all.

    .venv/bin/python benchmarks/bench_link.py                     # 2, 4 and 8 engines, ~4 minutes a run
    .venv/bin/python benchmarks/bench_link.py --engines 4 --runs 3 --mib 1 8

1. ``labkit.collectives`` ring and parameter-server all-reduce of 1–8 MiB on
   ``Link(bandwidth=--mbps MB/s)``. The α-β model (Thakur et al. 2005) gives the ring
   2(n-1)/n·S/β and the server 2(n-1)·S/β: the server's link takes in n-1 tensors and sends
   n-1 out, one after another, so server ÷ ring = n. The table shows each measured time
   beside its formula and the ratio against n; the last line says whether it was within 20 %
   at every n ≥ 4.
2. An all-to-all in which every rank sends its S bytes to rank 0: its time is the busiest
   receiver's, (n-1)·α + (n-1)·S/β, though each sender moves only S.

The link is slower than the engines' own loopback (4–8 engines on 2 cores move a 256 KiB
chunk in a few ms): the emulated link only adds time to gloo's, so it must be the slower
of the two for its formula to show.
"""
from __future__ import annotations

import argparse

import labkit
from labkit.comm import collectives


def all_reduce_seconds(lab, algorithm: str, numel: int, repeats: int) -> float:
    """The slowest rank's best time of ``repeats`` all-reduces."""
    return max(min(r["seconds"]) for r in lab.apply(collectives.demo, algorithm, numel, repeats=repeats,
                                                    check=False))


def measure(n: int, link: labkit.Link, sizes_mib, repeats: int) -> list[dict]:
    rows = []
    with labkit.Lab.start(engines=n, timeout=120, progress=False) as lab:
        lab.link = link
        for mib in sizes_mib:
            numel = int(mib * 2 ** 18)
            S = 4 * numel
            row = {"n": n, "mib": mib,
                   "ring": all_reduce_seconds(lab, "ring", numel, repeats),
                   "ps": all_reduce_seconds(lab, "ps", numel, repeats),
                   "ring_ab": collectives.predict("ring", S, n, link.latency, link.bandwidth),
                   "ps_ab": collectives.predict("ps", S, n, link.latency, link.bandwidth)}
            row["a2a"] = max(r["seconds"] for r in lab.apply(collectives.incast_demo, numel))
            row["a2a_ab"] = (n - 1) * link.latency + (n - 1) * S / link.bandwidth
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--mib", type=float, nargs="+", default=[1, 2, 4, 8], help="all-reduce sizes, MiB")
    p.add_argument("--mbps", type=float, default=4.0, help="the link's bandwidth, MB/s per direction")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--runs", type=int, default=1, help="the whole measurement, repeated")
    p.add_argument("--repeats", type=int, default=1, help="all-reduces per point (the best is kept)")
    args = p.parse_args()
    link = labkit.Link(bandwidth=args.mbps * 1e6, latency=args.latency_ms * 1e-3)

    print(f"link: {link}")
    print(f"{'run':>3} {'n':>2} {'MiB':>4} {'ring ms':>8} {'α-β':>7} {'server ms':>9} {'α-β':>7} "
          f"{'server÷ring':>11} {'÷ n':>5} {'all-to-all ms':>13} {'α-β':>7}")
    worst = 0.0
    for run in range(args.runs):
        for n in args.engines:
            for r in measure(n, link, args.mib, args.repeats):
                ratio = r["ps"] / r["ring"]
                if n >= 4:
                    worst = max(worst, abs(ratio / n - 1))
                print(f"{run:>3} {n:>2} {r['mib']:>4g} {1e3 * r['ring']:8.1f} {1e3 * r['ring_ab']:7.1f} "
                      f"{1e3 * r['ps']:9.1f} {1e3 * r['ps_ab']:7.1f} {ratio:11.2f} {ratio / n:5.2f} "
                      f"{1e3 * r['a2a']:13.1f} {1e3 * r['a2a_ab']:7.1f}", flush=True)
    if any(n >= 4 for n in args.engines):
        verdict = "within" if worst <= 0.2 else "NOT within"
        print(f"server ÷ ring at n ≥ 4: furthest from n by {100 * worst:.0f} % ({verdict} 20 %)")


if __name__ == "__main__":
    main()
