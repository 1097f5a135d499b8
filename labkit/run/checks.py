"""Checks on a run's arguments and model, in the notebook, before any engine is called.

``runner.validate`` calls these; each raises ValueError naming the argument and the fix, or
warns where the run would work but silently differ from one process.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable

import torch
from torch import nn


def check_number(name: str, value, rule: str, ok: Callable[[float], bool]) -> None:
    """``value`` must be a finite real number (not a bool, not a string) satisfying ``ok``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r} must be a finite number {rule}")


def check_profile(profile) -> None:
    """``lab.run(profile=...)``: False, True (a new temporary folder) or a folder's path."""
    if not isinstance(profile, (bool, str, os.PathLike)):
        raise TypeError(f"profile={profile!r} must be True, False or a folder to save the traces in "
                        f"(profile='traces/')")
    if not isinstance(profile, bool) and os.path.isfile(profile):
        raise ValueError(f"profile={str(profile)!r} is a file; name a folder for the per-rank traces")


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


# -- the loss contract (checked in the notebook on the first batch) ------------------------------
def check_loss(loss: Callable, model: nn.Module, data: Callable, batch: int) -> None:
    """A user's ``loss(output, target)`` must return a scalar tensor that is the MEAN over the
    rows it is given: labkit averages it over dp replicas and micro-batches, which is one
    process's loss only for a mean. Checked on the first batch's targets and the model's
    output shapes (the model runs on the meta device: no weights, nothing written): the loss
    of two rows must equal the loss of those rows given twice. A sum doubles: refused."""
    from ..training import TokenLoss
    if isinstance(loss, TokenLoss) or not callable(loss):
        return
    sample = _sample_outputs(model, data, batch)
    if sample is None:                  # outputs labkit cannot make: the engines check the type
        return
    out, twice, y = sample
    try:
        once_value, twice_value = loss(out, y), loss(twice, torch.cat([y, y]))
    except Exception:                   # the real run reports the loss's own error, with its step
        return
    for value in (once_value, twice_value):
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                f"a {type(value).__name__}"
            raise TypeError(f"loss: returned {what} on the first batch, not a scalar tensor; return the mean over "
                            "the rows as a tensor, e.g. ((o - y) ** 2).mean() (not .item() or float(...))")
    a, b = float(once_value), float(twice_value)
    if not (math.isfinite(a) and math.isfinite(b)) or abs(a) < 1e-12:
        return
    if abs(b - 2 * a) <= 1e-4 * abs(a):
        raise ValueError("loss: it doubles when the batch is given twice, so it is a SUM over the rows; labkit "
                         "averages the loss over dp replicas and micro-batches, which matches one process only "
                         "for a mean: end it with .mean() (or reduction=\"mean\"), or, for tokens with padding, "
                         "use labkit.losses.token_loss")
    if abs(b - a) > 1e-4 * abs(a):
        warnings.warn(f"loss: the loss of a batch given twice is {b / a:.3g}× the batch's own, so it is not a mean "
                      "over the rows; under dp or micro-batches the run departs from one process (return a "
                      "mean over the rows to match it)", UserWarning, stacklevel=3)


def _sample_outputs(model: nn.Module, data: Callable, batch: int):
    """(random outputs of two rows, the same rows twice, their targets) shaped by the model's
    forward on the meta device, or None where that cannot be done."""
    from torch.func import functional_call
    try:
        x, y = data(0)
        rows = min(2, batch)
        x2 = {k: v[:rows] for k, v in x.items()} if isinstance(x, dict) else x[:rows]
        y = y[:rows]
        meta = {k: torch.empty_like(v, device="meta")
                for k, v in [*model.named_parameters(), *model.named_buffers()]}
        on_meta = {k: v.to("meta") for k, v in x2.items()} if isinstance(x2, dict) else x2.to("meta")
        with torch.no_grad():
            out = functional_call(model, meta, (on_meta,), strict=False, tie_weights=True)
        g = torch.Generator().manual_seed(0)
        once, twice = _made(out, rows, g, once=True), None
        g.manual_seed(0)
        twice = _made(out, rows, g, once=False)
        return once, twice, y
    except Exception:                # data-dependent code, an output kind not handled: not checked
        return None


def _made(out, rows: int, g: torch.Generator, once: bool):
    """``out`` (meta) with random values; ``once=False``: each tensor's rows given twice. A
    tensor, a tuple/list or a dict (Hugging Face's outputs are dicts) of them; tensors whose
    first dim is not the rows (a scalar aux loss) are made alike in both."""
    if isinstance(out, torch.Tensor):
        made = torch.randn(out.shape, generator=g).to(out.dtype) if out.is_floating_point() else \
            torch.zeros(out.shape, dtype=out.dtype)
        if out.dim() and out.shape[0] == rows and not once:
            made = torch.cat([made, made])
        return made
    if isinstance(out, (tuple, list)) and out:
        return type(out)(_made(o, rows, g, once) for o in out)
    if isinstance(out, dict) and out:
        return type(out)(**{k: _made(v, rows, g, once) for k, v in out.items()})
    raise TypeError(f"cannot make an output like {type(out).__name__}")


def warn_dropout(model: nn.Module, strategy) -> None:
    """Dropout draws its masks from each rank's generator, per replica and per micro-batch, so
    a split run zeroes other activations than one process does: same data, other model."""
    drops = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    split = strategy.dp * strategy.pp * strategy.tp * strategy.microbatches > 1
    if drops and split:
        warnings.warn(f"the model has {len(drops)} dropout layer(s) with p > 0 ({', '.join(drops[:3])}"
                      f"{', …' if len(drops) > 3 else ''}): each rank draws its own masks for its rows, so the run "
                      "departs from one process by the masks alone; set their p to 0 to compare parameters "
                      "with labkit.reference", UserWarning, stacklevel=4)
