"""Data parallelism: gradients averaged over the dp group, four ways (see :mod:`.sync`).

This file owns the dp axis's settings and their rule: :func:`check_strategy` is what
``Strategy`` calls for ``dp_mode``, ``bucket_mb``, ``compression`` and ``error_feedback``.
It imports nothing heavy, so a notebook can validate a strategy without torch.distributed.
"""
from __future__ import annotations

DP_MODES = ("naive", "bucketed", "overlap", "ddp")
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "powersgd")


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible dp setting."""
    if not isinstance(s.bucket_mb, (int, float)) or isinstance(s.bucket_mb, bool) or not s.bucket_mb > 0:
        raise ValueError(f"Strategy.bucket_mb={s.bucket_mb!r} must be a number > 0 (MiB)")
    if not isinstance(s.error_feedback, bool):
        raise ValueError(f"Strategy.error_feedback={s.error_feedback!r} must be True or False")
    c, mode = s.compression, s.dp_mode
    if c != "none" and mode == "naive":
        raise ValueError(f"Strategy.compression={c!r} works per bucket, and dp_mode='naive' has no buckets; "
                         "use dp_mode='bucketed', 'overlap' or 'ddp'")
    if c in ("int8", "fp8_e4m3", "fp8_e5m2") and mode == "ddp":
        raise ValueError(f"Strategy.compression={c!r}: torch has no {c.split('_')[0]} DDP hook; use "
                         f"dp_mode='bucketed' or 'overlap' (labkit's {c}), or compression='fp16'/'bf16'/"
                         "'powersgd' with ddp")
    if c == "powersgd" and mode != "ddp":
        raise ValueError("Strategy.compression='powersgd' is torch's DDP comm hook; use dp_mode='ddp'")
