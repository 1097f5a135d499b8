"""The axes of parallelism, one line each, in the order they apply to a model.

Each axis is a package under ``labkit/parallel/`` whose ``axis`` module answers the same
questions (the :class:`Axis` protocol, torchtitan's ``ParallelDims`` and ``parallelize`` cut
by axis as picotron cuts its folders): which Strategy field is its degree, the rules on the
strategy and on the model, its process groups on the grid (:mod:`labkit.grid`), what it does
to the model and to the data, and how it wraps a stage's gradient sync. The parts of labkit
that used to name every axis loop over :data:`AXES` instead: ``Strategy.__post_init__`` (the
strategy rules), ``run/runner.py``'s ``validate`` (the model rules), ``labkit.engine.grid``
(the groups), ``parallel/build.py`` (the model, the data and the sync) and the CLI (its flags,
one group per axis). Adding an axis is its package, its line here, its tests and its notebook.

>>> [axis.NAME for axis in AXES]
['tp', 'cp', 'pp', 'dp', 'zero', 'ep']
>>> grid_of(type("S", (), dict(dp=2, pp=1, cp=1, tp=2))())
ParallelDims(dp=2, pp=1, tp=2, cp=1, order='tp,cp,pp,dp')
"""
from __future__ import annotations

from typing import Any, Protocol

from ..grid import ParallelDims
from .context import axis as context
from .data import axis as data
from .expert import axis as expert
from .pipeline import axis as pipeline
from .tensor import axis as tensor
from .zero import axis as zero

# The order they apply (torchtitan's parallelize_llama: TP, then AC and compile, then FSDP
# last; picotron: TP → PP → CP → DP). A model hook runs on the whole model before the pipeline
# split; a sync hook runs per stage, each axis seeing what the one before it built.
AXES = (
    tensor,     # tp: each planned layer's matrices split over the tp group (Megatron's f/g, or DTensor)
    context,    # cp: every sequence cut over the cp ring; attention computed across it
    pipeline,   # pp: consecutive blocks on consecutive ranks (the split itself: build.py, step 3)
    data,       # dp: each stage's gradients averaged over its replicas (four modes; batch norm synced)
    zero,       # zero: the replicas' states sharded instead (ZeRO-1/2/3, FSDP2, HSDP), replacing dp's sync
    expert,     # ep: MoE layers keep this rank's experts, routed by all-to-all; their gradients
                #     averaged over their own replicas around the dp/zero sync
)


class Axis(Protocol):
    """What each ``parallel/<axis>/axis.py`` declares (module-level names)."""

    NAME: str               # "tp": its Strategy fields are those whose ``setting(axis=...)`` is NAME
    TAKES_RANKS: bool       # its degree multiplies the world (dp, pp, cp, tp) or lives inside dp (ep, zero)

    def check_strategy(self, s) -> None: ...                        # Strategy.__post_init__
    def check_model(self, spec, built, data) -> None: ...           # before any engine (run/runner.py)
    def groups(self, dims: ParallelDims) -> list[tuple[str, list[list[int]]]]: ...   # built with the grid
    def shape_model(self, model, spec, groups) -> Any: ...          # the whole model, before the pp split
    def shape_data(self, data, spec, groups) -> Any: ...            # this rank's share of each batch
    def wrap_sync(self, sync, s, groups, stage) -> Any: ...         # a stage's gradient sync


def axis(name: str):
    """The registry's axis called ``name`` ("tp", "dp", "zero", …)."""
    for a in AXES:
        if a.NAME == name:
            return a
    raise KeyError(f"no axis {name!r}; the axes are {', '.join(a.NAME for a in AXES)}")


def grid_of(s) -> ParallelDims:
    """The rank grid a strategy needs: the degree of every axis that takes ranks of its own."""
    degrees = {a.NAME: getattr(s, a.NAME) for a in AXES if a.TAKES_RANKS}
    return ParallelDims(**degrees, order=getattr(s, "order", ParallelDims.order))


def grid_groups(dims: ParallelDims) -> list[tuple[str, list[list[int]]]]:
    """Every axis's groups on ``dims``, in registry order: (kind, the rank lists of that kind)."""
    return [kind for a in AXES for kind in a.groups(dims)]


def check_models(spec, built, data) -> None:
    """Every axis's rules on the model and the first batch (ValueError names the fix)."""
    for a in AXES:
        a.check_model(spec, built, data)


def check_strategy(s) -> None:
    """Every axis's rules on its Strategy fields, in registry order."""
    for a in AXES:
        a.check_strategy(s)
