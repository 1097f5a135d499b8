"""Which tokens a context-parallel rank holds, and the context a cp job installs on its engine.

The sequence of T tokens is cut into 2·cp chunks of T/(2·cp). Balanced (Megatron-LM's
``get_batch_on_this_cp_rank``, Llama 3): rank i holds chunks i and 2·cp − 1 − i. Unbalanced
(the lesson's contrast): rank i holds chunks 2i and 2i + 1, the contiguous slice i·T/cp ….
Either way a rank holds two chunks, and attention works chunk by chunk: query chunk a sees
key chunk b fully when a > b, under the causal mask when a = b, not at all when a < b, so
the work skipped is the work the mask removes.

>>> rank_chunks(0, 4, True), rank_chunks(3, 4, True), rank_chunks(3, 4, False)
((0, 7), (3, 4), (6, 7))
>>> token_index(1, 2, 8, True).tolist()
[2, 3, 4, 5]
"""
from __future__ import annotations

import torch

from . import activate


def rank_chunks(index: int, cp: int, balance: bool) -> tuple[int, int]:
    """The two global chunk ids (of 2·cp) that cp rank ``index`` holds, in order."""
    return (index, 2 * cp - 1 - index) if balance else (2 * index, 2 * index + 1)


def token_index(index: int, cp: int, t: int, balance: bool) -> torch.Tensor:
    """Global positions of the tokens cp rank ``index`` holds in a sequence of ``t``."""
    c = t // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in rank_chunks(index, cp, balance)])


class ContextParallel:
    """This rank's place in its cp ring and how attention crosses it (installed on the engine
    by :func:`labkit.parallel.build.build_job`, read by :func:`labkit.parallel.context.attention`)."""

    def __init__(self, group, ranks: list[int], index: int, mode: str, balance: bool):
        self.group, self.ranks, self.index, self.size = group, ranks, index, len(ranks)
        self.mode, self.balance = mode, balance
        self.chunks = rank_chunks(index, self.size, balance)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def chunks_of(self, index: int) -> tuple[int, int]:
        return rank_chunks(index, self.size, self.balance)

    def positions(self, t: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``t`` tokens (a sequence of t·cp)."""
        return token_index(self.index, self.size, t * self.size, self.balance).to(device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``x`` (batch, sequence, …)."""
        return x[:, token_index(self.index, self.size, x.shape[1], self.balance)]

    def attention(self, q, k, v, causal: bool, scale: float | None = None):
        if self.mode == "ring":
            from .ring import ring_attention
            return ring_attention(q, k, v, causal, self, scale)
        if self.mode == "ulysses":
            from .ulysses import ulysses_attention
            return ulysses_attention(q, k, v, causal, self, scale)
        from .allgather import allgather_attention
        return allgather_attention(q, k, v, causal, self, scale)


class ShardedData:
    """A run's data with every step's inputs and targets cut to this rank's tokens."""

    def __init__(self, data, cp: ContextParallel):
        self.data, self.cp = data, cp
        self.whole_target = None      # the last step's uncut targets: a token loss counts over them

    def __call__(self, step: int):
        x, y = self.data(step)
        self.whole_target = y
        return self.cp.shard(x), self.cp.shard(y)


def build_context_parallel(s, groups, data):
    """Engine side, for a run's job: install this rank's context (cp > 1; none otherwise, so a
    later run computes as one process) and return the data cut to this rank's tokens."""
    activate(None)
    if s.cp == 1:
        return data
    cp = ContextParallel(groups.cp, groups.cp_ranks, groups.cp_index, s.cp_mode, s.cp_balance)
    activate(cp)
    return ShardedData(data, cp)
