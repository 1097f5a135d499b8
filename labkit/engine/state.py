"""What each ipyparallel engine holds between notebook cells: one :class:`EngineSession` per
engine process, with its rank, the rendezvous store (rank 0), the process groups and the
current job (model, optimizer, gradient sync).

The notebook reaches it through the plain functions of :mod:`labkit.engine` (``lab.view.apply``
sends them by reference); each finds this engine's session with :func:`session`.
"""
from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist

from .placement import choose_device, rank_from_env

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


def describe() -> dict:
    return session().describe()


def assign_rank(rank: int, world_size: int, local_rank: int) -> dict:
    """For launchers that set no rank variables (SSH): the lab assigns them, hosts in order."""
    s = session()
    s.rank, s.world_size, s.local_rank, s.rank_source = rank, world_size, local_rank, "lab"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    return s.describe()


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
