"""Planted sync faults: a bug put into data parallelism's gradient averaging on purpose, to learn
what one looks like and to find it (``labkit.drift``, notebook 10).

>>> from labkit.parallel.data import SyncFault, sync_fault
>>> with sync_fault(lab, SyncFault("skip", bucket=1, rank=1, from_step=2)):
...     broken = lab.run(labkit.Strategy(dp=2, dp_mode="bucketed"), model=model, snapshots=True)

Two faults, the two ways an average goes wrong:

* ``"skip"`` — rank ``rank`` keeps its own gradient for bucket ``bucket`` instead of the
  average. It still takes part in the all-reduce (so nothing hangs), it only never writes the
  result back: the replicas disagree, a *sync* bug (a missing hook, a wrong condition).
* ``"factor"`` — the bucket's sum is divided by ``factor``·dp instead of dp (on every rank, or
  on ``rank`` alone): replicas that agree drift together, a *math* slip.

They act where a bucket's average is written back into the gradients, so they apply to
``dp_mode="bucketed"`` and ``"overlap"`` (with or without compression); ``naive`` has no
buckets and ``ddp``'s are torch's. Buckets are numbered as they fill, last layer first.

A fault is a teaching instrument, not a training option, so it is not a field of
``Strategy`` or an argument of ``lab.run``: ``sync_fault`` plants it on every engine for the
``with`` block and takes it out when the block ends, also when a run inside it fails, so the lab
is clean afterwards and a re-run cell never finds a stale one. On leaving, a fault that never
fired (a bucket index past the last, a step past the run, a mode without buckets) warns.
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("skip", "factor")


@dataclass(frozen=True)
class SyncFault:
    """One planted fault in the gradient average (see the module docstring)."""

    kind: str
    """"skip" (a rank keeps its own gradient) or "factor" (the sum divided by factor·dp)."""
    bucket: int
    """The bucket it hits: 0 is the first to fill (the last layer's gradients)."""
    rank: int | None = None
    """The (global) rank that misbehaves; "skip" needs one; "factor": None means every rank."""
    from_step: int = 0
    """The first step it acts on (steps count from 0, the warm-up included)."""
    factor: float = 2.0
    """"factor": the bucket's sum is divided by ``factor``·dp instead of dp."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"SyncFault kind={self.kind!r} is unknown; use 'skip' (a rank keeps its own "
                             "gradient) or 'factor' (the sum divided by factor·dp)")
        for name in ("bucket", "from_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SyncFault {name}={value!r} must be a whole number ≥ 0")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0):
            raise ValueError(f"SyncFault rank={self.rank!r} must be a rank (a whole number ≥ 0) or None")
        if self.kind == "skip" and self.rank is None:
            raise ValueError("SyncFault('skip') needs rank=: the rank that keeps its own gradient, e.g. rank=1")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not 0 < self.factor < math.inf:
            raise ValueError(f"SyncFault factor={self.factor!r} must be a finite number > 0 "
                             "(2: the sum divided by 2·dp)")

    def __str__(self) -> str:
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        what = ("keeps its own gradient" if self.kind == "skip"
                else f"divides the sum by {self.factor:g}·dp")
        return f"{who} {what} for bucket {self.bucket} from step {self.from_step}"


@contextmanager
def sync_fault(lab, *faults: SyncFault):
    """Plant ``faults`` on every engine of ``lab`` for the ``with`` block; taken out on leaving.

    Yields a dict that, after the block, maps each fault to the times each rank applied it (a
    list in rank order), so a reader can see where it fired.
    """
    if not faults or not all(isinstance(f, SyncFault) for f in faults):
        raise TypeError(f"sync_fault(lab, *faults) takes SyncFault objects, e.g. SyncFault('skip', bucket=1, "
                        f"rank=1); got {faults!r}")
    for fault in faults:
        if fault.rank is not None and fault.rank >= lab.world_size:
            raise ValueError(f"SyncFault rank={fault.rank} is not a rank of this lab (0..{lab.world_size - 1})")
    fired: dict = {}
    lab.apply(install, list(faults))
    try:
        yield fired
    except BaseException:
        try:
            lab.apply(remove, list(faults))
        except Exception:       # noqa: BLE001 — the block's own error is the one to see; engines
            pass                # that cannot answer are restarted by lab.recover(), faults and all
        raise
    counts = lab.apply(remove, list(faults))
    for i, fault in enumerate(faults):
        fired[fault] = [per_rank[i] for per_rank in counts]
        if not any(fired[fault]):
            warnings.warn(f"the planted fault ({fault}) never fired: is the dp_mode 'bucketed' or 'overlap', "
                          f"does the model have a bucket {fault.bucket}, did the run reach step "
                          f"{fault.from_step}?", stacklevel=3)


# -- the engines' side ---------------------------------------------------------------------------
_planted: dict[SyncFault, int] = {}      # fault → times it fired on this engine


def install(faults: list[SyncFault]) -> None:
    """Plant ``faults`` in this engine (called through ``lab.apply``)."""
    for fault in faults:
        _planted[fault] = 0


def remove(faults: list[SyncFault]) -> list[int]:
    """Take ``faults`` out of this engine; how many times each fired here."""
    return [_planted.pop(fault, 0) for fault in faults]


def active(bucket: int, rank: int, step: int) -> SyncFault | None:
    """The planted fault that hits ``bucket`` on ``rank`` at ``step``, if any (counted). The
    caller passes where it is, so this file stays free of torch.distributed (a notebook imports it)."""
    if not _planted:
        return None
    for fault in _planted:
        if fault.bucket == bucket and step >= fault.from_step and fault.rank in (None, rank):
            _planted[fault] += 1
            return fault
    return None
