"""The parts of the GPU check (scripts/gpu_check.py runs them in the order of PARTS).

Each part is ``part(check) -> (summary, details)``: it raises :class:`Skip` with the reason
when it cannot run here, and any other exception is a failure. ``details["text"]`` is
printed in the report. What runs on the engine itself is in scripts/gpu_engine.py.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import torch

import labkit
from labkit import engine, gpu
from labkit.parallel.build import RunSpec
from labkit.analysis.metrics import step_metrics
from labkit.parallel.data.sync import MiB, make_buckets

import gpu_model
from gpu_engine import (on_engine_drop_job, on_engine_dtensor_tp, on_engine_probe, on_engine_setup_pipeline,
                        on_engine_torch_cp, drive, measured)

ROOT = Path(__file__).resolve().parents[1]
GPT_BUCKET_MB = 25.0
EXACT = 1e-4           # GPU kernels sum in another order than CPU ones (as tests/test_gpu.py allows)
CP_EXACT = 1e-3        # float32 attention: the fused kernel and the block-by-block merge sum in other orders


class Skip(Exception):
    """A part that cannot run here; the message says why."""


# -- the parts, in run order -------------------------------------------------------------------------
def part_device(check):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if not check.cuda:
        raise Skip(f"no CUDA device (torch {torch.__version__}): the GPU-only parts skip, the rest runs on "
                   f"CPU at small sizes")
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    peak = gpu.peak_bf16_flops(name)
    info.update(name=name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1), peak_bf16_tflops=peak / 1e12)
    check.state["device_name"] = name
    return (f"{name} ×{info['gpus']} (sm {info['capability']}, {info['memory_gib']} GiB), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, peak bf16 dense {peak / 1e12:.0f} TFLOP/s"), info


def part_tests(check):
    """tests/test_gpu.py in its own process (it starts and closes its own one-engine lab)."""
    log = check.out / "test_gpu.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            if proc.poll() is None:          # timed out: end pytest and the engines it started
                os.killpg(proc.pid, 9)
    last = (log.read_text().strip().splitlines() or ["(no output)"])[-1]
    if rc != 0:
        raise RuntimeError(f"tests/test_gpu.py exit {rc}: {last} (see test_gpu.log)")
    if "passed" not in last:
        raise Skip(f"tests/test_gpu.py: {last}")
    return f"tests/test_gpu.py: {last}", {}


def part_lab(check):
    lab = check.state["lab"] = labkit.Lab.start(engines=1, timeout=60, progress=False)
    rank = lab.ranks[0]
    if check.cuda and (rank["device"] != "cuda:0" or rank["backend"] != "nccl"):
        raise RuntimeError(f"the engine sees {rank['device']} with {rank['backend']}; expected cuda:0 with nccl")
    return f"one engine: rank 0 on {rank['device']}, world backend {rank['backend']}", {"rank": rank}


def _mlp_spec(check, strategy, steps=3):
    return RunSpec(strategy, labkit.models.mlp(**check.sizes["mlp"]), batch=check.sizes["batch"], steps=steps)


def part_dp(check):
    """The four DP modes on the engine, each against one process; the overlap run is kept."""
    model, batch = labkit.models.mlp(**check.sizes["mlp"]), check.sizes["batch"]
    reference = labkit.reference(model, batch=batch, steps=3)
    diffs, overlap = {}, {}
    for mode in ("naive", "bucketed", "overlap", "ddp"):
        s = labkit.Strategy(dp=1, dp_mode=mode, bucket_mb=check.sizes["bucket_mb"])
        run = check.lab.run(s, model=model, batch=batch, steps=3)
        diffs[mode], overlap[mode] = run.max_diff(reference), run.metrics["overlap_fraction"]
        check.state[f"dp_{mode}"] = run
    bad = {m: d for m, d in diffs.items() if not d < EXACT}
    if bad:
        raise RuntimeError(f"parameters differ from one process by {bad} (tolerance {EXACT:g})")
    run = check.state["dp_overlap"]
    check.save_timeline(run.timeline.events, "timeline_dp", f"DP overlap on {run.ranks[0]['device']}")
    kinds = sorted({e["kind"] for e in run.timeline.events})
    return (f"naive/bucketed/overlap/ddp equal one process (max diff {max(diffs.values()):.1e}); overlap run: "
            f"step {run.metrics['step_time_s'] * 1e3:.2f} ms, overlap_fraction {overlap['overlap']:.2f}"), \
        {"max_diff": diffs, "overlap_fraction": overlap, "kinds": kinds, "metrics": run.metrics}


def part_backend(check):
    params = list(check.state["dp_overlap"].params.items()) if "dp_overlap" in check.state else []
    biggest = max((sum(t.numel() * 4 for _, t in b) for b in make_buckets(params, check.sizes["bucket_mb"] * MiB)),
                  default=MiB)
    info = check.lab.apply(on_engine_probe, biggest)[0]
    check.state["probe"] = info
    if not info["allreduce_right"]:
        raise RuntimeError(f"a lone all-reduce on {info['device']} gave a wrong sum")
    if check.cuda and not info.get("comm_stream_separate"):
        raise RuntimeError("the engine has no comm stream of its own: comm and compute cannot overlap")
    text = (f"world: {info['world_backend']} over {info['world_size']} rank(s); dp group: {info['dp_backend']}"
            + (f"; NCCL {info['nccl']}; CPU tensors: {info['cpu_tensors']}" if check.cuda else ""))
    return (f"{text}; lone all-reduce of {biggest / MiB:.2f} MiB: {info['lone_allreduce_s'] * 1e6:.0f} µs "
            f"(labkit.comm span)"), info


def _check_cuda_events(events) -> None:
    streams = {e["stream"] for e in events}
    if streams != {"compute", "comm"}:
        raise RuntimeError(f"events on streams {sorted(streams)}; expected compute and comm")
    for e in events:
        if not 0 <= e["start"] <= e["end"] < 60:
            raise RuntimeError(f"an event's CUDA times did not resolve: {e}")


def _comm_span_s(events) -> float:
    spans = [e["end"] - e["start"] for e in events if e["kind"] == "allreduce" and e["step"] > 0]
    return median(spans) if spans else 0.0


def _span_verdict(spans: dict, lone_s: float, overlap: float) -> None:
    """Comm spans far longer than the same all-reduce alone: they include waiting, not transfer."""
    long = {m: s for m, s in spans.items() if s > 3 * lone_s + 5e-4}
    if long:
        shown = ", ".join(f"{m} {s * 1e3:.3f} ms" for m, s in long.items())
        raise RuntimeError(
            f"comm spans (median) {shown} against {lone_s * 1e3:.3f} ms for the same all-reduce alone: a span runs "
            f"to where the host waited, not to where the collective ended (labkit/comm.py marks the end on the "
            f"compute stream after the wait); overlap_fraction {overlap:.2f} is then not a measurement")


def part_cuda_events(check):
    check.require_gpu("compute and comm spans are CUDA events only on a GPU (on CPU they are host clock "
                      "readings, which the CPU suite checks)")
    lone_s = check.state["probe"]["lone_allreduce_s"]
    spans = {}
    for mode in ("bucketed", "overlap", "ddp"):
        events = check.state[f"dp_{mode}"].timeline.events
        _check_cuda_events(events)
        spans[mode] = _comm_span_s(events)
    detail = {"comm_span_median_s": spans, "lone_allreduce_s": lone_s}
    _span_verdict(spans, lone_s, check.state["dp_overlap"].metrics["overlap_fraction"])
    shown = ", ".join(f"{m} {s * 1e6:.0f}" for m, s in spans.items())
    return (f"compute and comm lanes from CUDA events; comm span medians (µs) {shown} vs {lone_s * 1e6:.0f} alone"), detail


def part_pipeline(check):
    """The pipeline executor at pp=1 (where lab.run takes the DP job), 1F1B and GPipe."""
    model, batch = labkit.models.mlp(**check.sizes["mlp"]), check.sizes["batch"]
    reference = labkit.reference(model, batch=batch, steps=3)
    found = {}
    for schedule in ("1f1b", "gpipe"):
        spec = _mlp_spec(check, labkit.Strategy(pp=1, schedule=schedule, microbatches=4))
        _, events, walls = drive(check.lab, spec, setup=on_engine_setup_pipeline)
        params = check.lab.apply(engine.parameters)[0]
        diff = labkit.max_abs_diff(params, reference.parameters())
        if not diff < EXACT:
            raise RuntimeError(f"{schedule} at pp=1 differs from one process by {diff:.2e}")
        names = [e["name"] for e in events if e["step"] == 0 and e["stream"] == "compute"]
        found[schedule] = {"max_diff": diff, "step_s": median(measured(walls)), "order": names}
    order = " ".join(found["1f1b"]["order"][:8])
    return (f"1F1B and GPipe at pp=1, 4 micro-batches, equal one process; 1F1B order {order}; interleaved at "
            f"pp=1 not run: its chunks hand activations over by send/recv, which one rank has no peer for"), found


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:          # a parent package is missing
        return False


def part_tp(check):
    fields = {f.name for f in dataclasses.fields(labkit.Strategy)}
    if "tp_mode" not in fields and not _has_module("labkit.parallel.tensor"):
        raise Skip("labkit's tensor parallelism is not built in this tree (Strategy refuses tp > 1)")
    raise Skip("tp > 1 needs one engine per GPU and this lab has one engine")


def part_tp_dtensor(check):
    info = check.lab.apply(on_engine_dtensor_tp, check.sizes["mlp"]["width"])[0]
    if not max(info["out_diff"], info["grad_diff"]) < EXACT:
        raise RuntimeError(f"DTensor TP differs from plain: {info}")
    return (f"torch's DTensor TP (colwise, rowwise) on {info['mesh']}: output and gradients equal plain "
            f"(max diff {max(info['out_diff'], info['grad_diff']):.1e})"), info


def part_profile(check):
    """A profiled run on the GPU (lab.run(..., profile=True)): its Kineto trace read back as a
    Timeline of kernels, each step's kernels inside the step, beside the run's CUDA-event timeline."""
    check.require_gpu("a profiled step's kernels need a GPU (the CPU path is tests/test_profile.py)")
    s = labkit.Strategy(dp=1, dp_mode="overlap", bucket_mb=check.sizes["bucket_mb"])
    run = check.lab.run(s, model=labkit.models.mlp(**check.sizes["mlp"]), batch=check.sizes["batch"], steps=3,
                        profile=check.out / "profile")
    tl = run.profile
    kernels = [e for e in tl.events if e["stream"] == "compute" and e["kind"] != "memcpy"]
    if not kernels or any(e["name"].startswith("aten::") for e in kernels):
        raise RuntimeError(f"the trace holds no kernels as compute (names: {sorted({e['name'] for e in tl.events})[:8]})")
    if tl.steps != run.timeline.steps:
        raise RuntimeError(f"profiler steps {tl.steps} against the run's {run.timeline.steps}")
    ends = tl.step_durations()
    if not all(0 <= e["start"] <= e["end"] <= ends[e["step"]] for e in tl.events):
        raise RuntimeError("a kernel lies outside its step's window")
    tl.plot().savefig(check.out / "timeline_profile.png", dpi=110, bbox_inches="tight")
    m, own = tl.metrics(check.sizes["batch"]), run.metrics
    return (f"{len(tl.events)} kernels/memcpys over {len(tl.steps)} steps, e.g. {kernels[0]['name'][:40]}; step "
            f"{m['step_time_s'] * 1e3:.2f} ms from kernels vs {own['step_time_s'] * 1e3:.2f} ms from CUDA events"), \
        {"kernels": len(kernels), "metrics": m, "paths": run.profile_paths}


def part_torch_cp(check):
    """torch's context_parallel on CUDA beside labkit's ring arithmetic (torch's has no CPU path:
    sdpa's CPU flash kernel has no sharding rule, docs/design.md)."""
    check.require_gpu("torch's context_parallel shards CUDA attention kernels only (its CPU sdpa kernel has "
                      "no sharding rule)")
    info = check.lab.apply(on_engine_torch_cp, check.sizes["cp_seq"])[0]
    if not max(info["torch_cp_max_diff"], info["labkit_blocks_max_diff"]) < CP_EXACT:
        raise RuntimeError(f"context-parallel attention differs from plain sdpa: {info}")
    return (f"causal sdpa, T={info['seq']}, {info['heads']}×{info['head_dim']} float32 on a mesh of {info['world']}: "
            f"plain {info['plain_ms']:.2f} ms, torch context_parallel {info['torch_cp_ms']:.2f} ms "
            f"(max diff {info['torch_cp_max_diff']:.1e}), labkit's chunk pairs merged by log-sum-exp "
            f"{info['labkit_blocks_ms']:.2f} ms (max diff {info['labkit_blocks_max_diff']:.1e})"), info


def part_gpt(check):
    """A GPT step on the engine (DP overlap, dp=1): TFLOP/s, MFU and overlap from the recorded step."""
    dims, batch, steps = check.sizes["gpt"], check.sizes["gpt_batch"], check.sizes["gpt_steps"]
    factory, source = gpu_model.build_gpt(**dims)
    n_all, n_matmul = gpu_model.count_params(factory, dims["vocab_size"])
    data = gpu_model.RandomTokens(dims["vocab_size"], batch, dims["block_size"])
    flops = gpu.transformer_train_flops(n_matmul, dims["n_layer"], dims["n_embd"], dims["block_size"],
                                        batch * dims["block_size"])
    check.state["gpt_model"] = (factory, data, flops)
    spec = RunSpec(labkit.Strategy(dp=1, dp_mode="overlap", bucket_mb=GPT_BUCKET_MB), factory, data=data,
                   loss=gpu_model.token_loss, batch=batch, steps=steps, lr=0.01)
    losses, events, walls = drive(check.lab, spec)
    kept = [e for e in events if e["step"] >= (1 if steps >= 3 else 0)]
    metrics = step_metrics(kept, 1, batch)
    check.lab.apply(on_engine_drop_job)
    if not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
        raise RuntimeError(f"losses are not finite: {losses}")
    name = check.state.get("device_name", "cpu")
    step_s = median(measured(walls))
    result = {"model": source, "params": n_all, "matmul_params": n_matmul, "tokens_per_step": batch * dims["block_size"],
              "flops_per_step": flops, "step_s": step_s, "step_s_events": metrics["step_time_s"],
              "tflops": flops / step_s / 1e12, "mfu": gpu.mfu(flops, step_s, name),
              "overlap_fraction": metrics["overlap_fraction"], "losses": losses, "dims": dims}
    check.state["gpt"] = result
    check.state["gpt_events"] = events
    check.save_timeline(events, "timeline", f"GPT step ({n_all / 1e6:.3g} M params) on {name}")
    return (f"{source}: {n_all / 1e6:.3g} M params, {result['tokens_per_step']} tokens/step, step {step_s * 1e3:.1f} ms "
            f"(events {metrics['step_time_s'] * 1e3:.1f} ms), {result['tflops']:.1f} TFLOP/s, MFU {result['mfu']:.1%}, "
            f"overlap_fraction {metrics['overlap_fraction']:.2f}"), result


def part_gpt_plain(check):
    if "gpt_model" not in check.state:
        raise Skip("the gpt part did not get as far as building its model")
    factory, data, flops = check.state["gpt_model"]
    times = gpu_model.plain_step_times(factory, data, check.sizes["gpt_steps"], "cuda" if check.cuda else "cpu")
    step_s = median(measured(times))
    result = {"step_s": step_s, "tflops": flops / step_s / 1e12,
              "mfu": gpu.mfu(flops, step_s, check.state.get("device_name", "cpu"))}
    summary = (f"plain torch, same model and step: {step_s * 1e3:.1f} ms, {result['tflops']:.1f} TFLOP/s, "
               f"MFU {result['mfu']:.1%}")
    if "gpt" in check.state:
        result["lab_over_plain"] = check.state["gpt"]["step_s"] / step_s
        summary += f"; the lab's step takes {result['lab_over_plain']:.2f}× that"
    return summary, result


def part_gpt_events(check):
    """The GPT step's CUDA-event spans, its comm spans against a lone all-reduce of a bucket."""
    check.require_gpu("CUDA-event spans need a GPU")
    if "gpt_events" not in check.state:
        raise Skip("the gpt part did not run")
    events = check.state["gpt_events"]
    _check_cuda_events(events)
    lone_s = check.lab.apply(on_engine_probe, int(GPT_BUCKET_MB * MiB))[0]["lone_allreduce_s"]
    span_s = _comm_span_s(events)
    _span_verdict({"gpt overlap": span_s}, lone_s, check.state["gpt"]["overlap_fraction"])
    return (f"comm span median {span_s * 1e6:.0f} µs vs {lone_s * 1e6:.0f} µs alone ({GPT_BUCKET_MB:g} MiB); "
            f"overlap_fraction {check.state['gpt']['overlap_fraction']:.2f} stands"), {"span_s": span_s, "lone_s": lone_s}


def part_stall(check):
    answers = gpu.sync_debug(check.lab, on=True, quiet=True)
    try:
        run = check.lab.run(labkit.Strategy(dp=1, dp_mode="overlap", bucket_mb=check.sizes["bucket_mb"]),
                            model=labkit.models.mlp(**check.sizes["mlp"]), batch=check.sizes["batch"], steps=3)
    finally:
        gpu.sync_debug(check.lab, on=False, quiet=True)
    if check.cuda and not answers[0]["sync_debug"]:
        raise RuntimeError(f"sync_debug did not switch on: {answers[0]['message']}")
    report = gpu.stall_report(run)
    if report.worst is None:
        raise RuntimeError("the stall report found no recorded ops")
    text = answers[0]["message"] + "\n" + str(report)
    return report.verdict(), {"text": text, "overlap_fraction_synced": run.metrics["overlap_fraction"]}


def part_env(check):
    report = gpu.env_check(check.lab)
    if set(report.ranks[0]["env"]) != set(gpu.ENV_VARS):
        raise RuntimeError(f"env_check read {sorted(report.ranks[0]['env'])}")
    shown = ", ".join(f"{k}={v}" for k, v in report.ranks[0]["env"].items() if v is not None) or "none set"
    return f"{len(gpu.ENV_VARS)} variables explained per rank ({shown})", {"text": str(report)}


PARTS = [("device", part_device), ("tests", part_tests), ("lab", part_lab), ("dp", part_dp),
         ("profile", part_profile),
         ("backend", part_backend), ("cuda_events", part_cuda_events), ("pipeline", part_pipeline),
         ("tp", part_tp), ("tp_dtensor", part_tp_dtensor), ("torch_cp", part_torch_cp), ("gpt", part_gpt),
         ("gpt_events", part_gpt_events),
         ("gpt_plain", part_gpt_plain),
         ("stall", part_stall), ("env", part_env)]
