"""torch.profiler over a run's steps, on each engine: ``lab.run(..., profile=True)``.

The profiler starts when the run is set up and collects only inside each step: from the exit
of the step's barrier (where labkit's own clock starts the step) to its end, with the CUDA
stream synchronised on a GPU. Inside, a ``ProfilerStep#N`` annotation names labkit's step N,
the annotation ``torch.profiler.profile.step()`` leaves, so the trace reads back with
:func:`labkit.analysis.traces.read_profiler` like any production trace. Between steps
collection is toggled off (``toggle_collection_dynamic``), so the harness's own work (the next
batch, the barrier, the answer to the notebook) is not in the trace.

What it records: CPU ops (``aten::``, ``c10d::``, gloo's annotations) on every device, and on a
GPU the kernels and memcpys on their streams too. Export happens once, at the end
(:meth:`StepProfiler.finish`): the Kineto Chrome trace, gzipped, as bytes for the notebook,
which may sit on another host than the engine.

    >>> p = StepProfiler(torch.device("cpu"))
    >>> with p.step(0):
    ...     job.step(0, batch)
    >>> data = p.finish()          # gzipped Chrome trace JSON
"""
from __future__ import annotations

import gzip
import os
import tempfile
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    """One engine's profiler for one run; see the module docstring."""

    def __init__(self, device: torch.device):
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=self.activities)
        self.prof.start()
        self.running = True
        self._collect(False)          # nothing until the first step starts

    def _collect(self, on: bool) -> None:
        # CPU and CUDA together: toggling CUDA alone can mismatch the kernels' correlation ids
        # with their launches (pytorch#140285); toggling off syncs the device and flushes
        # CUPTI's buffers (kineto#1105), so a step's last kernels stay in that step.
        self.prof.toggle_collection_dynamic(on, self.activities)

    @contextmanager
    def step(self, step: int):
        """Collect inside: the ops of labkit's step ``step``, under a ``ProfilerStep#step`` annotation."""
        self._collect(True)
        try:
            with record_function(f"ProfilerStep#{step}"):
                yield
        finally:
            self._collect(False)

    def finish(self) -> bytes:
        """Stop and return the Chrome trace, gzipped (distributedInfo names the rank)."""
        self.close()
        fd, path = tempfile.mkstemp(prefix="labkit-profile-", suffix=".json")
        os.close(fd)
        try:
            self.prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                return gzip.compress(f.read(), compresslevel=5)
        finally:
            os.unlink(path)

    def close(self) -> None:
        """Stop collecting (a run replaced or failed before :meth:`finish`)."""
        if self.running:
            self.running = False
            self.prof.stop()
