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

A pipeline rank holds its L/p layers for every micro-batch in flight: p on the first stage
for 1F1B (Megatron's warm-up) and zb-h1 (its first stage's W follow its I closely enough that
p are held until W, as labkit's schedule counts them), ×(1 + (p−1)/(p·v)) for the interleaved schedule (§4.2.3), all
m for GPipe. Full recomputation re-materialises one layer at a time in backward, so one
layer's full activations come on top.
"""
from __future__ import annotations

from .hardware import GB, GPT
from .layout import ClusterStrategy

USABLE_FRACTION = 0.92
"""Share of HBM a run can use: the CUDA context, NCCL buffers and allocator fragmentation
take the rest (a few GB on an 80 GB part, as PyTorch's memory snapshots typically show)."""


def layer_activation_bytes(model: GPT, s: ClusterStrategy) -> float:
    """Korthikanti et al. 2022, Table 2: activations one layer keeps for one micro-batch."""
    sbh, t = model.seq * s.microbatch_size * model.hidden, s.tp
    attn = 5 * model.heads * model.seq / model.hidden
    if s.recompute == "full":
        return 2 * sbh / (t if s.sequence_parallel else 1)
    if s.sequence_parallel:
        return sbh * (34 + (0 if s.recompute == "selective" else attn)) / t
    return sbh * (10 + 24 / t + (0 if s.recompute == "selective" else attn / t))


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


def stage_params(model: GPT, s: ClusterStrategy) -> float:
    """Parameters on the heaviest pipeline rank, per tp shard: its layers plus a word
    embedding (the first stage's input table; the last stage keeps its own copy for the
    output layer when pp > 1, as Megatron does)."""
    layers = model.layers / s.pp
    return (layers * model.layer_params + model.embedding_params) / s.tp


def memory_breakdown(model: GPT, s: ClusterStrategy, global_batch: int) -> dict:
    """Bytes per GPU on the heaviest rank: weights, gradients, optimizer, activations, total."""
    n = stage_params(model, s)
    dp = s.dp
    weights = 2 * n / (dp if s.zero >= 3 else 1)
    grads = 2 * n / (dp if s.zero >= 2 else 1)
    optimizer = 12 * n / (dp if s.zero >= 1 else 1)
    m = s.microbatches(global_batch)
    per_layer = layer_activation_bytes(model, s)
    layers = model.layers / s.pp
    acts = per_layer * layers * in_flight(s, m)
    if s.recompute == "full":       # one layer re-materialised during its backward
        acts += layer_activation_bytes(model, ClusterStrategy(**{**s.to_dict(), "recompute": "none"}))
    sbh = model.seq * s.microbatch_size * model.hidden
    # the output layer's logits and their softmax (Korthikanti eq. for the last stage): fp32
    # logits of s·b·V/t and a bf16 copy.
    logits = 4 * sbh * (1 + model.vocab / model.hidden) / s.tp
    last = per_layer * layers + logits if s.pp > 1 else 0.0
    acts = max(acts if s.pp > 1 else acts + logits, last)
    total = weights + grads + optimizer + acts
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": acts, "total": total}


def fits(total_bytes: float, hbm_bytes: float) -> bool:
    return total_bytes <= USABLE_FRACTION * hbm_bytes


def gb(nbytes: float) -> float:
    return nbytes / GB
