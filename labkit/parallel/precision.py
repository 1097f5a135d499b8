"""Mixed precision: compute in bf16 or fp16, keep fp32 master weights, scale fp16's loss.

``Strategy(precision="fp32" | "bf16" | "fp16")``. The executor asks one object, built once
per job by :func:`build_precision`, three things, whatever the other axes do:

* ``autocast()`` around each forward (and its loss): matmuls and convolutions run in the low
  precision, reductions and the loss stay in fp32 (torch's autocast op lists). The parameters
  stay fp32 (the "master weights" of Micikevicius et al. 2018, "Mixed Precision Training",
  arXiv 1710.03740): autocast casts a copy per forward, so the optimizer updates fp32 values
  and small updates are not rounded away. Backward runs outside autocast, as torch advises;
  its ops follow the dtypes the forward chose. Activations between pipeline stages travel in
  the dtype the stage produced (bf16/fp16: half the bytes of fp32).
* ``scale(loss)``: fp16 has 5 exponent bits, so small gradients underflow to zero. Dynamic
  loss scaling (Micikevicius et al. §3.2) multiplies the loss by S before backward, divides
  the gradients by S before the step, skips a step whose gradients overflowed and halves S,
  and doubles S after ``growth_interval`` clean steps. bf16 has fp32's exponent range and
  needs no scaling.
* ``step(optimizer)``: unscale, step unless an inf/NaN was found, update S. With pipeline
  stages each rank holds different gradients, so one rank's overflow must skip the step on
  every rank or the stages drift apart: torch's ``ShardedGradScaler`` (its GradScaler for
  sharded/model-parallel training) all-reduces the found-inf flag over the world group before
  deciding, the same agreement Megatron makes over its model-parallel group.

Data parallelism needs nothing more: the dp sync averages the scaled gradients (scaling is
linear), and every replica sees the same overflow after the average.

    >>> p = build_precision("bf16", torch.device("cpu"))
    >>> with p.autocast():
    ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    >>> y.dtype
    torch.bfloat16
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from . import PRECISIONS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_device(precision: str, device: torch.device) -> None:
    """ValueError naming the fix unless ``device`` can autocast to ``precision``."""
    if precision == "fp32":
        return
    dtype, kind = DTYPES[precision], device.type
    ok = torch.amp.is_autocast_available(kind)
    if ok and kind == "cuda" and precision == "bf16":
        ok = torch.cuda.is_bf16_supported()
    if ok:
        try:                     # the device may list autocast yet lack the dtype's kernels
            with torch.autocast(kind, dtype=dtype):
                ok = (torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)).dtype == dtype
        except (RuntimeError, NotImplementedError):
            ok = False
    if not ok:
        other = "bf16" if precision == "fp16" else "fp16"
        raise ValueError(f"Strategy.precision={precision!r}: device {kind!r} cannot compute in {precision} "
                         f"under autocast; use precision='fp32', or {other!r}, or engines on a device "
                         f"that supports {precision}")


class Precision:
    """What the executor calls around forward, loss and optimizer step (see the module doc)."""

    def __init__(self, name: str, device: torch.device, group=None):
        self.name, self.device = name, device
        self.dtype = DTYPES.get(name)
        self.scaler = None
        if name == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            self.scaler = ShardedGradScaler(device=device.type, process_group=group)
            # The scale is made on the first scale() call, which only the last pipeline stage
            # makes: make it now on every rank, so every rank can unscale and agree.
            self.scaler.scale(torch.zeros((), device=device))

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from: times the current scale for fp16, else itself."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self, optimizer) -> dict:
        """Step ``optimizer`` (unscaled, skipped on overflow for fp16); what happened, for the run."""
        if self.scaler is None:
            optimizer.step()
            return {}
        scale = self.scaler.get_scale()
        self.scaler.unscale_(optimizer)          # agrees on found-inf over the group
        self.scaler.step(optimizer)              # skipped when any rank overflowed
        self.scaler.update()
        return {"skipped": self.scaler.get_scale() < scale, "loss_scale": scale}


def build_precision(name: str, device: torch.device, group=None) -> Precision:
    """The job's precision policy; ValueError (naming the fix) on a device without it.

    ``group``: where fp16's overflow flag is agreed (None: the world group, every rank).
    """
    if name not in PRECISIONS:
        raise ValueError(f"Strategy.precision={name!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}")
    check_device(name, device)
    return Precision(name, device, group)
