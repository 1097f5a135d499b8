"""GPU paths: NCCL, one engine per GPU, CUDA-event timing. Skipped cleanly without GPUs.

    .venv/bin/python -m pytest tests/test_gpu.py -v     # on a machine with 1+ (or 2+) GPUs
"""
from __future__ import annotations

import pytest
import torch

import labkit

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
MODEL = labkit.models.mlp(width=64, depth=4)


@pytest.fixture(scope="module")
def reference():
    return labkit.reference(MODEL, batch=32, steps=3, lr=0.1, seed=0)


def _check_events(run):
    for e in run.timeline.events:
        assert 0 <= e["start"] <= e["end"] < 10.0, e          # CUDA events resolved to seconds
    kinds = {e["kind"] for e in run.timeline.events}
    assert {"fwd", "bwd", "optimizer"} <= kinds


def test_one_engine_per_gpu_uses_nccl_and_cuda_events(reference):
    from conftest import release_labs
    release_labs()
    with labkit.Lab.start(engines=1, timeout=60, progress=False) as lab:
        assert lab.ranks[0]["device"] == "cuda:0" and lab.ranks[0]["backend"] == "nccl"
        run = lab.run(labkit.Strategy(dp=1, dp_mode="overlap"), model=MODEL, batch=32, steps=3)
        assert run.max_diff(reference) < 1e-4      # GPU kernels sum in another order than CPU ones
        _check_events(run)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["naive", "bucketed", "overlap", "ddp"])
def test_data_parallel_over_two_gpus(mode, reference):
    from conftest import release_labs
    release_labs()
    with labkit.Lab.start(engines=2, timeout=60, progress=False) as lab:
        assert [r["device"] for r in lab.ranks] == ["cuda:0", "cuda:1"]
        run = lab.run(labkit.Strategy(dp=2, dp_mode=mode, bucket_mb=0.01), model=MODEL, batch=32, steps=3)
        assert run.max_diff(reference) < 1e-4
        _check_events(run)
        assert any(e["stream"] == "comm" for e in run.timeline.events)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_pipeline_over_two_gpus(reference):
    from conftest import release_labs
    release_labs()
    with labkit.Lab.start(engines=2, timeout=60, progress=False) as lab:
        run = lab.run(labkit.Strategy(pp=2, schedule="1f1b", microbatches=4), model=MODEL, batch=32, steps=3)
        assert run.max_diff(reference) < 1e-4
        _check_events(run)
