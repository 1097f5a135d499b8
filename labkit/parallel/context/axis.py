"""The context-parallel axis (:mod:`labkit.parallel.axes`): ``cp``, ``cp_mode`` and
``cp_balance``. Its rules live in the package (:func:`check_strategy`, :func:`check_model`);
here they are wired to the protocol, with the ring's groups and this rank's share of the data.
"""
from __future__ import annotations

from . import check_model as _check_model
from . import check_strategy  # noqa: F401  (the axis's strategy rule)

NAME = "cp"
TAKES_RANKS = True


def check_model(spec, built, data) -> None:
    _check_model(spec.strategy, built, data)


def groups(dims) -> list:
    """The cp rings and the ranks that average gradients together (dp × cp); none for cp = 1,
    which builds exactly the groups of a grid without the axis."""
    if dims.cp == 1:
        return []
    return [("cp", dims.cp_groups()), ("dp_cp", dims.dp_cp_groups())]


def shape_model(model, spec, groups):
    """A transformers model's attention goes through labkit's (its attention registry)."""
    if spec.strategy.cp > 1:
        from .hf import is_hf, route
        if is_hf(model):
            route(model)
    return model


def shape_data(data, spec, groups):
    """This rank's tokens of every sequence (cp > 1); for cp = 1 the data as it is, and no
    context left from an earlier run."""
    from .layout import build_context_parallel
    return build_context_parallel(spec.strategy, groups, data)


def wrap_sync(sync, s, groups, stage):
    return sync
