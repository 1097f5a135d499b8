"""Per-rank span recording: events kept as plain data, one buffer per rank.

A span is ``with rec.span("fwd", "block 3", microbatch=2): ...``; comm spans are opened
only by :mod:`labkit.comm`. Times are seconds from the step's start. Merging ranks, metrics
and plots happen later, elsewhere (:mod:`labkit.analysis.timeline`, :mod:`labkit.analysis.metrics`).

On CPU a span is two ``perf_counter`` readings. On a GPU, compute and comm spans are CUDA
events recorded on the stream doing the work and resolved once per step, so asynchronous
kernels are timed where they ran, not where the host launched them.

``sync_debug`` (on a GPU only) synchronises the device after every recorded op, so the host
blocks at the op that is slow rather than at some later sync point (torch's advice for
locating a stall); overlap disappears while it is on. Engines read ``LABKIT_SYNC_DEBUG=1``
from their environment; ``labkit.gpu.sync_debug(lab)`` switches it at run time.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

from ..analysis.events import make_event


SYNC_DEBUG_ENV = "LABKIT_SYNC_DEBUG"


class Recorder:
    """Collects this rank's events for the current step."""

    def __init__(self, rank: int, device=None, enabled: bool = True, sync_debug: bool | None = None):
        self.rank = rank
        self.enabled = enabled
        self.cuda = device is not None and getattr(device, "type", "cpu") == "cuda"
        if sync_debug is None:        # from the engine's environment, so a re-made recorder keeps it
            sync_debug = os.environ.get(SYNC_DEBUG_ENV, "") == "1"
        self.sync_debug = bool(sync_debug)
        self.step = 0
        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._pending: list[tuple[dict, object, object]] = []   # CUDA: (event, start, end)
        self._step_start = None
        self._blocked: list[tuple[float, float]] = []   # intervals the host waited in a blocking call

    # -- clock ---------------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        """Mark time zero of ``step`` (called right after the step's aligning barrier)."""
        self.step = step
        self._events, self._pending, self._blocked = [], [], []
        self._t0 = time.perf_counter()
        if self.cuda:
            import torch
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()

    @property
    def origin(self) -> float:
        """The step's time zero on this host's clock (``time.perf_counter``, which is
        system-wide: every process of one machine reads the same clock)."""
        return self._t0

    def now(self) -> float:
        """Host seconds since the step started."""
        return time.perf_counter() - self._t0

    def mark(self):
        """A point in time: a float on CPU, a recorded CUDA event on the current stream on GPU."""
        if not self.cuda:
            return self.now()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- events --------------------------------------------------------------------------
    def add(self, kind: str, name: str, start, end, stream: str | None = None, microbatch=None,
            nbytes: int = 0, peer=None, group=None) -> dict | None:
        """Record one span between two marks (floats, or CUDA events on GPU); the stream is the
        kind's (labkit.analysis.events) unless given; ``group``: a collective's ranks."""
        if not self.enabled:
            return None
        if self.sync_debug and self.cuda:
            import torch
            torch.cuda.synchronize()      # the op's kernels end before the next op is launched
        event = make_event(self.rank, kind, name, self.step, start, end, microbatch, nbytes, peer, stream, group)
        if isinstance(start, float) and isinstance(end, float):
            self._events.extend(self._cut(event))
        else:
            self._pending.append((event, start, end))
        return event

    def blocked(self, start, end) -> None:
        """The host waited in a blocking collective from ``start`` to ``end`` (CPU marks): a
        compute span around that wait is cut in two, since the rank computed nothing then
        (tensor parallelism's f and g sit inside forward and backward, on the critical path)."""
        if self.enabled and isinstance(start, float) and isinstance(end, float):
            self._blocked.append((start, end))

    def _cut(self, event: dict) -> list[dict]:
        """``event`` without the blocked intervals inside it (compute spans only)."""
        if event["stream"] != "compute" or not self._blocked:
            return [event]
        pieces, start = [], event["start"]
        for b0, b1 in self._blocked:
            if b0 >= start and b1 <= event["end"]:
                if b0 > start:
                    pieces.append({**event, "start": start, "end": b0})
                start = b1
        if start < event["end"] or not pieces:
            pieces.append({**event, "start": start, "end": max(start, event["end"])})
        return pieces

    @contextmanager
    def span(self, kind: str, name: str = "", stream: str | None = None, microbatch=None, nbytes=0, peer=None):
        """Time the body as one span (a no-op when recording is off)."""
        if not self.enabled:
            yield
            return
        start = self.mark()
        yield
        self.add(kind, name or kind, start, self.mark(), stream, microbatch, nbytes, peer)

    def drain(self) -> list[dict]:
        """This step's events, CUDA spans resolved to seconds, sorted by start."""
        if self._pending:
            import torch
            torch.cuda.synchronize()
            for event, start, end in self._pending:
                event["start"] = self._seconds(start)
                event["end"] = self._seconds(end)
                self._events.append(event)
            self._pending = []
        events, self._events = sorted(self._events, key=lambda e: e["start"]), []
        return events

    def _seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        return self._step_start.elapsed_time(mark) / 1000.0
