"""Every data-parallel mode equals the single-process run, through the real Lab."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.data.sync import make_buckets

MODES = ["naive", "bucketed", "overlap", "ddp"]
STEPS = 5


def odd_model():
    """A user's own model: odd sizes, several non-linearities, a LayerNorm."""
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 29), nn.ReLU(inplace=True),
                         nn.LayerNorm(29), nn.Linear(29, 7), nn.Sigmoid(), nn.Linear(7, 5))


def odd_data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(24, 13, generator=g), torch.randn(24, 5, generator=g)


@pytest.fixture(scope="module")
def mlp_reference():
    return labkit.reference(labkit.models.mlp(width=48, depth=4), batch=24, steps=STEPS, lr=0.1, seed=3)


@pytest.fixture(scope="module")
def odd_reference():
    return labkit.reference(odd_model, data=odd_data, batch=24, steps=STEPS, lr=0.05, seed=5)


def _check(run, ref):
    assert run.max_diff(ref) <= 1e-5
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)
    assert set(run.parameters()) == set(ref.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_reference_dp2(lab2, mode, mlp_reference, odd_reference):
    strategy = labkit.Strategy(dp=2, dp_mode=mode, bucket_mb=0.004)
    _check(lab2.run(strategy, model=labkit.models.mlp(width=48, depth=4), batch=24, steps=STEPS, seed=3),
           mlp_reference)
    _check(lab2.run(strategy, model=odd_model, data=odd_data, batch=24, steps=STEPS, lr=0.05, seed=5),
           odd_reference)


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_reference_dp4(lab4, mode, mlp_reference, odd_reference):
    strategy = labkit.Strategy(dp=4, dp_mode=mode, bucket_mb=0.004)
    _check(lab4.run(strategy, model=labkit.models.mlp(width=48, depth=4), batch=24, steps=STEPS, seed=3),
           mlp_reference)
    _check(lab4.run(strategy, model=odd_model, data=odd_data, batch=24, steps=STEPS, lr=0.05, seed=5),
           odd_reference)


def test_microbatches_accumulate_to_the_same_step(lab2, mlp_reference):
    strategy = labkit.Strategy(dp=2, dp_mode="overlap", microbatches=3, bucket_mb=0.004)
    _check(lab2.run(strategy, model=labkit.models.mlp(width=48, depth=4), batch=24, steps=STEPS, seed=3),
           mlp_reference)


def test_timeline_shows_what_each_mode_sends(lab2):
    model = labkit.models.mlp(width=48, depth=4)     # 8 parameter tensors
    by_mode = {}
    for mode in MODES:
        run = lab2.run(labkit.Strategy(dp=2, dp_mode=mode, bucket_mb=0.004), model=model, batch=24, steps=2)
        step = [e for e in run.timeline.events if e["step"] == 1]
        by_mode[mode] = [e for e in step if e["kind"] == "allreduce" and e["rank"] == 0]
        assert {e["rank"] for e in step} == {0, 1}
        assert all(0 <= e["start"] <= e["end"] for e in step)
        assert any(e["kind"] == "bwd" for e in step) and any(e["kind"] == "optimizer" for e in step)
    assert len(by_mode["naive"]) == 8                    # one all-reduce per tensor
    assert 1 < len(by_mode["bucketed"]) < 8              # fewer, larger messages
    assert len(by_mode["overlap"]) == len(by_mode["bucketed"])
    assert len(by_mode["ddp"]) >= 1
    sent = [sum(e["bytes"] for e in by_mode[m]) for m in ("naive", "bucketed", "overlap")]
    assert sent[0] == sent[1] == sent[2] > 0              # same gradients, packed differently


def test_overlap_launches_during_backward(lab2):
    run = lab2.run(labkit.Strategy(dp=2, dp_mode="overlap", bucket_mb=0.004),
                   model=labkit.models.mlp(width=48, depth=4), batch=24, steps=2)
    step = [e for e in run.timeline.events if e["step"] == 1 and e["rank"] == 0]
    last_bwd_start = max(e["start"] for e in step if e["kind"] == "bwd")
    first_comm = min(e["start"] for e in step if e["kind"] == "allreduce")
    assert first_comm < last_bwd_start        # a bucket left before backward was over


def test_run_metrics_have_the_design_keys(lab2):
    run = lab2.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=32, depth=2), batch=8, steps=3)
    for key in ("step_time_s", "throughput_samples_s", "comm_fraction", "exposed_comm_fraction",
                "overlap_fraction", "bubble_fraction", "bytes_sent", "peak_activation_bytes"):
        assert key in run.metrics
    assert len(run.metrics["bytes_sent"]) == 2 and run.metrics["step_time_s"] > 0


def test_make_buckets_follows_gradient_order():
    params = [(f"p{i}", nn.Parameter(torch.zeros(256))) for i in range(6)]   # 1 KiB each
    buckets = make_buckets(params, bucket_bytes=2048)
    assert [[n for n, _ in b] for b in buckets] == [["p5", "p4"], ["p3", "p2"], ["p1", "p0"]]
    assert len(make_buckets(params, bucket_bytes=1e9)) == 1


@pytest.mark.parametrize("mode", ["overlap", "ddp"])
def test_microbatches_reduce_once_per_step(lab2, mode, mlp_reference):
    model = labkit.models.mlp(width=48, depth=4)
    counts = []
    for m in (1, 3):
        run = lab2.run(labkit.Strategy(dp=2, dp_mode=mode, microbatches=m, bucket_mb=0.004), model=model,
                       batch=24, steps=STEPS, seed=3)
        _check(run, mlp_reference)
        counts.append(sum(1 for e in run.timeline.events if e["kind"] == "allreduce" and e["step"] == 2))
    assert counts[0] == counts[1] > 0


def test_activation_memory_shrinks_with_microbatches(lab2):
    model = labkit.models.mlp(width=48, depth=4)
    peaks = []
    for m in (1, 4):
        run = lab2.run(labkit.Strategy(dp=2, microbatches=m), model=model, batch=32, steps=1)
        peaks.append(run.metrics["peak_activation_bytes"])
    assert all(p > 0 for p in peaks[0])
    assert all(a > 3 * b for a, b in zip(peaks[0], peaks[1]))      # one micro-batch held at a time
