"""How long after a slider change the dashboard shows the new timeline, minus the step itself.

On a warm 2-engine CPU lab, change a control (micro-batches, bucket size, dp mode in turn) and
time until the painter has drawn the new run's step, for the static-image view and for the
ipympl canvas (rendered in full as for a page; there is no page here). The step's own duration
(T from its events) is subtracted: what is left is the dashboard's overhead — checking the
settings, three round trips to the engines (groups, set-up, step), metrics and the redraw.
Target: ≤ 1 s.

    .venv/bin/python benchmarks/bench_dashboard.py [--changes 12] [--width 256] [--depth 8]
    .venv/bin/python benchmarks/bench_dashboard.py --engines 32 --batch 128 --changes 6 --views image
"""
from __future__ import annotations

import argparse
import statistics
import time

import matplotlib

matplotlib.use("Agg")

import labkit  # noqa: E402
from labkit.widgets import Dashboard  # noqa: E402

CHANGES = [("microbatches", 2), ("bucket_mb", 0.25), ("dp_mode", "bucketed"), ("microbatches", 4),
           ("bucket_mb", 1.0), ("dp_mode", "overlap"), ("microbatches", 1)]


def time_change(dash: Dashboard, name: str, value, timeout: float = 60.0) -> dict:
    """Change one control; return the latency to the drawn timeline and its parts."""
    before = dash.runner.started
    t0 = time.perf_counter()
    dash.controls[name].value = value                  # "run on change": this submits a run
    t_submitted = time.perf_counter()
    deadline = t0 + timeout
    while not (dash.last_draw and dash.last_draw[0] > before):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no redraw within {timeout} s after {name}={value!r}: {dash.status_text}")
        time.sleep(0.002)
    t_drawn = dash.last_draw[2]
    live = dash.wait()
    step_s = live.run.timeline.step_durations()[0]
    return {"latency": t_drawn - t0, "step": step_s, "overhead": t_drawn - t0 - step_s,
            "check": t_submitted - t0, "draw": t_drawn - live.step_done_at[0], "redraw": dash.redraw_s[-1][0],
            "redraw_cpu": dash.redraw_s[-1][1]}


def bench(lab, plot: str, changes: int, model, batch: int = 64) -> list[dict]:
    dash = Dashboard(lab, model=model, batch=batch, steps=1, plot=plot)
    draw, dash.redraw_s = dash._draw_timeline, []

    def timed(*args):                                  # the painter's redraw alone
        t0, cpu0 = time.perf_counter(), time.thread_time()
        draw(*args)
        dash.redraw_s.append((time.perf_counter() - t0, time.thread_time() - cpu0))

    dash._draw_timeline = timed
    dash.run()
    dash.wait()                                        # warm: groups built, first draw done
    rows = [time_change(dash, *CHANGES[i % len(CHANGES)]) for i in range(changes)]
    dash.close()
    return rows


def summary(rows: list[dict], key: str) -> str:
    values = sorted(1e3 * r[key] for r in rows)
    p90 = values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]
    return f"{statistics.median(values):8.0f} {p90:8.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--changes", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--engines", type=int, default=2, help="local CPU engines (dp = engines)")
    p.add_argument("--batch", type=int, default=64, help="global batch (a multiple of engines × 4)")
    p.add_argument("--views", nargs="+", default=["image", "ipympl"], choices=("image", "ipympl"))
    args = p.parse_args()
    model = labkit.models.mlp(width=args.width, depth=args.depth)
    with labkit.Lab.start(engines=args.engines, timeout=60, progress=False) as lab:
        results = {plot: bench(lab, plot, args.changes, model, args.batch) for plot in args.views}
    print(f"dashboard latency, {args.engines} CPU engines, mlp({args.width}, {args.depth}), batch {args.batch}, "
          f"{args.changes} changes per view; ms, median and p90")
    print(f"{'view':8} {'part':34} {'median':>8} {'p90':>8}")
    parts = [("latency", "slider change → timeline drawn"), ("step", "  the step itself (T)"),
             ("overhead", "  latency − step  (target ≤ 1000)"), ("check", "  check settings + submit"),
             ("draw", "  step answered → drawn"), ("redraw", "    of which the redraw"),
             ("redraw_cpu", "    its CPU time (the painter's)")]
    for plot, rows in results.items():
        for key, label in parts:
            print(f"{plot:8} {label:34} {summary(rows, key)}")


if __name__ == "__main__":
    main()
