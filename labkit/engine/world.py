"""The world group and the grid's groups on this engine: the rendezvous store, joining the
world (gloo on CPU, NCCL on GPU), the emulated link, the process groups of a grid, and leaving.

Groups are rebuilt only when the grid changes; a change of micro-batches, bucket size or mode
reuses them.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import comm
from ..grid import ParallelDims
from ..record.recorder import Recorder
from .grid import build_groups
from .state import EngineSession, drop_job, session


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


def _teardown(s: EngineSession) -> None:
    drop_job(s)
    s.groups = None
    if dist.is_initialized():
        dist.destroy_process_group()
    comm.bind(None)
    s.store = None


def ensure_groups(dims: ParallelDims) -> bool:
    """Build the groups of grid ``dims`` unless the same grid is already in place; True if rebuilt."""
    s = session()
    if s.groups is not None and s.groups.dims == dims:
        return False
    drop_job(s)
    s.groups = build_groups(dims, s.rank, s.timeout_s)
    return True


def shutdown() -> None:
    """Leave the process group and drop the store (before engines stop)."""
    _teardown(session())
