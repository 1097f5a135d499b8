"""All-reduce written to teach: the ring, the parameter server, and torch's own, side by side.

Each algorithm sums ``tensor`` in place over ``group`` with labkit's point-to-point calls, so
every message lands on the timeline (kind ``send`` / ``recv``, named by phase and step) and
counts in ``bytes_sent``. Run them on the engines through ``lab.apply``::

    >>> lab.apply(labkit.collectives.demo, "ring", 1_000_000)       # events + result checks
    >>> labkit.collectives.predict("ring", nbytes=4e6, n=4, alpha=1e-4, beta=1e9)

Costs with the α-β model (α = latency per message, β = bandwidth of one link, S = bytes,
n = ranks; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH", §4):

    ring              2(n-1) messages of S/n        t = 2(n-1)·α + 2(n-1)/n · S/β
    parameter server  the root takes n-1 messages of S in and sends n-1 out
                                                    t = 2(n-1)·(α + S/β)
    bytes sent per rank: ring 2(n-1)/n·S on every rank; the server (n-1)·S, a worker S.

The ring's per-rank traffic stays below 2·S however many ranks join; the server's grows
with n. That is why ring all-reduce (Baidu 2017, then Horovod and NCCL) replaced it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

ALGORITHMS = ("ring", "ps", "torch")


# -- the algorithms (engine side) -----------------------------------------------------------
def _members(group) -> tuple[list[int], int]:
    """Global ranks of ``group`` in group order, and this rank's index among them."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ranks, ranks.index(dist.get_rank())


def _check(tensor, algorithm: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        raise ValueError(f"labkit.collectives.{algorithm}: needs a non-empty tensor, got {tensor!r:.60}")
    if not tensor.is_contiguous():
        raise ValueError(f"labkit.collectives.{algorithm}: the tensor is not contiguous; call .contiguous() first")


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous (start, end) ranges covering ``numel``; the first ``numel % n`` get one more.

    When ``numel < n`` some ranges are empty; both ends of a message skip those, in step.
    """
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _exchange(send_buf, dst: int, recv_buf, src: int, group, name: str) -> None:
    """Send to ``dst`` and receive from ``src`` at once.

    Both are posted before either is waited on, and the receive is waited on first: a send
    may complete only once its receiver has posted the matching receive.
    """
    handles = []
    if recv_buf.numel():
        handles.append(comm.irecv(recv_buf, src, group, name=name))
    if send_buf.numel():
        handles.append(comm.isend(send_buf, dst, group, name=name))
    for h in handles:
        h.wait()


def ring_all_reduce(tensor: torch.Tensor, group=None, name: str = "ring") -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place: ring reduce-scatter, then ring all-gather.

    The flat tensor is cut into n chunks. In each of the n-1 reduce-scatter steps a rank
    passes one chunk to its right neighbour and adds the chunk arriving from its left; after
    them rank i holds the full sum of chunk i+1. The n-1 all-gather steps pass those finished
    chunks round the ring once more, copying instead of adding.
    """
    _check(tensor, "ring_all_reduce")
    ranks, me = _members(group)
    n = len(ranks)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    chunk = lambda i: flat[slice(*bounds[i % n])]
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):                       # 1. reduce-scatter
        send_i, recv_i = me - step, me - step - 1
        buf = incoming[:chunk(recv_i).numel()]
        _exchange(chunk(send_i), right, buf, left, group, f"{name} RS {step + 1}/{n - 1} chunk {recv_i % n}")
        chunk(recv_i).add_(buf)
    for step in range(n - 1):                       # 2. all-gather
        send_i, recv_i = me + 1 - step, me - step
        buf = incoming[:chunk(recv_i).numel()]
        _exchange(chunk(send_i), right, buf, left, group, f"{name} AG {step + 1}/{n - 1} chunk {recv_i % n}")
        chunk(recv_i).copy_(buf)
    return tensor


def ps_all_reduce(tensor: torch.Tensor, group=None, name: str = "ps", root: int = 0) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place through one server (the group's ``root``-th rank).

    Every worker sends its whole tensor to the server; the server adds them in rank order
    and sends the sum back to each worker. The server's link carries 2(n-1)·S.
    """
    _check(tensor, "ps_all_reduce")
    ranks, me = _members(group)
    n, server = len(ranks), ranks[root]
    if n == 1:
        return tensor
    if ranks[me] != server:
        comm.isend(tensor, server, group, name=f"{name} push").wait()
        comm.irecv(tensor, server, group, name=f"{name} pull").wait()
        return tensor
    workers = [r for r in ranks if r != server]
    inbox = {r: torch.empty_like(tensor) for r in workers}
    handles = [comm.irecv(inbox[r], r, group, name=f"{name} gather from {r}") for r in workers]
    for h in handles:
        h.wait()
    total = torch.zeros_like(tensor)                 # rank order, so the sum is reproducible
    for r in ranks:
        total.add_(tensor if r == server else inbox[r])
    tensor.copy_(total)
    for h in [comm.isend(tensor, r, group, name=f"{name} send to {r}") for r in workers]:
        h.wait()
    return tensor


def torch_all_reduce(tensor: torch.Tensor, group=None, name: str = "torch") -> torch.Tensor:
    """torch's own all-reduce (gloo or NCCL picks the algorithm), for comparison."""
    _check(tensor, "torch_all_reduce")
    comm.all_reduce(tensor, group, name=name)
    return tensor


def all_reduce(tensor: torch.Tensor, algorithm: str = "ring", group=None, name: str | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place with ``algorithm``: "ring", "ps" (parameter server) or "torch"."""
    impl = {"ring": ring_all_reduce, "ps": ps_all_reduce, "torch": torch_all_reduce}
    if algorithm not in impl:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {', '.join(map(repr, ALGORITHMS))}")
    return impl[algorithm](tensor, group, name=name or algorithm)


# -- the α-β model (notebook side) ----------------------------------------------------------
def predict(algorithm: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds the α-β model predicts for one all-reduce of ``nbytes`` over ``n`` ranks.

    ``alpha``: seconds per message; ``beta``: bytes per second of one link. "torch" is
    predicted as a ring (what gloo and NCCL use for large messages).
    """
    if n <= 1:
        return 0.0
    if algorithm in ("ring", "torch"):
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    if algorithm == "ps":
        return 2 * (n - 1) * (alpha + nbytes / beta)
    raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {', '.join(map(repr, ALGORITHMS))}")


def bytes_per_rank(algorithm: str, numel: int, n: int, element_size: int = 4) -> list[int]:
    """Bytes each rank of ``n`` sends for one all-reduce of ``numel`` elements (rank order; ps: server first)."""
    nbytes = numel * element_size
    if n <= 1:
        return [0] * n
    if algorithm == "ring":        # every chunk but (me+1) in reduce-scatter, every chunk but (me+2) in all-gather
        sizes = [(e - s) * element_size for s, e in chunk_bounds(numel, n)]
        return [2 * nbytes - sizes[(r + 1) % n] - sizes[(r + 2) % n] for r in range(n)]
    if algorithm == "torch":
        return [comm.wire_bytes("allreduce", nbytes, n)] * n
    if algorithm == "ps":
        return [(n - 1) * nbytes] + [nbytes] * (n - 1)
    raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {', '.join(map(repr, ALGORITHMS))}")


# -- a demonstration on the engines (called through lab.apply) -------------------------------
def demo(algorithm: str, numel: int, ranks: int | None = None, repeats: int = 1, seed: int = 0,
         values: str = "int", check: bool = True) -> dict:
    """One rank's part of a measured all-reduce on the first ``ranks`` ranks (default: all).

    Every rank of the world must call it (a sub-group is built collectively). Each member
    sums a seeded tensor of ``numel`` float32 values (``values="int"``: whole numbers, so
    every summation order gives the same bits). With ``check`` the same input also goes
    through torch's all-reduce and the result is compared. Returns this rank's events of the
    last repeat, seconds per repeat, bytes sent, and the comparison.
    """
    import time

    from ..engine import session

    world = dist.get_world_size()
    ranks = ranks or world
    if not 1 <= ranks <= world:
        raise ValueError(f"ranks={ranks} must be between 1 and the lab's {world} engines")
    s = session()
    group = dist.new_group(list(range(ranks)), timeout=_timeout(s)) if ranks < world else None
    rec, was = s.recorder, s.recorder.enabled
    out = {"rank": s.rank, "member": s.rank < ranks, "events": [], "seconds": [], "bytes": 0}
    try:
        if s.rank < ranks:
            x0 = _values(numel, s.rank, seed, values)
            for _ in range(repeats):
                x = x0.clone()
                rec.enabled = True
                # Clocks aligned as in a training step: every member starts its clock as the
                # barrier releases it, so one rank's sends and another's receives share a zero
                # (without it the server's sends appeared after the workers' pulls had ended).
                dist.barrier(group=group)
                rec.start_step(0)
                t0 = time.perf_counter()
                all_reduce(x, algorithm, group)
                out["seconds"].append(time.perf_counter() - t0)
                out["events"] = rec.drain()
            out["bytes"] = sum(e["bytes"] for e in out["events"] if e["kind"] in ("send", "allreduce"))
            if check:
                rec.enabled = False
                ref = x0.clone()
                comm.all_reduce(ref, group, name="check")
                out["equal_to_torch"] = bool(torch.equal(x, ref))
                out["max_diff_vs_torch"] = float((x - ref).abs().max())
    finally:
        rec.enabled = was
        if group is not None:
            dist.barrier()
            dist.destroy_process_group(group)
    return out


def incast_demo(numel: int, root: int = 0) -> dict:
    """One rank's part of an all-to-all in which every rank sends its ``numel`` float32 values to
    global rank ``root`` and nothing elsewhere (expert parallelism's all-to-all when every token
    picks one expert). Every rank of the world calls it. ``root`` takes in (n-1) of them while
    each other rank sends one: on an emulated link the exchange lasts the busiest receiver's
    time, (n-1)·(α + S/β), on every member. Returns this rank's seconds and bytes each way."""
    import time

    n, me = dist.get_world_size(), dist.get_rank()
    x = torch.ones(numel, 1)
    out = torch.empty(numel * n if me == root else 0, 1)
    into = [numel if me == root else 0] * n
    sizes = [numel if r == root else 0 for r in range(n)]
    dist.barrier()
    t0 = time.perf_counter()
    comm.all_to_all_single(out, x, output_split_sizes=into, input_split_sizes=sizes)
    took = time.perf_counter() - t0
    return {"rank": me, "seconds": took, "sent": 0 if me == root else 4 * numel,
            "received": 4 * numel * (n - 1) if me == root else 0}


def _values(numel: int, rank: int, seed: int, values: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if values == "int":
        return torch.randint(-1000, 1000, (numel,), generator=g).float()
    return torch.randn(numel, generator=g)


def _timeout(s):
    from datetime import timedelta
    return timedelta(seconds=s.timeout_s)
