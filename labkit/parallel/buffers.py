"""Buffers a model's forward writes (an EMA, a counter), found on a job's first step.

Gradients are averaged over dp replicas; buffers are not. The executor copies the model's
buffers before its first step and compares after it; a buffer that changed is warned about
where the strategy makes the run depart from one process (:func:`warn_written_buffers`).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn


def written_buffers(model: nn.Module, before: dict | None = None):
    """With ``before`` None: a copy of ``model``'s buffers (BatchNorm's left out: warned about by
    :func:`labkit.run.checks.warn_batch_norm`). Else: the names of the buffers that differ from ``before``."""
    norms = {name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    now = {name: b for name, b in model.named_buffers()
           if name.rpartition(".")[0] not in norms and isinstance(b, torch.Tensor)}
    if before is None:
        return {name: b.detach().clone() for name, b in now.items()}
    local = {name: getattr(b, "_local_tensor", b).detach() for name, b in now.items()}   # a DTensor: its shard
    return [name for name, b in local.items() if name in before and
            (b.shape != before[name].shape or not torch.equal(b, getattr(before[name], "_local_tensor", before[name])))]


def warn_written_buffers(names: list, strategy) -> None:
    """A buffer the forward writes (an EMA, a counter) is updated from the rows a forward sees:
    under dp each replica updates its own copy from its 1/dp of the batch (the copies drift
    apart; gradients are averaged, buffers are not), and with micro-batches it is updated once
    per micro-batch instead of once per step. Either way the run departs from one process."""
    recompute = getattr(strategy, "recompute", "none") != "none"
    if not names or (strategy.dp == 1 and strategy.microbatches == 1 and not recompute):
        return
    where = f"{len(names)} buffer(s) ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
    why = []
    if strategy.dp > 1:
        why.append(f"with dp={strategy.dp} each replica updates its own copy from its 1/{strategy.dp} of the "
                   "batch (gradients are averaged, buffers are not)")
    if strategy.microbatches > 1:
        why.append(f"with microbatches={strategy.microbatches} they are updated once per micro-batch, not "
                   "once per step")
    if recompute:
        why.append(f"with recompute={strategy.recompute!r} the forward runs again in backward and updates "
                   "them again")
    warnings.warn(f"the model's forward writes {where}: {'; '.join(why)}, so the run departs from one "
                  "process; keep state out of forward, sync it yourself (all-reduce it over the dp group "
                  "after the step), or accept the departure (dp=1, microbatches=1 and no recompute match exactly)",
                  UserWarning, stacklevel=2)
