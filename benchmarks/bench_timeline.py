"""How the timeline scales with ranks and spans: plot, metrics and trace export seconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_timeline.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_timeline.py --cases 64x100 256x400
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_timeline.py --every-lane   # no aggregation
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_timeline.py --redraw 32    # the dashboard's redraw only

Synthetic events in the event schema (labkit.analysis.events), no engines: each rank of a
dp × pp grid (pp = 4 when ranks allow) runs `spans` spans per step — forward/backward
micro-batches named as pipeline actions ("0F3"), a pipeline send and receive after each,
gradient all-reduces overlapping the backward — with a per-rank jitter so ranks differ.
One step per case. Columns:

    build_s   Timeline(list of event dicts, world_size)
    plot_s    tl.plot() and the figure rendered to PNG (what a notebook shows)
    metrics_s tl.metrics(global_batch=...)
    trace_s   tl.to_chrome_trace() serialised with json.dumps
    height_in the figure's height in inches

After the table, the dashboard's redraw at 32 ranks (``--redraw``): what its painter does
after each step (labkit.widgets.redraw_timeline: clear what the Axes showed, ``tl.plot(ax=ax,
step=...)``, render the figure to PNG), median of 5, on a 32-rank step of the same shape:
as between steps and runs whose lanes and legend stay the same, and laid out anew (as after
a change of grid, which renames the lanes).
The dashboard's whole latency beyond the step, engines included, is benchmarks/bench_dashboard.py.

Past 32 ranks plot() aggregates (labkit.view.timeline); ``--every-lane`` draws all lanes
anyway, to show the cost per span. Targets: 256 × 400 plotted in ≤ 2 s; plot_s growing no faster than linearly in spans from
8 to 1,024 ranks (the last column: plot_s per 100,000 spans).
"""
from __future__ import annotations

import argparse
import io
import json
import time

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

import labkit  # noqa: E402


def synthetic_events(ranks: int, spans: int, seed: int = 0) -> list[dict]:
    """`spans` events per rank in one step; see the module docstring."""
    rng = np.random.default_rng(seed)
    pp = 4 if ranks % 4 == 0 else 1
    events = []
    per_mb = 4                                      # compute, send, recv and an all-reduce
    for rank in range(ranks):
        stage = rank % pp
        scale = 1.0 + 0.05 * rng.standard_normal() + (0.3 if rank == ranks // 3 else 0.0)
        t = stage * 1e-4
        for i in range(spans // per_mb):
            mb, backward = i % 8, i >= (spans // per_mb) // 2
            op = "B" if backward else "F"
            d = (2e-4 if backward else 1e-4) * scale
            events.append(_ev(rank, "bwd" if backward else "fwd", f"{stage}{op}{mb}", t, t + d, mb))
            events.append(_ev(rank, "send", f"{stage}SEND_{op}{mb}", t + d, t + d + 2e-5, mb, 4096,
                              (rank + 1) % ranks))
            events.append(_ev(rank, "recv", f"{stage}RECV_{op}{mb}", t + d + 2e-5, t + d + 5e-5, mb, 4096,
                              (rank - 1) % ranks))
            kind = "allreduce" if backward else "wait"
            events.append(_ev(rank, kind, f"bucket {i}", t + 0.3 * d, t + 1.5 * d, None,
                              65536 if backward else 0))
            t += d + 6e-5
    return events


def _ev(rank, kind, name, start, end, mb, nbytes=0, peer=None):
    return labkit.analysis.events.make_event(rank, kind, name, 0, start, end, mb, nbytes, peer)


def measure(ranks: int, spans: int, every_lane: bool = False) -> dict:
    events = synthetic_events(ranks, spans)
    t0 = time.perf_counter()
    tl = labkit.Timeline(events, ranks)
    t1 = time.perf_counter()
    fig = tl.plot(aggregate=False) if every_lane else tl.plot()
    fig.savefig(io.BytesIO(), format="png")
    t2 = time.perf_counter()
    tl.metrics(global_batch=ranks)
    t3 = time.perf_counter()
    json.dumps(tl.to_chrome_trace())
    t4 = time.perf_counter()
    return {"ranks": ranks, "spans": spans, "events": len(events), "build_s": t1 - t0, "plot_s": t2 - t1,
            "metrics_s": t3 - t2, "trace_s": t4 - t3, "height_in": float(fig.get_size_inches()[1])}


def redraw_s(ranks: int, spans: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of the dashboard painter's redraw of one `ranks`-rank step (see above):
    (the figure laid out anew, as when the lanes or the legend changed; laid out already)."""
    from labkit.view.canvas import WidgetFigure
    from labkit.widgets import redraw_timeline, timeline_figsize

    tl = labkit.Timeline(synthetic_events(ranks, spans), ranks)
    view = WidgetFigure(timeline_figsize(ranks), 1, False)     # the dashboard's, for `ranks` engines
    redraw_timeline(view, tl, 0, "run 0")
    times = {True: [], False: []}
    for i in range(2 * repeats):
        fresh = i % 2 == 0
        if fresh:
            view._laid_out = None      # as if the lanes had changed: constrained layout again
        t0 = time.perf_counter()
        redraw_timeline(view, tl, 0, f"run {i + 1}")     # PNG at 90 dpi into the widget
        times[fresh].append(time.perf_counter() - t0)
    return float(np.median(times[True])), float(np.median(times[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+",
                        default=["8x400", "32x400", "64x100", "64x400", "128x400", "256x400", "512x400", "1024x400"],
                        help="ranks x spans per rank")
    parser.add_argument("--every-lane", action="store_true",
                        help="draw every rank's lanes (no aggregation past 32 ranks)")
    parser.add_argument("--redraw", type=int, default=32, metavar="RANKS",
                        help="ranks of the dashboard redraw measured after the table (0: skip)")
    parser.add_argument("--redraw-spans", type=int, default=100, help="spans per rank of that step")
    args = parser.parse_args()
    print(f"{'ranks':>6} {'spans':>6} {'events':>8} {'build_s':>8} {'plot_s':>8} {'metrics_s':>9} "
          f"{'trace_s':>8} {'height_in':>9} {'plot_s/1e5 ev':>13}")
    for case in args.cases:
        ranks, spans = (int(x) for x in case.split("x"))
        r = measure(ranks, spans, args.every_lane)
        per = r["plot_s"] / r["events"] * 1e5
        print(f"{r['ranks']:>6} {r['spans']:>6} {r['events']:>8} {r['build_s']:>8.2f} {r['plot_s']:>8.2f} "
              f"{r['metrics_s']:>9.2f} {r['trace_s']:>8.2f} {r['height_in']:>9.1f} {per:>13.2f}", flush=True)
    if args.redraw:
        fresh, kept = redraw_s(args.redraw, args.redraw_spans)
        print(f"dashboard redraw, {args.redraw} ranks × {args.redraw_spans} spans: {kept:.2f} s "
              f"(median of 5; {fresh:.2f} s when the lanes or legend changed and it lays out anew)")


if __name__ == "__main__":
    main()
