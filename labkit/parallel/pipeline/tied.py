"""Tied weights across pipeline stages: the embedding group (Megatron-LM).

A GPT's LM head reuses the token embedding's weight (Press & Wolf 2017). Split into
pipeline stages, the embedding lives on the first stage and the head on the last, so the
one Parameter becomes two copies on two ranks. Both start equal (the whole model is built
under the seed on every rank); they stay equal if each copy steps with the *sum* of the two
gradients — the gradient the single process accumulates into its one tensor. Megatron does
this after the dp reduction, over an "embedding group" made of the first and last pipeline
rank (``megatron/core/distributed/finalize_model_grads.py``, ``_allreduce_embedding_grads``).
labkit does the same through :mod:`labkit.comm`, so the all-reduce is on the timeline.

When one rank holds both stages (ZB-V's rank 0 holds the first and the last), the copies
are one Parameter again and autograd sums the gradients itself: no message.
"""
from __future__ import annotations

import torch
from torch import nn

from ... import comm
from .modules import unit_parameters


def tied_across_stages(full: nn.Module, blocks: list[range]) -> list[str]:
    """Names (in the first stage) of parameters that the first and the last stage share."""
    if len(blocks) < 2:
        return []
    per_unit = unit_parameters(full)
    first: dict[int, str] = {}
    for i in blocks[0]:
        for name, p in per_unit[i]:
            first.setdefault(id(p), name)
    last = {id(p) for i in blocks[-1] for _, p in per_unit[i]}
    return [name for key, name in first.items() if key in last]


class TiedGradSync:
    """Sums the tied copies' gradients over the embedding group, after the dp reduction."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group):
        self.params, self.group = params, group

    def finish(self) -> None:
        for name, p in self.params:
            if p.grad is None:           # this micro-batch set never reached the copy
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, group=self.group, name=f"embedding grad {name}")


def build_tied_sync(full: nn.Module, blocks: list[range], held: list[int], groups) -> TiedGradSync | None:
    """The embedding group's sync for this rank, or None (nothing tied, or both copies here).

    ``held``: the global stages this rank holds. The group is the first and last pipeline
    rank (:meth:`labkit.grid.ParallelDims.embedding_groups`).
    """
    names = tied_across_stages(full, blocks)
    last = len(blocks) - 1
    if not names or (0 in held) == (last in held):      # no copy here, or both
        return None
    if groups.embedding is None:
        raise RuntimeError("a tied weight spans the first and last stage, but this rank has no embedding "
                           "group; the stage placement must put them on the first and last pipeline rank")
    params = dict(full.named_parameters(remove_duplicate=False))
    return TiedGradSync([(n, params[n]) for n in names], groups.embedding)
