"""A Llama-family decoder as the planner sees it: grouped-query attention, SwiGLU, mixture-of-experts.

    >>> from labkit.plan import Decoder, from_hf_config
    >>> Decoder(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq=8192).params / 1e9
    8.03...
    >>> m = from_hf_config("config.json")               # a Hugging Face config.json, read with json
    >>> m.params, m.active_params

Pure arithmetic, like :class:`labkit.plan.ModelShape` (whose methods of the same names it mirrors, so
:mod:`labkit.plan.scale.step` and :mod:`labkit.plan.scale.memory` price either). A layer is one of two
kinds: "dense" (attention + a SwiGLU MLP of ``ffn_hidden``) or "moe" (attention + a router over
``experts`` SwiGLU experts of ``expert_ffn``, ``top_k`` of them per token, plus an always-on
shared expert of ``shared_ffn``). Layers before ``dense_layers`` are dense, and after that every
``moe_every``-th one is MoE (DeepSeek's ``first_k_dense_replace``, Qwen-MoE's ``decoder_sparse_step``).

FLOPs (a multiply-add counted as 2; Narayanan et al. 2021, the derivation of their eq. 3): per
token, each weight matrix of shape (m, n) costs 2·m·n in forward, backward twice that; attention
scores and their weighted sum cost 4·s·(a·d) forward (the full s×s square, as Megatron-LM and
torchtitan count it, not the causal half). Model FLOPs per token are therefore
6·N_active + 12·L·(a·d)·s: the model FLOPs of MFU (Chowdhery et al. 2022, PaLM, appendix B, the
definition the Llama 3 paper's Table 4 reports its BF16 MFU in; torchtitan's
``get_num_flop_per_token`` counts the same), with N_active the parameters one token passes
through: the top_k routed experts, not all of them (DeepSeek-V3, arXiv 2412.19437: "671B total
parameters with 37B activated for each token"), and without the input embedding table (a
lookup, not a matmul).

Experts are replicated over dp unless the strategy sets ``ep`` (:class:`~labkit.plan.scale.layout.
ClusterStrategy`): then each dp replica keeps and updates 1/ep of them (:meth:`rank_expert_params`
is what ep divides), and tokens travel by all-to-all (:mod:`labkit.plan.scale.step`); tp splits each
expert's matrices as it splits the dense MLP.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .hardware import require_whole

# HF ``model_type`` values whose attention is grouped-query (or full multi-head) attention with
# a SwiGLU MLP or SwiGLU experts: what this description counts.
SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
REFUSED = {
    "deepseek_v2": "multi-head latent attention (MLA: low-rank compressed q/k/v)",
    "deepseek_v3": "multi-head latent attention (MLA: low-rank compressed q/k/v)",
}


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """A Llama-, Mistral- or Qwen-shaped decoder (RMSNorm, rotary positions, no biases)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means as many as ``heads``."""
    head_dim: int = 0
    """Per-head width; 0 means hidden // heads (Qwen3 sets it apart from hidden)."""
    ffn_hidden: int = 0
    """SwiGLU width of a dense layer's MLP (three matrices: gate, up, down)."""
    vocab: int = 32000
    seq: int = 4096
    tie: bool = False
    """Output projection shares the input embedding table."""
    experts: int = 0
    """Routed experts per MoE layer (0: every layer is dense)."""
    top_k: int = 0
    expert_ffn: int = 0
    """SwiGLU width of one routed expert."""
    shared_ffn: int = 0
    """Total SwiGLU width of the shared expert(s) every token passes through (0: none)."""
    dense_layers: int = 0
    """Leading layers that stay dense (DeepSeek's first_k_dense_replace)."""
    moe_every: int = 1
    """After those, layer i is MoE when (i + 1) % moe_every == 0 (Qwen-MoE's decoder_sparse_step)."""
    name: str = ""

    def __post_init__(self):
        require_whole(self, ("layers", "hidden", "heads", "vocab", "seq", "moe_every"))
        require_whole(self, ("kv_heads", "head_dim", "ffn_hidden", "experts", "top_k", "expert_ffn", "shared_ffn",
                             "dense_layers"), minimum=0)
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        if not self.head_dim:
            if self.hidden % self.heads:
                raise ValueError(f"Decoder.hidden={self.hidden} must divide by heads={self.heads} (or give head_dim)")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"Decoder.heads={self.heads} must divide by kv_heads={self.kv_heads} "
                             "(each key/value head serves a whole group of query heads)")
        if self.experts:
            if not 1 <= self.top_k <= self.experts or not self.expert_ffn:
                raise ValueError(f"Decoder with experts={self.experts} needs 1 ≤ top_k ≤ experts (got {self.top_k}) "
                                 f"and expert_ffn ≥ 1 (got {self.expert_ffn})")
        if any(not self.is_moe(i) for i in range(self.layers)) and not self.ffn_hidden:
            raise ValueError("Decoder.ffn_hidden=0 but some layers are dense; give the dense MLP's width")

    # -- shape -------------------------------------------------------------------------------
    def is_moe(self, i: int) -> bool:
        """Layer ``i`` (from 0) routes its tokens to experts."""
        return bool(self.experts) and i >= self.dense_layers and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    def kinds(self, first: int, count: int) -> dict:
        """How many layers of each kind ("dense", "moe") layers first … first+count−1 hold."""
        moe = sum(self.is_moe(i) for i in range(first, first + count))
        return {k: n for k, n in (("dense", count - moe), ("moe", moe)) if n}

    def can_split(self, stages: int) -> bool:
        """Stages of a layer or more, and up to two of none at the ends (:meth:`stage_layers`)."""
        return 1 <= stages <= self.layers + 2

    def stage_layers(self, stages: int) -> list[int]:
        """Layers per pipeline stage: as even as possible, a stage short taken first from the first
        and last stages, which also hold the embedding and the output layer (Llama 3, §3.3.2: "we
        reduce one Transformer layer each from the first and the last stages ... the first model
        chunk on the first stage has only the embedding, and the last model chunk on the last
        stage has only output projection and loss calculation")."""
        per = -(-self.layers // stages)
        counts = [per] * stages
        order = [j for pair in zip(range(stages), reversed(range(stages))) for j in pair]
        for j in list(dict.fromkeys(order))[:per * stages - self.layers]:
            counts[j] -= 1
        return counts

    # -- parameters --------------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """q and o projections (h × a·d each), k and v (h × kv·d each), two RMSNorm gains."""
        q = self.heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * self.kv_heads * self.head_dim + 2 * self.hidden

    def kind_params(self, kind: str, active: bool = False) -> int:
        """One layer's parameters; ``active``: only those one token passes through."""
        h = self.hidden
        if kind == "dense":
            return self.attention_params + 3 * h * self.ffn_hidden
        routed = (self.top_k if active else self.experts) * 3 * h * self.expert_ffn
        return self.attention_params + h * self.experts + routed + 3 * h * self.shared_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final RMSNorm and the output projection (none of its own when tied)."""
        return self.hidden + (0 if self.tie else self.vocab * self.hidden)

    def _layer_params(self, active: bool) -> int:
        return sum(n * self.kind_params(k, active) for k, n in self.kinds(0, self.layers).items())

    @property
    def params(self) -> int:
        """Every parameter: embedding, layers (all experts), final norm, output projection."""
        return self.embedding_params + self._layer_params(False) + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (top_k experts of each MoE layer, not all)."""
        return self.embedding_params + self._layer_params(True) + self.head_params

    def rank_params(self, pp: int, chunks: int = 1) -> list[float]:
        """Parameters held by each pipeline rank: its stages' layers, the embedding on the first
        stage, the output layer on the last (and a copy of a tied table there when pp > 1, as
        Megatron-LM keeps one)."""
        stages = pp * chunks
        counts, first, out = self.stage_layers(stages), 0, [0.0] * pp
        for g, n in enumerate(counts):
            held = sum(c * self.kind_params(k) for k, c in self.kinds(first, n).items())
            if g == 0:
                held += self.embedding_params
            if g == stages - 1:
                held += self.head_params + (self.embedding_params if self.tie and pp > 1 else 0)
            out[g % pp] += held
            first += n
        return out

    def rank_expert_params(self, pp: int, chunks: int = 1) -> list[float]:
        """Of :meth:`rank_params`, the routed experts' parameters on each pipeline rank (what
        expert parallelism divides by ep)."""
        stages, out, first = pp * chunks, [0.0] * pp, 0
        for g, n in enumerate(self.stage_layers(stages)):
            out[g % pp] += self.kinds(first, n).get("moe", 0) * self.experts * 3 * self.hidden * self.expert_ffn
            first += n
        return out

    # -- FLOPs -------------------------------------------------------------------------------
    def gemms(self, kind: str, tokens: int, tp: int) -> list[tuple[float, float, float]]:
        """Forward GEMMs of one layer over ``tokens``: (FLOPs, of which weight GEMMs, d) per group,
        d the smallest GEMM dimension on one of ``tp`` GPUs (sets the GEMM efficiency). The
        routed experts are their own group: each sees tokens·top_k/experts rows on average."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        d = min(h / tp, tokens)
        linear = 2 * tokens * (2 * h * q + 2 * h * kv)
        if kind == "dense":
            linear += 2 * tokens * 3 * h * self.ffn_hidden
        else:
            linear += 2 * tokens * (h * self.experts + 3 * h * self.shared_ffn)
        core = self.attention_core_flops(tokens)
        groups = [(linear + core, linear, d)]
        if kind == "moe":
            experts = 2 * tokens * self.top_k * 3 * h * self.expert_ffn
            groups.append((experts, experts, min(self.expert_ffn / tp, tokens * self.top_k / self.experts)))
        return groups

    def attention_core_flops(self, tokens: int) -> float:
        """QKᵀ and the weighted sum of V over the full s×s square: 4·tokens·s·(a·d)."""
        return 4 * tokens * self.seq * self.heads * self.head_dim

    def logit_forward_flops(self, tokens: int) -> float:
        return 2 * tokens * self.hidden * self.vocab

    def selective_flops(self, kind: str, tokens: int) -> float:
        """Forward FLOPs recomputed in backward under ``recompute="selective"``, torchtitan's op
        policy (:mod:`labkit.plan.scale.memory`): wk, wo and w3 again, an MoE layer's whole MLP."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 2 * tokens * (h * kv + q * h)
        if kind == "dense":
            return attention + 2 * tokens * h * self.ffn_hidden
        return attention + 2 * tokens * (h * self.experts + 3 * h * self.shared_ffn
                                         + self.top_k * 3 * h * self.expert_ffn)

    def model_flops(self, tokens: int) -> float:
        """6·N_active·tokens + 12·L·(a·d)·s·tokens (module docstring), N_active without the input table."""
        n = self.active_params - self.embedding_params
        return 6 * n * tokens + 12 * self.layers * self.heads * self.head_dim * self.seq * tokens

    def hardware_flops(self, global_batch: int, recompute: str) -> float:
        """FLOPs the GPUs execute per step: model FLOPs, plus one more forward of every layer
        under full recomputation, or what :meth:`selective_flops` counts under selective."""
        tokens = global_batch * self.seq
        flops = self.model_flops(tokens)
        if recompute == "full":
            flops += sum(n * sum(g[0] for g in self.gemms(k, tokens, 1))
                         for k, n in self.kinds(0, self.layers).items())
        elif recompute == "selective":
            flops += sum(n * self.selective_flops(k, tokens) for k, n in self.kinds(0, self.layers).items())
        return flops

    def describe(self, ep: int = 1) -> str:
        """One line: the shape, and total vs active parameters for MoE; ``ep``: where the
        experts live (replicated over dp at ep=1, spread over the ep ranks above)."""
        attn = f"GQA {self.heads}/{self.kv_heads}" if self.kv_heads < self.heads else f"MHA {self.heads}"
        head = f"{self.name + ': ' if self.name else ''}{self.layers} layers, hidden {self.hidden}, {attn}, " \
               f"vocab {self.vocab}, seq {self.seq}, {'tied' if self.tie else 'untied'} embeddings"
        if not self.experts:
            return f"{head}, SwiGLU {self.ffn_hidden}; {self.params / 1e9:.2f} B parameters"
        shared = f" + shared {self.shared_ffn}" if self.shared_ffn else ""
        return (f"{head}; MoE in {self.moe_layers} of {self.layers} layers: {self.experts} experts of "
                f"{self.expert_ffn}, top-{self.top_k}{shared}; {self.params / 1e9:.2f} B parameters, "
                f"{self.active_params / 1e9:.2f} B active per token; " + (
                    f"experts spread over {ep} ep ranks ({self.experts // ep} per rank)" if ep > 1
                    else "experts replicated over dp (ep=1)"))


def from_hf_config(config, seq: int | None = None, name: str = "") -> Decoder:
    """A :class:`Decoder` from a Hugging Face ``config.json`` (a path or its dict), read with json.

    ``seq``: the training sequence length (default: the config's max_position_embeddings).
    """
    if not isinstance(config, dict):
        path = config
        with open(path) as f:
            config = json.load(f)
        name = name or str(config.get("_name_or_path") or os.path.splitext(os.path.basename(path))[0])
    kind = config.get("model_type")
    if kind in REFUSED:
        raise ValueError(f"model_type={kind!r} uses {REFUSED[kind]}, which the planner does not count; "
                         f"supported model_type values: {', '.join(SUPPORTED)}")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported by the planner; supported model_type values: "
                         f"{', '.join(SUPPORTED)} (or describe the model with labkit.plan.Decoder(...))")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if k not in config]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)}; a {kind} config.json names them")
    if config.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers={config['mlp_only_layers']} (dense layers between MoE layers) is not "
                         "counted yet; give an explicit labkit.plan.Decoder")
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    moe = dict(experts=experts)
    if experts:
        moe.update(top_k=config["num_experts_per_tok"],
                   expert_ffn=config.get("moe_intermediate_size") or config["intermediate_size"],
                   shared_ffn=config.get("shared_expert_intermediate_size")
                   or config.get("n_shared_experts", 0) * config.get("moe_intermediate_size", 0),
                   dense_layers=config.get("first_k_dense_replace", 0),
                   moe_every=config.get("decoder_sparse_step") or config.get("moe_layer_freq") or 1)
    # Mixtral's intermediate_size is the experts' width and it has no dense layer
    ffn = 0 if kind == "mixtral" else config.get("intermediate_size", 0)
    return Decoder(layers=config["num_hidden_layers"], hidden=config["hidden_size"],
                   heads=config["num_attention_heads"], kv_heads=config.get("num_key_value_heads") or 0,
                   head_dim=config.get("head_dim") or 0, ffn_hidden=ffn, vocab=config["vocab_size"],
                   seq=seq or config.get("max_position_embeddings") or 4096,
                   tie=bool(config.get("tie_word_embeddings", False)), name=name, **moe)
