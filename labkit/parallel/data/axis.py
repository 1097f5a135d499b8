"""The data-parallel axis (:mod:`labkit.parallel.axes`): ``dp``, ``dp_mode``, ``bucket_mb``,
``compression``, ``error_feedback`` and ``sync_batchnorm``.
"""
from __future__ import annotations

from . import check_strategy  # noqa: F401  (the axis's strategy rule)

NAME = "dp"
TAKES_RANKS = True


def check_model(spec, built, data) -> None:
    pass               # any model averages its gradients


def groups(dims) -> list:
    return [("dp", dims.dp_groups())]


def shape_model(model, spec, groups):
    """Batch norm over the whole global batch when the strategy asks (``sync_batchnorm``,
    :mod:`.batchnorm`); otherwise the model as it is."""
    s = spec.strategy
    if s.sync_batchnorm and s.dp > 1:
        from .batchnorm import build_sync_batchnorm
        build_sync_batchnorm(model, groups.dp)
    return model


def shape_data(data, spec, groups):
    return data        # the executor takes this rank's rows of the global batch (executor.global_batch)


def wrap_sync(sync, s, groups, stage):
    """The stage's gradient average in ``dp_mode`` (zero > 0: the zero axis shards instead)."""
    if s.zero:
        return sync
    from .sync import build_grad_sync
    return build_grad_sync(s.dp_mode, stage.group, stage.size if stage.has_grads else 1, s.bucket_mb,
                           s.compression, s.error_feedback)
