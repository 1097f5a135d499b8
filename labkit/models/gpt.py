"""A nanoGPT-shaped decoder as an ``nn.Sequential`` of blocks, with its tensor-parallel plan.

The blocks, top to bottom (pipelines split a model by its top-level blocks):

* ``0``: :class:`Embedding` — token + position embedding (``wte``, ``wpe``);
* ``1`` … ``n_layer``: :class:`Block` — pre-LN causal self-attention then a 4× MLP, each with
  a residual connection (GPT-2, Radford et al. 2019; nanoGPT's ``model.py``);
* ``n_layer + 1``: :class:`Head` — final LayerNorm and the LM head, whose weight *is* the
  token embedding's when ``tie=True`` (Press & Wolf 2017, "Using the Output Embedding").

The tensor-parallel plan uses DTensor's convention (glob keys over module names, ``*``
matching one name): ``nn.Sequential`` names its blocks ``0``, ``1``, …, so the keys start
with ``*`` — they match only the transformer blocks, the only ones with an ``attn`` and an
``mlp``::

    {"*.attn.qkv": "colwise", "*.attn.proj": "rowwise",
     "*.mlp.fc": "colwise", "*.mlp.proj": "rowwise"}

That is Megatron's split (Shoeybi et al. 2019, §3): heads across ranks (QKV by columns, the
output projection by rows) and the MLP's hidden dimension (fc by columns, proj by rows), two
all-reduces forward and two backward per layer.

>>> make = gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
>>> model = make(); len(model)        # embedding, 2 blocks, head
4
>>> model(torch.zeros(3, 16, dtype=torch.long)).shape
torch.Size([3, 16, 50])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from .. import attention as context     # the attention hook cp takes over (labkit.parallel.context)

TP_PLAN = {"*.attn.qkv": "colwise", "*.attn.proj": "rowwise", "*.mlp.fc": "colwise", "*.mlp.proj": "rowwise"}
# Sequence parallelism (optional): where the residual stream is cut along the sequence (after
# the embedding), which modules work on a slice of it (the LayerNorms), where it is whole again
# (the LM head's input). See labkit.parallel.tensor.
SP_PLAN = {"0": "scatter_output", "*.ln_1": "sequence", "*.ln_2": "sequence", "*.ln_f": "sequence",
           "*.lm_head": "gather_input"}


class Embedding(nn.Module):
    """Token + learned position embedding (block 0)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than gpt.block_size={self.block_size}; "
                             f"use data with block_size ≤ {self.block_size} or a gpt with block_size ≥ {t}")
        pos = context.positions(t, idx.device)     # arange(t), or this rank's slices under cp
        return self.drop(self.wte(idx) + self.wpe(pos))


class AttentionCore(nn.Module):
    """scores → causal softmax → dropout → @V: the parameter-free region that selective
    recomputation checkpoints (Korthikanti et al. 2022, §4: it holds the 5·a·s²·b bytes of
    activations per layer but costs few FLOPs to redo)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.drop = nn.Dropout(dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if context.active():      # cp: this rank holds slices of the sequence; keys come from the others
            if self.drop.p and self.training:
                raise ValueError(f"gpt(dropout={self.drop.p}) under context parallelism: attention across "
                                 "ranks has no attention dropout; use dropout=0.0, or cp=1")
            return context.attention(q, k, v, causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        probs = self.drop(scores.masked_fill(future, float("-inf")).softmax(dim=-1))
        return probs @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` Linear and a ``proj`` Linear.

    ``qkv``'s output features are laid out head by head — ``[h0: q k v | h1: q k v | …]`` — as
    Megatron's fused QKV is (``ParallelAttention``: view to ``(np, 3·hn)``, then split), so a
    column split of ``qkv`` hands each tensor-parallel rank whole heads, and the reshape
    ``view(B, T, -1, 3·head_dim)`` finds however many heads this rank holds.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.core = AttentionCore(dropout)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]         # t: the whole sequence, even when x held a slice of it (SP)
        qkv = qkv.view(b, t, -1, 3 * self.head_dim)                  # -1: the heads this rank holds
        q, k, v = (part.transpose(1, 2) for part in qkv.split(self.head_dim, dim=-1))   # (B, h, T, hd)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """Linear to 4·n_embd, GELU, Linear back (``fc`` then ``proj``)."""

    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and the LM head: (B, T, n_embd) → logits (B, T, vocab_size)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPTModel(nn.Sequential):
    """The built model: an ``nn.Sequential`` that carries its ``tp_plan`` and ``sp_plan``."""

    tp_plan = TP_PLAN
    sp_plan = SP_PLAN


@dataclass(frozen=True)
class GPT:
    """A factory for :class:`GPTModel`; ``lab.run`` calls it on every engine under the seed."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 128
    tie: bool = True
    """The LM head reuses the token embedding's weight (one Parameter, two modules)."""
    dropout: float = 0.0
    """0 by default: dropout draws random numbers, so a run equals the reference only without it."""
    bias: bool = True

    tp_plan = TP_PLAN
    """Which Linear layers tensor parallelism splits, and how (see the module docstring)."""
    sp_plan = SP_PLAN
    """Where sequence parallelism cuts and joins the sequence (with tp_plan, megatron mode)."""

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"gpt: {name}={value!r} must be a whole number ≥ 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"gpt: n_embd={self.n_embd} does not divide into n_head={self.n_head} heads; "
                             f"use n_embd a multiple of {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"gpt: dropout={self.dropout!r} must be in [0, 1)")

    def __call__(self) -> GPTModel:
        blocks = [Embedding(self.vocab_size, self.block_size, self.n_embd, self.dropout)]
        blocks += [Block(self.n_embd, self.n_head, self.dropout, self.bias) for _ in range(self.n_layer)]
        blocks.append(Head(self.n_embd, self.vocab_size, self.bias))
        model = GPTModel(*blocks)
        model.apply(self._init)
        for block in model[1:-1]:       # GPT-2: residual projections scaled by 1/sqrt(2·n_layer)
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.n_layer))
        if self.tie:
            model[-1].lm_head.weight = model[0].wte.weight
        return model

    @staticmethod
    def _init(module: nn.Module) -> None:
        """nanoGPT's initialisation: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def check_data(self, data) -> None:
        """Raise ValueError (naming the field and the fix) unless ``data`` fits this model:
        its windows no longer than ``block_size``, its token ids below ``vocab_size``. Reads
        ``data.block_size`` and ``data.vocab_size`` where the data has them (labkit.data.text)."""
        t, vocab = getattr(data, "block_size", None), getattr(data, "vocab_size", None)
        if t is not None and t > self.block_size:
            raise ValueError(f"text: block_size={t} is longer than gpt.block_size={self.block_size}; use "
                             f"labkit.data.text(block_size≤{self.block_size}) or gpt(block_size={t})")
        if vocab is not None and vocab > self.vocab_size:
            raise ValueError(f"gpt.vocab_size={self.vocab_size} is smaller than the data's vocab_size={vocab}; "
                             f"use labkit.models.gpt(vocab_size=data.vocab_size)")

    def num_parameters(self) -> int:
        """Parameters of the built model, a tied weight counted once."""
        return sum(p.numel() for p in self().parameters())


def gpt(n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 64, vocab_size: int = 128,
        tie: bool = True, dropout: float = 0.0, bias: bool = True) -> GPT:
    """A GPT factory. Take ``vocab_size`` from the data: ``gpt(vocab_size=data.vocab_size)``.

    >>> data = labkit.data.text(batch=8, block_size=64)
    >>> run = lab.run(labkit.Strategy(tp=2), model=labkit.models.gpt(vocab_size=data.vocab_size),
    ...               data=data, loss="cross_entropy", batch=8)
    """
    return GPT(n_layer, n_head, n_embd, block_size, vocab_size, tie, dropout, bias)
