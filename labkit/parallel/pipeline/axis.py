"""The pipeline axis (:mod:`labkit.parallel.axes`): ``pp``, ``schedule``, ``microbatches``,
``chunks`` and ``split_at``. The split into stages is structural, so the builder does it
itself (``parallel/build.py``, step 3); this module holds the rules and the groups.
"""
from __future__ import annotations

from . import check_strategy  # noqa: F401  (the axis's strategy rule)

NAME = "pp"
TAKES_RANKS = True


def check_model(spec, built, data) -> None:
    """The split against the model's blocks, and what ZB-V cannot do with a tied weight."""
    s = spec.strategy
    if s.pp == 1:
        return
    from .modules import layer_span, unit_count
    from .stages import check_split
    check_split(s, unit_count(built), len(layer_span(built)))
    _check_tied_split_backward(s, built)


def _check_tied_split_backward(s, built) -> None:
    """ZB-V puts the first and last stage on rank 0, so a tied embedding and head are one
    Parameter there, reached by two stages' split backward: not built (it fails on the engines)."""
    if s.schedule != "zbv":
        return
    from .stages import stage_blocks
    from .tied import tied_across_stages
    if tied_across_stages(built, stage_blocks(built, s)):
        raise ValueError("Strategy.schedule='zbv' with a weight tied between the first and last stage (a tied "
                         "embedding and head) is not built; use labkit.models.gpt(tie=False), or another schedule")


def groups(dims) -> list:
    """One pipeline per (dp, cp, tp) cell, and its first and last rank (a tied weight's two copies)."""
    return [("pp", dims.pp_groups()), ("embedding", dims.embedding_groups())]


def shape_model(model, spec, groups):
    return model


def shape_data(data, spec, groups):
    return data


def wrap_sync(sync, s, groups, stage):
    return sync
