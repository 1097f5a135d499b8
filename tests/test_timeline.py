"""Timeline views: lanes and legend of the plot, Chrome trace layout, step filtering."""

import matplotlib

matplotlib.use("Agg")

import io  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labkit.analysis.metrics import step_metrics  # noqa: E402
from labkit.analysis.timeline import STREAM_TIDS, Timeline  # noqa: E402
from labkit.view.timeline import compare  # noqa: E402


def ev(rank, stream, kind, start, end, step=0, microbatch=None, nbytes=0, peer=None):
    return {"rank": rank, "stream": stream, "kind": kind, "name": f"{kind}_op", "step": step,
            "microbatch": microbatch, "start": start, "end": end, "bytes": nbytes, "peer": peer}


def two_rank_run():
    """Two ranks, two steps: step 0 lasts 4 ms, step 1 lasts 6 ms (rank 1 waits first)."""
    events = []
    for step, lag in ((0, 0.0), (1, 0.002)):
        for rank in (0, 1):
            t0 = lag * rank
            if t0:
                events.append(ev(rank, "comm", "wait", 0.0, t0, step, peer=0))
            events += [ev(rank, "compute", "fwd", t0, t0 + 0.001, step, microbatch=0),
                       ev(rank, "compute", "bwd", t0 + 0.001, t0 + 0.003, step, microbatch=0),
                       ev(rank, "comm", "allreduce", t0 + 0.002, t0 + 0.004, step, nbytes=64)]
    return events


def lanes(ax):
    return [t.get_text() for t in ax.get_yticklabels()]


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_basics_and_repr():
    tl = Timeline(two_rank_run(), title="dp")
    assert len(tl) == 13 and tl.ranks == [0, 1] and tl.steps == [0, 1]
    assert tl.step_durations() == pytest.approx({0: 0.004, 1: 0.006})
    assert tl.step_offsets() == pytest.approx({0: 0.0, 1: 0.004})
    text = repr(tl)
    assert "2 ranks" in text and "2 steps" in text and "13 events" in text
    assert Timeline(two_rank_run(), world_size=4).ranks == [0, 1, 2, 3]


def test_step_filtering():
    tl = Timeline(two_rank_run(), world_size=2)
    one = tl.step(1)
    assert isinstance(one, Timeline)
    assert one.steps == [1] and len(one) == 7
    assert all(e["step"] == 1 for e in one.events)
    assert one.world_size == 2


def test_metrics_match_step_metrics():
    events = two_rank_run()
    assert Timeline(events).metrics(global_batch=8) == step_metrics(events, 2, 8)


def test_plot_lanes_legend_and_labels():
    fig = Timeline(two_rank_run()).plot()
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert lanes(ax) == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert legend_labels(ax) == ["fwd", "bwd", "allreduce", "wait"]  # palette order
    texts = {t.get_text() for t in ax.texts}
    assert {"F0", "B0"} <= texts
    assert ax.get_xlim()[1] == pytest.approx(6.0)  # last step, in ms
    assert "step 1" in ax.get_title()
    fig.savefig(io.BytesIO(), format="png")  # renders under Agg


def test_plot_one_step_and_all_steps():
    tl = Timeline(two_rank_run())
    ax0 = tl.plot(step=0).axes[0]
    assert ax0.get_xlim()[1] == pytest.approx(4.0)
    assert legend_labels(ax0) == ["fwd", "bwd", "allreduce"]
    assert tl.plot(step="all").axes[0].get_xlim()[1] == pytest.approx(10.0)


def test_plot_into_given_axes_without_labels():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert Timeline(two_rank_run()).plot(ax=ax, labels=False) is fig
    assert len(ax.texts) == 0
    plt.close(fig)


def test_save_trace(tmp_path):
    path = tmp_path / "trace.json"
    Timeline(two_rank_run()).save_trace(path)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(spans) == 13
    bwd = [e for e in spans if e["cat"] == "bwd" and e["pid"] == 1]
    assert [e["tid"] for e in bwd] == [STREAM_TIDS["compute"]] * 2
    # Step 0 bwd at 1 ms; step 1 bwd at 2 + 1 ms, shifted by step 0's 4 ms.
    assert [e["ts"] for e in bwd] == pytest.approx([1000.0, 7000.0])
    assert [e["dur"] for e in bwd] == pytest.approx([2000.0, 2000.0])
    assert bwd[1]["args"] == {"stream": "compute", "kind": "bwd", "step": 1, "microbatch": 0,
                              "bytes": 0, "peer": None}
    names = {(e["name"], e["pid"], e["tid"]): e["args"].get("name") for e in meta}
    assert names[("process_name", 1, 0)] == "rank 1"
    assert names[("thread_name", 0, STREAM_TIDS["comm"])] == "comm"
    assert names[("thread_name", 0, STREAM_TIDS["compute"])] == "compute"


def test_compare_shares_the_time_axis():
    a = Timeline(two_rank_run())
    b = Timeline([e for e in two_rank_run() if e["step"] == 0])  # 4 ms vs 6 ms
    fig = compare(a, b, labels=("GPipe", "1F1B"))
    ax_a, ax_b = fig.axes
    assert ax_a.get_shared_x_axes().joined(ax_a, ax_b)
    assert ax_a.get_xlim() == ax_b.get_xlim() == pytest.approx((0.0, 6.0))
    assert ax_a.get_title().startswith("GPipe") and ax_b.get_title().startswith("1F1B")
    assert len(lanes(ax_a)) == len(lanes(ax_b)) == 4
    fig.savefig(io.BytesIO(), format="png")


def bar_heights(ax):
    return sorted({round(p.get_paths()[0].get_extents().height, 6) for p in ax.collections})


def test_touching_spans_share_a_row_and_overlapping_ones_stack():
    touching = [ev(0, "compute", "bwd", 0.0, 0.001005, microbatch=0),       # ends 5 µs after the next starts
                ev(0, "compute", "bwd", 0.001, 0.002, microbatch=1)]
    fig = Timeline(touching, 1).plot()
    assert bar_heights(fig.axes[0]) == [pytest.approx(0.8)]              # one full-height row
    buckets = [ev(0, "comm", "allreduce", 0.0, 0.002), ev(0, "comm", "allreduce", 0.001, 0.003)]
    assert bar_heights(Timeline(buckets, 1).plot().axes[0]) == [pytest.approx(0.4)]   # two rows


def test_labels_that_do_not_fit_are_left_out_not_cut():
    events = [ev(0, "comm", "allreduce", 0.0, 0.0001), ev(0, "compute", "fwd", 0.0, 0.01, microbatch=3)]
    events[0]["name"] = "a rather long bucket name"
    texts = [t.get_text() for t in Timeline(events, 1).plot().axes[0].texts]
    assert texts == ["F3"]
    assert not any("…" in t for t in texts)


def test_one_x_label_per_figure_of_stacked_panels():
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, sharex=True)
    for ax in axes:
        Timeline(two_rank_run()).plot(ax=ax)
    assert [ax.get_xlabel() for ax in axes] == ["", "", "time (ms)"]
    plt.close(fig)


def test_a_label_that_stops_fitting_when_the_axis_widens_is_not_drawn():
    events = [ev(0, "compute", "fwd", 0.0, 0.002, microbatch=0), ev(0, "compute", "bwd", 0.002, 0.004, microbatch=0)]
    fig = Timeline(events, 1).plot()
    ax = fig.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    drawn = lambda: [t.get_text() for t in ax.texts if t.get_visible() and _draws(t, renderer)]
    assert drawn() == ["F0", "B0"]
    ax.set_xlim(0, 400)                       # the spans are now 1/200 of the axis
    assert drawn() == []


def _draws(text, renderer) -> bool:
    """Whether ``text.draw`` puts anything on the canvas (a fitted label may decline)."""
    from unittest import mock

    with mock.patch("matplotlib.text.Text.draw") as base:
        text.draw(renderer)
    return base.called


# --- events as columns --------------------------------------------------------------------


def test_columns_and_pandas_hold_the_schema():
    tl = Timeline(two_rank_run())
    assert list(tl.table.columns) == ["rank", "stream", "kind", "name", "step", "microbatch",
                                      "start", "end", "bytes", "peer", "group", "waited", "posted", "moved", "tier"]
    assert set(tl.table["group"]) == {""} and np.isnan(tl.table["waited"]).all()    # optional: not given
    assert tl.table["microbatch"].dtype.kind == "i" and tl.table["start"].dtype.kind == "f"
    assert tl.events == two_rank_run()                      # the dicts as given, None kept
    frame = tl.to_pandas()
    assert len(frame) == 13 and frame["peer"].isna().sum() == 12    # only the one wait has a peer
    assert frame.groupby("kind", observed=True)["bytes"].sum()["allreduce"] == 4 * 64


def test_extend_adds_a_step_and_events_follow():
    tl = Timeline([e for e in two_rank_run() if e["step"] == 0], 2)
    assert len(tl.events) == 6
    tl.extend(e for e in two_rank_run() if e["step"] == 1)
    assert len(tl) == len(tl.events) == 13 and tl.steps == [0, 1]
    assert tl.step_durations() == pytest.approx({0: 0.004, 1: 0.006})


def test_a_saved_trace_loads_back(tmp_path):
    path = tmp_path / "trace.json"
    tl = Timeline(two_rank_run(), world_size=3, title="dp")
    tl.save_trace(path)
    for back in (Timeline.load(path), Timeline(json.loads(path.read_text()))):
        assert (back.world_size, back.title, back.steps) == (3, "dp", [0, 1])
        got = sorted(back.events, key=lambda e: (e["step"], e["rank"], e["start"], e["kind"]))
        want = sorted(tl.events, key=lambda e: (e["step"], e["rank"], e["start"], e["kind"]))
        for g, w in zip(got, want, strict=True):
            assert {k: g[k] for k in w if k not in ("start", "end", "name")} == \
                {k: w[k] for k in w if k not in ("start", "end", "name")}
            assert (g["start"], g["end"]) == pytest.approx((w["start"], w["end"]), abs=1e-9)
        scalars = lambda m: {k: v for k, v in m.items() if not isinstance(v, list)}  # noqa: E731
        assert scalars(back.metrics(8)) == pytest.approx(scalars(tl.metrics(8)))


def test_a_dict_that_is_not_a_saved_trace_is_refused():
    with pytest.raises(ValueError, match="from_profiler"):
        Timeline({"traceEvents": [{"ph": "X", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]})


# --- views that scale ---------------------------------------------------------------------


def grid_run(dp, pp, slow=None):
    """One step of dp × pp ranks: a forward and backward per rank, then an all-reduce."""
    from labkit.grid import ParallelDims

    events = []
    for rank in range(dp * pp):
        extra = 0.002 if rank == slow else 0.0
        events += [ev(rank, "compute", "fwd", 0.0, 0.001, microbatch=0),
                   ev(rank, "compute", "bwd", 0.001, 0.003 + extra, microbatch=0),
                   ev(rank, "comm", "allreduce", 0.003 + extra, 0.006, nbytes=64)]
        events[-3]["name"] = "0F0"
    return Timeline(events, dp * pp, grid=ParallelDims(dp=dp, pp=pp))


def test_lanes_name_grid_coordinates_and_labels_have_a_key():
    tl = grid_run(2, 2)
    ax = tl.plot().axes[0]
    assert lanes(ax)[:4] == ["rank 0 dp0 pp0 compute", "rank 0 dp0 pp0 comm",
                             "rank 1 dp0 pp1 compute", "rank 1 dp0 pp1 comm"]
    texts = {t.get_text() for t in ax.texts}
    assert {"F0", "B0"} <= texts and "0F0" not in texts
    assert "micro-batch" in ax.get_legend().get_title().get_text()
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 3   # one per kind


def test_pipeline_action_names_read_as_arrows():
    from labkit.view.timeline import _span_label

    assert _span_label("recv", "0RECV_B0", -1) == ("←B0", True)
    assert _span_label("send", "2SEND_F3", -1) == ("→F3", True)
    assert _span_label("allreduce", "bucket 1", -1) == ("bucket 1", False)


def test_many_ranks_aggregate_per_stage_and_zoom_back():
    tl = grid_run(10, 4, slow=9)                            # 40 ranks; rank 9 is dp2 pp1
    fig = tl.plot()
    lanes_ax, heat_ax = fig.axes[:2]
    names = lanes(lanes_ax)
    assert len(names) == 4 * 3 * 2                          # 4 stages × slowest/median/fastest × 2 streams
    assert names[6] == "pp1 slowest: rank 9 dp2 pp1 compute"
    assert fig.get_size_inches()[1] <= 12
    assert heat_ax.images[0].get_array().shape == (40, 400)
    assert lanes(tl.plot(stage=1).axes[0])[::2] == [f"rank {r} dp{r // 4} pp1 compute" for r in range(1, 40, 4)]
    assert len(lanes(tl.plot(ranks=[3, 9]).axes[0])) == 4
    with pytest.raises(ValueError, match="stages 0..3"):
        tl.plot(stage=4)
    fig.savefig(io.BytesIO(), format="png")


def test_heatmap_states_by_hand():
    from labkit.view.heatmap import heat_states
    import numpy as np

    tl = Timeline([ev(0, "compute", "fwd", 0.0, 0.002), ev(0, "comm", "allreduce", 0.0015, 0.003),
                   ev(1, "comm", "wait", 0.0, 0.004)], 2)
    # bins of 1 ms: rank 0 computes in bins 0–1, communicates in bin 2, idles in bin 3; rank 1 waits (idle)
    states = heat_states(tl.table, np.zeros(3), [0, 1], 4.0, bins=4)
    assert states.tolist() == [[2, 2, 1, 0], [0, 0, 0, 0]]


def test_the_timelines_grid_lays_ranks_out_as_parallel_dims():
    from labkit.analysis.timeline import Grid
    from labkit.grid import ParallelDims

    dims, grid = ParallelDims(dp=2, pp=3, tp=2), Grid(2, 3, 2)
    assert [grid.coords(r) for r in range(12)] == [dims.coords(r) for r in range(12)]
    assert grid.dp_groups() == dims.dp_groups()


def test_the_timelines_grid_names_cp_and_ep_places_and_groups_cp_slices_with_their_replicas():
    from labkit.analysis.timeline import Grid, Timeline
    from labkit.grid import ParallelDims
    from labkit.view.timeline import _rank_name

    dims = ParallelDims(dp=2, pp=2, tp=2, cp=2)
    grid = Grid.of(type("S", (), {"dp": 2, "pp": 2, "tp": 2, "cp": 2, "ep": 2})())
    assert [grid.coords(r) for r in range(16)] == [dims.coords(r) for r in range(16)]
    assert [grid.cp_index(r) for r in range(16)] == [dims.cp_index(r) for r in range(16)]
    assert grid.dp_cp_groups() == dims.dp_cp_groups()
    tl = Timeline([], world_size=16, grid=grid)
    assert tl.coords(11) == {"dp": 1, "pp": 0, "cp": 1, "tp": 1, "ep": 1}
    assert _rank_name(tl, 11) == "rank 11 dp1 pp0 cp1 tp1 ep1"


def test_dashboard_redraw_keeps_its_layout_until_the_lanes_change():
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    from matplotlib.patches import PathPatch

    from labkit.grid import ParallelDims
    from labkit.view.canvas import WidgetFigure
    from labkit.widgets import redraw_timeline

    def hatched(ax):
        return [a for a in ax.patches if isinstance(a, PathPatch) and a.get_hatch() == "//"]

    view = WidgetFigure((8, 2.4), 1, False)
    ax = view.axes[0]
    redraw_timeline(view, Timeline(two_rank_run()), 1, "run 1")      # step 1: rank 1 waits
    first, png, drawn = ax.get_position().bounds, bytes(view.widget.value), len(ax.collections)
    assert png.startswith(b"\x89PNG") and ax.get_title().startswith("run 1 · step 1")
    assert len(hatched(ax)) == 1 and "wait" in legend_labels(ax)

    redraw_timeline(view, Timeline(two_rank_run()), 1, "run 2")      # same lanes, same legend
    assert not isinstance(view.fig.get_layout_engine(), ConstrainedLayoutEngine)   # not laid out again
    assert ax.get_position().bounds == first and bytes(view.widget.value) != png   # the new title drawn
    assert len(ax.collections) == drawn and len(hatched(ax)) == 1     # the last drawing removed, not piled up
    assert lanes(ax) == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]

    redraw_timeline(view, Timeline(two_rank_run(), grid=ParallelDims(pp=2)), 1, "run 3")
    assert lanes(ax)[0] == "rank 0 pp0 compute"
    assert ax.get_position().x0 > first[0]                            # wider lane names: laid out again


def test_the_key_lists_only_the_label_families_drawn():
    """A data-parallel run's "F0"/"B0" get the forward/backward line, not the pipeline's arrows."""
    from labkit.view.timeline import key_for

    assert key_for({"F0", "B0"}) == "F3 · B3  forward · backward of micro-batch 3"
    assert key_for(set()) is None
    both = key_for({"F1", "→F1", "←B12", "W3"}).splitlines()
    assert [line.split()[0] for line in both] == ["F3", "I3", "→F3", "→B3"]


def test_tp_all_reduces_and_dp_buckets_are_told_apart():
    """On a tp × dp timeline tensor parallelism's all-reduces ("tp g …") get their own shade and
    legend entry beside data parallelism's buckets, though both are of kind allreduce."""
    import matplotlib.colors as mcolors

    from labkit.view.timeline import PALETTE

    def span(name, start):
        return {"rank": 0, "stream": "comm", "kind": "allreduce", "name": name, "step": 0, "microbatch": -1,
                "start": start, "end": start + 1e-3, "bytes": 64, "peer": -1}
    ax = Timeline([span("tp g blocks.0.attn", 0.0), span("bucket 0", 2e-3)], 1).plot().axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["allreduce", "allreduce (tp)"]
    colors = {mcolors.to_hex(c.get_facecolor()[0]) for c in ax.collections if isinstance(c, PolyCollection)}
    assert len(colors) == 2 and PALETTE["allreduce"].lower() in colors
