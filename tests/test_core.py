"""Pure pieces: strategy validation, the rank grid, models, the reference run. No engines."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import labkit
from labkit.grid import ParallelDims
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate


@pytest.mark.parametrize("kwargs, field", [
    (dict(dp=0), "dp"), (dict(pp=-1), "pp"), (dict(dp_mode="fast"), "dp_mode"),
    (dict(schedule="zigzag"), "schedule"), (dict(compression="zip"), "compression"),
    (dict(bucket_mb=0), "bucket_mb"), (dict(microbatches=0), "microbatches"),
    (dict(chunks=2), "chunks"), (dict(pp=2, schedule="interleaved", chunks=1), "chunks"),
    (dict(pp=2, schedule="interleaved", chunks=2, microbatches=3), "microbatches"),
])
def test_strategy_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Strategy\.{field}"):
        labkit.Strategy(**kwargs)


def test_strategy_is_a_frozen_keyword_dataclass():
    s = labkit.Strategy(dp=2)
    assert dataclasses.replace(s, bucket_mb=4.0).bucket_mb == 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dp = 3
    with pytest.raises(TypeError):
        labkit.Strategy(2)        # keyword-only


def test_engine_and_batch_checks_say_the_fix():
    s = labkit.Strategy(dp=2, microbatches=4)
    with pytest.raises(ValueError, match="engines=2"):
        s.check_engines(4)
    with pytest.raises(ValueError, match="multiple of 2"):
        s.check_batch(9)
    with pytest.raises(ValueError, match="microbatches=4"):
        s.check_batch(12)
    s.check_batch(16)


def test_validate_rejects_bad_runs_before_any_engine():
    model = labkit.models.mlp(width=8, depth=2)
    ok = RunSpec(labkit.Strategy(dp=2), model, batch=8)
    validate(ok, engines=2)
    with pytest.raises(ValueError, match="engines"):
        validate(ok, engines=3)
    validate(RunSpec(labkit.Strategy(dp=2), lambda: nn.Linear(2, 2), batch=8), engines=2)   # any nn.Module
    with pytest.raises(TypeError, match="nn.Module"):
        validate(RunSpec(labkit.Strategy(dp=2), lambda: "model", batch=8), engines=2)
    with pytest.raises(ValueError, match="nn.Sequential"):
        validate(RunSpec(labkit.Strategy(pp=2), lambda: nn.Linear(2, 2), batch=8), engines=2)
    with pytest.raises(ValueError, match="loss"):
        validate(RunSpec(labkit.Strategy(dp=2), model, loss="hinge", batch=8), engines=2)
    with pytest.raises(ValueError, match="steps"):
        validate(RunSpec(labkit.Strategy(dp=2), model, batch=8, steps=0), engines=2)


def test_grid_layout_is_dp_major_tp_innermost():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.world_size == 8
    assert dims.tp_groups()[0] == [0, 1]
    assert dims.pp_groups()[0] == [0, 2]
    assert dims.dp_groups()[0] == [0, 4]
    assert [dims.coords(r) for r in (0, 3, 5)] == [(0, 0, 0), (0, 1, 1), (1, 0, 1)]
    for kind in ("dp", "pp", "tp"):
        groups = getattr(dims, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(8))   # a partition
    with pytest.raises(ValueError):
        dims.coords(8)


def test_mlp_factory_builds_the_same_weights_under_a_seed():
    make = labkit.models.mlp(width=16, depth=3, in_features=5, out_features=2)
    from labkit.training import build_model
    a, b = build_model(make, 1), build_model(make, 1)
    assert isinstance(a, nn.Sequential) and len(a) == 5
    assert a[0].in_features == 5 and a[-1].out_features == 2
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_reference_learns_and_is_deterministic():
    model = labkit.models.mlp(width=16, depth=2)
    r1 = labkit.reference(model, batch=32, steps=30, lr=0.5, seed=1)
    r2 = labkit.reference(model, batch=32, steps=30, lr=0.5, seed=1)
    assert r1.losses == r2.losses
    assert r1.losses[-1] < 0.7 * r1.losses[0]
    assert labkit.max_abs_diff(r1.parameters(), r2.parameters()) == 0.0


def test_rendezvous_address_is_never_loopback_across_hosts():
    from labkit.errors import LabError
    from labkit.session.ranks import master_address as _master_address
    assert _master_address([{"host": "n1"}, {"host": "n1"}]) == "127.0.0.1"
    assert _master_address([{"host": "n1", "master_addr": "10.1.2.3"}, {"host": "n2"}]) == "10.1.2.3"
    with pytest.raises(LabError, match="MASTER_ADDR"):
        _master_address([{"host": "localhost"}, {"host": "n2"}])
