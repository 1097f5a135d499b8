"""The instrumented collectives and point-to-point calls every strategy uses.

This module is the only place that talks to ``torch.distributed`` during a step and the
only place that records comm events, so no strategy can forget to. Each call

* gets a sequence number in a small flight recorder (op, group, shape, dtype, peer, step,
  state), so a hang can be explained afterwards from every rank's log;
* is timed from issue to completion (CPU: host clock, completion seen by the work's
  future; GPU: CUDA events on a dedicated comm stream);
* turns torch's terse failures into errors that name the rank, the operation and the step;
* with an emulated link (``lab.link``, :class:`labkit.Link`), completes no earlier than the
  link's α-β time allows, waiting off the CPU (:mod:`.emulate`).

>>> labkit.comm.all_reduce(t, name="grad 0")              # on an engine, inside lab.apply
>>> h = labkit.comm.all_reduce(t, async_op=True); ...; h.wait()
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..analysis.events import kind_of_call
from ..errors import CollectiveTimeout, CommFailure, CommMismatch
from ..record.recorder import Recorder
from .emulate import Joined, LinkClock, hold_until, timer

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CommContext:
    """Per-engine state of this module: who we are, where events go, how long to wait."""

    rank: int
    recorder: Recorder
    timeout_s: float
    flight: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    seq: itertools.count = field(default_factory=itertools.count)
    comm_stream: object = None      # torch.cuda.Stream on GPU engines
    calls: collections.Counter = field(default_factory=collections.Counter)   # channel → calls made
    check_p2p: bool = True          # receives check shape and dtype in a small header first
    link: LinkClock | None = None   # an emulated link's clocks (CPU only); None: gloo's own speed


_ctx: CommContext | None = None


def bind(ctx: CommContext | None) -> None:
    """Install this engine's context (done by the engine session)."""
    global _ctx
    _ctx = ctx


def context() -> CommContext:
    if _ctx is None:
        raise RuntimeError("labkit.comm is used outside a lab engine; call it through lab.apply or lab.run")
    return _ctx


def rank() -> int:
    """This engine's rank (inside ``lab.apply`` or a run), from the launcher's environment."""
    return context().rank


def span(kind: str, name: str = "", **kwargs):
    """Record user code as one span on this rank's timeline (``lab.trace``)::

        with labkit.comm.span("fwd", "some compute"):
            y = x @ w
    """
    return context().recorder.span(kind, name, **kwargs)


def flight_log() -> list[dict]:
    """The last calls this rank made, oldest first (each a dict; ``state`` says how it ended).

    ``channel`` and ``call`` line calls up across ranks: the n-th call on a group (or the n-th
    message from one rank to another) has the same ``call`` number on every rank that made it.
    """
    return [{k: v for k, v in entry.items() if not k.startswith("_")} for entry in context().flight]


def set_link(link) -> None:
    """Emulate ``link`` (a :class:`labkit.Link`) on this rank from the next call; None: raw gloo.

    Every rank of the lab must set the same link: a message's departure time travels ahead
    of it only when both ends emulate. The lab does this (``lab.link = ...``).
    """
    ctx = context()
    if link is not None and ctx.comm_stream is not None:
        raise ValueError("an emulated link is for CPU engines (gloo); a GPU lab has its own interconnect: "
                         "leave lab.link = None")
    ctx.link = LinkClock(link, ctx.rank) if link is not None else None


def set_p2p_check(on: bool) -> None:
    """Switch the shape/dtype header of point-to-point messages on or off (on every rank alike).

    On (the default), each message is preceded by a small header, so a receive whose tensor
    does not match what was sent raises :class:`CommMismatch` naming both ranks instead of
    killing the receiving process (gloo aborts on a size mismatch). Off saves one small
    message per send.
    """
    context().check_p2p = bool(on)


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


# -- handles --------------------------------------------------------------------------------
BLOCKED_S = 50e-6
"""A wait on an asynchronous call longer than this cuts the compute span around it."""


class Handle:
    """An issued call: ``wait()`` blocks until it completes (and records when it did)."""

    def __init__(self, ctx: CommContext, entry: dict, work, start, watch: bool = True,
                 thread: bool = False, deadline=None):
        self._ctx, self.entry, self.work, self._start = ctx, entry, work, start
        self._done_at = None
        # An emulated link's end (perf_counter): a float, or a function that knows it once the
        # real work is done (a receive learns when its message left from the message itself).
        self._deadline = deadline
        self._watcher, self._thread = None, thread
        if (watch and work is not None and ctx.recorder.enabled and not ctx.recorder.cuda
                and entry["op"] not in ("send", "recv")):
            # gloo completes collectives on its own thread: note when, without blocking.
            try:
                work.get_future().add_done_callback(lambda _f: self._completed(moved=True))
            except RuntimeError:
                # gloo's reduce_scatter_tensor has no future and its is_completed() stays False;
                # an async one (zero=2/3, issued during backward) is waited for by one watcher
                # thread, so it ends on the timeline when it did, not when the optimizer waits.
                # That thread is the only waiter: two threads waiting on one such work copied
                # its result out twice, the second over a buffer already reused (measured).
                if thread:
                    self._watcher = _Watcher(work, lambda: self._completed(moved=True))

    def _completed(self, moved: bool = False):
        """Note when the call completed; ``moved``: called as gloo finished moving the bytes."""
        if self._done_at is None:
            done = self._ctx.recorder.mark()
            if self._deadline is not None:      # the link's end, on the step's clock
                if moved:
                    self._moved(done)
                done = max(done, self._resolve() - self._ctx.recorder.origin)
            self._done_at = done

    def _moved(self, at) -> None:
        """On an emulated link: when gloo itself had moved the bytes (CPU clock), before the
        link's wait; a replay on a faster link needs gloo's own time (labkit.plan.whatif)."""
        if isinstance(at, float) and "moved" not in self.entry:
            self.entry["moved"] = at

    def _resolve(self) -> float | None:
        """The emulated end, worked out once (a receive's needs its message's departure)."""
        if callable(self._deadline):
            self._deadline = self._deadline()
        return self._deadline

    def _hold(self):
        """Emulated link: wait (asleep) until the call's emulated end."""
        if self._resolve() is not None:
            hold_until(self._deadline)

    def wait(self):
        """Block until done; raise CollectiveTimeout / CommFailure naming rank, op and step.

        An asynchronous call's wait that blocks inside a compute span (a ZeRO-2 bucket collected
        during backward, a ring attention's K/V hop inside a block's forward) cuts that span, as
        a blocking call does: the rank computed nothing while it waited."""
        rec = self._ctx.recorder
        if rec.enabled and not rec.cuda and "waited" not in self.entry:
            self.entry["waited"] = rec.mark()          # where this rank consumed the result
        began = rec.mark() if self._thread and rec.enabled and not rec.cuda else None
        self._wait()
        if began is not None and (ended := rec.mark()) - began > BLOCKED_S:
            rec.blocked(began, ended)
        return self

    def _wait(self):
        if self._watcher is not None:
            _guard(self._ctx, self.entry, self._watcher.join)
        elif self.work is not None:
            _guard(self._ctx, self.entry, lambda: _wait_work(self._ctx, self.work))
        if self._deadline is not None and self._done_at is None and self.entry["peer"] is None:
            self._moved(self._ctx.recorder.mark())         # a blocking collective: gloo is done now
        self._hold()
        self._completed()
        self.entry["state"] = "done"
        _record(self._ctx, self.entry, self._start, self._done_at)

    def future(self, first: bool = False) -> torch.futures.Future:
        """A future resolving to the (reduced) tensors (``first``: to the first one, as a DDP
        communication hook must return), completion recorded in the same single callback."""
        def finish(fut):
            self._completed()
            self.entry["state"] = "done"
            _record(self._ctx, self.entry, self._start, self._done_at)
            return fut.value()[0] if first else fut.value()
        future = self.work.get_future().then(finish)
        if self._deadline is None:
            return future
        # Emulated link: a second future, settled by the link's timer thread at the deadline
        # (DDP waits on it at the end of backward; no thread of ours blocks meanwhile).
        late = torch.futures.Future()
        future.add_done_callback(lambda f: timer().at(self._resolve(), lambda: _settle(late, f)))
        return late


def _settle(future: torch.futures.Future, done: torch.futures.Future) -> None:
    try:
        future.set_result(done.value())
    except Exception as exc:
        future.set_exception(exc)


class _OnLink:
    """A work that reads as completed only once its emulated link time has passed too (a
    pipeline polls its sends: one whose bytes are still on the emulated wire is not done)."""

    def __init__(self, work, handle: Handle):
        self._work, self._handle = work, handle

    def wait(self):
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed() and self._handle._resolve() <= time.perf_counter()

    def get_future(self):
        return self._work.get_future()


class _Watcher:
    """One thread that waits for a work without a future and notes when it completed."""

    def __init__(self, work, on_done):
        self.done, self.error = threading.Event(), None
        self._work, self._on_done = work, on_done
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            self._work.wait()
        except Exception as exc:      # raised again in the caller's thread by join()
            self.error = exc
        self._on_done()
        self.done.set()

    def join(self):
        self.done.wait()
        if self.error is not None:
            raise self.error


def _wait_work(ctx, work):
    if ctx.comm_stream is None:
        work.wait()
        return
    with torch.cuda.stream(ctx.comm_stream):
        work.wait()              # the comm stream now waits on the collective's own stream
    torch.cuda.current_stream().wait_stream(ctx.comm_stream)


def _record(ctx, entry, start, end):
    if entry.get("_recorded") or entry["op"] == "barrier":     # a barrier only aligns ranks
        return
    entry["_recorded"] = True
    group = entry["group"] if entry["peer"] is None else None       # a collective's members
    event = ctx.recorder.add(entry["kind"], entry["name"], start, end, stream="comm",
                             microbatch=entry["microbatch"], nbytes=entry["bytes"], peer=entry["peer"],
                             group=group)
    for instant in ("waited", "moved"):
        if event is not None and isinstance(entry.get(instant), float):
            event[instant] = entry[instant]


def _guard(ctx: CommContext, entry: dict, call):
    """Run ``call``; translate torch's failure into one that names rank, op, step and group."""
    try:
        return call()
    except Exception as exc:  # torch raises RuntimeError / DistBackendError with terse text
        text = str(exc)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        entry["state"] = "timeout" if timed_out else "failed"
        where = (f"rank {ctx.rank}, step {entry['step']}: {entry['op']} '{entry['name']}' "
                 f"(call #{entry['call']} on {entry['channel']}, shape {entry['shape']}, {entry['dtype']}"
                 + (f", peer {entry['peer']}" if entry["peer"] is not None else "") + ")")
        if isinstance(exc, CommMismatch):
            entry["state"] = "mismatch"
            raise CommMismatch(f"{where}: {text}") from None
        if timed_out:
            raise CollectiveTimeout(f"{where} timed out after {ctx.timeout_s:g} s; a rank of the group "
                                    f"never reached this call. Torch said: {text.splitlines()[0]}") from None
        raise CommFailure(f"{where} failed: {text.splitlines()[0] if text else type(exc).__name__}") from None


# -- issuing --------------------------------------------------------------------------------
def _check_tensor(op: str, tensor, name: str) -> None:
    # an all-to-all may carry nothing from this rank (no token routed off it); it still joins
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 and op != "all_to_all":
        raise ValueError(f"labkit.comm.{op}: needs a non-empty tensor, got {tensor!r:.60}")
    if not tensor.is_contiguous():
        raise ValueError(f"labkit.comm.{op}: tensor '{name}' is not contiguous; call .contiguous() first")


def _issue(op: str, tensor: torch.Tensor, group, name: str, peer, microbatch, nbytes: int, call,
           async_op: bool, watch: bool = True, size: int = 0, deadline=None):
    """Issue ``call`` as labkit's ``op``; ``size``: the collective's size for an emulated link
    (:meth:`Link.seconds`); ``deadline``: a point-to-point call's own (see isend/irecv)."""
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
            deadline = _join(ctx, entry, LINK_OPS[op], size, ranks, group)
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


def _join(ctx: CommContext, entry: dict, op: str, size: int, ranks: list[int], group) -> Joined:
    """Post this rank's start on the emulated link (a MAX all-reduce of one number, ahead of the
    payload): the collective's deadline is the latest member's start plus its α-β time."""
    tier, start, cost = ctx.link.collective(op, size, ranks, time.perf_counter())
    stamp = torch.tensor([start], dtype=torch.float64)
    work = _guard(ctx, entry, lambda: dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return Joined(ctx.link, work, stamp, tier, cost)


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
                  lambda: dist.all_gather_into_tensor(output, tensor, group=group, async_op=True), async_op,
                  size=size)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group=None, name="", op="sum", async_op=False):
    """Reduce ``tensor`` over the group and leave this rank's 1/n slice in ``output``."""
    size = tensor.numel() * tensor.element_size()
    nbytes = wire_bytes("reduce_scatter", size, _group_size(group))
    reduce_op = OPS[op] if isinstance(op, str) else op        # FSDP2 passes torch's ReduceOp
    return _issue("reduce_scatter", tensor, group, name, None, None, nbytes,
                  lambda: dist.reduce_scatter_tensor(output, tensor, op=reduce_op, group=group, async_op=True),
                  async_op, size=size)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, name="", async_op=False):
    """Send the i-th slice of ``tensor`` (rows, ``input_split_sizes[i]`` of them) to the group's
    i-th rank and receive its slice for us into ``output`` (``output_split_sizes``; None: equal).
    The bytes are those that leave this rank: every slice but our own. On an emulated link the
    exchange is priced by this rank's whole input (the link's pairwise all-to-all time)."""
    rows = len(tensor) if tensor.dim() else 0
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    me = dist.get_group_rank(group, context().rank) if group is not None else context().rank
    own = input_split_sizes[me] if input_split_sizes is not None else rows // _group_size(group)
    nbytes = row_bytes * (rows - own)
    return _issue("all_to_all", tensor, group, name, None, None, nbytes,
                  lambda: dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                                 group=group, async_op=True), async_op,
                  size=rows * row_bytes)


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


# -- the point-to-point header: [dtype code, ndim, dims…], int64 ------------------------------
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
MAX_DIMS = 14


HEADER_LEN = 2 + MAX_DIMS


def describable(tensor: torch.Tensor) -> bool:
    """Whether a message header can describe ``tensor`` (its dtype and number of dims)."""
    return tensor.dtype in DTYPES and tensor.dim() <= MAX_DIMS


def header(tensor: torch.Tensor) -> torch.Tensor:
    """The one point-to-point header format: [dtype code, ndim, dims…, 0…], int64, HEADER_LEN long.

    Sent before a payload, it lets the receiver check what arrives (``irecv(check=True)``) or
    allocate for it (the pipeline's first activation on a channel, :func:`read_header`).
    """
    if not describable(tensor):
        raise ValueError(f"labkit.comm: cannot describe a {tensor.dim()}-d {tensor.dtype} tensor in a "
                         f"message header; call labkit.comm.set_p2p_check(False) on every rank")
    values = [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def read_header(values: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) that a :func:`header` announces."""
    code, ndim, *dims = values.tolist()
    return tuple(dims[:ndim]), DTYPES[code]


_header = header


def _describe(dtype, shape) -> str:
    return f"shape {tuple(shape)} {str(dtype).replace('torch.', '')}"


class _Works:
    """Several torch works waited for as one (a header and its payload)."""

    def __init__(self, works, keep=None):
        self.works, self._keep = works, keep

    def wait(self):
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self):
        return self.works[-1].get_future()


class _CheckedRecv:
    """A receive that reads the sender's header before posting the payload's receive."""

    def __init__(self, tensor, src, group, tag):
        self.tensor, self.src, self.group, self.tag = tensor, src, group, tag
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=tensor.device)
        self.header_work = dist.irecv(self.header, src, group=group, tag=tag)
        self._done = False

    def wait(self):
        if self._done:
            return True
        self.header_work.wait()
        shape, dtype = read_header(self.header)
        if dtype == self.tensor.dtype and shape == tuple(self.tensor.shape):
            dist.irecv(self.tensor, self.src, group=self.group, tag=self.tag).wait()
            self._done = True
            return True
        scratch = torch.empty(shape, dtype=dtype, device=self.tensor.device)
        dist.irecv(scratch, self.src, group=self.group, tag=self.tag).wait()     # drain: both stay in step
        self._done = True
        raise CommMismatch(f"this rank expected {_describe(self.tensor.dtype, self.tensor.shape)} from rank "
                           f"{self.src}, but rank {self.src} sent {_describe(dtype, shape)}")

    def is_completed(self) -> bool:
        return self._done

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result([self.tensor])
        return future
