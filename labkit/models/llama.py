"""A Llama-family decoder as an ordinary ``nn.Module``, dense or with mixture-of-experts layers.

The model, top to bottom (names as in the state dict)::

    tok_emb                     token embedding (no position embedding: RoPE rotates q and k)
    layers.{i}                  n_layer identical Blocks:
        attn_norm, attn         RMSNorm, grouped-query attention (q_proj k_proj v_proj o_proj)
        mlp_norm,  mlp          RMSNorm, SwiGLU (gate_proj up_proj down_proj) or a MoE layer
    norm                        final RMSNorm
    head                        LM head, its weight the embedding's when ``tie=True``

The pieces are Llama's (Touvron et al. 2023): pre-norm RMSNorm (Zhang & Sennrich 2019),
rotary position embeddings (Su et al. 2021, the "rotate half" layout of GPT-NeoX and Hugging
Face), grouped-query attention (Ainslie et al. 2023: ``n_kv_heads`` key/value heads, each
shared by ``n_head // n_kv_heads`` query heads) and the SwiGLU MLP (Shazeer 2020). The
mixture-of-experts layer is in :mod:`.moe`.

Tensor parallelism (``tp_plan``, DTensor's convention, ``*`` over the layer list) is
Megatron's split: q/k/v and gate/up by columns, o and down by rows. Every reshape is
``view(B, T, -1, head_dim)``, so a rank finds however many heads it holds; whole heads need
``n_head`` and ``n_kv_heads`` both divisible by tp. With fewer kv heads than ranks the k/v
projections cannot be split by heads (Megatron then replicates k/v and all-reduces their
gradients, which a colwise/rowwise plan cannot express), so that case is refused:
:meth:`Llama.check_tp` in the notebook, and the attention itself if a split ever hands a
rank part of a head. Routed experts are replicated on every tp rank (expert parallelism is
a separate axis); a shared expert is split like the dense MLP. A dense model also ships an
``sp_plan`` for sequence parallelism (Korthikanti et al. 2022), as gpt does.

>>> make = llama(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=96, n_kv_heads=2)
>>> make()(torch.zeros(2, 32, dtype=torch.long)).shape
torch.Size([2, 32, 96])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import attention as context     # the attention hook cp takes over (labkit.parallel.context)
from .moe import MoE, MoEOutput, SwiGLU


def rope_cos_sin(positions: torch.Tensor | int, head_dim: int, theta: float,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, (T, head_dim), for the "rotate half" layout.

    ``positions`` are the tokens' global positions (T,): under context parallelism those of
    the slice of the sequence this rank holds; an int T means ``arange(T)`` on ``device``.

    Recomputed in every attention layer (T·head_dim/2 products, nothing next to the matmuls)
    rather than kept in a buffer or passed along: the state dict holds only parameters, a
    model built on the ``meta`` device and materialised later needs no buffer re-initialised,
    and a block takes the hidden states alone.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, h, T, head_dim) by position: x·cos + rotate_half(x)·sin (Su et al., eq. 34)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class AttentionCore(nn.Module):
    """Causal softmax(q·kᵀ/√d)·v with k/v heads repeated for their query groups: the
    parameter-free region that selective recomputation checkpoints (Korthikanti et al. 2022).
    It is :func:`labkit.parallel.context.attention`: torch's scaled_dot_product_attention, or
    across the ranks of a context-parallel group (k and v travel with their n_kv_heads heads)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context.attention(q, k, v, causal=True)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE. The softmax core is
    :func:`labkit.parallel.context.attention`: torch's scaled_dot_product_attention, or across
    the ranks of a context-parallel group (k and v travel with their n_kv_heads heads)."""

    def __init__(self, n_embd: int, n_head: int, n_kv_heads: int, rope_theta: float = 10000.0):
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = n_head, n_kv_heads, n_embd // n_head
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(n_embd, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(n_embd, n_kv_heads * self.head_dim, bias=False)
        self.core = AttentionCore()
        self.o_proj = nn.Linear(n_head * self.head_dim, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t = q.shape[:2]          # t: the whole sequence, even when x held a slice of it (SP)
        if q.shape[-1] % self.head_dim or k.shape[-1] % self.head_dim:
            raise ValueError(f"llama: this rank holds {k.shape[-1]} k/v features, not whole heads of "
                             f"head_dim={self.head_dim}; use a tp that divides n_kv_heads={self.n_kv_heads}")
        # the tokens' global positions: arange(t), or this rank's slices under context parallelism
        cos, sin = rope_cos_sin(context.positions(t, x.device), self.head_dim, self.rope_theta)
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))   # (B, h, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)). Hidden states in,
    hidden states out, so a pipeline stage is a slice of the layer list; a MoE layer keeps its
    balance loss on ``mlp.aux_loss`` for the model to collect."""

    def __init__(self, n_embd: int, n_head: int, n_kv_heads: int, mlp: nn.Module, eps: float, rope_theta: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(n_embd, eps=eps)
        self.attn = Attention(n_embd, n_head, n_kv_heads, rope_theta)
        self.mlp_norm = nn.RMSNorm(n_embd, eps=eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    """The built model. ``forward(idx)`` returns logits (B, T, V), or a :class:`MoEOutput`
    (``.logits``, ``.aux_loss``) when its MoE layers have a balance loss to add."""

    def __init__(self, config: "Llama"):
        super().__init__()
        c = config
        self.n_head, self.n_kv_heads, self.block_size = c.n_head, c.kv_heads, c.block_size
        self.tp_plan = dict(c.tp_plan)
        if c.sp_plan is not None:
            self.sp_plan = dict(c.sp_plan)
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.layers = nn.ModuleList(Block(c.n_embd, c.n_head, c.kv_heads, c.build_mlp(), c.norm_eps, c.rope_theta)
                                    for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.n_embd, eps=c.norm_eps)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """(n_layer, n_experts): tokens each expert received in the last forward, layer by
        layer (detached); None for a dense model or before the first forward."""
        counts = [getattr(layer.mlp, "tokens_per_expert", None) for layer in self.layers]
        return None if any(c is None for c in counts) else torch.stack(counts)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | MoEOutput:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than llama.block_size={self.block_size}; "
                             f"use data with block_size ≤ {self.block_size} or a llama with block_size ≥ {t}")
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        aux = [layer.mlp.pop_aux_loss() for layer in self.layers if isinstance(layer.mlp, MoE)]
        if not aux or aux[0] is None:           # dense, or aux_loss_coef=0
            return logits
        return MoEOutput(logits, torch.stack(aux).sum())


@dataclass(frozen=True)
class Llama:
    """A factory for :class:`LlamaModel`; ``lab.run`` calls it on every engine under the seed."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 128
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: as many as n_head (multi-head)."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width; None: Llama's rule, 2/3 of 4·n_embd rounded up to a multiple of 64."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0: every layer has a dense SwiGLU MLP."""
    top_k: int = 2
    """Experts each token reaches (no token is dropped)."""
    shared_expert: bool = False
    """One more SwiGLU expert that every token passes through (DeepSeekMoE's shared expert)."""
    aux_loss_coef: float = 0.01
    """Weight of the sequence-wise load-balancing loss; 0 turns it off."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gates to sum to 1 (Mixtral, Qwen3-MoE); False: raw softmax probs."""
    router_skew: float = 0.0
    """A router bias (trainable, one per layer) starting at ``router_skew`` for expert 0 and 0 for
    the rest: > 0 sends expert 0 more tokens than its share, so under expert parallelism the
    rank holding it is a straggler, until the balance loss (``aux_loss_coef``) pulls it back."""
    tie: bool = False
    """The LM head reuses the token embedding's weight (then tp_plan cannot split either)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("n_kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_int("n_experts", self.n_experts, 0)
        _check_int("top_k", self.top_k, 1)
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"llama: n_embd={self.n_embd} must split into n_head={self.n_head} heads of an even "
                             f"width (RoPE rotates pairs); use n_embd a multiple of {2 * self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"llama: n_head={self.n_head} is not a multiple of n_kv_heads={self.kv_heads}; "
                             f"use n_kv_heads a divisor of {self.n_head}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"llama: top_k={self.top_k} is more than n_experts={self.n_experts}; "
                             f"use top_k ≤ {self.n_experts}")
        if not 0 <= self.aux_loss_coef < math.inf:
            raise ValueError(f"llama: aux_loss_coef={self.aux_loss_coef!r} must be a finite number ≥ 0 "
                             "(0 turns it off)")
        if not (isinstance(self.router_skew, (int, float)) and 0 <= self.router_skew < math.inf) or \
                (self.router_skew and not self.n_experts):
            raise ValueError(f"llama: router_skew={self.router_skew!r} must be a finite number ≥ 0, and needs "
                             "experts (n_experts > 0); use router_skew=0 for a dense model")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_head

    @property
    def hidden(self) -> int:
        """The SwiGLU width: ``ffn_hidden``, or Llama's ``multiple_of`` rule with 64 (Llama
        uses 256; 64 keeps small models small): ceil(8/3·n_embd / 64)·64."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return 64 * math.ceil(int(8 * self.n_embd / 3) / 64)

    @property
    def tp_plan(self) -> dict[str, str]:
        """Which Linear layers tensor parallelism splits (see the module docstring)."""
        plan = {f"layers.*.attn.{p}_proj": "colwise" for p in "qkv"}
        plan["layers.*.attn.o_proj"] = "rowwise"
        mlp = "layers.*.mlp" if not self.n_experts else "layers.*.mlp.shared" if self.shared_expert else None
        if mlp:
            plan.update({f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise", f"{mlp}.down_proj": "rowwise"})
        return plan

    @property
    def sp_plan(self) -> dict[str, str] | None:
        """Where sequence parallelism cuts and joins the sequence (megatron mode), as for gpt:
        cut after the embedding, RMSNorms on a slice, whole again before the head. None with
        experts: the router and the balance loss need every token of a sequence on each rank."""
        if self.n_experts:
            return None
        return {"tok_emb": "scatter_output", "layers.*.attn_norm": "sequence", "layers.*.mlp_norm": "sequence",
                "norm": "sequence", "head": "gather_input"}

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless ``tp`` ranks can each hold whole query and key/value heads."""
        for name, heads in (("n_head", self.n_head), ("n_kv_heads", self.kv_heads)):
            if heads % tp:
                raise ValueError(f"llama: {name}={heads} does not divide by Strategy.tp={tp}: tp ranks split the "
                                 f"heads (k/v are not replicated); use {name} a multiple of {tp}, or a tp dividing {heads}")

    def build_mlp(self) -> nn.Module:
        if not self.n_experts:
            return SwiGLU(self.n_embd, self.hidden)
        return MoE(self.n_embd, self.hidden, self.n_experts, self.top_k, self.shared_expert,
                   self.aux_loss_coef, self.norm_topk_prob)

    def __call__(self) -> LlamaModel:
        model = LlamaModel(self)
        model.apply(_init)
        for layer in model.layers:      # GPT-2's scaled init of the projections into the residual
            for name, p in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.n_layer))
        if self.tie:
            model.head.weight = model.tok_emb.weight
        if self.router_skew:
            for layer in model.layers:
                router = layer.mlp.router
                biased = nn.Linear(router.in_features, router.out_features, bias=True)
                biased.weight.data.copy_(router.weight.data)
                biased.bias.data.zero_()[0] = self.router_skew
                layer.mlp.router = biased
        return model

    def check_data(self, data) -> None:
        """Raise ValueError (naming the field and the fix) unless ``data`` fits this model."""
        t, vocab = getattr(data, "block_size", None), getattr(data, "vocab_size", None)
        if t is not None and t > self.block_size:
            raise ValueError(f"text: block_size={t} is longer than llama.block_size={self.block_size}; use "
                             f"labkit.data.text(block_size≤{self.block_size}) or llama(block_size={t})")
        if vocab is not None and vocab > self.vocab_size:
            raise ValueError(f"llama.vocab_size={self.vocab_size} is smaller than the data's vocab_size={vocab}; "
                             f"use labkit.models.llama(vocab_size=data.vocab_size)")

    def num_parameters(self) -> int:
        """Parameters of the built model, a tied weight counted once (all experts counted)."""
        return sum(p.numel() for p in self().parameters())

    def active_parameters(self) -> int:
        """Parameters one token passes through: every dense one, and in each MoE layer only
        ``top_k`` of its routed experts (the router and a shared expert always). A dense model
        of the same width and depth has active = total."""
        expert = 3 * self.n_embd * self.hidden                       # one SwiGLU: gate, up, down
        return self.num_parameters() - self.n_layer * (self.n_experts - self.top_k) * expert * bool(self.n_experts)


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"llama: {name}={value!r} must be a whole number ≥ {low}")


def _init(module: nn.Module) -> None:
    """N(0, 0.02) for every Linear and Embedding weight (Llama's and GPT-2's scale)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


def llama(n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 64, vocab_size: int = 128,
          n_kv_heads: int | None = None, ffn_hidden: int | None = None, n_experts: int = 0, top_k: int = 2,
          shared_expert: bool = False, aux_loss_coef: float = 0.01, tie: bool = False, **more) -> Llama:
    """A Llama-family factory; ``n_experts > 0`` makes every MLP a mixture of experts.
    ``more``: ``norm_topk_prob``, ``router_skew``, ``rope_theta``, ``norm_eps`` (see :class:`Llama`).

    >>> data = labkit.data.text(batch=8, block_size=64)
    >>> model = labkit.models.llama(n_kv_heads=2, n_experts=4, vocab_size=data.vocab_size)
    >>> ref = labkit.reference(model, data=data, loss="cross_entropy", batch=8, lr=1e-3, optimizer="adamw")
    """
    return Llama(n_layer, n_head, n_embd, block_size, vocab_size, n_kv_heads, ffn_hidden, n_experts, top_k,
                 shared_expert, aux_loss_coef, tie=tie, **more)
