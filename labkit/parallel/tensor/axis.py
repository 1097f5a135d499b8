"""The tensor-parallel axis's own settings and rule (what ``Strategy`` calls for ``tp``,
``tp_mode`` and ``sequence_parallel``). It imports nothing heavy, so a notebook validates a
strategy without torch.distributed; the checks that need the model (heads, widths, the plan)
are :func:`labkit.parallel.tensor.plan.check_tensor_parallel`, called by the run driver
before any engine is touched.
"""
from __future__ import annotations

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
