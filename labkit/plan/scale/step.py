"""Step time, MFU and memory of a model under a strategy on a cluster, from first principles.

Compute: each stage's FLOPs per micro-batch (Narayanan et al. 2021, §5.1: a GPT layer's
forward is 24·b·s·h² + 4·b·s²·h, backward twice that, full recomputation one more forward,
selective the attention core again (a GPT: Megatron's, the core's GEMMs and its s×s tensors;
a Decoder: torchtitan's op policy, wk, wo, w3 and the memory-bound work again); the logits
2·b·s·h·V on the last stage), over tp, each GEMM group at peak × ``Hardware.efficiency(d)``, d
its smallest dimension on one GPU; the memory-bound work at HBM bandwidth: each tensor a
layer's forward writes, written and read once (for a GPT the s×s scores too,
:func:`~labkit.plan.scale.memory.layer_written_bytes`), backward twice that. The attention
core (QKᵀ and PV) where the GPU has a measured FlashAttention rate (``Hardware.attention_flops``)
is that kernel: the causal half of the s×s square at its forward rate, 2.5× that in backward at
its backward rate (:func:`attention_times`); elsewhere a GEMM over the full square. At 128K
tokens it is most of a Llama layer's time.

Communication: every call is ``AlphaBeta.seconds`` (α once per call, nccl-tests' bus factors) on
the links its group spans (``Cluster.seconds``: NVLink inside a node; across nodes InfiniBand,
a ring collective on as many NICs a node as the group has GPUs there):

* tp (Megatron's f and g): 2 all-reduces of b·s·h a layer in forward, 2 in backward.
* pp: b·s·h/t to the neighbour, all-gathered over tp (Megatron's scatter/gather, §4.1).
* ep: 2 all-to-alls of 2·b·s·k·h (bf16 rows, top_k of each token) a MoE layer in forward and
  2 in backward, on the ep·pp·cp·tp consecutive GPUs; ``ep_overlap`` exposes only what the
  routed experts' GEMMs of the same pass do not hide (DeepSeek-V3's prefilling, arXiv 2412.19437).
* cp: K and V of the whole sequence (S = 2·b·s·kv width, bf16) on the cp·tp group's link.
  ``"allgather"``: one exposed all-gather in forward, one and a reduce-scatter of the
  gradients in backward (Llama 3, §3.3.2: "the all-gather communication latency is exposed on
  the critical path"). ``"ring"``: cp−1 hops of S/cp, each under its round's attention (1/cp
  of the core; Liu et al. 2023), 2·S/cp and twice the attention in backward.
* dp: gradients all-reduced over dp·cp (a routed expert's over its dp·cp/ep replicas); ZeRO 1/2
  move the same bytes as reduce-scatter + all-gather, ZeRO-3 gathers the weights again for
  backward: 1.5× (Rajbhandari et al. 2020, §7); HSDP (``dp_shard``) reduce-scatters and gathers
  inside its shard group and all-reduces the shard across the replicas, each on its own tier
  (:mod:`labkit.plan.scale.traffic`, which also counts every axis's bytes per tier: ``parts
  ["bytes_by_tier"]``). Full recomputation repeats a forward's calls.

Pipeline: with per-micro-batch rank costs w_r (forward + backward + p2p), GPipe and 1F1B take
Σ_r w_r + (m−1)·max_r w_r; interleaved with v chunks (m + (p−1)/v)·max_r w_r (bubble
(p−1)/(v·m+p−1), Narayanan et al. 2021 §2.2). zb-h1 splits backward into I (the input
gradient: everything but W) and W (the weight-gradient GEMMs, 24·b·s·h²/t a layer, and the
logits' half), and fills 1F1B's bubble with W: 2·(p−1)·W less (Qi et al., ICLR 2024, arXiv
2401.10241, §3.1: a bubble of (p−1)(F+I−W) against (p−1)(F+I+W)). Then the exposed dp
traffic and the optimizer step at HBM bandwidth.

    >>> p = predict(ModelShape(layers=96, hidden=12288, heads=96), Cluster(nodes=128), 1536,
    ...             ClusterStrategy(dp=8, pp=16, tp=8, recompute="full"))
    >>> p.step_time_s, p.tflops_per_gpu, p.memory_gb_per_gpu, p.fits
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...parallel.pipeline import SPLIT_BACKWARD
from .hardware import Cluster, ModelShape
from .layout import ClusterStrategy
from .model import Decoder
from .memory import (core_written_bytes, fits, gb, kv_width, layer_written_bytes, memory_breakdown, replica_groups,
                     sharded, stage_kinds)
from .simulation import simulate_scale
from .traffic import bytes_by_tier, dp_calls

ADAM_BYTES_PER_PARAM = 32
"""HBM traffic of one mixed-precision Adam update per parameter: read fp32 weight, momentum,
variance and gradient, write the three back and the bf16 copy (4·4 + 3·4 + 2 ≈ 30)."""


def gemm_efficiency(model: ModelShape, cluster: Cluster, s: ClusterStrategy) -> float:
    """Efficiency of the layer's main GEMMs (hidden/tp wide, b·s rows)."""
    return cluster.hardware.efficiency(min(model.hidden / s.tp, s.tokens(model.seq)))


def expert_comm_times(model, cluster: Cluster, s: ClusterStrategy, expert_fwd: float) -> tuple[float, float]:
    """Exposed seconds of one MoE layer's all-to-alls for one micro-batch: (forward, backward);
    ``expert_fwd``: the routed experts' forward GEMMs, what ``ep_overlap`` hides them behind."""
    if s.ep == 1:
        return 0.0, 0.0
    a2a = cluster.seconds("all_to_all", 2 * s.tokens(model.seq) * model.top_k * model.hidden, s.ep,
                          s.ep * s.pp * s.cp * s.tp)
    if s.ep_overlap == "none":
        return 2 * a2a, 2 * a2a
    return max(0.0, 2 * a2a - expert_fwd), max(0.0, 2 * a2a - 2 * expert_fwd)


def context_comm_times(model, cluster: Cluster, s: ClusterStrategy, core_fwd: float) -> tuple[float, float]:
    """Exposed seconds of one layer's context-parallel traffic for one micro-batch: (forward,
    backward); ``core_fwd``: the rank's attention core forward, what the ring hides under."""
    if s.cp == 1:
        return 0.0, 0.0
    span = s.cp * s.tp
    kv = 2 * 2 * s.microbatch_size * model.seq * kv_width(model) / s.tp       # K and V, bf16
    if s.cp_mode == "allgather":
        gather = cluster.seconds("all_gather", kv, s.cp, span)
        return gather, 2 * gather
    rounds, share = s.cp - 1, core_fwd / s.cp
    fwd = rounds * max(0.0, cluster.seconds("send", kv / s.cp, 2, span) - share)
    bwd = rounds * max(0.0, cluster.seconds("send", 2 * kv / s.cp, 2, span) - 2 * share)
    return fwd, bwd


def attention_times(model: ModelShape, cluster: Cluster, s: ClusterStrategy) -> tuple[float, float]:
    """Seconds of one layer's attention core (QKᵀ and the weighted sum of V) for one micro-batch:
    (forward, backward). On a GPU with a measured FlashAttention rate (``Hardware.attention_flops``)
    the kernel does the causal half of the square, a context-parallel rank half of its share too
    (Llama 3's 2×cp chunks balance it, §3.3.2), and its backward recomputes the scores: 2.5× the
    forward's FLOPs, at the kernel's own measured rate, not a GEMM's. Without one, the full square
    as GEMMs at the layer's efficiency, backward twice the forward (Megatron-LM 2021)."""
    hw, tokens = cluster.hardware, s.tokens(model.seq)
    full = model.attention_core_flops(tokens) / s.tp
    if not hw.attention_flops:
        t = full / (hw.peak_flops * hw.efficiency(min(model.hidden / s.tp, tokens)))
        return t, 2 * t
    forward_rate, backward_rate = hw.attention_flops
    return full / 2 / forward_rate, 2.5 * full / 2 / backward_rate


def elementwise_time(model: ModelShape, cluster: Cluster, s: ClusterStrategy, kind: str = "dense") -> float:
    """Forward seconds of one layer's memory-bound work (norms, activations, softmax, dropout,
    residuals): each activation the layer writes (:func:`~labkit.plan.scale.memory.layer_written_bytes`)
    written once and read once at HBM bandwidth, 2 × those bytes (what each tp rank touches); backward twice that."""
    return 2 * layer_written_bytes(model, s, kind) / cluster.hardware.hbm_bandwidth


@dataclass
class StageCosts:
    """Per-micro-batch seconds of each global stage (pp·chunks of them) and the step's tail."""

    fwd: list[float]
    bwd: list[float]
    p2p: float                   # one activation (or gradient) hop between neighbour stages
    dp_sync: float               # gradient all-reduce (or ZeRO's reduce-scatter + all-gather; HSDP's two tiers)
    optimizer: float
    tp_comm: float = 0.0         # of fwd + bwd, the part that is tp all-reduces (one micro-batch, one stage)
    ep_comm: float = 0.0         # of fwd + bwd, the exposed expert all-to-alls (one micro-batch, heaviest stage)
    cp_comm: float = 0.0         # of fwd + bwd, the exposed context-parallel K/V traffic (one micro-batch, one stage)
    bwd_weight: list[float] = field(default_factory=list)   # of bwd, the weight-gradient GEMMs (W)
    dp_gather_fwd: float = 0.0   # of dp_sync, ZeRO-3's all-gathers before the forward

    @property
    def bwd_input(self) -> list[float]:
        """Of bwd, what the input gradient needs (I): the rest of it."""
        return [b - w for b, w in zip(self.bwd, self.bwd_weight)]


def layer_times(model: ModelShape, cluster: Cluster, s: ClusterStrategy, kind: str, tp_ar: float) -> tuple:
    """Seconds of one layer of ``kind`` for one micro-batch: forward, backward, of backward the
    weight-gradient GEMMs (W), of forward and backward the exposed expert all-to-alls, and the
    exposed context-parallel traffic. Each GEMM group runs at its own efficiency."""
    hw, tokens = cluster.hardware, s.tokens(model.seq)
    groups = model.gemms(kind, tokens, s.tp)

    def gemm_s(flops: float, d: float) -> float:
        return flops / s.tp / (hw.peak_flops * hw.efficiency(d))
    # the GEMMs without the attention core, which attention_times prices on its own
    gemm_f = sum(gemm_s(f, d) for f, _, d in groups) - gemm_s(model.attention_core_flops(tokens), groups[0][2])
    gemm_w = sum(gemm_s(w, d) for _, w, d in groups)
    memory_bound = elementwise_time(model, cluster, s, kind)
    expert_f = sum(gemm_s(f, d) for f, _, d in groups[1:])              # the routed experts
    ep_f, ep_b = expert_comm_times(model, cluster, s, expert_f) if kind == "moe" else (0.0, 0.0)
    core_f, core_b = attention_times(model, cluster, s)
    cp_f, cp_b = context_comm_times(model, cluster, s, core_f)
    f = gemm_f + core_f + memory_bound + 2 * tp_ar + ep_f + cp_f
    b = 2 * (gemm_f + memory_bound) + core_b + 2 * tp_ar + ep_b + cp_b
    if s.recompute == "full":
        b += f
    elif s.recompute == "selective":        # torchtitan's op policy, or Megatron's: the attention core again
        b += gemm_s(model.selective_flops(kind, tokens), groups[0][2]) + memory_bound \
            if isinstance(model, Decoder) else core_f + 2 * core_written_bytes(model, s) / hw.hbm_bandwidth
    again = s.recompute == "full"
    return f, b, gemm_w, ep_f + ep_b + (ep_f if again else 0.0), cp_f + cp_b + (cp_f if again else 0.0)


def stage_costs(model: ModelShape, cluster: Cluster, s: ClusterStrategy) -> StageCosts:
    """The costs the closed form and the simulator share."""
    hw, tokens, stages = cluster.hardware, s.tokens(model.seq), s.pp * s.chunks
    act_bytes = 2 * tokens * model.hidden                      # bf16 b·(s/cp)·h
    tp_ar = cluster.seconds("all_reduce", act_bytes, s.tp, s.tp)
    logit_f = model.logit_forward_flops(tokens) / s.tp / (hw.peak_flops * gemm_efficiency(model, cluster, s))
    kinds_of = stage_kinds(model, stages)
    per_kind = {k: layer_times(model, cluster, s, k, tp_ar) for k in {k for kinds in kinds_of for k in kinds}}

    def per_stage(i: int, logits: float = 0.0) -> list[float]:
        """Item ``i`` of layer_times summed over each stage's layers, ``logits`` on the last."""
        out = [sum(n * per_kind[k][i] for k, n in kinds.items()) for kinds in kinds_of]
        out[-1] += logits
        return out
    p2p = 0.0
    if s.pp > 1:
        p2p = (cluster.seconds("send", act_bytes / s.tp, 2, s.pp * s.cp * s.tp)
               + cluster.seconds("all_gather", act_bytes, s.tp, s.tp))
    # dense gradients over dp·cp, each routed expert's over its dp·cp/ep replicas (traffic.dp_calls)
    calls, groups = dp_calls(model, s), max(replica_groups(model, s), key=lambda g: sum(g.values()))
    dp_sync = sum(c.seconds(cluster) for c in calls)
    optimizer = ADAM_BYTES_PER_PARAM * sharded(s, groups, 1) / hw.hbm_bandwidth
    return StageCosts(per_stage(0, logit_f), per_stage(1, 2 * logit_f), p2p, dp_sync, optimizer,
                      tp_comm=max(model.stage_layers(stages)) * 4 * tp_ar, ep_comm=max(per_stage(3)), cp_comm=max(per_stage(4)),
                      bwd_weight=per_stage(2, logit_f), dp_gather_fwd=sum(c.seconds(cluster) for c in calls if c.forward))


def rank_work(c: StageCosts, s: ClusterStrategy, p2p: bool = True) -> list[float]:
    """Seconds of one micro-batch on each pipeline rank: its chunks' forward and backward, and
    with ``p2p`` their two messages."""
    p = s.pp
    return [sum(c.fwd[k * p + r] + c.bwd[k * p + r] + (2 * c.p2p if p2p else 0.0) for k in range(s.chunks))
            for r in range(p)]


def pipeline_time(c: StageCosts, s: ClusterStrategy, m: int) -> float:
    """Forward and backward of all micro-batches (the closed form in the module docstring)."""
    p, per_rank = s.pp, rank_work(c, s)
    if s.schedule == "interleaved":
        return (m + (p - 1) / s.chunks) * max(per_rank)
    fill = 2 * (p - 1) * min(c.bwd_weight[:p]) if s.schedule in SPLIT_BACKWARD else 0.0   # W in 1F1B's bubble
    return sum(per_rank) + (m - 1) * max(per_rank) - fill


@dataclass
class Prediction:
    """One strategy's predicted step; the JSON of ``labkit plan --json`` is :meth:`summary`."""

    model: ModelShape
    cluster: Cluster
    strategy: ClusterStrategy
    global_batch: int
    step_time_s: float
    mfu: float
    tflops_per_gpu: float
    memory: dict
    fits: bool
    parts: dict = field(default_factory=dict)

    @property
    def memory_gb_per_gpu(self) -> float:
        return gb(self.memory["total"])

    @property
    def throughput_tokens_s(self) -> float:
        return self.global_batch * self.model.seq / self.step_time_s

    def summary(self) -> dict:
        return {"step_time_s": self.step_time_s, "mfu": self.mfu, "tflops_per_gpu": self.tflops_per_gpu,
                "memory_gb_per_gpu": self.memory_gb_per_gpu, "fits": self.fits}

    def timeline(self, max_microbatches: int | None = None):
        """The predicted timeline of one step (one pipeline; dp replicas are alike)."""
        return simulate_scale(self, stage_costs(self.model, self.cluster, self.strategy), max_microbatches)


def exposed_dp_sync(c: StageCosts, s: ClusterStrategy, last: list[float]) -> float:
    """Seconds of the dp traffic left exposed. With dp_mode "bucketed" all of it. Overlapped, the
    gradients' reduction hides behind the last micro-batch's backward (DDP's buckets, FSDP's
    reduce-scatters), ``last`` the backward part the gradients appear in; ZeRO-3's all-gathers
    for the forward (:func:`~labkit.plan.scale.traffic.dp_calls`) are prefetched behind the first
    micro-batch's forward, layer by layer, as FSDP2 does in both passes (Zhao et al. 2023,
    "PyTorch FSDP", §3.3.3 and §4.1: forward and backward prefetching)."""
    if not s.overlaps_dp:
        return c.dp_sync
    first_stage = range(0, s.pp * s.chunks, s.pp)          # this rank's chunks on pipeline rank 0
    tail_bwd = sum(last[g] for g in first_stage)
    if s.zero < 3:
        return max(0.0, c.dp_sync - tail_bwd)
    gather_fwd = c.dp_gather_fwd
    head_fwd = sum(c.fwd[g] for g in first_stage)
    return max(0.0, gather_fwd - head_fwd) + max(0.0, c.dp_sync - gather_fwd - tail_bwd)


def predict(model: ModelShape, cluster: Cluster, global_batch: int, strategy: ClusterStrategy) -> Prediction:
    """Memory, step time, MFU and TFLOP/s per GPU of ``strategy`` (ValueError if it cannot be placed)."""
    strategy.check(model, cluster, global_batch)
    m = strategy.microbatches(global_batch)
    c = stage_costs(model, cluster, strategy)
    pipe = pipeline_time(c, strategy, m)
    last = c.bwd_weight if strategy.schedule in SPLIT_BACKWARD else c.bwd        # the gradients appear in W
    dp_exposed = exposed_dp_sync(c, strategy, last)
    step = pipe + dp_exposed + c.optimizer
    peak = cluster.hardware.peak_flops
    mfu = model.model_flops(global_batch * model.seq) / (step * cluster.gpus * peak)      # PaLM, appendix B
    tflops = model.hardware_flops(global_batch, strategy.recompute) / (step * cluster.gpus) / 1e12
    memory = memory_breakdown(model, strategy, global_batch)
    ideal = m * max(rank_work(c, strategy, p2p=False))
    parts = {"pipeline_s": pipe, "compute_s": ideal, "bubble_and_p2p_s": pipe - ideal, "dp_comm_s": dp_exposed,
             "optimizer_s": c.optimizer, "tp_comm_s": m * c.tp_comm * strategy.chunks,
             "gemm_efficiency": gemm_efficiency(model, cluster, strategy), "microbatches": m,
             "bytes_by_tier": bytes_by_tier(model, cluster, strategy, m)}
    if strategy.ep > 1:
        parts["ep_comm_s"] = m * c.ep_comm * strategy.chunks
    if strategy.cp > 1:
        parts["cp_comm_s"] = m * c.cp_comm * strategy.chunks
    return Prediction(model, cluster, strategy, global_batch, step, mfu, tflops, memory,
                      fits(memory["total"], cluster.hardware.hbm_bytes), parts)
