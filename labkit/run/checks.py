"""Checks on a run's arguments and model, in the notebook, before any engine is called.

``runner.validate`` calls these; each raises ValueError naming the argument and the fix, or
warns where the run would work but silently differ from one process.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

from torch import nn


def check_number(name: str, value, rule: str, ok: Callable[[float], bool]) -> None:
    """``value`` must be a finite real number (not a bool, not a string) satisfying ``ok``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r} must be a finite number {rule}")


def check_model(model: nn.Module, strategy) -> None:
    """A model the strategy can train: parameters to train, batch norm said out loud."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters, so there is nothing to train or "
                         "average; give it at least one layer with parameters (e.g. nn.Linear)")
    warn_batch_norm(model, strategy)


def warn_batch_norm(model: nn.Module, strategy) -> None:
    """Batch norm normalises by the statistics of the rows it sees; under data parallelism a
    replica sees 1/dp of the batch, and a micro-batch 1/microbatches of that, so the model
    differs from the single-process one (Ioffe & Szegedy 2015, §3; torch's SyncBatchNorm
    exists for this). ``Strategy(sync_batchnorm=True)`` computes them over all replicas."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    where = f"{len(norms)} BatchNorm layer(s) ({', '.join(norms[:3])}{', …' if len(norms) > 3 else ''})"
    if strategy.dp > 1 and not strategy.sync_batchnorm:
        warnings.warn(f"the model has {where}: with dp={strategy.dp} each replica normalises by its own "
                      f"1/{strategy.dp} of the batch, so the run departs from one process; "
                      "Strategy(sync_batchnorm=True) uses the whole batch's statistics", UserWarning, stacklevel=4)
    if strategy.microbatches > 1:
        warnings.warn(f"the model has {where}: with microbatches={strategy.microbatches} each micro-batch "
                      "is normalised by its own statistics, so the run departs from one process "
                      "(use microbatches=1 to match it)", UserWarning, stacklevel=4)
