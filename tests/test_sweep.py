"""A hostile sweep on two engines: bad data, bad models and misuse either give the
reference's answer or a clear error, and the lab works afterwards.

Hypothesis draws the data's row count, the model's defect and the strategy; every example
shares the session's two-engine lab (``lab2``) and ends with a check that a plain run still
matches the single-process reference.

    python -m pytest -q tests/test_sweep.py
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings

import cloudpickle
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import labkit
from labkit import Strategy

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])      # engines cannot import this file
BATCH = 8


def rows_data(rows: int):
    def data(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(rows, 16, generator=g), torch.randn(rows, 16, generator=g)
    return data


def mlp():
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def assert_lab_works(lab):
    """A plain data-parallel run equals the single-process reference."""
    run = lab.run(Strategy(dp=2), model=mlp, batch=BATCH, steps=2, lr=0.1)
    ref = labkit.reference(mlp, batch=BATCH, steps=2, lr=0.1)
    assert run.max_diff(ref) < 1e-5


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from([0, 1, 7, 9, 16]), st.sampled_from(["naive", "overlap", "ddp"]))
def test_data_with_the_wrong_number_of_rows_is_refused(lab2, rows, dp_mode):
    with pytest.raises(labkit.LabError, match=f"data gave {rows} inputs.*batch={BATCH}"):
        lab2.run(Strategy(dp=2, dp_mode=dp_mode), model=mlp, data=rows_data(rows), batch=BATCH, steps=2)
    assert_lab_works(lab2)


class Poison(nn.Module):
    def forward(self, x):
        return x * float("nan")


def test_a_non_finite_loss_stops_the_run_naming_step_and_rank(lab2):
    model = lambda: nn.Sequential(nn.Linear(16, 16), Poison())          # noqa: E731
    with pytest.raises(labkit.LabError, match=r"step 0.*loss is nan") as caught:
        lab2.run(Strategy(dp=2), model=model, data=rows_data(BATCH), batch=BATCH, steps=3)
    assert caught.value.ranks == [0, 1]
    with pytest.raises(ValueError, match="lr=inf"):
        lab2.run(Strategy(dp=2), model=mlp, batch=BATCH, lr=math.inf)
    run = lab2.run(Strategy(dp=2), model=model, data=rows_data(BATCH), batch=BATCH, steps=2,
                   allow_nonfinite=True)
    assert len(run.losses) == 2 and all(math.isnan(x) for x in run.losses)
    assert_lab_works(lab2)


class Branches(nn.Module):
    """Two linears, one never used: no gradient ever reaches ``unused``."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x)


def branch_model():
    return nn.Sequential(nn.Linear(16, 16), Branches(), nn.Tanh(), nn.Linear(16, 16))


@pytest.mark.parametrize("dp_mode", ["naive", "bucketed", "overlap"])
def test_an_unused_parameter_is_treated_as_a_zero_gradient(lab2, dp_mode):
    run = lab2.run(Strategy(dp=2, dp_mode=dp_mode, bucket_mb=0.001), model=branch_model, batch=BATCH, steps=3)
    assert run.max_diff(labkit.reference(branch_model, batch=BATCH, steps=3)) < 1e-5


class Pair(nn.Module):
    def forward(self, x):
        return x, x


def test_a_pipeline_stage_returning_a_tuple_is_named(lab2):
    model = lambda: nn.Sequential(nn.Linear(16, 16), Pair(), nn.Linear(16, 16))     # noqa: E731
    with pytest.raises(labkit.LabError, match=r"stage 0.*returned a tuple.*one tensor"):
        lab2.run(Strategy(pp=2, split_at=(2,)), model=model, batch=BATCH, steps=1)
    assert_lab_works(lab2)


def test_warnings_raised_on_the_engines_reach_the_notebook(lab2):
    def narrow(step):        # (8, 1) targets against (8, 16) outputs: torch warns about broadcasting
        g = torch.Generator().manual_seed(step)
        return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 1, generator=g)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lab2.run(Strategy(dp=2), model=mlp, data=narrow, batch=BATCH, steps=2)
    texts = [str(w.message) for w in caught]
    assert any("rank 0" in t and "target size" in t for t in texts), texts
    assert len([t for t in texts if "target size" in t]) <= 2         # once per rank and run, not per step


def bn_model():
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16))


@pytest.mark.parametrize("dp_mode", ["overlap", "ddp"])
def test_sync_batchnorm_matches_one_process(lab2, dp_mode):
    ref = labkit.reference(bn_model, batch=BATCH, steps=3)
    with pytest.warns(UserWarning, match="BatchNorm"):
        apart = lab2.run(Strategy(dp=2, dp_mode=dp_mode), model=bn_model, batch=BATCH, steps=3)
    assert apart.max_diff(ref) > 1e-4                     # per-replica statistics depart
    synced = lab2.run(Strategy(dp=2, dp_mode=dp_mode, sync_batchnorm=True), model=bn_model, batch=BATCH, steps=3)
    assert synced.max_diff(ref) < 1e-5
    assert set(synced.parameters()) == set(ref.parameters())


def _echo(**kwargs):
    return kwargs


def _sleepy(seconds):
    if int(os.environ["RANK"]) == 1:
        time.sleep(seconds)
    return "awake"


def test_apply_keeps_the_functions_own_keywords_and_a_stuck_rank_is_refused_at_once(lab2):
    assert lab2.apply(_echo, timeout=7, what="x") == [{"timeout": 7, "what": "x"}] * 2
    with lab2.limit(1):
        with pytest.raises(labkit.LabError, match="no answer after 1 s"):
            lab2.apply(_sleepy, 6)
    with pytest.raises(labkit.LabError, match=r"still running _sleepy.*lab.recover\(\)") as caught:
        lab2.apply(_echo)
    assert "s after the others left their groups" not in str(caught.value)     # refused, not waited for
    time.sleep(6)
    assert lab2.apply(_sleepy, 0) == ["awake", "awake"]
