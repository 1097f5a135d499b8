"""The drift finder on planted faults: each found at the right step and parameter, and told
apart (replicas disagree: a sync bug; replicas agree but not with the reference: precision).

Faults are planted in the engine processes through ``lab.apply``, by wrapping the bucket's
``complete`` (where an averaged bucket is written back into the gradients), and removed
afterwards so the shared lab stays clean.
"""
from __future__ import annotations

import pytest
import torch

import labkit
from labkit.analysis.drift import GradNorms, grad_norms
from labkit.run.runner import ship_by_value

MODEL = labkit.models.mlp(width=48, depth=3)        # Linear layers 0, 2, 4
STEPS = 4
BUCKET_MB = 0.004       # one bucket per layer, last layer first: bucket 0 = layer 4, 1 = layer 2, 2 = layer 0
BUCKETED = labkit.Strategy(dp=2, dp_mode="bucketed", bucket_mb=BUCKET_MB)


# -- faults, run on the engines ---------------------------------------------------------------
def plant(fault: str, bucket: int, from_step: int) -> None:
    """Wrap ``_Bucket.complete`` so that bucket ``bucket`` goes wrong from step ``from_step`` on.

    "skip": rank 1 keeps its own (local) gradient instead of the average — it still takes part
    in the all-reduce, as a rank that skips the write-back would, so nothing hangs.
    "factor": every rank divides the bucket's sum by 2·dp instead of dp.
    """
    from labkit import engine
    from labkit.parallel.data import sync as data_parallel

    cls = data_parallel._Bucket
    original = getattr(cls, "_unplanted", cls.complete)

    def complete(self, dp, compressor=None):
        s = engine.session()
        if self.index != bucket or s.recorder.step < from_step:
            return original(self, dp, compressor)
        if fault == "factor":
            return original(self, 2 * dp, compressor)
        if s.rank != 1:
            return original(self, dp, compressor)
        self.handle.wait()               # p.grad still holds this rank's own gradient
        self.handle = self.flat = None
        self.ready = 0

    cls._unplanted, cls.complete = original, complete


def unplant() -> None:
    from labkit.parallel.data import sync as data_parallel

    cls = data_parallel._Bucket
    if hasattr(cls, "_unplanted"):
        cls.complete = cls._unplanted
        del cls._unplanted


ship_by_value(plant)        # this test module is not importable on the engines


@pytest.fixture(scope="module")
def reference():
    return labkit.reference(MODEL, batch=16, steps=STEPS, lr=0.1, seed=0, snapshots=True)


def _run_with(lab, fault, bucket, from_step, strategy=BUCKETED):
    lab.apply(plant, fault, bucket, from_step)
    try:
        return lab.run(strategy, model=MODEL, batch=16, steps=STEPS, snapshots=True)
    finally:
        lab.apply(unplant)


# -- pure -------------------------------------------------------------------------------------
class Recorded:
    def __init__(self, snapshots):
        self.snapshots = snapshots


def _snap(**params):
    return {"params": {k: torch.tensor(v) for k, v in params.items()},
            "grad_norms": {k: float(torch.tensor(v).norm()) for k, v in params.items()}}


def test_drift_walks_steps_then_parameters_then_ranks():
    ref = Recorded([{0: _snap(a=[1.0], b=[2.0])}, {0: _snap(a=[1.0], b=[2.0])}])
    run = Recorded([{0: _snap(a=[1.0], b=[2.0]), 1: _snap(a=[1.0], b=[2.0])},
                    {0: _snap(a=[1.0], b=[2.5]), 1: _snap(a=[1.1], b=[2.0])}])
    found = labkit.drift(run, ref, tol=1e-3)
    assert (found.step, found.parameter, found.rank, found.kind) == (1, "a", 1, "sync")
    assert found.size == pytest.approx(0.1) and found.spread == pytest.approx(0.1)
    assert [(p, r) for p, r, _ in found.departed] == [("a", 1), ("b", 0)]
    assert "sync bug" in str(found)
    assert labkit.drift(run, ref, tol=1.0) is None


def test_a_parameter_on_one_rank_cannot_be_called_a_sync_bug():
    ref = Recorded([{0: _snap(a=[1.0], b=[2.0])}])
    run = Recorded([{0: _snap(a=[1.0]), 1: _snap(b=[2.5])}])            # pipeline stages: one holder each
    found = labkit.drift(run, ref)
    assert (found.parameter, found.rank, found.kind, found.replicas) == ("b", 1, "unknown", (1,))
    assert "only one rank holds it" in str(found)


def test_drift_needs_snapshots_and_says_how():
    with pytest.raises(ValueError, match=r"lab.run\(\.\.\., snapshots=True\)"):
        labkit.drift(Recorded([]), Recorded([{0: _snap(a=[1.0])}]))
    with pytest.raises(ValueError, match="tol"):
        labkit.drift(Recorded([{0: _snap(a=[1.0])}]), Recorded([{0: _snap(a=[1.0])}]), tol=-1)
    with pytest.raises(ValueError, match="snapshots"):
        labkit.reference(MODEL, batch=16, steps=1, snapshots="yes")


def test_reference_records_one_snapshot_per_step(reference):
    assert len(reference.snapshots) == STEPS
    last = reference.snapshots[-1][0]["params"]
    assert all(torch.equal(last[k], v) for k, v in reference.parameters().items())
    table = reference.grad_norms()
    assert isinstance(table, GradNorms) and table[(0, "4.bias", 0)] > 0
    assert "4.weight" in repr(table) and "<table>" in table._repr_html_()


# -- on 2 engines -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_correct_run_does_not_drift_and_its_gradients_match(lab2, reference):
    run = lab2.run(BUCKETED, model=MODEL, batch=16, steps=STEPS, snapshots=True)
    assert labkit.drift(run, reference) is None
    table = run.grad_norms(reference)
    assert table.columns == [0, 1, "reference"]
    for step, name in table.order:
        assert table[(step, name, 0)] == table[(step, name, 1)] == pytest.approx(table[(step, name, "reference")],
                                                                                rel=1e-5)


@pytest.mark.slow
def test_a_rank_skipping_a_bucket_is_a_sync_bug_at_that_step(lab2, reference):
    run = _run_with(lab2, "skip", bucket=1, from_step=2)
    found = labkit.drift(run, reference)
    assert (found.step, found.parameter, found.rank, found.kind) == (2, "2.weight", 1, "sync")
    assert {p for p, _, _ in found.departed} == {"2.weight", "2.bias"}      # that bucket, nothing else
    assert found.spread == pytest.approx(found.size, rel=1e-3)              # rank 0 stayed on the reference
    norms = run.grad_norms(reference)
    assert norms[(2, "2.weight", 1)] != pytest.approx(norms[(2, "2.weight", 0)], rel=1e-3)
    assert norms[(2, "2.weight", 0)] == pytest.approx(norms[(2, "2.weight", "reference")], rel=1e-5)


@pytest.mark.slow
def test_a_wrong_averaging_factor_is_math_not_sync(lab2, reference):
    run = _run_with(lab2, "factor", bucket=2, from_step=1)
    found = labkit.drift(run, reference)
    assert (found.step, found.parameter, found.rank, found.kind) == (1, "0.weight", 0, "precision")
    assert {(p, r) for p, r, _ in found.departed} == {("0.weight", 0), ("0.weight", 1), ("0.bias", 0), ("0.bias", 1)}
    assert found.spread == 0.0
    norms = run.grad_norms(reference)
    assert norms[(1, "0.weight", 0)] == pytest.approx(norms[(1, "0.weight", "reference")] / 2, rel=1e-5)


@pytest.mark.slow
def test_bf16_compression_is_precision_from_the_first_step(lab2, reference):
    s = labkit.Strategy(dp=2, dp_mode="overlap", bucket_mb=BUCKET_MB, compression="bf16")
    run = lab2.run(s, model=MODEL, batch=16, steps=STEPS, snapshots=True)
    found = labkit.drift(run, reference, tol=5e-7)      # bf16 departs by 1.3e-6 at step 0; fp32 by 1.5e-8 after 4
    assert (found.step, found.kind) == (0, "precision") and found.spread == 0.0
    assert found.parameter == "0.weight" and found.size > 5e-7
    assert labkit.drift(run, reference, tol=2 * run.max_diff(reference)) is None


# -- loss curves --------------------------------------------------------------------------------
@pytest.mark.slow
def test_loss_curves_put_each_setting_beside_the_reference(lab2):
    from labkit.bench.curves import loss_curves

    curves = loss_curves(lab2, MODEL, settings=("fp32", "int8", "fp8_e4m3"), batch=16, steps=3, bucket_mb=BUCKET_MB)
    fp32, int8, fp8 = curves.curves
    assert fp32.losses == pytest.approx(curves.reference_losses, abs=1e-6)
    assert fp32.val_losses == pytest.approx(curves.reference_val_losses, abs=1e-6)
    assert fp32.max_diff < 1e-6 < int8.max_diff and len(fp8.param_gaps) == 3
    assert int8.bytes_per_step[-1] == fp8.bytes_per_step[-1] < 0.26 * fp32.bytes_per_step[-1]
    assert "fp8_e4m3" in repr(curves)
    assert len(curves.plot().axes) == 3
