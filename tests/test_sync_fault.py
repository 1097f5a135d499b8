"""The public fault hook (``labkit.parallel.data.sync_fault``): a planted fault does what it says,
the drift finder catches it where notebook 10 says, and the lab is clean afterwards."""
from __future__ import annotations

import pytest

import labkit
from labkit.parallel.data import SyncFault, sync_fault

MODEL = labkit.models.mlp(width=48, depth=3)        # Linear layers 0, 2, 4
SETUP = dict(batch=16, steps=4, lr=0.1, seed=0)
# one bucket per layer, last layer first: bucket 0 = layer 4, 1 = layer 2, 2 = layer 0
BUCKETED = labkit.Strategy(dp=2, dp_mode="bucketed", bucket_mb=0.004)


def test_a_fault_is_checked_before_any_engine():
    for bad, field in ((dict(kind="drop", bucket=0, rank=1), "kind"), (dict(kind="skip", bucket=-1, rank=1), "bucket"),
                       (dict(kind="skip", bucket=0), "rank="), (dict(kind="factor", bucket=0, factor=0), "factor"),
                       (dict(kind="factor", bucket=0, from_step=1.5), "from_step"),
                       (dict(kind="skip", bucket=0, rank=True), "rank")):
        with pytest.raises(ValueError, match=field):
            SyncFault(**bad)
    assert str(SyncFault("skip", bucket=1, rank=1, from_step=2)) == \
        "rank 1 keeps its own gradient for bucket 1 from step 2"
    with pytest.raises(TypeError, match="SyncFault"):
        with sync_fault(None, "skip"):
            pass


@pytest.fixture(scope="module")
def reference():
    return labkit.reference(MODEL, **SETUP, snapshots=True)


@pytest.mark.slow
def test_a_skipped_write_back_is_a_sync_bug_at_that_step(lab2, reference):
    with sync_fault(lab2, SyncFault("skip", bucket=1, rank=1, from_step=2)) as fired:
        run = lab2.run(BUCKETED, model=MODEL, **SETUP, snapshots=True)
    assert list(fired.values()) == [[0, 2]]                  # rank 1 alone, at steps 2 and 3
    found = labkit.drift(run, reference)
    assert (found.step, found.parameter, found.rank, found.kind) == (2, "2.weight", 1, "sync")
    assert {p for p, _, _ in found.departed} == {"2.weight", "2.bias"}
    norms = run.grad_norms(reference)
    assert norms[(2, "2.weight", 0)] == pytest.approx(norms[(2, "2.weight", "reference")], rel=1e-5)
    assert norms[(2, "2.weight", 1)] != pytest.approx(norms[(2, "2.weight", 0)], rel=1e-3)
    # the hook is gone with the block: the same run is exact again
    assert labkit.drift(lab2.run(BUCKETED, model=MODEL, **SETUP, snapshots=True), reference) is None


@pytest.mark.slow
def test_a_wrong_factor_is_math_on_every_path_and_an_idle_fault_warns(lab2, reference):
    overlap_int8 = labkit.Strategy(dp=2, dp_mode="overlap", bucket_mb=0.004, compression="int8")
    with sync_fault(lab2, SyncFault("factor", bucket=2, from_step=1)):
        run = lab2.run(BUCKETED, model=MODEL, **SETUP, snapshots=True)
        compressed = lab2.run(overlap_int8, model=MODEL, **SETUP, snapshots=True)
    found = labkit.drift(run, reference)
    assert (found.step, found.parameter, found.kind, found.spread) == (1, "0.weight", "precision", 0.0)
    norms = run.grad_norms(reference)
    assert norms[(1, "0.weight", 0)] == pytest.approx(norms[(1, "0.weight", "reference")] / 2, rel=1e-5)
    halved = compressed.grad_norms(reference)          # int8's average, halved as well
    assert halved[(1, "0.weight", 0)] == pytest.approx(halved[(1, "0.weight", "reference")] / 2, rel=0.05)
    with pytest.warns(UserWarning, match="never fired"):
        with sync_fault(lab2, SyncFault("factor", bucket=7)):
            lab2.run(BUCKETED, model=MODEL, batch=16, steps=1, seed=0)
