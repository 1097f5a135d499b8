"""The GPU check, known to start before a GPU is ever lent: its pure parts (peaks and MFU, the
environment explained, the stall report, the recorder's sync flag, bounded parts) and the whole
script end to end on CPU, where the GPU-only parts skip with their reason.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py          # -m "not slow": pure tests only
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit import gpu
from labkit.record.recorder import SYNC_DEBUG_ENV, Recorder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


# -- peaks, MFU, FLOPs ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.05),
])
def test_peak_table_matches_device_names(name, tflops):
    assert gpu.peak_bf16_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Tesla V100-SXM2-16GB", "cpu", ""])
def test_unknown_device_shows_mfu_zero_not_a_guess(name):
    assert math.isinf(gpu.peak_bf16_flops(name))
    assert gpu.mfu(1e15, 1.0, name) == 0.0


def test_mfu_and_transformer_flops():
    assert gpu.mfu(989.4e12 / 2, 1.0, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    # 6·N per token for the weights, 12·L·d·T for attention (PaLM appendix B)
    assert gpu.transformer_train_flops(1000, 2, 8, 16, tokens=10) == (6 * 1000 + 12 * 2 * 8 * 16) * 10
    with pytest.raises(ValueError, match="step_s"):
        gpu.mfu(1.0, 0.0, "NVIDIA H100 80GB HBM3")


# -- the environment explained ---------------------------------------------------------------------
def _row(env, name):
    return next(r for r in gpu.explain_env(env) if r["variable"] == name)


def test_env_rows_cover_every_variable_and_its_overlap():
    rows = gpu.explain_env({})
    assert [r["variable"] for r in rows] == list(gpu.ENV_VARS) and len(rows) == 5
    assert all(r["value"] is None and r["what"].startswith("unset") and r["overlap"] for r in rows)
    assert "default, 3" in _row({}, "TORCH_NCCL_ASYNC_ERROR_HANDLING")["what"]


def test_env_values_are_explained():
    assert "hung" in _row({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING")["what"]
    assert _row({"NCCL_DEBUG": "info"}, "NCCL_DEBUG")["what"].startswith("INFO")
    assert "a line per collective" in _row({"NCCL_DEBUG_SUBSYS": "INIT,COLL"}, "NCCL_DEBUG_SUBSYS")["what"]
    blocking = _row({"CUDA_LAUNCH_BLOCKING": "1"}, "CUDA_LAUNCH_BLOCKING")
    assert "waits for its kernel" in blocking["what"] and "removes all overlap" in blocking["overlap"]
    assert "launch" in _row({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "CUDA_DEVICE_MAX_CONNECTIONS")["what"]
    assert "4 hardware work queues" in _row({"CUDA_DEVICE_MAX_CONNECTIONS": "4"}, "CUDA_DEVICE_MAX_CONNECTIONS")["what"]
    assert "not a value" in _row({"CUDA_LAUNCH_BLOCKING": "yes"}, "CUDA_LAUNCH_BLOCKING")["what"]


def test_env_report_names_ranks_that_differ():
    report = gpu.EnvReport([{"rank": 0, "device": "cuda:0", "env": {"CUDA_LAUNCH_BLOCKING": "1"}},
                            {"rank": 1, "device": "cuda:1", "env": {}}])
    text = str(report)
    assert "CUDA_LAUNCH_BLOCKING differs between ranks" in text and "rank 1: unset" in text
    assert "NCCL_DEBUG = (unset)" in text


# -- the stall report from hand-made events --------------------------------------------------------
def _event(rank, step, kind, name, start, end, stream="compute"):
    return {"rank": rank, "stream": stream, "kind": kind, "name": name, "step": step, "microbatch": None,
            "start": start, "end": end, "bytes": 0, "peer": None}


def test_stall_report_names_the_rank_and_op_where_time_goes():
    events = [_event(0, 0, "bwd", "Linear 2", 0.0, 5.0)]          # step 0 warms up: left out
    for step in (1, 2):
        events += [_event(0, step, "fwd", "F0", 0.0, 0.010), _event(0, step, "bwd", "Linear 2", 0.010, 0.030),
                   _event(0, step, "allreduce", "bucket 0", 0.020, 0.035, "comm"),
                   _event(1, step, "fwd", "F0", 0.0, 0.010), _event(1, step, "bwd", "Linear 2", 0.010, 0.090),
                   _event(1, step, "optimizer", "SGD step", 0.090, 0.100)]
    report = gpu.stall_report(events)
    assert report.steps == [1, 2] and report.step_s == pytest.approx(0.100)
    assert (report.worst["rank"], report.worst["kind"], report.worst["name"]) == (1, "bwd", "Linear 2")
    assert report.worst["seconds"] == pytest.approx(0.080) and report.worst["share"] == pytest.approx(0.8)
    assert report.idle[0] == pytest.approx(0.065) and report.idle[1] == pytest.approx(0.0, abs=1e-12)
    comm = next(r for r in report.rows if r["kind"] == "allreduce")
    assert comm["calls"] == 1 and comm["seconds"] == pytest.approx(0.015)
    text = str(report)
    assert "time goes to rank 1: bwd 'Linear 2'" in text and "(no recorded op)" in text


def test_stall_report_points_at_the_host_when_idle_dominates():
    events = [_event(0, s, "fwd", "F0", 0.0, 0.001) for s in range(3)]
    events += [_event(0, s, "optimizer", "SGD step", 0.099, 0.100) for s in range(3)]
    verdict = gpu.stall_report(labkit.Timeline(events)).verdict()
    assert "outside any recorded op" in verdict and "host side" in verdict
    assert gpu.stall_report([]).worst is None and "no recorded ops" in gpu.stall_report([]).verdict()


# -- the recorder's per-op sync flag ---------------------------------------------------------------
def test_recorder_sync_flag_from_environment(monkeypatch):
    monkeypatch.setenv(SYNC_DEBUG_ENV, "1")
    assert Recorder(0).sync_debug
    monkeypatch.setenv(SYNC_DEBUG_ENV, "0")
    assert not Recorder(0).sync_debug and Recorder(0, sync_debug=True).sync_debug


def test_recorder_synchronises_after_each_op_only_on_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    rec = Recorder(0, sync_debug=True)
    rec.add("fwd", "F0", 0.0, 1.0)
    assert calls == []                             # CPU: a no-op
    rec.cuda = True                                # as on a GPU engine (times stay floats here)
    rec.add("fwd", "F1", 1.0, 2.0)
    rec.add("allreduce", "bucket 0", 1.5, 2.5, stream="comm")
    assert len(calls) == 2 and len(rec.drain()) == 3
    rec.sync_debug = False
    rec.add("fwd", "F2", 2.0, 3.0)
    assert len(calls) == 2


# -- the script's own machinery --------------------------------------------------------------------
def test_parts_are_bounded_and_failures_named(tmp_path, monkeypatch):
    import gpu_check

    monkeypatch.setitem(gpu_check.TIMEOUTS, "slow", 1)
    monkeypatch.setitem(gpu_check.TIMEOUTS, "broken", 5)
    monkeypatch.setitem(gpu_check.TIMEOUTS, "absent", 5)
    def absent(_check):
        raise gpu_check.Skip("needs what this machine lacks")

    check = gpu_check.Check(tmp_path, budget_s=30, size="cpu")
    check.run("slow", lambda c: time.sleep(5))
    check.run("broken", lambda c: 1 / 0)
    check.run("absent", absent)
    statuses = [(p["part"], p["status"]) for p in check.parts]
    assert statuses == [("slow", "FAIL"), ("broken", "FAIL"), ("absent", "SKIP")]
    assert "timed out after 1 s" in check.parts[0]["summary"] and check.parts[0]["seconds"] < 3
    assert "ZeroDivisionError" in check.parts[1]["summary"]
    assert gpu_check.write_report(check) == 1
    assert "FAILED: 2 part(s): slow (timed out after 1 s); broken (ZeroDivisionError" in (tmp_path / "report.txt").read_text()


def test_gpt_fallback_model_and_flops():
    import gpu_model

    factory, source = gpu_model.build_gpt(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    n_all, n_matmul = gpu_model.count_params(factory, vocab_size=32)
    assert n_matmul == 2 * 12 * 16 * 16 + 16 * 32            # 12·d² per block, plus the head
    assert n_all > n_matmul
    x, y = gpu_model.RandomTokens(32, 4, 8)(step=3)
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    if "not in this tree" in source:
        assert isinstance(factory, gpu_model.PlainGPT)
    assert len(gpu_model.plain_step_times(factory, gpu_model.RandomTokens(32, 4, 8), 2, "cpu")) == 2


# -- end to end on CPU -----------------------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    from conftest import release_labs
    release_labs()                                  # it starts its own one-engine lab
    env = dict(os.environ, LABKIT_PYTHON=sys.executable, OMP_NUM_THREADS="1", LABKIT_GPU_BUDGET="240")
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    status = {p["part"]: p["status"] for p in report["parts"]}
    assert status == {"device": "SKIP", "tests": "SKIP", "lab": "PASS", "dp": "PASS", "profile": "SKIP", "backend": "PASS",
                      "cuda_events": "SKIP", "pipeline": "PASS", "tp": "SKIP", "tp_dtensor": "PASS", "torch_cp": "SKIP",
                      "gpt": "PASS",
                      "gpt_events": "SKIP", "gpt_plain": "PASS", "stall": "PASS", "env": "PASS"}
    skipped = [p for p in report["parts"] if p["status"] == "SKIP"]
    assert all(p["summary"] for p in skipped)                        # each skip says why
    gpt_part = next(p for p in report["parts"] if p["part"] == "gpt")["details"]
    assert gpt_part["mfu"] == 0.0 and gpt_part["tflops"] > 0        # CPU: no peak, so MFU shows 0
    for name in ("report.txt", "timeline.png", "timeline_dp.png", "test_gpu.log"):
        assert (tmp_path / name).stat().st_size > 0, name
    for name in ("trace.json", "trace_dp.json"):
        trace = json.loads((tmp_path / name).read_text())
        assert any(e["ph"] == "X" for e in trace["traceEvents"]), name
    text = (tmp_path / "report.txt").read_text()
    assert "sync_debug does nothing on CPU" in text and "CUDA_DEVICE_MAX_CONNECTIONS" in text
    assert "all parts passed or were skipped" in proc.stdout
