"""labkit.course: tour checks read the reader's settings or answer, and hold the answer back."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import labkit
from labkit import course


def fake_dash(pp=2, schedule="gpipe", microbatches=1, bubble=0.5, state="done"):
    live = SimpleNamespace(number=3, state=state, run=SimpleNamespace(metrics={"bubble_fraction": bubble}),
                           spec=SimpleNamespace(strategy=labkit.Strategy(pp=pp, schedule=schedule,
                                                                         microbatches=microbatches)))
    return SimpleNamespace(model=labkit.models.mlp(width=256, depth=8), wait=lambda: live)


def test_bubble_check_reads_the_last_run_and_does_not_give_m_away():
    assert "Not yet" in course.check("bubble", fake_dash(microbatches=1, bubble=0.5))
    text = course.check("bubble", fake_dash(microbatches=8, bubble=0.12))
    assert "Goal reached" in text and "12%" in text
    assert "set dp = 1 and pp = 2" in course.check("bubble", fake_dash(pp=1, bubble=0.0))


def test_bucket_check_judges_the_answer_by_the_models_own_buckets():
    dash = fake_dash()                                      # 8×Linear(256): ~2 MiB of gradients
    total = course.gradient_bytes(dash.model) / course.MiB
    assert 1.9 < total < 2.1
    assert "guess first" in course.check("bucket", dash).lower()
    assert "Not there yet" in course.check("bucket", dash, answer=0.5)
    assert "Right" in course.check("bucket", dash, answer=4)
    assert f"{total:.2f} MiB" in course.answer("bucket", dash)


def test_bubble_goal_is_reached_by_the_hints_m_whatever_the_machine_adds():
    """m = 5 is the hint: the formula's 1/6 decides, the measured share is reported beside it."""
    assert "Goal reached" in course.check("bubble", fake_dash(microbatches=5, bubble=0.26))
    assert "Not yet" in course.check("bubble", fake_dash(microbatches=4, bubble=0.15))
    assert "gpipe and 1f1b" in course.check("bubble", fake_dash(schedule="zb-h1", microbatches=8))


@pytest.mark.parametrize("question, right, wrong", [
    ("busbw", 1.75, 2.0), ("gpipe_p4", 12, 13), ("interleaved", 3 / 19, 3 / 11), ("megatron_dp", [0, 2], [0, 4]),
    ("timeout", 5, 6.5), ("tp_bytes", 2**20, 2**21), ("zero3_bytes", 4e6, 16e6),
    ("zbv_p4", 3 / 51, 3 / 11), ("drift_kind", "Math or precision", "sync"), ("cp_tokens", 8192, 4096),
    ("zero3_forward", 1 / 3, 2 / 3),
    ("ep_dispatch_bytes", 4096 * 8 * 7168 * 2 * 7 / 8, 4096 * 8 * 7168 * 2), ("ep_imbalance", 4, 1),
    ("dp_traffic", 1.5, 2.0), ("bucketed_ms", 20.97, 41.9), ("ps_ring", 8, 4), ("sendrecv_ms", 0.3, 0.2), ("hsdp_inter", 0.5, 2.25),
    ("moe_active", 0.25, 2 / 4), ("gqa_kv", 8388608, 33554432), ("whatif_link", 50, 20)])
def test_exercises_judge_the_answer_and_hold_it_back(question, right, wrong):
    prompt = course.check(question)
    assert "answer=" in prompt and course.EXERCISES[question].why not in prompt
    assert course.check(question, answer=right).startswith("Right")
    wrong_text = course.check(question, answer=wrong)
    assert wrong_text.startswith("Not yet") and "Hint" in wrong_text
    assert course.answer(question).startswith(course._shown(course.EXERCISES[question].expected()))


def test_a_non_number_is_refused_by_name():
    assert "not a number" in course.check("busbw", answer="lots")


def test_the_megatron_exercise_follows_megatrons_order_not_labkits():
    """Megatron: tp fastest, then dp, then pp; labkit's grid puts pp before dp."""
    from labkit.grid import ParallelDims
    assert course._megatron_dp_group(0, tp=2, dp=2, pp=2) == [0, 2]
    assert course._megatron_dp_group(5, tp=2, dp=2, pp=2) == [5, 7]
    assert [0, 4] in ParallelDims(dp=2, pp=2, tp=2).dp_groups()


def test_unknown_question_names_the_choices():
    with pytest.raises(ValueError, match="bubble"):
        course.check("nope", fake_dash())


class ClosingLab:
    """A lab the test closes by hand; its engines are never called."""

    world_size, ranks, closed = 2, [], False

    @property
    def view(self):
        raise AssertionError("the dashboard reached the engines")


def test_playground_run_all_leaves_the_lab_open():
    """05's last cell holds ``lab.close()`` commented: Run All, the room's first action, must not
    close the playground under the dashboard (tests/test_browser.py drives that Run All)."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "notebooks" / "05_playground.ipynb"
    code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert code[-1].lstrip().startswith("# lab.close()")
    assert not any(line.strip().startswith("lab.close()") for cell in code for line in cell.splitlines())


def test_dashboard_shows_a_closed_lab_without_a_click():
    """A reader who runs lab.close() sees the status line say so at once, and Run goes off."""
    import time

    from labkit.widgets import Dashboard

    lab = ClosingLab()
    dash = Dashboard(lab, model=labkit.models.mlp(width=32, depth=2), batch=32, auto=True, plot="image")
    try:
        assert not dash.run_button.disabled
        lab.closed = True                                  # what lab.close() leaves
        deadline = time.monotonic() + 5
        while not dash.run_button.disabled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dash.run_button.disabled and dash.status_text == "the lab is closed: start a new one"
    finally:
        dash.close()


def test_megatron_dp_accepts_the_group_with_or_without_rank_0():
    """"Which ranks average with rank 0" reads two ways: [0, 2] (the group) and [2] (the others)."""
    assert course.check("megatron_dp", answer=[2]).startswith("Right")
    assert course.check("megatron_dp", answer=[0, 2]).startswith("Right")
    assert course.check("megatron_dp", answer=[4]).startswith("Not yet")


def test_cp_chunks_answer_counts_the_pairs_as_notebook_13_does():
    """A diagonal (query, key) chunk pair counts half: 8 pairs a rank at cp = 4, not 9."""
    assert "8 (query, key) chunk pairs" in course.answer("cp_chunks")
