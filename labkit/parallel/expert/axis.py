"""The expert-parallel axis (:mod:`labkit.parallel.axes`): ``ep`` and ``ep_overlap``. It takes
no ranks of its own: the experts are spread over runs of ep consecutive dp ranks, whose groups
are built on first use (:meth:`labkit.engine.grid.ProcessGroups.expert`).
"""
from __future__ import annotations

from . import check_model as _check_model
from . import check_strategy  # noqa: F401  (the axis's strategy rule)

NAME = "ep"
TAKES_RANKS = False


def check_model(spec, built, data) -> None:
    _check_model(spec.strategy, built)


def groups(dims) -> list:
    return []          # ep's groups depend on ep, not on the grid: built on first use


def shape_model(model, spec, groups):
    """Each MoE layer keeps this rank's experts and routes tokens to them by all-to-all."""
    s = spec.strategy
    if s.ep == 1:
        return model
    from .dispatch import build_expert_parallel
    return build_expert_parallel(model, groups.expert(s.ep), s.ep, s.ep_overlap, groups.tp if s.tp > 1 else None)


def shape_data(data, spec, groups):
    return data


def wrap_sync(sync, s, groups, stage):
    """The experts averaged over their own replicas, the rest by the dp/zero sync; with
    ZeRO-1/2 the experts' shards cut over every rank holding them."""
    if s.ep == 1:
        return sync
    from .dispatch import ExpertSync
    experts = groups.expert(s.ep)
    sharded = None
    if s.zero and stage.has_grads:
        from ..zero.sync import Zero1Sync, Zero2Sync
        kind = Zero2Sync if s.zero == 2 else Zero1Sync
        sharded = kind(experts.replicas, len(experts.replica_ranks), s.bucket_mb, stage.recorder)
    return ExpertSync(sync, experts, stage.size, sharded, groups.cp if s.cp > 1 else None)
