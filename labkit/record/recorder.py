"""Per-rank span recording: events kept as plain data, one buffer per rank.

A span is ``with rec.span("fwd", "block 3", microbatch=2): ...``; comm spans are opened
only by :mod:`labkit.comm`. Times are seconds from the step's start. Merging ranks, metrics
and plots happen later, elsewhere (:mod:`labkit.timeline`, :mod:`labkit.metrics`).

On CPU a span is two ``perf_counter`` readings. On a GPU, compute and comm spans are CUDA
events recorded on the stream doing the work and resolved once per step, so asynchronous
kernels are timed where they ran, not where the host launched them.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class Recorder:
    """Collects this rank's events for the current step."""

    def __init__(self, rank: int, device=None, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.cuda = device is not None and getattr(device, "type", "cpu") == "cuda"
        self.step = 0
        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._pending: list[tuple[dict, object, object]] = []   # CUDA: (event, start, end)
        self._step_start = None

    # -- clock ---------------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        """Mark time zero of ``step`` (called right after the step's aligning barrier)."""
        self.step = step
        self._events, self._pending = [], []
        self._t0 = time.perf_counter()
        if self.cuda:
            import torch
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()

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
    def add(self, kind: str, name: str, start, end, stream: str = "compute", microbatch=None,
            nbytes: int = 0, peer=None) -> dict | None:
        """Record one span between two marks (floats, or CUDA events on GPU)."""
        if not self.enabled:
            return None
        event = {"rank": self.rank, "stream": stream, "kind": kind, "name": name, "step": self.step,
                 "microbatch": microbatch, "start": start, "end": end, "bytes": int(nbytes), "peer": peer}
        if isinstance(start, float) and isinstance(end, float):
            self._events.append(event)
        else:
            self._pending.append((event, start, end))
        return event

    @contextmanager
    def span(self, kind: str, name: str = "", stream: str = "compute", microbatch=None, nbytes=0, peer=None):
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
