"""The tensor-parallel axis (:mod:`labkit.parallel.axes`): ``tp``, ``tp_mode`` and
``sequence_parallel``. It imports nothing heavy at import, so a notebook validates a strategy
without torch.distributed; the checks that need the model (heads, widths, the plan) are
:func:`labkit.parallel.tensor.plan.check_tensor_parallel`, run by :func:`check_model` before any
engine is touched.
"""
from __future__ import annotations

NAME = "tp"
TAKES_RANKS = True
TP_MODES = ("megatron", "dtensor")


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible tp setting."""
    if not isinstance(s.sequence_parallel, bool):
        raise ValueError(f"Strategy.sequence_parallel={s.sequence_parallel!r} must be True or False")
    if s.sequence_parallel and s.tp_mode != "megatron":
        raise ValueError("Strategy.sequence_parallel is built for tp_mode='megatron' only; use that mode")
    if s.tp > 1 and s.tp_mode == "dtensor" and s.dp > 1:
        # DTensor parameters carry DTensor gradients; labkit's dp modes flatten plain tensors
        # into buckets. Not built: say so rather than average the wrong thing.
        raise ValueError("Strategy.tp_mode='dtensor' with dp > 1 is not built (DTensor gradients do not go "
                         "into labkit's dp buckets); use tp_mode='megatron' for dp×tp, or dp=1")


def check_model(spec, built, data) -> None:
    """The plan against the model: every planned layer found, its widths and heads split by tp."""
    s = spec.strategy
    if s.tp == 1:
        return
    from .plan import check_tensor_parallel
    plan = spec.tp_plan if spec.tp_plan is not None else getattr(spec.model, "tp_plan", None)
    check_tensor_parallel(s.tp, s.tp_mode, built, plan, s.sequence_parallel, getattr(spec.data, "block_size", None))


def groups(dims) -> list:
    return [("tp", dims.tp_groups())]


def shape_model(model, spec, groups):
    """Split the planned layers over the tp group; ``tp == 1`` leaves the model whole. The
    model holds the seeded whole weights, so every tp rank cuts its shard from the reference's (the plan: ``RunSpec.tp_plan``, else the model's own)."""
    s = spec.strategy
    if s.tp == 1:
        return model
    from . import build_tensor_parallel
    return build_tensor_parallel(model, s.tp_mode, groups.tp, groups.coords[2], s.tp, spec.tp_plan,
                                 sequence_parallel=s.sequence_parallel)


def shape_data(data, spec, groups):
    return data


def wrap_sync(sync, s, groups, stage):
    return sync
