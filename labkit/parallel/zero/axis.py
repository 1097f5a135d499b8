"""The sharding axis (:mod:`labkit.parallel.axes`): ``zero``, ``zero_mode``, ``prefetch`` and
``dp_shard``. It takes no ranks of its own: it shards what the dp group holds, and replaces
dp's sync.

HSDP (``dp_shard``; FSDP's ``HYBRID_SHARD``, torchtitan's ``data_parallel_shard_degree``): the
dp ranks are cut into runs of dp_shard consecutive ranks (:meth:`labkit.grid.ParallelDims.dp_runs`),
each run shards one whole copy of the model states, and the runs are replicas of each other:
a shard's gradient is reduce-scattered inside its run and all-reduced across the runs
(:meth:`~labkit.grid.ParallelDims.dp_strides`). With ranks filling nodes in order, a run of
consecutive ranks stays inside a node: the sharding's gathers on the fast link, one all-reduce
of 1/dp_shard of the gradients on the slow one.
"""
from __future__ import annotations

from . import check_model as _check_model
from . import check_strategy as _check_zero

NAME = "zero"
TAKES_RANKS = False


def check_strategy(s) -> None:
    """zero's rules (:func:`labkit.parallel.zero.check_strategy`), then HSDP's."""
    _check_zero(s)
    check_hsdp(s)


def check_hsdp(s) -> None:
    """Raise ValueError naming ``dp_shard`` and the fix where HSDP cannot be laid out."""
    k = s.dp_shard
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"Strategy.dp_shard={k!r} must be a whole number ≥ 2 (the dp ranks that shard one copy "
                         "together), or None to shard over the whole dp group")
    if s.zero == 0:
        raise ValueError(f"Strategy.dp_shard={k} shards ZeRO's states inside runs of {k} dp ranks, and zero=0 "
                         "shards nothing; use zero=1, 2 or 3, or dp_shard=None")
    if s.dp % k:
        fits = [d for d in range(2, s.dp + 1) if s.dp % d == 0]
        raise ValueError(f"Strategy.dp_shard={k} must divide dp={s.dp}: each run of dp_shard ranks holds one "
                         f"whole copy, sharded; use dp_shard in {fits}, or dp a multiple of {k}")
    for name in ("cp", "ep"):
        if getattr(s, name) > 1:
            raise ValueError(f"Strategy.dp_shard={k} with {name}={getattr(s, name)}: HSDP is built over the dp "
                             f"group alone here; use {name}=1, or dp_shard=None")


def check_model(spec, built, data) -> None:
    _check_model(spec.strategy, built, spec.blocks)


def groups(dims) -> list:
    return []


def shape_model(model, spec, groups):
    return model


def shape_data(data, spec, groups):
    return data


def wrap_sync(sync, s, groups, stage):
    """ZeRO-1/2/3 by hand, or torch's FSDP2, over the stage's averaging group (zero = 0: dp's
    sync); under HSDP over this rank's run of dp_shard ranks, its shards replicated across runs."""
    if not s.zero:
        return sync
    from .sync import build_zero_sync
    if s.dp_shard in (None, s.dp):
        return build_zero_sync(s, stage.group, stage.size if stage.has_grads else 1, stage.recorder, stage.path)
    k = s.dp_shard
    # every rank builds both kinds of group, with parameters or not (a collective)
    shard, _ = groups.within("dp_shard", groups.dims.dp_runs(k))
    replicate, _ = groups.within("dp_replicate", groups.dims.dp_strides(k))
    runs = [groups.dp_ranks[i:i + k] for i in range(0, s.dp, k)]       # this dp group's mesh, a run a row
    return build_zero_sync(s, shard, k if stage.has_grads else 1, stage.recorder, stage.path, (replicate, runs))
