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

A Llama-family :class:`~labkit.plan.scale.model.Decoder` is counted tensor by tensor, as what its
backward reads (16-bit, in units of s·b·h; a·d the query width, kv·d the key/value width, f
the MLP width), with FlashAttention (Dao et al. 2022: no s×s scores kept, so Megatron's
"selective" has nothing left to drop) and no dropout:

    attention       2 (the norm's output: the q/k/v GEMMs' input; an RMSNorm's gradient needs
                    only its output and 1/rms) + (4·a·d + 4·kv·d)/h / t (q, k, v, the attention
                    output, which is also the o GEMM's input)
    SwiGLU MLP      2 (the norm's output) + 6·f/h / t (gate and up: the SwiGLU's derivative;
                    their product: the down GEMM's input)
    MoE MLP         2 + 4·k + 8·E/h (norm, routed copies of each token in and out, fp32 router
                    scores) + 6·(k·f_e + f_shared)/h / t

with sequence parallelism dividing every term by t. Eager autograd keeps more (the norms'
inputs and fp32 internals, silu(gate)); Megatron-Core's fused kernels and Meta's "we
proactively deallocate tensors that will not be used for future computation" (Llama 3,
§3.3.2) keep this. ``recompute="selective"`` on a Decoder is torchtitan's op-level policy
(``_save_list``: every aten.mm output but every second one, and attention's output; the rest
recomputed, for a Llama layer wk, wo and w3): the layer input 2, wq, wv and attention outputs
(4·a·d + 2·kv·d)/h, w1's 2·f/h and w2's 2 (an MoE layer's MLP keeps its count above);
``"full"`` keeps the layer input, 2 (/ t).

Expert parallelism (``ep`` > 1) keeps 1/ep of each MoE layer's routed experts on a GPU; ZeRO
shards those over the dp/ep ranks that hold the same experts (Megatron-Core's expert-data-
parallel group), the rest over dp. Activations do not change on average: a rank receives as
many routed rows as it sends.

Context parallelism (``cp`` > 1) cuts every sequence over cp ranks, so each rank keeps the
activations of s/cp tokens: every count above with s·b·h read as (s/cp)·b·h (the scores of
a GPT's unfused attention are (s/cp)×s a rank, the same 1/cp). "allgather" holds one layer's
gathered keys and values (2·s·b·kv width, /t) on top while it computes. The weights are
replicated over cp as over dp: ZeRO shards over dp·cp.

Each pipeline rank is counted on its own — its stages' parameters (the embedding on the first,
the output layer on the last) and its activations at its peak — and the rank that needs the
most is reported. A rank holds a chunk's activations from its forward to its backward (to
its W for zb-h1), so its peak is what labkit's schedules (Megatron's) keep in flight: GPipe
all m micro-batches; 1F1B min(m, p − r) on rank r (a warm-up of p − r − 1 forwards, then one
forward before each backward); zb-h1 min(m, p); interleaved a warm-up of 2(p − r − 1) +
(v − 1)·p (micro-batch, chunk) forwards, taken in groups of p micro-batches per chunk, then one
forward before each backward (Megatron's get_num_warmup_microbatches; all m·v forwards first
when that is no fewer) — for uniform chunks and m ≥ 2p, (1 + (p−1)/(p·v)) times p micro-batches
on the first rank (Korthikanti et al., §4.2.3). Recomputation (full or selective) re-materialises
one layer at a time in backward, so one layer's activations without it come on top.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from itertools import accumulate

from .hardware import GB, ModelShape
from .layout import ClusterStrategy
from .model import Decoder

USABLE_FRACTION = 0.92
"""Share of HBM a run can use: the CUDA context, NCCL buffers and allocator fragmentation
take the rest (a few GB on an 80 GB part, as PyTorch's memory snapshots typically show)."""


def layer_activation_bytes(model: ModelShape, s: ClusterStrategy, kind: str = "dense") -> float:
    """Activations one layer keeps for one micro-batch (Korthikanti et al. 2022, Table 2, for a
    GPT; the module docstring's counts for a Decoder)."""
    sbh, t = s.tokens(model.seq) * model.hidden, s.tp
    if s.recompute == "full":                   # the layer's input alone
        return 2 * sbh / (t if s.sequence_parallel else 1)
    if isinstance(model, Decoder):
        return decoder_activation_bytes(model, s, kind)
    attn = 5 * model.heads * model.seq / model.hidden
    if s.sequence_parallel:
        return sbh * (34 + (0 if s.recompute == "selective" else attn)) / t
    return sbh * (10 + 24 / t + (0 if s.recompute == "selective" else attn / t))


def decoder_activation_bytes(model: Decoder, s: ClusterStrategy, kind: str) -> float:
    """A Llama-family layer with FlashAttention, without full recomputation (module docstring)."""
    h, t = model.hidden, s.tp
    sbh = s.tokens(model.seq) * h
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    op_policy = s.recompute == "selective"
    replicated = 4.0                                                  # two norm outputs, or input and w2's output
    split = (4 * q + (2 if op_policy else 4) * kv) / h
    if kind == "moe":
        replicated += 4 * model.top_k + 8 * model.experts / h
        split += 6 * (model.top_k * model.expert_ffn + model.shared_ffn) / h
    else:
        split += (2 if op_policy else 6) * model.ffn_hidden / h
    if s.sequence_parallel:
        return sbh * (replicated + split) / t
    return sbh * (replicated + split / t)


def layer_written_bytes(model, s: ClusterStrategy, kind: str = "dense") -> float:
    """Bytes one layer's forward writes for one micro-batch, each tensor once (what its memory-
    bound work moves): for a GPT Korthikanti et al.'s no-recompute count and the attention scores
    QKᵀ writes for the softmax to read, 2·a·s²·b/t (not kept, so not in their count: backward
    reads the softmax's output; at hidden 2304 a fifth of the layer's bytes); for a Decoder
    (FlashAttention: no scores in memory) what it keeps with the norms' inputs and silu(gate)
    written too, 8 + (4·a·d + 4·kv·d)/h + 8·f/h."""
    plain = replace(s, recompute="none")
    if not isinstance(model, Decoder):
        return layer_activation_bytes(model, plain, kind) + 2 * score_elements(model, s)
    f = model.top_k * model.expert_ffn + model.shared_ffn if kind == "moe" else model.ffn_hidden
    tokens = s.tokens(model.seq)
    norm_inputs = 4 * tokens * model.hidden / (s.tp if s.sequence_parallel else 1)
    return layer_activation_bytes(model, plain, kind) + norm_inputs + 2 * tokens * f / s.tp


def score_elements(model, s: ClusterStrategy) -> float:
    """Elements of one s×s tensor of a GPT's attention core on one GPU for one micro-batch: a·s²·b/t."""
    return s.tokens(model.seq) * model.heads * model.seq / s.tp


def core_written_bytes(model, s: ClusterStrategy) -> float:
    """The s×s tensors a GPT's unfused attention core writes for one micro-batch (Megatron-LM's
    QKᵀ, scale-mask-softmax, dropout, ·V): the scores, the softmax's output, dropout's mask and
    output, 2 + 2 + 1 + 2 bytes an element: 7·a·s²·b/t. What selective recomputation writes again."""
    return 7 * score_elements(model, s)


def kv_width(model) -> int:
    """Width of one token's keys (or values): kv_heads·head_dim, or h for a GPT's full heads."""
    return model.kv_heads * model.head_dim if isinstance(model, Decoder) else model.hidden


def gathered_kv_bytes(model, s: ClusterStrategy) -> float:
    """cp_mode="allgather": one layer's keys and values of the whole sequence on a rank (bf16)."""
    if s.cp == 1 or s.cp_mode != "allgather":
        return 0.0
    return 2 * 2 * s.microbatch_size * model.seq * kv_width(model) / s.tp


@lru_cache(maxsize=4096)
def held(schedule: str, p: int, m: int, v: int, rank: int) -> tuple:
    """Micro-batches of each of pipeline ``rank``'s v chunks whose activations it holds, at every
    moment that can be its peak (after a forward; module docstring), without repeats."""
    if p == 1:
        return ((1,),)
    if schedule != "interleaved":
        return ((m if schedule == "gpipe" else min(m, p if schedule == "zb-h1" else p - rank),),)
    total = m * v
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    if warmup == total:
        return ((m,) * v,)

    def forwards(n: int, chunk: int) -> int:          # of the first n units, those of ``chunk``
        return n // (p * v) * p + min(p, max(0, n % (p * v) - chunk * p))
    # the steady state's held set repeats every p·v units; backward visits the chunks in reverse
    return tuple(dict.fromkeys(tuple(forwards(warmup + k + 1, c) - forwards(k, v - 1 - c) for c in range(v))
                               for k in range(min(p * v, total - warmup))))


def replica_groups(model, s: ClusterStrategy) -> list[dict]:
    """Per pipeline rank, its parameters per tp shard by the ranks that hold the same ones
    (ZeRO's and the gradient all-reduce's group): the dense ones over dp·cp, the routed
    experts (1/ep of them) over dp·cp/ep; one group when ep = 1."""
    total = model.rank_params(s.pp, s.chunks)
    experts = model.rank_expert_params(s.pp, s.chunks) if getattr(model, "experts", 0) else [0.0] * s.pp
    out = []
    for dense, expert in ((t - e, e / s.ep) for t, e in zip(total, experts)):
        groups = {s.replicas: dense / s.tp}
        groups[s.replicas // s.ep] = groups.get(s.replicas // s.ep, 0.0) + expert / s.tp
        out.append(groups)
    return out


def sharded(s: ClusterStrategy, groups: dict, stage: int) -> float:
    """Parameters of one rank's ``groups`` it keeps of a state ZeRO shards from ``stage`` on: each
    group's over its replicas (over the dp_shard·cp of them in its HSDP group)."""
    return sum(n / (ranks * s.shard_group // s.replicas if s.zero >= stage else 1) for ranks, n in groups.items())


def model_state_bytes(s: ClusterStrategy, groups: dict) -> tuple[float, float, float]:
    """Weights, gradients and optimizer state of one rank's ``groups`` (module docstring)."""
    return 2 * sharded(s, groups, 3), 2 * sharded(s, groups, 2), 12 * sharded(s, groups, 1)


def loss_bytes(model, s: ClusterStrategy) -> float:
    """The last stage's output layer and loss, for one micro-batch (freed by the loss's backward,
    I for zb-h1): the final norm's output (the output GEMM's input) and what the cross-entropy
    holds per logit at its peak. Megatron's vocab-parallel cross-entropy keeps the fp32 softmax,
    4 bytes a logit (Korthikanti et al. 2022's output-layer count); torch's cross-entropy on fp32 logits
    (torchtitan's and Hugging Face's loss), in the log-softmax's backward, its saved fp32 output,
    the incoming fp32 gradient and the outgoing one: 12 (the bf16 logits freed before it)."""
    per_logit = 12 if isinstance(model, Decoder) else 4
    return s.tokens(model.seq) * (4 * model.hidden + per_logit * model.vocab) / s.tp


def gathered_layer_bytes(model, s: ClusterStrategy) -> float:
    """ZeRO-3: the 16-bit weights gathered at once, the layer computing and the one prefetched
    (FSDP's unit is a layer; Zhao et al. 2023, §3.3)."""
    if s.zero < 3:
        return 0.0
    return 2 * 2 * max(model.kind_params(k) for k in model.kinds(0, model.layers)) / s.tp


def stage_kinds(model, stages: int) -> list[dict]:
    """Per pipeline stage, how many layers of each kind it holds ({} for an empty end stage)."""
    counts = model.stage_layers(stages)
    return [model.kinds(first, n) for first, n in zip(accumulate([0] + counts), counts)]


def rank_memory(model: ModelShape, s: ClusterStrategy, global_batch: int) -> list[dict]:
    """Bytes per GPU on each pipeline rank: weights, gradients, optimizer, activations, total
    (module docstring)."""
    m = s.microbatches(global_batch)
    logits = loss_bytes(model, s) * (m if s.schedule == "gpipe" and s.pp > 1 else 1)
    kinds = stage_kinds(model, s.pp * s.chunks)
    per_kind = {k: (layer_activation_bytes(model, s, k), layer_activation_bytes(model, replace(s, recompute="none"), k))
                for k in {k for stage in kinds for k in stage}}
    stage_acts = [sum(n * per_kind[k][0] for k, n in stage.items()) for stage in kinds]
    stage_layer = [max((per_kind[k][1] for k in stage), default=0.0) for stage in kinds]
    ranks = []
    for r, groups in enumerate(replica_groups(model, s)):
        weights, grads, optimizer = model_state_bytes(s, groups)
        weights += gathered_layer_bytes(model, s)
        chunks = stage_acts[r::s.pp]          # rank r holds stages r, r + p, …
        acts = max(sum(n * a for n, a in zip(h, chunks)) for h in held(s.schedule, s.pp, m, s.chunks, r)) \
            + (max(stage_layer[r::s.pp]) if s.recompute != "none" else 0.0) + gathered_kv_bytes(model, s) \
            + (logits if r == s.pp - 1 else 0.0)
        ranks.append({"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": acts,
                      "total": weights + grads + optimizer + acts})
    return ranks


def memory_breakdown(model: ModelShape, s: ClusterStrategy, global_batch: int) -> dict:
    """:func:`rank_memory` of the pipeline rank that needs the most."""
    return max(rank_memory(model, s, global_batch), key=lambda mem: mem["total"])


def fits(total_bytes: float, hbm_bytes: float) -> bool:
    return total_bytes <= USABLE_FRACTION * hbm_bytes


def gb(nbytes: float) -> float:
    return nbytes / GB
