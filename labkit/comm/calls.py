"""Every collective and point-to-point call, issued the one way: logged in the flight
recorder, timed, on the emulated link where there is one (:mod:`.emulate`).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..analysis.events import kind_of_call
from .emulate import Joined
from .handles import Handle, _guard, _OnLink
from .p2p import _CheckedRecv, _Works, header as _header
from .state import CommContext, context

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# -- bytes on the wire ----------------------------------------------------------------------
def wire_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for ``op`` on ``nbytes`` of payload over ``n`` ranks.

    Ring algorithms (what nccl-tests' bus-bandwidth factors assume): all-reduce sends
    2(n-1)/n·S, reduce-scatter and all-gather (n-1)/n·S of the full tensor, send S.
    """
    if n <= 1 and op != "send":
        return 0
    factor = {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "allgather": (n - 1) / n,
              "broadcast": 1.0, "send": 1.0}.get(op, 0.0)
    return int(round(factor * nbytes))


# -- issuing --------------------------------------------------------------------------------
def _check_tensor(op: str, tensor, name: str) -> None:
    # an all-to-all may carry nothing from this rank (no token routed off it); it still joins
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 and op != "all_to_all":
        raise ValueError(f"labkit.comm.{op}: needs a non-empty tensor, got {tensor!r:.60}")
    if not tensor.is_contiguous():
        raise ValueError(f"labkit.comm.{op}: tensor '{name}' is not contiguous; call .contiguous() first")


def _issue(op: str, tensor: torch.Tensor, group, name: str, peer, microbatch, nbytes: int, call,
           async_op: bool, watch: bool = True, size: int = 0, deadline=None, busiest: int = 0):
    """Issue ``call`` as labkit's ``op``; ``size``: the collective's size for an emulated link
    (:meth:`Link.seconds`); ``deadline``: a point-to-point call's own (see isend/irecv);
    ``busiest``: an all-to-all's bytes in this rank's busier direction (:class:`.emulate.Joined`)."""
    ctx = context()
    if op != "barrier":
        _check_tensor(op, tensor, name)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    channel = _channel(ctx.rank, op, ranks, peer, group is None)
    ctx.calls[channel] += 1
    entry = {"seq": next(ctx.seq), "op": op, "kind": kind_of_call(op), "name": name or op, "group": ranks,
             "channel": channel, "call": ctx.calls[channel], "time": time.time(),
             "shape": tuple(tensor.shape) if tensor is not None else (),
             "dtype": str(tensor.dtype).replace("torch.", "") if tensor is not None else "-", "peer": peer,
             "step": ctx.recorder.step, "microbatch": microbatch, "bytes": nbytes, "state": "issued"}
    if ctx.link is not None:        # the tier the bytes cross (bytes_sent_by_tier, the timeline)
        entry["tier"] = ctx.link.link.tier(ranks if peer is None or op not in ("send", "recv") else [ctx.rank, peer])
    ctx.flight.append(entry)
    if ctx.comm_stream is not None:
        ctx.comm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ctx.comm_stream):
            start = ctx.recorder.mark()
            work = _guard(ctx, entry, call)
            if work is not None:
                # The comm stream waits for the collective's own stream, so an event recorded on
                # it now completes when the collective does. Marked later, at wait(), the end
                # would fall where the compute stream asks for the result (the end of backward
                # for an overlapped bucket), and overlap would read as ~1 without measuring.
                _guard(ctx, entry, work.wait)
                end = ctx.recorder.mark()
    else:
        start = ctx.recorder.mark()
        if ctx.link is not None and op in LINK_OPS:
            deadline = _join(ctx, entry, LINK_OPS[op], size, ranks, group, busiest)
        work = _guard(ctx, entry, call)
    # A blocking call ends when its wait returns; only an async one needs gloo's thread to
    # note its completion (a Python callback there doubled a small blocking call's cost).
    handle = Handle(ctx, entry, work, start, watch and async_op, thread=async_op, deadline=deadline)
    if ctx.comm_stream is not None and work is not None:
        handle._done_at = end
    if deadline is not None and work is not None:
        handle.work = _OnLink(work, handle)
    if async_op:
        return handle
    handle.wait()
    # The caller blocked here: a compute span around this call (a forward holding a tensor-
    # parallel all-reduce) is cut around it, so the wait counts as exposed comm, not compute.
    ctx.recorder.blocked(start, ctx.recorder.mark())
    return handle


def _join(ctx: CommContext, entry: dict, op: str, size: int, ranks: list[int], group, busiest: int = 0) -> Joined:
    """Post this rank's start on the emulated link (a MAX all-reduce of [start, busiest bytes],
    ahead of the payload): the collective's deadline is the latest member's start plus its α-β
    time, an all-to-all's from its busiest member's bytes."""
    tier, start, cost = ctx.link.collective(op, size, ranks, time.perf_counter())
    stamp = torch.tensor([start, float(busiest)], dtype=torch.float64)
    work = _guard(ctx, entry, lambda: dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return Joined(ctx.link, work, stamp, tier, cost, len(ranks))


# labkit's op names → the link's (a barrier only aligns ranks: it moves no payload)
LINK_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
            "broadcast": "broadcast", "all_to_all": "all_to_all"}


def _channel(rank: int, op: str, ranks: list[int], peer, world: bool) -> str:
    """What lines calls up across ranks: a group's collectives, or one direction of a pair."""
    if op == "send":
        return f"p2p {rank}->{peer}"
    if op == "recv":
        return f"p2p {peer}->{rank}"
    return f"{'world' if world else 'group'} {ranks}"


def _group_size(group) -> int:
    return dist.get_world_size(group)


def all_reduce(tensor, group=None, name="", op="sum", async_op=False, microbatch=None):
    """Reduce ``tensor`` in place over ``group`` (sum by default)."""
    size = tensor.numel() * tensor.element_size()
    nbytes = wire_bytes("allreduce", size, _group_size(group))
    return _issue("all_reduce", tensor, group, name, None, microbatch, nbytes,
                  lambda: dist.all_reduce(tensor, op=OPS[op], group=group, async_op=True), async_op, size=size)


def all_reduce_future(tensor, group=None, name="") -> torch.futures.Future:
    """Start a sum all-reduce of ``tensor``; a future of the reduced tensor, as a DDP comm hook
    returns. Its completion is noted by that future's one callback (no second watcher: a
    Python callback per bucket is paid on gloo's thread, under the GIL)."""
    size = tensor.numel() * tensor.element_size()
    nbytes = wire_bytes("allreduce", size, _group_size(group))
    handle = _issue("all_reduce", tensor, group, name, None, None, nbytes,
                    lambda: dist.all_reduce(tensor, group=group, async_op=True), True, watch=False, size=size)
    return handle.future(first=True)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None, name="", async_op=False):
    """Gather every rank's ``tensor`` into ``output`` (n times as long, rank order)."""
    size = output.numel() * output.element_size()
    nbytes = wire_bytes("allgather", size, _group_size(group))
    return _issue("all_gather", tensor, group, name, None, None, nbytes,
                  lambda: dist.all_gather_single(output, tensor, group=group, async_op=True), async_op,
                  size=size)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group=None, name="", op="sum", async_op=False):
    """Reduce ``tensor`` over the group and leave this rank's 1/n slice in ``output``."""
    size = tensor.numel() * tensor.element_size()
    nbytes = wire_bytes("reduce_scatter", size, _group_size(group))
    reduce_op = OPS[op] if isinstance(op, str) else op        # FSDP2 passes torch's ReduceOp
    return _issue("reduce_scatter", tensor, group, name, None, None, nbytes,
                  lambda: dist.reduce_scatter_single(output, tensor, op=reduce_op, group=group, async_op=True),
                  async_op, size=size)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, name="", async_op=False):
    """Send the i-th slice of ``tensor`` (rows, ``input_split_sizes[i]`` of them) to the group's
    i-th rank and receive its slice for us into ``output`` (``output_split_sizes``; None: equal).
    The bytes are those that leave this rank: every slice but our own. On an emulated link the
    exchange takes as long as its busiest member's bytes, sent or received (a rank that every
    token is routed to is the bottleneck, as in expert parallelism)."""
    n = _group_size(group)
    me = dist.get_group_rank(group, context().rank) if group is not None else context().rank
    sent = _slice_bytes(tensor, input_split_sizes, me, n)
    received = _slice_bytes(output, output_split_sizes, me, n)
    rows = len(tensor) if tensor.dim() else 0
    return _issue("all_to_all", tensor, group, name, None, None, sent,
                  lambda: dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=True), async_op,
                  size=rows * (tensor[0].numel() * tensor.element_size() if rows else 0),
                  busiest=max(sent, received))


def _slice_bytes(tensor, split_sizes, me: int, n: int) -> int:
    """Bytes of ``tensor``'s rows outside this rank's own slice (what crosses the link)."""
    rows = len(tensor) if tensor.dim() else 0
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    own = split_sizes[me] if split_sizes is not None else rows // n
    return row_bytes * (rows - own)


def broadcast(tensor, src: int, group=None, name="", async_op=False):
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    sends = context().rank == src
    size = tensor.numel() * tensor.element_size()
    return _issue("broadcast", tensor, group, name, src, None, size if sends else 0,
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), async_op, size=size)


def barrier(group=None, name="barrier") -> Handle:
    """Wait until every rank of ``group`` gets here (logged like any call, not drawn)."""
    return _issue("barrier", None, group, name, None, None, 0,
                  lambda: dist.barrier(group=group, async_op=True), False)


def isend(tensor, dst: int, group=None, name="", microbatch=None, tag: int = 0, check: bool | None = None) -> Handle:
    """Start sending ``tensor`` to global rank ``dst``; wait on the handle before reusing it.

    ``check`` overrides the shape/dtype header for this message (None: the rank's setting);
    the matching ``irecv`` must pass the same value.
    """
    nbytes = tensor.numel() * tensor.element_size()
    link, stamp, deadline = context().link, None, None
    if link is not None:
        _check_tensor("send", tensor, name)
        departed, deadline = link.depart(dst, nbytes, time.perf_counter())
        stamp = torch.tensor([departed], dtype=torch.float64)    # ahead of the payload: when it left

    def call():
        sends = [] if stamp is None else [(stamp, dist.isend(stamp, dst, group=group, tag=tag))]
        if context().check_p2p if check is None else check:
            header = _header(tensor)       # posted first, so the receiver learns what is coming
            sends.append((header, dist.isend(header, dst, group=group, tag=tag)))
        payload = dist.isend(tensor, dst, group=group, tag=tag)
        if not sends:
            return payload
        return _Works([w for _, w in sends] + [payload], keep=[t for t, _ in sends])
    return _issue("send", tensor, group, name, dst, microbatch, nbytes, call, True, deadline=deadline)


def irecv(tensor, src: int, group=None, name="", microbatch=None, tag: int = 0, check: bool | None = None) -> Handle:
    """Start receiving into ``tensor`` from global rank ``src``.

    With the header check on (the default) the shape and dtype the sender announced are
    compared with ``tensor`` before the payload is received; on a mismatch the payload is
    drained into a scratch buffer (so both ranks stay in step and alive) and ``wait()``
    raises :class:`CommMismatch` naming both ranks.
    """
    nbytes = tensor.numel() * tensor.element_size()   # received; metrics count only what is sent
    link = context().link
    stamp = None if link is None else torch.empty(1, dtype=torch.float64)

    def call():
        first = [] if stamp is None else [dist.irecv(stamp, src, group=group, tag=tag)]   # when it left
        if context().check_p2p if check is None else check:
            payload = _CheckedRecv(tensor, src, group, tag)
        else:
            payload = dist.irecv(tensor, src, group=group, tag=tag)
        return _Works(first + [payload], keep=stamp) if first else payload
    arrival = None if link is None else (lambda: link.arrive(src, nbytes, float(stamp[0])))
    return _issue("recv", tensor, group, name, src, microbatch, nbytes, call, True, deadline=arrival)


def send(tensor, dst: int, group=None, name="", microbatch=None) -> Handle:
    return isend(tensor, dst, group, name, microbatch).wait()


def recv(tensor, src: int, group=None, name="", microbatch=None) -> Handle:
    return irecv(tensor, src, group, name, microbatch).wait()
