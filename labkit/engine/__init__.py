"""The engine side: what each ipyparallel engine holds between notebook cells.

One :class:`EngineSession` per engine process keeps the rank, the rendezvous store (rank 0),
the process groups and the current job (model, optimizer, gradient sync). The notebook calls
the module-level functions below through ``lab.view.apply``; they are plain functions so they
travel by reference. Groups are rebuilt only when the degrees change; a change of
micro-batches, bucket size or mode reuses them.
"""
from __future__ import annotations

import math
import os
import socket
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import comm
from ..grid import ParallelDims
from .grid import build_groups
from .placement import choose_device, rank_from_env
from ..errors import NonFiniteLoss
from ..record.recorder import Recorder
from ..parallel.expert import counting_routes

warnings.filterwarnings("ignore", message="Full backward hook is firing")


class EngineSession:
    """This engine's rank, device, process groups and current job."""

    def __init__(self):
        found = rank_from_env(os.environ) or {"rank": None, "local_rank": 0, "world_size": None, "source": "lab"}
        self.rank, self.local_rank = found["rank"], found["local_rank"]
        self.world_size, self.rank_source = found["world_size"], found["source"]
        self.host = socket.gethostname()
        self.device = None
        self.store = None            # the TCPStore, kept alive on rank 0 only
        self.timeout_s = 60.0
        self.groups = None
        self.job = None
        self.run_id = None           # the run the job was built for; every step names it
        self.recorder = None
        self.snapshots = None        # per-step parameter snapshots, when the run asks (labkit.drift)
        self.profiler = None         # the run's StepProfiler, when it asks (lab.run(..., profile=True))
        self.straggler = None        # a planted straggler's forward hook (lab.straggler)
        self.link = None             # the emulated link (labkit.Link), kept across re-initialisations

    def describe(self) -> dict:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = choose_device(self.local_rank, gpus, self.host) if self.rank is not None else "?"
        return {"rank": self.rank, "local_rank": self.local_rank, "world_size": self.world_size,
                "host": self.host, "pid": os.getpid(), "device": device, "gpus": gpus,
                "backend": "nccl" if gpus else "gloo", "rank_source": self.rank_source,
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "initialized": dist.is_initialized(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "master_addr": os.environ.get("MASTER_ADDR")}


_session: EngineSession | None = None


def session() -> EngineSession:
    """This engine's session (created on first use)."""
    global _session
    if _session is None:
        _session = EngineSession()
    return _session


# -- called from the notebook through lab.view.apply ------------------------------------------
def describe() -> dict:
    return session().describe()


def assign_rank(rank: int, world_size: int, local_rank: int) -> dict:
    """For launchers that set no rank variables (SSH): the lab assigns them, hosts in order."""
    s = session()
    s.rank, s.world_size, s.local_rank, s.rank_source = rank, world_size, local_rank, "lab"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    return s.describe()


def open_store(host: str, world_size: int, timeout_s: float) -> int:
    """Rank 0: a fresh rendezvous store on a port the OS picks (bound, never closed and reused)."""
    s = session()
    _teardown(s)
    s.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                            wait_for_workers=False, master_listen_fd=_listen_on(host))
    return s.store.port


def _listen_on(host: str) -> int:
    """A socket bound to ``host`` only (TCPStore alone listens on every interface); its fd.

    For a local lab the host is 127.0.0.1, so the store, which has no authentication, is
    not reachable from other machines. The store takes ownership of the descriptor.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock.detach()


def init_distributed(master_addr: str, port: int, world_size: int, timeout_s: float, threads: int | None,
                     debug: bool = False, link=None) -> dict:
    """Join the world group through the store at ``master_addr:port``; gloo on CPU, NCCL on GPU.

    ``debug`` switches on ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (read when a group is created):
    collectives are checked for matching op and shapes across ranks, at a few ms per call.
    ``link``: the emulated link every labkit.comm call then obeys (None: gloo's own speed).
    """
    s = session()
    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    if s.rank != 0:
        _teardown(s)
        s.store = dist.TCPStore(master_addr, port, world_size, is_master=False,
                                timeout=timedelta(seconds=timeout_s))
    if threads:
        torch.set_num_threads(threads)
    info = s.describe()
    s.device = torch.device(info["device"])
    if s.device.type == "cuda":
        # One hardware work queue: kernels reach the GPU in launch order, so a comm kernel launched
        # before the compute it should hide behind gets its SMs first and runs beside it (what
        # Megatron-LM asks for). Read when the CUDA context is created, hence before set_device;
        # a value the job script set is kept.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        torch.cuda.set_device(s.device)
    s.timeout_s, s.world_size = timeout_s, world_size
    dist.init_process_group(info["backend"], store=s.store, rank=s.rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    s.recorder = Recorder(s.rank, s.device)
    stream = torch.cuda.Stream() if s.device.type == "cuda" else None
    comm.bind(comm.CommContext(s.rank, s.recorder, timeout_s, comm_stream=stream))
    s.groups = None
    set_link(link)
    return s.describe()


def set_link(link) -> None:
    """Emulate ``link`` (a labkit.Link, or None for raw gloo) from the next labkit.comm call.

    Groups and the job stay as they are: only the times the calls take change.
    """
    comm.set_link(link)
    session().link = link


def drop_job(s: EngineSession) -> None:
    """Forget the current job, breaking the cycles through its parameters' hooks (Executor.close)."""
    job, s.job, s.run_id = s.job, None, None
    if job is not None:
        job.close()
    if s.profiler is not None:          # a profiled run replaced before its trace was taken
        s.profiler.close()
        s.profiler = None
    from ..parallel.context import deactivate
    deactivate()                  # a cp job's attention context goes with it


def _teardown(s: EngineSession) -> None:
    drop_job(s)
    s.groups = None
    if dist.is_initialized():
        dist.destroy_process_group()
    comm.bind(None)
    s.store = None


def ensure_groups(dp: int, pp: int, tp: int, cp: int = 1) -> bool:
    """Build the grid's groups unless the same degrees are already in place; True if rebuilt."""
    s = session()
    dims = ParallelDims(dp, pp, tp, cp)
    if s.groups is not None and s.groups.dims == dims:
        return False
    drop_job(s)
    s.groups = build_groups(dims, s.rank, s.timeout_s)
    return True


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
        raise NonFiniteLoss(f"rank {s.rank}, step {step}: loss is {result['loss']} (a diverging lr, or a NaN "
                            f"or inf in the model or data); lab.run(..., allow_nonfinite=True) carries on")
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


def flight_log() -> dict:
    """This rank's flight recorder (its last labkit.comm calls), for the lab's failure reports."""
    s = session()
    try:
        entries = comm.flight_log()
    except RuntimeError:          # not initialised (yet, or any more)
        entries = []
    return {"rank": s.rank, "entries": entries}


def parameters() -> dict:
    """The parameters this rank's job reports (its ``full_state_dict()``), on CPU, keyed as in
    the model's state_dict; merged over ranks they are the whole model."""
    s = session()
    return s.job.full_state_dict() if s.job is not None else {}


def shutdown() -> None:
    """Leave the process group and drop the store (before engines stop)."""
    _teardown(session())
