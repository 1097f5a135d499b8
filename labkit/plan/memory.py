"""Memory per GPU: model states by ZeRO stage, activations by schedule and recomputation.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1): mixed-precision Adam
keeps 2 bytes of bf16 weights, 2 of bf16 gradients and K = 12 of optimizer state (fp32
master weights, momentum, variance) per parameter; stage 1 shards the 12 over dp, stage 2
the gradients too, stage 3 the weights too.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198), Table 2, bytes per layer with 16-bit activations,
s sequence, b micro-batch size, h hidden, a heads, t tensor-parallel degree:

    no recompute              s·b·h·(10 + 24/t + 5·a·s/(h·t))
      + sequence parallel     s·b·h·(34 + 5·a·s/h) / t
    selective recompute       s·b·h·(10 + 24/t)
      + sequence parallel     s·b·h·34 / t
    full recompute            2·s·b·h   (the layer's input; / t with sequence parallel)

A Llama-family :class:`~labkit.plan.model.Decoder` is counted the same way, tensor by tensor,
with FlashAttention (Dao et al. 2022), which keeps no s×s scores (so "selective" saves nothing
more), no dropout, and what autograd saves for its layers (16-bit, in units of s·b·h; a·d the
query width, kv·d the key/value width, f the MLP width):

    attention       4 (two RMSNorm inputs' first, q/k/v input) + (4·a·d + 4·kv·d)/h / t
                    (q, k, v, the attention output)
    SwiGLU MLP      4 (second norm input, gate/up input) + 8·f/h / t (gate, up, silu(gate), product)
    MoE MLP         4 + 4·k + 8·E/h (norm, routed copies of each token in and out, fp32 router
                    scores) + 8·(k·f_e + f_shared)/h / t

with sequence parallelism dividing every term by t, and full recomputation keeping 2 (/ t).

Expert parallelism (``ep`` > 1) keeps 1/ep of each MoE layer's routed experts on a GPU; ZeRO
shards those over the dp/ep ranks that hold the same experts (Megatron-Core's expert-data-
parallel group), the rest over dp. Activations do not change on average: a rank receives as
many routed rows as it sends.

Context parallelism (``cp`` > 1) cuts every sequence over cp ranks, so each rank keeps the
activations of s/cp tokens: every count above with s·b·h read as (s/cp)·b·h (the scores of
a GPT's unfused attention are (s/cp)×s a rank, the same 1/cp). "allgather" holds one layer's
gathered keys and values (2·s·b·kv width, /t) on top while it computes. The weights are
replicated over cp as over dp: ZeRO shards over dp·cp.

A pipeline rank holds its L/p layers for every micro-batch in flight: p on the first stage
for 1F1B (Megatron's warm-up) and zb-h1 (its first stage's W follow its I closely enough that
p are held until W, as labkit's schedule counts them), ×(1 + (p−1)/(p·v)) for the interleaved schedule (§4.2.3), all
m for GPipe. Full recomputation re-materialises one layer at a time in backward, so one
layer's full activations come on top.
"""
from __future__ import annotations

from dataclasses import replace

from .hardware import GB, GPT
from .layout import ClusterStrategy
from .model import Decoder

USABLE_FRACTION = 0.92
"""Share of HBM a run can use: the CUDA context, NCCL buffers and allocator fragmentation
take the rest (a few GB on an 80 GB part, as PyTorch's memory snapshots typically show)."""


def layer_activation_bytes(model: GPT, s: ClusterStrategy, kind: str = "dense") -> float:
    """Activations one layer keeps for one micro-batch (Korthikanti et al. 2022, Table 2, for a
    GPT; the module docstring's counts for a Decoder)."""
    if isinstance(model, Decoder):
        return decoder_activation_bytes(model, s, kind)
    sbh, t = s.tokens(model.seq) * model.hidden, s.tp
    attn = 5 * model.heads * model.seq / model.hidden
    if s.recompute == "full":
        return 2 * sbh / (t if s.sequence_parallel else 1)
    if s.sequence_parallel:
        return sbh * (34 + (0 if s.recompute == "selective" else attn)) / t
    return sbh * (10 + 24 / t + (0 if s.recompute == "selective" else attn / t))


def decoder_activation_bytes(model: Decoder, s: ClusterStrategy, kind: str) -> float:
    """A Llama-family layer with FlashAttention (module docstring)."""
    h, t = model.hidden, s.tp
    sbh = s.tokens(model.seq) * h
    if s.recompute == "full":
        return 2 * sbh / (t if s.sequence_parallel else 1)
    replicated = 8.0
    split = (4 * model.heads * model.head_dim + 4 * model.kv_heads * model.head_dim) / h
    if kind == "moe":
        replicated += 4 * model.top_k + 8 * model.experts / h
        split += 8 * (model.top_k * model.expert_ffn + model.shared_ffn) / h
    else:
        split += 8 * model.ffn_hidden / h
    if s.sequence_parallel:
        return sbh * (replicated + split) / t
    return sbh * (replicated + split / t)


def kv_width(model) -> int:
    """Width of one token's keys (or values): kv_heads·head_dim, or h for a GPT's full heads."""
    return model.kv_heads * model.head_dim if isinstance(model, Decoder) else model.hidden


def gathered_kv_bytes(model, s: ClusterStrategy) -> float:
    """cp_mode="allgather": one layer's keys and values of the whole sequence on a rank (bf16)."""
    if s.cp == 1 or s.cp_mode != "allgather":
        return 0.0
    return 2 * 2 * s.microbatch_size * model.seq * kv_width(model) / s.tp


def in_flight(s: ClusterStrategy, microbatches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    p, m = s.pp, microbatches
    if p == 1:
        return 1
    if s.schedule == "gpipe":
        return m
    if s.schedule == "interleaved":
        return min(m, p) * (1 + (p - 1) / (p * s.chunks))
    return min(m, p)


def replica_groups(model, s: ClusterStrategy) -> dict:
    """Parameters per tp shard on the heaviest pipeline rank, by the ranks that hold the same
    ones (ZeRO's and the gradient all-reduce's group): the dense ones over dp·cp, the routed
    experts (1/ep of them) over dp·cp/ep; one group when ep = 1."""
    total = model.rank_params(s.pp, s.chunks)
    experts = model.rank_expert_params(s.pp, s.chunks) if getattr(model, "experts", 0) else [0.0] * s.pp
    dense, expert = max(((t - e, e / s.ep) for t, e in zip(total, experts)), key=sum)
    groups = {s.replicas: dense / s.tp}
    groups[s.replicas // s.ep] = groups.get(s.replicas // s.ep, 0.0) + expert / s.tp
    return groups


def model_state_bytes(model, s: ClusterStrategy) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state per GPU (module docstring), each group of
    :func:`replica_groups` sharded by ZeRO over its ranks."""
    def part(per_param: float, stage: int) -> float:
        return per_param * sum(n / (ranks if s.zero >= stage else 1) for ranks, n in replica_groups(model, s).items())
    return part(2, 3), part(2, 2), part(12, 1)


def _rank_activations(model, s: ClusterStrategy, rank: int) -> tuple[float, float]:
    """Activations one micro-batch leaves on pipeline ``rank``'s layers, and its largest layer's
    without recomputation (full recomputation re-materialises one layer at a time)."""
    stages, kinds = s.pp * s.chunks, {}
    counts = model.stage_layers(stages)
    for g in range(rank, stages, s.pp):
        for k, n in model.kinds(sum(counts[:g]), counts[g]).items():
            kinds[k] = kinds.get(k, 0) + n
    return (sum(n * layer_activation_bytes(model, s, k) for k, n in kinds.items()),
            max(layer_activation_bytes(model, replace(s, recompute="none"), k) for k in kinds))


def memory_breakdown(model: GPT, s: ClusterStrategy, global_batch: int) -> dict:
    """Bytes per GPU on the heaviest rank: weights, gradients, optimizer, activations, total."""
    weights, grads, optimizer = model_state_bytes(model, s)
    first, one_layer = _rank_activations(model, s, 0)
    acts = first * in_flight(s, s.microbatches(global_batch)) + (one_layer if s.recompute == "full" else 0.0)
    acts += gathered_kv_bytes(model, s)
    sbh = s.tokens(model.seq) * model.hidden
    # the output layer's logits and their softmax (Korthikanti eq. for the last stage): fp32
    # logits of s·b·V/t and a bf16 copy.
    logits = 4 * sbh * (1 + model.vocab / model.hidden) / s.tp
    last = _rank_activations(model, s, s.pp - 1)[0] + logits if s.pp > 1 else 0.0
    acts = max(acts if s.pp > 1 else acts + logits, last)
    total = weights + grads + optimizer + acts
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": acts, "total": total}


def fits(total_bytes: float, hbm_bytes: float) -> bool:
    return total_bytes <= USABLE_FRACTION * hbm_bytes


def gb(nbytes: float) -> float:
    return nbytes / GB
