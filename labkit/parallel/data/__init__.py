"""Data parallelism: gradients averaged over the dp group, four ways (see :mod:`.sync`).

This file owns the dp axis's settings and their rule: :func:`check_strategy` is what
``Strategy`` calls for ``dp_mode``, ``bucket_mb``, ``compression``, ``error_feedback`` and
``sync_batchnorm``.
It imports nothing heavy, so a notebook can validate a strategy without torch.distributed.
:func:`sync_fault` plants a fault in the gradient average on purpose (:mod:`.faults`).
"""
from __future__ import annotations

from .faults import SyncFault, sync_fault  # noqa: F401  (the public fault hook)

DP_MODES = ("naive", "bucketed", "overlap", "ddp")
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "powersgd")

# Buckets from 1 KiB (one per small tensor) to 1 TiB (everything in one): outside that range a
# value is a typo (1e-9, 2**70), and inf would make the bucket arithmetic meaningless.
BUCKET_MB_RANGE = (2 ** -10, 2 ** 20)


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible dp setting."""
    low, high = BUCKET_MB_RANGE
    if isinstance(s.bucket_mb, bool) or not isinstance(s.bucket_mb, (int, float)) or not low <= s.bucket_mb <= high:
        raise ValueError(f"Strategy.bucket_mb={s.bucket_mb!r} must be a number of MiB from 1/1024 (1 KiB) to "
                         "2**20 (1 TiB), e.g. 1.0 (DDP uses 25)")
    for name in ("error_feedback", "sync_batchnorm"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"Strategy.{name}={getattr(s, name)!r} must be True or False")
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


def fill_buckets(items: list, size_of, bucket_bytes: float) -> list[list]:
    """``items`` in registration order → buckets in the order gradients arrive: backward runs
    from the last layer to the first, so buckets fill in reverse order (as DDP's do), each
    closing once it reaches ``bucket_bytes``. Pure, so the planner replays the same buckets."""
    buckets, current, size = [], [], 0
    for item in reversed(items):
        current.append(item)
        size += size_of(item)
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
