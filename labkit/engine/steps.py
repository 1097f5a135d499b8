"""A run on this engine: its job built from the spec, one step at a time (aligned across ranks
by a barrier), user code traced as a step, a planted straggler, the profiler's trace.
"""
from __future__ import annotations

import math
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from .. import comm
from ..errors import NonFiniteLoss
from ..parallel.expert import counting_routes
from .state import drop_job, session


def setup_run(spec, run_id: str | None = None) -> dict:
    """Build this rank's part of the run (model, stages, gradient sync, executor) for ``run_id``."""
    from ..parallel.build import build_job

    s = session()
    drop_job(s)
    s.recorder.enabled = spec.record
    with capture_warnings() as caught:
        s.job = build_job(spec, s.groups, s.recorder, s.device, run_id)
    s.run_id = run_id
    from ..analysis.drift import build_step_snapshots
    s.snapshots = build_step_snapshots(s.job) if spec.extra.get("snapshots") else None
    if spec.extra.get("profile"):
        from ..record.profiler import StepProfiler
        s.profiler = StepProfiler(s.device)
    local = [getattr(p, "_local_tensor", p) for p in s.job.model.parameters()]    # a DTensor: its shard
    return {"rank": s.rank, "params": sum(t.numel() for t in local),
            "parameter_bytes": sum(t.numel() * t.element_size() for t in local), "warnings": caught}


def run_step(step: int, run_id: str | None = None) -> dict:
    """One training step of run ``run_id``, aligned across ranks by a barrier; loss and events.

    A step that names another run than the one set up here (a stray call left from a run that
    failed or was replaced) is refused before it touches the job.
    """
    s = session()
    if s.job is None:
        raise RuntimeError(f"rank {s.rank}: no run is set up on this engine (call lab.run)")
    if run_id != s.run_id:
        raise RuntimeError(f"rank {s.rank}: step {step} belongs to run {run_id} but run {s.run_id} is set up "
                           f"here; a step never runs another run's job")
    s.recorder.step = step
    job = s.job
    try:
        with capture_warnings() as caught, counting_routes([st.module for st in getattr(job, "stages", [])],
                                                           getattr(job, "tp_index", 0) == 0) as routed:
            batch = s.job.batch(step)       # this rank's share of the step's data, made before the clock starts
            comm.barrier(name=f"start of step {step}")      # logged, so a rank that never arrives is named
            s.recorder.start_step(step)
            t0, c0 = time.perf_counter(), time.process_time()
            with _profiled(s.profiler, step):
                result = s.job.step(step, batch)
                if s.device.type == "cuda":
                    torch.cuda.synchronize()
    except BaseException as error:
        # The engine's kernel keeps the error it reports; its frames' locals (this one's too)
        # would keep the failed job (stages, syncs, groups) alive after it is replaced. The text
        # of the traceback stays.
        job = None
        seen = set()
        while error is not None and id(error) not in seen:       # and the errors it was raised from
            seen.add(id(error))
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__
        raise
    result["step_s"] = time.perf_counter() - t0       # wall time, recorded or not
    result["cpu_s"] = time.process_time() - c0        # CPU time of every thread (gloo's too)
    result["memory"] = s.job.memory()
    result["events"] = s.recorder.drain()
    result["rank"] = s.rank
    result["clock"] = {"host": s.host, "origin_s": s.recorder.origin}    # labkit.analysis.clocks
    if s.snapshots is not None:
        result["snapshot"] = s.snapshots.pop()
    result["warnings"] = caught
    if routed:
        result["tokens_per_expert"] = routed          # MoE routing, for labkit.view.experts
    if result.get("loss_weight", 0) > 0 and not math.isfinite(result["loss"]) and not s.job.spec.allow_nonfinite:
        # after the step, so every rank has finished its collectives: the lab stays in step
        raise NonFiniteLoss(f"rank {s.rank}, step {step}: loss is {result['loss']} (a diverging lr, a NaN or "
                            f"inf in the model or data, or a mean over a shard whose targets are all padding: "
                            f"use labkit.losses.token_loss); lab.run(..., allow_nonfinite=True) carries on")
    return result


def plant_straggler(rank: int, seconds: float) -> None:
    """On ``rank`` only, make every forward of a layer with weights sleep ``seconds`` (0: remove).

    torch's global forward hook, so no labkit code is patched and any model slows; the sleep
    lies inside the executor's forward span, so the timeline counts it as the rank's compute.
    """
    s = session()
    if s.straggler is not None:
        s.straggler.remove()
        s.straggler = None
    if s.rank != rank or seconds <= 0:
        return

    def slow(module, args, output):
        if next(module.parameters(recurse=False), None) is not None:
            time.sleep(seconds)

    s.straggler = torch.nn.modules.module.register_module_forward_hook(slow)


def _profiled(profiler, step: int):
    """The profiler's window around the step (labkit.record.profiler), or nothing."""
    return profiler.step(step) if profiler is not None else nullcontext()


def finish_profile() -> dict:
    """Stop the run's profiler; its Chrome trace, gzipped, for the notebook to save."""
    s = session()
    if s.profiler is None:
        raise RuntimeError(f"rank {s.rank}: this run was not profiled (lab.run(..., profile=True))")
    profiler, s.profiler = s.profiler, None
    return {"rank": s.rank, "trace_gz": profiler.finish()}


@contextmanager
def capture_warnings():
    """Warnings raised inside, as ``[category name, message]`` pairs (each once), so they travel
    to the notebook with the result instead of going to the engine's log, which nobody sees."""
    caught: list = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # torch's deprecations of the calls labkit.comm makes are labkit's to fix, not the user's
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        try:
            yield caught
        finally:
            for w in records:
                pair = [w.category.__name__, str(w.message)]
                if pair not in caught:
                    caught.append(pair)


def traced(fn, args: tuple, kwargs: dict):
    """Run user code as one recorded "step": its labkit.comm calls land on the timeline."""
    s = session()
    dist.barrier()
    s.recorder.start_step(0)
    result = fn(*args, **kwargs)
    return {"result": result, "events": s.recorder.drain(), "rank": s.rank,
            "clock": {"host": s.host, "origin_s": s.recorder.origin}}
