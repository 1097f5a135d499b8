"""Column- and row-parallel Linear and a vocab-parallel Embedding, each built from a whole
module that was initialised under the run's seed, then split — so a tp run starts from the
very weights of the single-process run and stays equal to it.

For ``y = x Wᵀ + b`` with ``W`` of shape (out, in) and ``t`` tp ranks (Megatron-LM §3):

* **column-parallel** keeps rows ``out/t`` of ``W`` (and of ``b``): each rank computes its
  slice of the output features from the whole input (f in front: the input's gradient is
  summed over ranks);
* **row-parallel** keeps columns ``in/t`` of ``W``: each rank multiplies its slice of the
  input features, the partial outputs are summed (g), then ``b`` is added once.

A column-parallel layer followed by a row-parallel one needs no communication in between;
what sits between them (GELU, or attention over this rank's heads) works on local features.

Parameters keep the names ``weight`` and ``bias``, so the model's state_dict keys do not
change; :func:`labkit.parallel.tensor.full_state_dict` gathers the shards back.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .mappings import (all_reduce_grad, copy_to_tensor_parallel, gather_from_sequence_parallel,
                       gather_from_tensor_parallel, reduce_from_tensor_parallel,
                       reduce_scatter_to_sequence_parallel)


def _shard(t: torch.Tensor | None, dim: int, rank: int, size: int) -> nn.Parameter | None:
    """Chunk ``rank`` of ``t`` along ``dim``; a tensor materialised as that chunk already
    (``labkit_shard``, :mod:`labkit.parallel.materialize`) is taken as it is."""
    if t is None:
        return None
    if getattr(t, "labkit_shard", None) == (dim, rank, size):
        return _whole(t)
    return nn.Parameter(t.detach().chunk(size, dim=dim)[rank].clone(), requires_grad=t.requires_grad)


def _whole(t: torch.Tensor) -> nn.Parameter:
    """A copy of a parameter kept whole on every tp rank; one materialised per rank
    (:mod:`labkit.parallel.materialize`, a ZeRO-3 carrier without values of its own) is
    taken as it is, its tags kept."""
    if not any(hasattr(t, tag) for tag in ("labkit_shard", "labkit_piece")):
        return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
    out = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
    for tag in ("labkit_shard", "labkit_piece"):
        if hasattr(t, tag):
            setattr(out, tag, getattr(t, tag))
    return out


class ColumnParallelLinear(nn.Module):
    """Rows ``rank``/``size`` of a Linear's weight and bias; output features stay split.
    With ``sequence_parallel`` the input arrives as a slice of the sequence and is gathered."""

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, linear: nn.Linear, group, rank: int, size: int, name: str = "",
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.name, self.sequence_parallel = group, name, sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features // size
        self.weight = _shard(linear.weight, 0, rank, size)
        self.bias = _shard(linear.bias, 0, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.group, self.name)
        else:
            x = copy_to_tensor_parallel(x, self.group, self.name)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local), name={self.name!r}"


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel Linear whose output is gathered whole on every rank (Megatron's
    ``gather_output=True``): a vocabulary-split head in front of a replicated loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_tensor_parallel(super().forward(x), self.group, self.name)


class RowParallelLinear(nn.Module):
    """Columns ``rank``/``size`` of a Linear's weight; the partial outputs are summed, then the
    (replicated) bias is added once. With ``sequence_parallel`` the sum is a reduce-scatter
    along the sequence, and the bias, added to a slice of it, has its gradient summed over tp."""

    shard_dims = {"weight": 1}

    def __init__(self, linear: nn.Linear, group, rank: int, size: int, name: str = "",
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.name, self.sequence_parallel = group, name, sequence_parallel
        self.in_features, self.out_features = linear.in_features // size, linear.out_features
        self.weight = _shard(linear.weight, 1, rank, size)
        self.bias = None if linear.bias is None else _whole(linear.bias)
        if sequence_parallel and self.bias is not None:
            self.bias.register_hook(all_reduce_grad(group, f"{name}.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        y = reduce(F.linear(x, self.weight), self.group, self.name)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, name={self.name!r}"


class VocabParallelEmbedding(nn.Module):
    """Rows ``rank``/``size`` of an embedding table (a slice of the vocabulary): ids outside
    this rank's slice look up zeros, and g sums the ranks' lookups (Megatron's
    ``VocabParallelEmbedding``; DTensor's ``RowwiseParallel`` on an ``nn.Embedding``)."""

    shard_dims = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, group, rank: int, size: int, name: str = "",
                 sequence_parallel: bool = False):
        super().__init__()
        if sequence_parallel:
            raise ValueError("Strategy.sequence_parallel with a vocab-parallel embedding is not built; "
                             "leave the embedding out of tp_plan or switch sequence_parallel off")
        self.group, self.name = group, name
        rows = embedding.num_embeddings // size
        self.start, self.end = rank * rows, (rank + 1) * rows
        self.weight = _shard(embedding.weight, 0, rank, size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.group, self.name)

    def extra_repr(self) -> str:
        return f"vocabulary [{self.start}, {self.end}) of {self.weight.shape}, name={self.name!r}"


MEGATRON_LAYERS = {(nn.Linear, "colwise"): ColumnParallelLinear, (nn.Linear, "rowwise"): RowParallelLinear,
                   (nn.Linear, "colwise_gather_output"): GatheredColumnParallelLinear,
                   (nn.Embedding, "rowwise"): VocabParallelEmbedding}
"""(module type, plan style) → the layer that replaces it in megatron mode."""
