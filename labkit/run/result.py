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
    return max(_abs_diff(a[k], b[k]) for k in a)


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


class MaxDiff(float):
    """``run.max_diff(ref)``: the largest |Δ| over every rank's copy, a float that also says
    where: ``rank`` and ``parameter`` of the largest, and ``by_rank`` {rank: its largest |Δ|}
    for every rank whose copy was read apart (a replica that is not bitwise the reported one).
    Its repr names the rank that departs when the replicas disagree."""

    rank: int | None
    parameter: str | None
    by_rank: dict

    def __new__(cls, value: float, rank=None, parameter=None, by_rank=None):
        out = super().__new__(cls, value)
        out.rank, out.parameter, out.by_rank = rank, parameter, dict(by_rank or {})
        return out

    def __repr__(self) -> str:
        value = float.__repr__(self)
        if not self.by_rank:
            return value
        return (f"{value} (rank {self.rank} departs, parameter {self.parameter!r}: the dp replicas disagree, "
                f"largest |Δ| per rank {', '.join(f'{r}: {v:.3g}' for r, v in sorted(self.by_rank.items()))})")

    def __reduce__(self):
        return MaxDiff, (float(self), self.rank, self.parameter, self.by_rank)


def every_copy_diff(params: dict, holders: dict, copies: dict, theirs: dict) -> MaxDiff:
    """The largest |Δ| between ``theirs`` and every rank's copy: the reported ``params`` (each
    key from the rank in ``holders``) and every other rank's copies that differ from them
    (``copies``: {rank: {key: tensor}})."""
    max_abs_diff(params, theirs)                   # the same keys, or KeyError naming them
    best = (-1.0, None, None)
    for key, tensor in params.items():
        best = max(best, (_abs_diff(tensor, theirs[key]), holders.get(key), key), key=lambda b: b[0])
    by_rank = {}
    for rank, part in copies.items():
        for key, tensor in part.items():
            d = _abs_diff(tensor, theirs[key])
            by_rank[rank] = max(by_rank.get(rank, 0.0), d)
            best = max(best, (d, rank, key), key=lambda b: b[0])
    if by_rank:                      # the reported copies too, for the comparison
        for key, tensor in params.items():
            r = holders.get(key)
            by_rank[r] = max(by_rank.get(r, 0.0), _abs_diff(tensor, theirs[key]))
    return MaxDiff(best[0], best[1], best[2], by_rank)


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
    holders: dict = field(default_factory=dict, repr=False)
    """Per parameter, the rank whose copy ``parameters()`` reports."""
    copies: dict = field(default_factory=dict, repr=False)
    """{rank: {parameter: tensor}}: every other rank's copy of a parameter where it is not
    bitwise the reported one (empty when the replicas agree, as they do in a correct run)."""
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
        run with ``labkit.plan.overlay``). Exact replays of the measured graph; ``bucket_mb=``
        rebuilds plain data parallelism's buckets at that size, and the other knobs that change
        the step's shape (micro-batches, modes) belong to labkit.plan.simulate (:mod:`labkit.analysis.whatif`).
        Each call keeps the time it took beyond its gloo and link parts as measured (a thread's
        wake-up, a late join), so a run measured on a loaded machine replays its load too: start
        from a run on a quiet one."""
        from ..analysis.whatif import whatif
        return whatif(self, link, compute, straggler, **knobs)

    def max_diff(self, other) -> MaxDiff:
        """Largest parameter difference from another run or ``labkit.reference`` result, over
        every rank's copy (each dp replica, each stage; ZeRO shards and tp pieces as gathered),
        not just the reported one: a replica that departed shows here, named by its rank."""
        theirs = other.parameters()
        mine = every_copy_diff(self.params, self.holders, self.copies, theirs)
        if getattr(other, "copies", None):           # the other run's replicas, read alike
            other_side = every_copy_diff(other.params, other.holders, other.copies, self.params)
            if other_side > mine:
                return other_side
        return mine

    def __repr__(self) -> str:
        s = self.strategy
        m = self.metrics
        return (f"Run({s.label()}, steps={len(self.losses)}, "
                f"loss {self.losses[0]:.4g} → {self.losses[-1]:.4g}, "
                f"step {1e3 * m.get('step_time_s', float('nan')):.1f} ms, "
                f"overlap {m.get('overlap_fraction', 0):.2f})")
