"""Pipeline parallelism: schedules as data (:mod:`.schedules`), the stage split (:mod:`.stages`).

This file owns the pp axis's rule: :func:`check_strategy` is what ``Strategy`` calls for
``schedule``, ``chunks`` and ``split_at`` (the split against a model is
:func:`.stages.check_split`, once the model's blocks are known). Nothing heavy is imported.
"""
from __future__ import annotations


# Schedules that split backward into I and W.
SPLIT_BACKWARD = ("zb-h1", "zbv")


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible pipeline setting."""
    _check_split_at(s)
    if s.pp == 1 and (s.chunks > 1 or s.split_at):
        name = "chunks" if s.chunks > 1 else "split_at"
        raise ValueError(f"Strategy.{name}={getattr(s, name)!r} splits a pipeline, and pp=1 has none "
                         f"(it would be ignored); set pp > 1 or leave {name} at its default")
    if s.chunks > 1 and s.schedule not in ("interleaved", "zbv"):
        raise ValueError(f"Strategy.chunks={s.chunks} needs schedule='interleaved' (or 'zbv', two chunks); "
                         "set chunks=1 or schedule='interleaved'")
    if s.schedule == "zbv" and s.pp > 1 and s.chunks != 2:
        raise ValueError(f"Strategy.chunks={s.chunks}: zbv places exactly two chunks per rank in a V; "
                         "set chunks=2")
    if s.schedule in SPLIT_BACKWARD and s.pp > 1 and s.dp > 1 and s.dp_mode == "ddp":
        raise ValueError(f"Strategy.dp_mode='ddp' with schedule={s.schedule!r}: DDP's reducer expects one fused "
                         "backward per micro-batch, and this schedule splits it into I and W; use "
                         "dp_mode='overlap', 'bucketed' or 'naive'")
    if s.schedule == "interleaved" and s.pp > 1:
        if s.chunks < 2:
            raise ValueError("Strategy.chunks: the interleaved schedule needs chunks ≥ 2 "
                             "(model chunks per rank); or use schedule='1f1b'")
        if s.microbatches % s.pp:
            raise ValueError(f"Strategy.microbatches={s.microbatches} must be a multiple of "
                             f"pp={s.pp} for the interleaved schedule")


def _check_split_at(s) -> None:
    if not isinstance(s.split_at, tuple):
        if not isinstance(s.split_at, (list, range)):
            raise ValueError(f"Strategy.split_at={s.split_at!r} must be a tuple of block indices")
        object.__setattr__(s, "split_at", tuple(s.split_at))     # frozen: normalise once, here
    at = s.split_at
    if not at:
        return
    stages = s.pp * s.chunks
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in at) or \
            list(at) != sorted(set(at)) or at[0] < 1:
        raise ValueError(f"Strategy.split_at={at} must be increasing block indices ≥ 1, "
                         "e.g. (3, 6) for three stages starting at blocks 0, 3 and 6")
    if len(at) != stages - 1:
        raise ValueError(f"Strategy.split_at has {len(at)} boundaries but pp*chunks = {stages} "
                         f"stages need {stages - 1}; give {stages - 1} or leave split_at empty")
