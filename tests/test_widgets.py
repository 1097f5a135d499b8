"""The dashboard driven from Python, no browser: controls → runs on the engines → timeline and
metrics. Answers arrive on ipyparallel's client thread, so tests wait with a deadline
(``dash.wait``), never sleep a fixed time.

    python -m pytest tests/test_widgets.py
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import labkit
from labkit import engine
from labkit.grid import ParallelDims
from labkit.widgets import Dashboard

MODEL = labkit.models.mlp(width=32, depth=3)
DEADLINE = 120


class NoEngines:
    """A lab whose engines must never be called (bad input stops in the notebook)."""

    world_size, ranks = 2, []

    @property
    def view(self):
        raise AssertionError("the dashboard reached the engines")


def slow_data(step):
    """Synthetic data that takes ~0.2 s per step, so a run is still in flight while we change things."""
    time.sleep(0.2)
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)


def failing_model():
    """Builds in the notebook; raises on rank 1 when the engines build their part."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one refuses on purpose")
    return nn.Sequential(nn.Linear(32, 32))


def fwd_per_rank(live) -> dict[int, int]:
    """Forward spans of each rank in the last finished step."""
    counts: dict[int, int] = {}
    for e in live.run.timeline.events:
        if e["step"] == live.step and e["kind"] == "fwd":
            counts[e["rank"]] = counts.get(e["rank"], 0) + 1
    return counts


def test_impossible_settings_disable_run_and_never_reach_the_engines():
    dash = Dashboard(NoEngines(), model=MODEL, batch=32, auto=True, plot="image")
    assert not dash.run_button.disabled
    dash.controls["dp"].value = 1                       # 1*1*1 ranks on a 2-engine lab
    assert dash.run_button.disabled and "dp*pp*tp" in dash.status_text
    assert dash.run() is None
    dash.set(dp=2, microbatches=3)                      # 16 rows per rank do not split into 3
    assert dash.run_button.disabled and "microbatches=3" in dash.status_text
    dash.set(dp=2, microbatches=4, auto=False)          # fixed: Run comes back
    assert not dash.run_button.disabled and dash.status_text == "ready"
    dash.close()


@pytest.mark.slow
def test_slider_change_reruns_and_redraws_with_the_new_settings(lab2):
    dash = Dashboard(lab2, model=MODEL, batch=32, steps=2, plot="image",
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    assert dash.run() == "started"
    first = dash.wait(DEADLINE)
    assert first.state == "done" and len(first.run.losses) == 2
    assert len(first.run.step_times) == 2 and min(first.run.step_times) > 0   # the one driver fills them
    assert fwd_per_rank(first) == {0: 1, 1: 1}
    image, table = bytes(dash.timeline_view.widget.value), dash.metrics.value
    assert image.startswith(b"\x89PNG") and "step time" in table

    dash.controls["microbatches"].value = 4             # "run on change": this starts run 2
    second = dash.wait(DEADLINE)
    assert second.number == first.number + 1 and second.state == "done"
    assert second.spec.strategy.microbatches == 4
    assert fwd_per_rank(second) == {0: 4, 1: 4}         # the timeline holds 4 micro-batches
    assert second.groups_rebuilt == [False, False]      # same degrees: groups kept
    assert bytes(dash.timeline_view.widget.value) != image and dash.metrics.value != table
    assert dash.last_draw[:2] == (second.number, 1)     # the drawn timeline is run 2's last step
    assert f"run {second.number} done" in dash.status_text and "groups kept" in dash.status_text

    dash.pin()
    dash.set(dp_mode="bucketed", bucket_mb=0.0625)      # one run for both changes
    third = dash.wait(DEADLINE)
    assert third.number == second.number + 1 and third.groups_rebuilt == [False, False]
    names = {e["name"] for e in third.run.timeline.events if e["kind"] == "allreduce"}
    assert any("bucket" in n for n in names)
    assert "microbatches=4" not in dash.diff.value      # labels name what differs: the mode
    assert "dp_mode=naive" in dash.diff.value and "dp_mode=bucketed" in dash.diff.value
    assert bytes(dash.compare_view.widget.value).startswith(b"\x89PNG")
    drawn, image = dash.draws, bytes(dash.timeline_view.widget.value)
    dash.path_box.value = True                          # a view toggle: it redraws, it runs nothing
    dash._painter.wait(DEADLINE)
    assert dash.draws == drawn + 1 and dash.runner.last is third
    assert "critical path" in dash.timeline_view.axes[0].get_title()
    assert bytes(dash.timeline_view.widget.value) != image
    dash.close()


@pytest.mark.slow
def test_changes_during_a_run_coalesce_and_stop_ends_at_a_step_boundary(lab2):
    dash = Dashboard(lab2, model=MODEL, data=slow_data, batch=16, steps=4, plot="image",
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    dash.run()
    for mb in (2, 4, 8):                                 # while run 1 is in flight
        dash.controls["microbatches"].value = mb
    assert dash.runner.pending.strategy.microbatches == 8
    last = dash.wait(DEADLINE)
    assert dash.runner.started == 2                      # run 1, then only the latest change
    assert last.spec.strategy.microbatches == 8 and fwd_per_rank(last) == {0: 8, 1: 8}
    assert last.groups_rebuilt == [False, False]

    dash.run()
    deadline = time.monotonic() + DEADLINE
    while dash.latest.step < 0:                          # stop after the first step is in
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.01)
    dash.controls["microbatches"].value = 2             # queued ...
    dash.stop()                                          # ... and dropped by Stop
    stopped = dash.wait(DEADLINE)
    assert stopped.state == "stopped" and stopped.run.interrupted
    assert len(stopped.run.losses) < 4 and dash.runner.started == 3
    assert "stopped after step" in dash.status_text
    dash.close()


@pytest.mark.slow
def test_a_change_of_degrees_rebuilds_the_groups(lab2):
    lab2.apply(engine.ensure_groups, ParallelDims(1, 2, 1))
    dash = Dashboard(lab2, model=MODEL, batch=32, steps=1, plot="image",
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    dash.run()
    assert dash.wait(DEADLINE).groups_rebuilt == [True, True]
    assert "groups rebuilt" in dash.status_text
    dash.close()


@pytest.mark.slow
def test_an_engine_failure_names_the_rank_and_leaves_the_dashboard_usable(lab2):
    dash = Dashboard(lab2, model=failing_model, batch=32, steps=2, plot="image",
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    dash.run()
    failed = dash.wait(DEADLINE)
    assert failed.state == "failed" and failed.error.ranks == [1]
    assert "rank 1" in dash.status_text and "refuses on purpose" in dash.status_text
    assert not dash.run_button.disabled

    dash.model = MODEL
    dash.run()
    again = dash.wait(DEADLINE)
    assert again.state == "done" and len(again.run.losses) == 2
    assert f"run {again.number} done" in dash.status_text
    dash.close()


STRAGGLE_S = 6.0      # longer than the 3 s timeout below plus the lab's 2 s grace


def straggler_data(step):
    """Rank 1 is late at step 1 by more than the collective timeout: rank 0 times out waiting."""
    if step == 1 and os.environ.get("RANK") == "1":
        time.sleep(STRAGGLE_S)
    return plain_data(step)


def plain_data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)


@pytest.mark.slow
def test_a_collective_timeout_in_the_dashboard_is_handled_as_in_lab_run(lab2):
    lab2.timeout = 3.0                    # groups made from now on time out after 3 s
    dash = Dashboard(lab2, model=MODEL, data=straggler_data, batch=16, steps=2, plot="image", auto=False,
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    try:
        dash.run()
        deadline = time.monotonic() + DEADLINE
        while dash.latest.step < 0 and not dash.latest.ended:        # step 1 (the slow one) is running
            assert time.monotonic() < deadline, "no step finished"
            time.sleep(0.01)
        with pytest.raises(labkit.LabError, match="busy with dashboard run"):    # no interleaving
            lab2.run(labkit.Strategy(dp=2), model=MODEL, batch=16, steps=1)
        with pytest.raises(labkit.LabError, match="busy with dashboard run"):
            lab2.apply(engine.describe)
        failed = dash.wait(DEADLINE)
        assert failed.state == "failed" and isinstance(failed.error, labkit.CollectiveTimeoutError)
        # the status names the late rank (the cause), not rank 0's timeout (the echo)
        assert "rank 1 never reached barrier 'start of step 1'" in dash.status_text, dash.status_text

        dash.data = plain_data            # the same dashboard runs again on a clean world: exact
        dash.run()
        again = dash.wait(DEADLINE)
        assert again.state == "done", again.error
        ref = labkit.reference(MODEL, batch=16, steps=2, lr=0.1, seed=0, data=plain_data)
        assert again.run.max_diff(ref) < 1e-5
    finally:
        dash.close()
        lab2.timeout = 30                 # the shared lab's own timeout (a fresh store next call)


class ClosedLab(NoEngines):
    """What ``lab.close()`` leaves: no engines to call."""

    closed = True


def test_after_lab_close_the_dashboard_says_so_and_disables_run():
    dash = Dashboard(ClosedLab(), model=MODEL, batch=32, auto=True, plot="image")
    assert dash.run_button.disabled and dash.status_text == "the lab is closed: start a new one"
    dash.controls["microbatches"].value = 2              # a change after close: no AttributeError
    assert dash.run() is None and dash.run_button.disabled
    dash.close()


def test_stop_says_a_queued_change_is_dropped_and_pin_confirms(lab2):
    """Run with the settings already in flight queues nothing; Stop drops a queued change and
    says so (the controls then show settings that never ran);
    Pin before any run says there is nothing to pin, after one names the run it kept; the
    metrics row of a run without a pipeline shows no bubble."""
    dash = Dashboard(lab2, model=MODEL, data=slow_data, batch=16, steps=4, plot="image",
                     strategy=labkit.Strategy(dp=2, dp_mode="naive"))
    try:
        assert dash.pin() is None and "nothing to pin" in dash.status_text
        dash.run()
        assert dash.run() == "running" and dash.runner.pending is None     # no change: nothing queued
        assert "in flight with these settings" in dash.status_text
        dash.controls["microbatches"].value = 2          # queued behind the run in flight
        assert dash.runner.pending is not None
        dash.stop()
        live = dash.wait(DEADLINE)
        assert dash.runner.pending is None and "queued change was dropped: press Run" in dash.status_text
        assert dash.pin() == f"run {live.number}" and f"pinned run {live.number}" in dash.status_text
        assert "— (pp = 1)" in dash.metrics.value
    finally:
        dash.close()


def test_the_dashboard_describes_a_strategy_to_the_sliders_precision():
    from labkit.widgets import _describe

    assert "0.0156 MiB" in _describe(labkit.Strategy(dp=2, bucket_mb=0.015625))
    assert "0.25 MiB" in _describe(labkit.Strategy(dp=2, bucket_mb=0.25))


def test_controls_the_playgrounds_model_cannot_run_are_not_offered_and_say_why():
    """The MLP has no tp_plan and 15 blocks (no pp·chunks of 2 engines divides them): tp and
    interleaved are off, with the reason beside their group; the GPT offers both again."""
    dash = Dashboard(NoEngines(), model=labkit.models.mlp(width=256, depth=8), batch=64, auto=False, plot="image")
    try:
        c = dash.controls
        assert list(c["tp"].options) == [1] and c["tp"].disabled and "interleaved" not in c["schedule"].options
        assert "no tp_plan" in dash.notes["tp"].value and "15 blocks" in dash.notes["pp"].value
        assert "largest gradient 0.25 MiB" in dash.notes["dp"].value
        with pytest.raises(ValueError, match="offers 1; tp > 1: this model has no tp_plan"):
            dash.set(tp=2)
        dash.set(model="gpt", dp=1, tp=2)                 # a model with a plan: offered again
        assert not c["tp"].disabled and "interleaved" in c["schedule"].options and dash.status_text == "ready"
        assert dash.notes["tp"].value == ""
        dash.set(model="mlp")                             # back: tp's ranks return to dp, still runnable
        assert (c["dp"].value, c["tp"].value) == (2, 1) and dash.status_text == "ready"
    finally:
        dash.close()


def test_a_long_timeline_title_is_broken_to_the_figures_width():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from labkit.view.canvas import fit_title

    fig = Figure(figsize=(8, 3), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    text = ("run 12 · dp=2 zero=1 mb=4 0.0156 MiB bf16 recompute=full sync_batchnorm=True · step 2: 21.13 ms · "
            "bound by comm on rank 1 (this step)")
    for title, inside in ((text, False), (fit_title(fig, text), True)):
        ax.set_title(title, fontsize="medium")
        fig.canvas.draw()
        box = ax.title.get_window_extent()
        assert bool(box.x0 >= 0 and box.x1 <= fig.bbox.width) is inside
