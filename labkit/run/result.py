"""What ``lab.run`` returns: losses, metrics, the timeline and the trained parameters."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import Strategy


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state_dicts with the same keys."""
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))
        raise KeyError(f"the parameter sets differ: {missing[:6]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@dataclass
class Run:
    """One run of a strategy: ``losses`` (one per step), ``metrics``, ``timeline``, ``parameters()``."""

    strategy: Strategy
    losses: list[float]
    timeline: object
    metrics: dict
    batch: int
    params: dict = field(default_factory=dict, repr=False)
    ranks: list[dict] = field(default_factory=list, repr=False)
    interrupted: bool = False
    step_times: list[float] = field(default_factory=list, repr=False)
    """Wall time of each step on the slowest rank (measured whether or not events are recorded)."""
    step_cpu_times: list[float] = field(default_factory=list, repr=False)
    """CPU time of each step on the busiest rank: all of its process's threads (comm threads too)."""
    parameter_bytes: list[int] = field(default_factory=list, repr=False)
    """Per rank, bytes of the parameters it holds (a tensor-parallel shard counts its own part)."""
    snapshots: list[dict] = field(default_factory=list, repr=False)
    """Per step, {rank: parameters and gradient norms after the step}; with ``lab.run(..., snapshots=True)``."""
    skipped_steps: list[int] = field(default_factory=list, repr=False)
    """precision="fp16": the steps whose update the loss scaler skipped (gradients overflowed)."""
    link: object = None
    """The emulated link (labkit.Link) the run's calls obeyed; None: raw gloo. ``str(run.link)`` names it."""
    step_entries: dict = field(default_factory=dict, repr=False)
    """Per recorded step, its part of the metrics (analysis.metrics.step_entry), so the metrics
    are refreshed after each step from the new step's events alone."""
    profile_paths: list[str] = field(default_factory=list, repr=False)
    """With ``lab.run(..., profile=True)``: each rank's torch profiler trace, in rank order."""
    checkpoints: list[str] = field(default_factory=list, repr=False)
    """With ``lab.run(..., checkpoint=DIR)``: the complete checkpoints it saved, in step order
    (labkit.checkpoint)."""
    checkpoint_io: dict = field(default_factory=dict, repr=False)
    """Per rank, what checkpointing cost: ``"load"`` (resume=: seconds reading) and ``"save"``
    ({step: seconds gathering and writing, bytes offered and written}), in rank order."""
    first_step: int = 0
    """The global step its step 0 was (``resume=``: the checkpoint's step; ``data(step)`` saw it)."""

    @property
    def profile(self):
        """The profiler traces as a Timeline (``Timeline.from_profiler``), with the run's grid:
        the same metrics, plots and straggler report as ``run.timeline``, from torch's own ops
        (and kernels on a GPU). Read once, then kept."""
        if not self.profile_paths:
            raise ValueError("this run was not profiled; run it with lab.run(..., profile=True)")
        if getattr(self, "_profile", None) is None:
            from ..analysis.timeline import Timeline
            self._profile = Timeline.from_profiler(self.profile_paths, grid=self.strategy,
                                                   title=f"torch profiler · {self.strategy.label()}")
        return self._profile

    def grad_norms(self, reference=None):
        """The gradient check: every parameter's gradient norm per step and rank (and the reference's)."""
        from ..analysis.drift import grad_norms
        return grad_norms(self.snapshots, reference)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state_dict, gathered from the engines, same keys as the model's."""
        return dict(self.params)

    def tp_bytes(self, n_embd: int, seq: int) -> list[dict]:
        """Per rank, tensor-parallel bytes per step measured beside Megatron's formula
        (:mod:`labkit.analysis.tensor_bytes`)."""
        from ..analysis.tensor_bytes import tp_bytes_table
        return tp_bytes_table(self, n_embd, seq)

    def whatif(self, link="same", compute: float = 1.0, straggler: int | None = None, **knobs):
        """This run's measured steps replayed with another ``link`` (a labkit.Link), compute
        times ``compute`` (0.1: ten times faster), or rank ``straggler``'s compute brought to
        its peers' median: ``.step_time_s``, ``.metrics``, ``.timeline`` (draw it against the
        run with ``labkit.plan.overlay``). Exact replays of the measured graph; knobs that
        change its shape (buckets, micro-batches) belong to labkit.plan.simulate
        (:mod:`labkit.plan.whatif`)."""
        from ..plan.whatif import whatif
        return whatif(self, link, compute, straggler, **knobs)

    def max_diff(self, other) -> float:
        """Largest parameter difference from another run or ``labkit.reference`` result."""
        return max_abs_diff(self.parameters(), other.parameters())

    def __repr__(self) -> str:
        s = self.strategy
        m = self.metrics
        return (f"Run({s.label()}, steps={len(self.losses)}, "
                f"loss {self.losses[0]:.4g} → {self.losses[-1]:.4g}, "
                f"step {1e3 * m.get('step_time_s', float('nan')):.1f} ms, "
                f"overlap {m.get('overlap_fraction', 0):.2f})")
