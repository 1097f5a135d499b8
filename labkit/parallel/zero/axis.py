"""The sharding axis (:mod:`labkit.parallel.axes`): ``zero``, ``zero_mode`` and ``prefetch``.
It takes no ranks of its own: it shards what the dp group holds, and replaces dp's sync.
"""
from __future__ import annotations

from . import check_model as _check_model
from . import check_strategy  # noqa: F401  (the axis's strategy rule)

NAME = "zero"
TAKES_RANKS = False


def check_model(spec, built, data) -> None:
    _check_model(spec.strategy, built, spec.blocks)


def groups(dims) -> list:
    return []


def shape_model(model, spec, groups):
    return model


def shape_data(data, spec, groups):
    return data


def wrap_sync(sync, s, groups, stage):
    """ZeRO-1/2/3 by hand, or torch's FSDP2, over the stage's averaging group (zero = 0: dp's sync)."""
    if not s.zero:
        return sync
    from .sync import build_zero_sync
    return build_zero_sync(s, stage.group, stage.size if stage.has_grads else 1, stage.recorder, stage.path)
