"""An issued call's handle: ``wait()`` blocks until it completes, records its span when it did
(gloo's completion seen by the work's future, or a watcher thread where there is none) and
turns torch's terse failures into errors that name the rank, the operation and the step.
"""
from __future__ import annotations

import threading
import time

import torch

from ..errors import CollectiveTimeout, CommFailure, CommMismatch
from .emulate import hold_until, timer
from .state import CommContext


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
                # gloo's reduce_scatter_single has no future and its is_completed() stays False;
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
        link's wait; a replay on a faster link needs gloo's own time (labkit.analysis.whatif)."""
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
    group = entry.get("group") if entry["peer"] is None else None       # a collective's members
    event = ctx.recorder.add(entry["kind"], entry["name"], start, end, stream="comm",
                             microbatch=entry["microbatch"], nbytes=entry["bytes"], peer=entry["peer"],
                             group=group)
    for instant in ("waited", "moved"):
        if event is not None and isinstance(entry.get(instant), float):
            event[instant] = entry[instant]
    if event is not None and "tier" in entry:           # on an emulated link: "intra" or "inter"
        event["tier"] = entry["tier"]


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
