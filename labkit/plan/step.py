"""Step time, MFU and memory of a GPT under a strategy on a cluster, from first principles.

Compute: FLOPs of each pipeline stage per micro-batch (Narayanan et al. 2021, §5.1: a layer's
forward is 24·b·s·h² + 4·b·s²·h, backward twice that, full recomputation one more forward;
the logits 2·b·s·h·V on the last stage), divided by tp, at peak × the GEMM efficiency
``eff(d) = e_max · d / (d + d_half)`` with d the smallest GEMM dimension on one GPU,
min(h/tp, b·s) (see :class:`~labkit.plan.hardware.Hardware`).

Communication: α-β per call on the link the group is placed on (tp inside a node on NVLink;
pp and dp across nodes on InfiniBand once a group spans more than a node). Ring all-reduce
moves 2(n−1)/n·S per GPU (nccl-tests' bus factor). Per layer Megatron's tensor parallelism
does 2 all-reduces of b·s·h in forward and 2 in backward (the f and g operators), 2 more when
the forward is recomputed. Pipeline neighbours exchange b·s·h activations, split over the tp
ranks and all-gathered over NVLink (Megatron's scatter/gather optimisation, §4.1).

Expert parallelism (``ep`` > 1): each MoE layer sends every token's top_k rows (bf16, k·h each)
to its experts' ranks and back, two all-to-alls in forward and their two mirrors in backward
(two more when full recomputation runs the forward again), each α + (ep−1)/ep · S/β with S = 2·b·s·k·h on the
ep group's link (NVLink while ep·pp·tp consecutive GPUs fit in a node, else InfiniBand; the
per-GPU bandwidth bounds a personalised exchange as it bounds a ring). ``ep_overlap`` hides
them behind the routed experts' GEMMs of the same pass (DeepSeek-V3 §3.2.2): only
max(0, all-to-all − expert compute) is exposed. The routed experts' gradients are
all-reduced over the dp/ep replicas of each expert, the rest over dp.

Context parallelism (``cp`` > 1): each rank computes s/cp tokens of every sequence (two
balanced chunks, so causal attention costs each the same): every GEMM and the attention core
at 1/cp. Attention needs the other chunks' keys and values (K and V of the whole sequence,
2·b·s·kv width in bf16, S below), on the cp group's link (NVLink while cp·tp GPUs fit in a
node). ``cp_mode="allgather"`` gathers them before attention, exposed (the Llama 3 paper,
§3.3.2: "the all-gather communication latency is exposed on the critical path"): one
all-gather in forward, and in backward one again and a reduce-scatter of their gradients.
``"ring"`` passes one block (S/cp) a hop per round, cp−1 rounds, each under that round's
attention (1/cp of the rank's attention core; Liu et al. 2023, Ring Attention): exposed
max(0, α + S/(cp·β) − core/cp) a round in forward, and with the gradients travelling too,
max(0, α + 2S/(cp·β) − 2·core/cp) in backward. The gradient all-reduce runs over dp·cp.

Pipeline: with per-micro-batch rank costs w_r (forward + backward + p2p), GPipe and 1F1B take
Σ_r w_r + (m−1)·max_r w_r; interleaved with v chunks (m + (p−1)/v)·max_r w_r (bubble
(p−1)/(v·m+p−1), Narayanan et al. 2021 §2.2). zb-h1 splits backward into I (input gradients:
the attention core's backward and half of the GEMMs', the memory-bound work, tp's f calls,
recomputation) and W (the weight-gradient GEMMs, 24·b·s·h²/t a layer, and the logits' half),
and fills the 1F1B bubble with W: 2·(p−1)·W less (Qi et al. 2023, arXiv 2401.10241, §3.1: a
bubble of (p−1)(F+I−W) against 1F1B's (p−1)(F+I+W)), at 1F1B's peak activation memory. Then the dp gradient all-reduce (exposed unless
``dp_overlap``), ZeRO-3's parameter all-gathers, and the optimizer step at HBM bandwidth.

    >>> p = predict(GPT(layers=96, hidden=12288, heads=96), Cluster(nodes=128), 1536,
    ...             ClusterStrategy(dp=8, pp=16, tp=8, recompute="full"))
    >>> p.step_time_s, p.tflops_per_gpu, p.memory_gb_per_gpu, p.fits
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.pipeline import SPLIT_BACKWARD
from .hardware import GPT, Cluster
from .layout import ClusterStrategy
from .memory import expert_split, fits, gb, kv_width, layer_activation_bytes, memory_breakdown
from .simulation import simulate_scale

ADAM_BYTES_PER_PARAM = 32
"""HBM traffic of one mixed-precision Adam update per parameter: read fp32 weight, momentum,
variance and gradient, write the three back and the bf16 copy (4·4 + 3·4 + 2 ≈ 30)."""


def gemm_efficiency(model: GPT, cluster: Cluster, s: ClusterStrategy) -> float:
    """Efficiency of the layer's main GEMMs (hidden/tp wide, b·s rows)."""
    return _efficiency(cluster, min(model.hidden / s.tp, s.tokens(model.seq)))


def _efficiency(cluster: Cluster, d: float) -> float:
    hw = cluster.hardware
    return hw.gemm_max_efficiency * d / (d + hw.gemm_half_dim)


def expert_comm_times(model, cluster: Cluster, s: ClusterStrategy, expert_fwd: float) -> tuple[float, float]:
    """Exposed seconds of one MoE layer's all-to-alls for one micro-batch: (forward, backward);
    ``expert_fwd``: the routed experts' forward GEMMs, what ``ep_overlap`` hides them behind."""
    if s.ep == 1:
        return 0.0, 0.0
    a2a = cluster.link(s.ep * s.pp * s.cp * s.tp).seconds("all_to_all", 2 * s.tokens(model.seq) * model.top_k
                                                          * model.hidden, s.ep)
    if not s.ep_overlap:
        return 2 * a2a, 2 * a2a
    return max(0.0, 2 * a2a - expert_fwd), max(0.0, 2 * a2a - 2 * expert_fwd)


def context_comm_times(model, cluster: Cluster, s: ClusterStrategy, core_fwd: float) -> tuple[float, float]:
    """Exposed seconds of one layer's context-parallel traffic for one micro-batch: (forward,
    backward); ``core_fwd``: the rank's attention core forward, what the ring hides under."""
    if s.cp == 1:
        return 0.0, 0.0
    link = cluster.link(s.cp * s.tp)
    kv = 2 * 2 * s.microbatch_size * model.seq * kv_width(model) / s.tp       # K and V, bf16
    if s.cp_mode == "allgather":
        gather = link.seconds("all_gather", kv, s.cp)
        return gather, 2 * gather
    rounds, share = s.cp - 1, core_fwd / s.cp
    fwd = rounds * max(0.0, link.seconds("send", kv / s.cp, 2) - share)
    bwd = rounds * max(0.0, link.seconds("send", 2 * kv / s.cp, 2) - 2 * share)
    return fwd, bwd


def elementwise_time(model: GPT, cluster: Cluster, s: ClusterStrategy, kind: str = "dense") -> float:
    """Forward seconds of one layer's memory-bound work (layer norms, GeLU, softmax, dropout,
    bias adds, residuals): each activation Korthikanti et al. count is written once and read
    once at HBM bandwidth, so 2 × their no-recompute bytes per layer (Table 2, no sequence
    parallelism: what each tp rank touches); backward moves about twice as much."""
    plain = ClusterStrategy(tp=s.tp, microbatch_size=s.microbatch_size, sequence_parallel=s.sequence_parallel,
                            cp=s.cp)
    return 2 * layer_activation_bytes(model, plain, kind) / cluster.hardware.hbm_bandwidth


@dataclass
class StageCosts:
    """Per-micro-batch seconds of each global stage (pp·chunks of them) and the step's tail."""

    fwd: list[float]
    bwd: list[float]
    p2p: float                   # one activation (or gradient) hop between neighbour stages
    dp_sync: float               # gradient all-reduce (or ZeRO's reduce-scatter + all-gather)
    optimizer: float
    tp_comm: float = 0.0         # of fwd + bwd, the part that is tp all-reduces (one micro-batch, one stage)
    ep_comm: float = 0.0         # of fwd + bwd, the exposed expert all-to-alls (one micro-batch, heaviest stage)
    cp_comm: float = 0.0         # of fwd + bwd, the exposed context-parallel K/V traffic (one micro-batch, one stage)
    bwd_weight: list[float] = field(default_factory=list)   # of bwd, the weight-gradient GEMMs (W)

    @property
    def bwd_input(self) -> list[float]:
        """Of bwd, what the input gradient needs (I): the rest of it."""
        return [b - w for b, w in zip(self.bwd, self.bwd_weight)]


def layer_times(model: GPT, cluster: Cluster, s: ClusterStrategy, kind: str, tp_ar: float) -> tuple:
    """Seconds of one layer of ``kind`` for one micro-batch: forward, backward, of backward the
    weight-gradient GEMMs (W), of forward and backward the exposed expert all-to-alls, and the
    exposed context-parallel traffic. Each GEMM group runs at its own efficiency."""
    rate = cluster.hardware.peak_flops
    tokens = s.tokens(model.seq)
    groups = model.gemms(kind, tokens, s.tp)
    gemm_f = sum(f / s.tp / (rate * _efficiency(cluster, d)) for f, _, d in groups)
    gemm_w = sum(w / s.tp / (rate * _efficiency(cluster, d)) for _, w, d in groups)
    memory_bound = elementwise_time(model, cluster, s, kind)
    expert_f = sum(fl / s.tp / (rate * _efficiency(cluster, d)) for fl, _, d in groups[1:])   # routed experts
    ep_f, ep_b = expert_comm_times(model, cluster, s, expert_f) if kind == "moe" else (0.0, 0.0)
    core_f = model.attention_core_flops(tokens) / s.tp / (rate * _efficiency(cluster, groups[0][2]))
    cp_f, cp_b = context_comm_times(model, cluster, s, core_f)
    f = gemm_f + memory_bound + 2 * tp_ar + ep_f + cp_f
    b = 2 * (gemm_f + memory_bound) + 2 * tp_ar + ep_b + cp_b
    if s.recompute == "full":
        b += f
    elif s.recompute == "selective":        # the attention core again
        b += core_f
    again = s.recompute == "full"
    return f, b, gemm_w, ep_f + ep_b + (ep_f if again else 0.0), cp_f + cp_b + (cp_f if again else 0.0)


def stage_costs(model: GPT, cluster: Cluster, s: ClusterStrategy) -> StageCosts:
    """The costs the closed form and the simulator share."""
    hw, eff = cluster.hardware, gemm_efficiency(model, cluster, s)
    flops_rate = hw.peak_flops * eff
    tokens = s.tokens(model.seq)
    stages = s.pp * s.chunks
    act_bytes = 2 * tokens * model.hidden                      # bf16 b·(s/cp)·h
    tp_link = cluster.link(s.tp)
    tp_ar = tp_link.seconds("all_reduce", act_bytes, s.tp)
    logit_f = model.logit_forward_flops(tokens) / s.tp / flops_rate
    fwd, bwd, bwd_weight, first = [], [], [], 0
    per_kind = {}
    for g, count in enumerate(model.stage_layers(stages)):
        kinds = model.kinds(first, count)
        first += count
        for kind in kinds:
            if kind not in per_kind:
                per_kind[kind] = layer_times(model, cluster, s, kind, tp_ar)
        last = g == stages - 1
        fwd.append(sum(n * per_kind[k][0] for k, n in kinds.items()) + (logit_f if last else 0.0))
        bwd.append(sum(n * per_kind[k][1] for k, n in kinds.items()) + (2 * logit_f if last else 0.0))
        bwd_weight.append(sum(n * per_kind[k][2] for k, n in kinds.items()) + (logit_f if last else 0.0))
    pp_link = cluster.link(s.pp * s.cp * s.tp)
    p2p = 0.0
    if s.pp > 1:
        p2p = pp_link.seconds("send", act_bytes / s.tp, 2) + tp_link.seconds("all_gather", act_bytes, s.tp)
    params_local = max(model.rank_params(s.pp, s.chunks)) / s.tp
    grads = 2 * params_local
    dp_link = cluster.link(s.gpus)
    replicas = s.replicas            # dp·cp ranks hold the same weights
    # ZeRO 1/2 replace the all-reduce by reduce-scatter + all-gather: the same bytes; ZeRO-3
    # gathers the weights again for backward: 1.5× (Rajbhandari et al. 2020, §7). Without ep
    # the MoE experts are replicated over dp, so their gradients are all-reduced too.
    dp_sync = dp_link.seconds("all_reduce", grads, replicas) * (1.5 if s.zero >= 3 else 1.0)
    optimizer = ADAM_BYTES_PER_PARAM * params_local / (replicas if s.zero >= 1 else 1) / hw.hbm_bandwidth
    ep_comm = 0.0
    if s.ep > 1:           # dense gradients over dp·cp, each expert's over its dp·cp/ep replicas
        dense, expert = expert_split(model, s)
        edp = replicas // s.ep
        dp_sync = (dp_link.seconds("all_reduce", 2 * dense, replicas) + dp_link.seconds("all_reduce", 2 * expert, edp)) \
            * (1.5 if s.zero >= 3 else 1.0)
        optimizer = ADAM_BYTES_PER_PARAM * (dense / (replicas if s.zero >= 1 else 1)
                                            + expert / (edp if s.zero >= 1 else 1)) / hw.hbm_bandwidth
        ep_comm = max(model.kinds(sum(model.stage_layers(stages)[:g]), n).get("moe", 0)
                      for g, n in enumerate(model.stage_layers(stages))) * per_kind["moe"][3]
    layers = max(model.stage_layers(stages))
    cp_comm = layers * max(v[4] for v in per_kind.values())
    return StageCosts(fwd, bwd, p2p, dp_sync, optimizer, tp_comm=layers * 4 * tp_ar, bwd_weight=bwd_weight,
                      ep_comm=ep_comm, cp_comm=cp_comm)


def pipeline_time(c: StageCosts, s: ClusterStrategy, m: int) -> float:
    """Forward and backward of all micro-batches (the closed form in the module docstring)."""
    p, v = s.pp, s.chunks
    per_rank = [sum(c.fwd[k * p + r] + c.bwd[k * p + r] + 2 * c.p2p for k in range(v))
                for r in range(p)]
    if s.schedule == "interleaved":
        return (m + (p - 1) / v) * max(per_rank)
    if s.schedule in SPLIT_BACKWARD:       # the cool-down's W fill what 1F1B leaves idle
        return sum(per_rank) + (m - 1) * max(per_rank) - 2 * (p - 1) * min(c.bwd_weight[:p])
    return sum(per_rank) + (m - 1) * max(per_rank)


@dataclass
class Prediction:
    """One strategy's predicted step; the JSON of ``labkit plan --json`` is :meth:`summary`."""

    model: GPT
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
    """Seconds of the dp traffic left exposed. Without ``dp_overlap`` all of it. With it, the
    gradients' reduction hides behind the last micro-batch's backward (DDP's buckets, FSDP's
    reduce-scatters), ``last`` the backward part the gradients appear in; ZeRO-3's traffic is
    three equal passes over the weights (all-gather for forward, all-gather for backward,
    reduce-scatter), and the forward's all-gathers are prefetched behind the first
    micro-batch's forward, layer by layer, as FSDP2 does in both passes (Zhao et al. 2023,
    "PyTorch FSDP", §3.3.3 and §4.1: forward and backward prefetching)."""
    if not s.dp_overlap:
        return c.dp_sync
    first_stage = range(0, s.pp * s.chunks, s.pp)          # this rank's chunks on pipeline rank 0
    tail_bwd = sum(last[g] for g in first_stage)
    if s.zero < 3:
        return max(0.0, c.dp_sync - tail_bwd)
    gather_fwd = c.dp_sync / 3
    head_fwd = sum(c.fwd[g] for g in first_stage)
    return max(0.0, gather_fwd - head_fwd) + max(0.0, c.dp_sync - gather_fwd - tail_bwd)


def hardware_flops(model: GPT, global_batch: int, recompute: str) -> float:
    """FLOPs the GPUs execute per step (recomputation included), as the model counts them."""
    return model.hardware_flops(global_batch, recompute)


def predict(model: GPT, cluster: Cluster, global_batch: int, strategy: ClusterStrategy) -> Prediction:
    """Memory, step time, MFU and TFLOP/s per GPU of ``strategy`` (ValueError if it cannot be placed)."""
    strategy.check(model, cluster, global_batch)
    m = strategy.microbatches(global_batch)
    c = stage_costs(model, cluster, strategy)
    pipe = pipeline_time(c, strategy, m)
    last = c.bwd_weight if strategy.schedule in SPLIT_BACKWARD else c.bwd        # the gradients appear in W
    dp_exposed = exposed_dp_sync(c, strategy, last)
    step = pipe + dp_exposed + c.optimizer
    tokens = global_batch * model.seq
    peak = cluster.hardware.peak_flops
    mfu = model.model_flops(tokens) / (step * cluster.gpus * peak)      # PaLM, appendix B
    tflops = hardware_flops(model, global_batch, strategy.recompute) / (step * cluster.gpus) / 1e12
    memory = memory_breakdown(model, strategy, global_batch)
    ideal = m * max(sum(c.fwd[k * strategy.pp + r] + c.bwd[k * strategy.pp + r] for k in range(strategy.chunks))
                    for r in range(strategy.pp))
    parts = {"pipeline_s": pipe, "compute_s": ideal, "bubble_and_p2p_s": pipe - ideal, "dp_comm_s": dp_exposed,
             "optimizer_s": c.optimizer, "tp_comm_s": m * c.tp_comm * strategy.chunks,
             "gemm_efficiency": gemm_efficiency(model, cluster, strategy), "microbatches": m}
    if strategy.ep > 1:
        parts["ep_comm_s"] = m * c.ep_comm * strategy.chunks
    if strategy.cp > 1:
        parts["cp_comm_s"] = m * c.cp_comm * strategy.chunks
    return Prediction(model, cluster, strategy, global_batch, step, mfu, tflops, memory,
                      fits(memory["total"], cluster.hardware.hbm_bytes), parts)
