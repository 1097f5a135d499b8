"""Gradient compression: codecs, bytes on the wire, training close to uncompressed, loud failures."""
from __future__ import annotations

import pytest
import torch

import labkit
from labkit.comm.compression import dequantize_int8, int8_wire_bytes, quantize_int8
from labkit.parallel.data.sync import make_buckets

MODEL = labkit.models.mlp(width=48, depth=3)
STEPS = 4


def _bucket_numels(bucket_mb: float) -> list[int]:
    params = list(MODEL().named_parameters())
    return [sum(p.numel() for _, p in b) for b in make_buckets(params, bucket_mb * 2 ** 20)]


def _sent_per_step(run, rank=0, step=STEPS - 1) -> int:
    from labkit.analysis.metrics import SEND_KINDS
    return sum(e["bytes"] for e in run.timeline.events
               if e["rank"] == rank and e["step"] == step and e["kind"] in SEND_KINDS)


# -- pure -------------------------------------------------------------------------------------
def test_int8_round_trip_is_within_half_a_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    rounding = 4 * torch.finfo(torch.float32).eps * x.abs().max()     # float32's own error at |x|
    assert (dequantize_int8(q, scale) - x).abs().max() <= scale / 2 + rounding


def test_int8_scale_carries_a_non_finite_gradient():
    q, scale = quantize_int8(torch.tensor([1.0, float("nan")]))
    assert not torch.isfinite(scale).all()


def test_int8_wire_bytes_is_a_quarter_of_fp32_plus_scales():
    for n in (2, 3, 4):
        fp32 = labkit.comm.wire_bytes("allreduce", 4 * 10_000, n)
        assert int8_wire_bytes(10_000, n) == pytest.approx(fp32 / 4 + 8 * (n - 1), abs=2 * n)


@pytest.mark.parametrize("kwargs, says", [
    (dict(compression="zip"), "unknown"),
    (dict(compression="int8", dp_mode="naive"), "no buckets"),
    (dict(compression="int8", dp_mode="ddp"), "no int8 DDP hook"),
    (dict(compression="powersgd", dp_mode="overlap"), "dp_mode='ddp'"),
    (dict(compression="fp16", error_feedback="yes"), "error_feedback"),
])
def test_bad_compression_settings_say_why(kwargs, says):
    with pytest.raises(ValueError, match=says):
        labkit.Strategy(dp=2, **kwargs)


# -- on 4 engines -------------------------------------------------------------------------------
def test_int8_bytes_on_four_ranks(lab4):
    bucket_mb = 0.004
    none = lab4.run(labkit.Strategy(dp=4, dp_mode="bucketed", bucket_mb=bucket_mb), model=MODEL, batch=16,
                    steps=STEPS)
    int8 = lab4.run(labkit.Strategy(dp=4, dp_mode="overlap", bucket_mb=bucket_mb, compression="int8"),
                    model=MODEL, batch=16, steps=STEPS)
    expected = sum(int8_wire_bytes(numel, 4) for numel in _bucket_numels(bucket_mb))
    assert all(_sent_per_step(int8, rank) == expected for rank in range(4))
    assert 0.24 < _sent_per_step(int8) / _sent_per_step(none) < 0.27
    assert int8.max_diff(none) < 2e-3


# -- on 2 engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return labkit.reference(MODEL, batch=16, steps=STEPS, lr=0.1, seed=0)


CASES = [("bucketed", "fp16", True, 0.5), ("overlap", "bf16", True, 0.5), ("bucketed", "int8", True, None),
         ("overlap", "int8", False, None), ("ddp", "fp16", True, 0.5), ("ddp", "bf16", True, 0.5)]


@pytest.mark.parametrize("mode, compression, error_feedback, ratio", CASES)
def test_compressed_training_stays_close_and_counts_bytes(lab2, reference, mode, compression, error_feedback,
                                                          ratio):
    bucket_mb = 0.004
    run = lab2.run(labkit.Strategy(dp=2, dp_mode=mode, bucket_mb=bucket_mb, compression=compression,
                                   error_feedback=error_feedback), model=MODEL, batch=16, steps=STEPS)
    assert run.max_diff(reference) < 2e-3
    assert run.losses == pytest.approx(reference.losses, abs=1e-3)
    fp32 = sum(4 * p.numel() for p in MODEL().parameters())           # n=2: an all-reduce sends S
    sent = _sent_per_step(run)
    if ratio is not None:
        assert sent == ratio * fp32
    else:
        assert sent == sum(int8_wire_bytes(numel, 2) for numel in _bucket_numels(bucket_mb))
    kinds = {e["kind"] for e in run.timeline.events if e["step"] == STEPS - 1}
    assert {"compress", "decompress"} <= kinds


def test_powersgd_runs_through_labkit_comm(lab2, reference):
    run = lab2.run(labkit.Strategy(dp=2, dp_mode="ddp", compression="powersgd"), model=MODEL, batch=16,
                   steps=STEPS)
    fp32 = sum(4 * p.numel() for p in MODEL().parameters())
    assert _sent_per_step(run, step=0) == fp32                   # torch starts PowerSGD at iteration 2
    assert 0 < _sent_per_step(run) < fp32 / 4                    # rank-1 factors from then on
    assert abs(run.losses[-1] - reference.losses[-1]) < 0.05


def nan_on_rank1_at_step1(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 48, generator=g), torch.randn(16, 48, generator=g)
    if step == 1:
        x[12] = float("nan")          # rows 8..15 are rank 1's share
    return x, y


@pytest.mark.parametrize("mode, compression", [("overlap", "int8"), ("bucketed", "fp16"), ("ddp", "bf16")])
def test_non_finite_gradient_names_rank_and_bucket(lab2, mode, compression):
    with pytest.raises(labkit.LabError) as info:
        lab2.run(labkit.Strategy(dp=2, dp_mode=mode, compression=compression), model=MODEL,
                 data=nan_on_rank1_at_step1, batch=16, steps=3)
    text = str(info.value)
    assert "FloatingPointError" in text and "rank 1, step 1: non-finite gradient" in text
    assert "bucket" in text
    assert sorted(info.value.ranks) == [0, 1]          # every rank stops; none waits for a timeout
