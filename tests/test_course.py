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


def test_unknown_question_names_the_choices():
    with pytest.raises(ValueError, match="bubble"):
        course.check("nope", fake_dash())
