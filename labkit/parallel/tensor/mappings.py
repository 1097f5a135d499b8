"""The conjugate pair of tensor parallelism, as autograd functions (Shoeybi et al. 2019,
"Megatron-LM", §3, Figure 3).

* **f** — identity forward, all-reduce backward. It stands where a replicated activation
  enters a column-parallel layer: every rank uses the whole input, so the input's gradient
  is the sum of every rank's partial gradient.
* **g** — all-reduce forward, identity backward. It stands where a row-parallel layer's
  partial outputs leave: each rank holds a partial sum of the output, so they are added; the
  output's gradient is already whole on every rank.

An MLP or an attention layer is then ``f → column-parallel → (local work) → row-parallel → g``:
one all-reduce forward and one backward per pair. Megatron keeps these in
``megatron/core/tensor_parallel/mappings.py`` with thin public wrappers; so does labkit.
Every collective goes through :mod:`labkit.comm`, so it is on the timeline, in the flight
recorder and under the lab's timeout.

>>> y = reduce_from_tensor_parallel(F.linear(copy_to_tensor_parallel(x, group), w_rows), group)
"""
from __future__ import annotations

import torch

from ... import comm


def _all_reduce(x: torch.Tensor, group, name: str) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group=group, name=name)
    return x


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return x.view_as(x)          # a new tensor object, the same storage

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group, f"tp f {ctx.name}"), None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward (partial sums → the whole output), identity backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        # Reduced in place, as Megatron's _reduce does: x is a fresh partial output that
        # nothing else holds (F.linear does not save its output for backward).
        return _all_reduce(x, group, f"tp g {name}")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """f: use ``x`` whole on every tp rank; its gradient is summed over ``group`` in backward."""
    return _CopyToTensorParallel.apply(x, group, name)


def reduce_from_tensor_parallel(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """g: sum the tp ranks' partial outputs ``x`` over ``group`` (consumes ``x``)."""
    return _ReduceFromTensorParallel.apply(x, group, name)
