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


# -- sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", §4.2.2): LayerNorm and dropout work on 1/t of the sequence, so f and g
# become an all-gather along the sequence before a column-parallel layer (reduce-scatter of
# its gradient) and a reduce-scatter after a row-parallel layer (all-gather of its gradient).
# Same bytes on the wire as the all-reduce they replace; 1/t of the activations kept.
SEQ_DIM = 1          # activations are (batch, sequence, features)


def _gather_seq(x: torch.Tensor, group, name: str) -> torch.Tensor:
    size = torch.distributed.get_world_size(group)
    local = x.movedim(SEQ_DIM, 0).contiguous()
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, local, group=group, name=name)
    return out.movedim(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group, name: str) -> torch.Tensor:
    size = torch.distributed.get_world_size(group)
    whole = x.movedim(SEQ_DIM, 0).contiguous()
    out = torch.empty((whole.shape[0] // size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, whole, group=group, name=name)
    return out.movedim(0, SEQ_DIM).contiguous()


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if x.shape[SEQ_DIM] % size:
        raise ValueError(f"sequence parallelism splits the sequence ({x.shape[SEQ_DIM]} tokens) over tp={size} "
                         f"ranks; use a block_size that is a multiple of {size}")
    return x.chunk(size, dim=SEQ_DIM)[rank].contiguous()


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's slice of the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, f"sp gather grad {ctx.name}"), None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather the sequence forward; backward, reduce-scatter the gradient when the consumer
    is tensor-parallel (each rank's gradient is partial), or keep this rank's slice when the
    consumer is replicated (every rank computed the same gradient)."""

    @staticmethod
    def forward(ctx, x, group, name, grad_is_partial):
        ctx.group, ctx.name, ctx.partial = group, name, grad_is_partial
        return _gather_seq(x, group, f"sp gather {name}")

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return _reduce_scatter_seq(grad, ctx.group, f"sp reduce-scatter grad {ctx.name}"), None, None, None
        return _split_seq(grad, ctx.group), None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sum the partial outputs and keep this rank's slice of the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return _reduce_scatter_seq(x, group, f"sp reduce-scatter {name}")

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, f"sp gather grad {ctx.name}"), None, None


def scatter_to_sequence_parallel(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """Enter the sequence-parallel region: this rank's 1/t of the sequence (no message forward)."""
    return _ScatterToSequenceParallel.apply(x, group, name)


def gather_from_sequence_parallel(x: torch.Tensor, group, name: str = "", grad_is_partial: bool = True):
    """The whole sequence from every rank's slice (replaces f in front of a column-parallel layer)."""
    return _GatherFromSequenceParallel.apply(x, group, name, grad_is_partial)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """Partial outputs summed, this rank's slice of the sequence kept (replaces g after row-parallel)."""
    return _ReduceScatterToSequenceParallel.apply(x, group, name)


class _GatherFromTensorParallel(torch.autograd.Function):
    """Every rank's slice of the last dim, concatenated forward (Megatron's ``gather_output``);
    backward keeps this rank's slice: the consumer is replicated, so every rank holds the
    same whole gradient."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group = group
        size = torch.distributed.get_world_size(group)
        local = x.movedim(-1, 0).contiguous()
        out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather(out, local, group=group, name=f"tp gather output {name}")
        return out.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        size, rank = torch.distributed.get_world_size(ctx.group), torch.distributed.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None, None


def gather_from_tensor_parallel(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """The whole last dim from every rank's slice (after a column-parallel head, as Hugging
    Face's ``colwise_gather_output`` and DTensor's ``ColwiseParallel(output_layouts=Replicate())``)."""
    return _GatherFromTensorParallel.apply(x, group, name)


def all_reduce_grad(group, name: str):
    """A tensor hook that sums a replicated parameter's gradient over tp: inside the sequence
    region each rank sees 1/t of the tokens, so its LayerNorm gradient is partial (Megatron
    all-reduces these "sequence_parallel" parameters' gradients after backward)."""
    def hook(grad):
        return _all_reduce(grad.clone(), group, f"sp grad {name}")
    return hook
