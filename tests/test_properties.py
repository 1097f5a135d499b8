"""Any Strategy and run arguments either run or raise ValueError before an engine is touched.

Hypothesis draws strategies and run arguments from wide ranges (zero, negative, NaN,
unknown names). Most examples go to a stand-in lab whose every engine call raises
``Touched``, so thousands of examples take seconds: an argument set must fail with
``ValueError`` or get as far as ``Touched`` — never another exception, never a hang.
A handful of valid draws then run for real on two engines.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import labkit
from labkit.config import COMPRESSIONS, DP_MODES, SCHEDULES
from labkit.parallel.build import RunSpec
from labkit.run.runner import execute
from labkit.training import build_optimizer

TOUCHED = []      # examples that got past validation (the test checks there are some)


class Touched(Exception):
    """The run got past validation and asked the engines for something."""


class FakeLab:
    """Looks like a Lab to the runner; raises Touched at the first engine call."""

    def __init__(self, engines: int):
        self.world_size = engines
        self.ranks = [{"rank": r, "host": "here", "device": "cpu"} for r in range(engines)]
        self._interrupt = False

    def apply(self, fn, *args, **kwargs):
        raise Touched(getattr(fn, "__name__", "call"))

    def ensure_groups(self, *grid):
        raise Touched("ensure_groups")

    @contextlib.contextmanager
    def hold(self, what):
        yield self


small_ints = st.one_of(st.sampled_from([1, 1, 2]), st.integers(min_value=-2, max_value=9))
floats = st.one_of(st.sampled_from([0.1, 0.1, 0.0, -1.0, 1e-3]), st.floats(allow_nan=True, allow_infinity=True))
strategy_kwargs = st.fixed_dictionaries({}, optional={
    "dp": small_ints, "pp": small_ints, "tp": st.sampled_from([1, 1, 1, 0, 2]), "zero": st.sampled_from([0, 0, 1]),
    "microbatches": small_ints, "chunks": small_ints,
    "schedule": st.sampled_from(SCHEDULES + ("pipedream",)),
    "dp_mode": st.sampled_from(DP_MODES + ("fast",)),
    "compression": st.sampled_from(COMPRESSIONS + ("zip",)),
    "bucket_mb": floats,
})
run_kwargs = st.fixed_dictionaries({
    "batch": st.one_of(st.sampled_from([8, 16, 24, 48]), st.integers(min_value=-4, max_value=96)),
    "steps": st.integers(min_value=-1, max_value=6),
    "lr": floats,
    "momentum": floats,
    "seed": st.one_of(st.integers(min_value=-10, max_value=10), st.integers(min_value=-2**70, max_value=2**70)),
    "loss": st.sampled_from(["mse", "cross_entropy", "huber"]),
    "depth": st.integers(min_value=1, max_value=8),
})


def _spec(strategy, run) -> RunSpec:
    model = labkit.models.mlp(width=8, depth=run["depth"])
    return RunSpec(strategy, model, None, run["loss"], run["batch"], run["steps"], run["lr"],
                   run["momentum"], run["seed"], False)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(strategy_kwargs, run_kwargs, st.sampled_from([1, 2, 4, 8]))
def test_every_argument_set_runs_or_raises_value_error_first(kwargs, run, engines):
    try:
        strategy = labkit.Strategy(**kwargs)
    except ValueError:
        return
    try:
        execute(FakeLab(engines), _spec(strategy, run))
    except ValueError:
        return
    except Touched:
        # it passed validation: the values the engines will use must make sense
        assert strategy.world_size == engines
        assert run["batch"] % (strategy.dp * strategy.microbatches) == 0
        assert run["steps"] >= 1 and run["lr"] > 0 and not math.isnan(run["lr"])
        build_optimizer(torch.nn.Linear(2, 2).parameters(), run["lr"], run["momentum"])
        TOUCHED.append(1)
        return
    pytest.fail("execute returned without touching the engines")


def test_some_draws_get_past_validation():
    TOUCHED.clear()
    test_every_argument_set_runs_or_raises_value_error_first()
    assert len(TOUCHED) >= 5, "the draws hardly ever pass validation: widen the valid ones"


valid_runs = st.fixed_dictionaries({
    "dp_mode": st.sampled_from(DP_MODES),
    "pipeline": st.sampled_from([None, "gpipe", "1f1b"]),
    "microbatches": st.integers(min_value=1, max_value=3),
    "per_microbatch": st.integers(min_value=1, max_value=3),
    "steps": st.integers(min_value=1, max_value=2),
    "bucket_mb": st.sampled_from([0.001, 1.0]),
})


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid_runs)
def test_valid_draws_run_on_two_engines(lab2, draw):
    if draw["pipeline"]:
        strategy = labkit.Strategy(pp=2, schedule=draw["pipeline"], microbatches=draw["microbatches"])
        batch = draw["microbatches"] * draw["per_microbatch"]
    else:
        strategy = labkit.Strategy(dp=2, dp_mode=draw["dp_mode"], microbatches=draw["microbatches"],
                                   bucket_mb=draw["bucket_mb"])
        batch = 2 * draw["microbatches"] * draw["per_microbatch"]
    assume(batch >= 1)
    run = lab2.run(strategy, model=labkit.models.mlp(width=8, depth=4), batch=batch, steps=draw["steps"], lr=0.05)
    assert len(run.losses) == draw["steps"] and all(math.isfinite(x) for x in run.losses)
