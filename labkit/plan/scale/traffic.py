"""What each axis sends at scale, on which tier: the dp calls (plain, ZeRO, HSDP) and bytes per tier.

A group lands on a tier by the GPUs it spans: the "intra" tier (NVLink) when its consecutive
ranks fit in one node, else "inter" (InfiniBand), priced by
:meth:`~labkit.plan.scale.hardware.Cluster.seconds` (a ring on each node's NICs at once).
Ranks are ``arange(world).view(dp, pp, cp, tp)``, so a tp group spans tp GPUs, a cp group cp·tp,
a pp group pp·cp·tp, an ep group ep·pp·cp·tp, and the dp group the whole cluster.

**The dp calls.** Per pipeline rank, for its parameters n (per tp shard, 16-bit gradients and
weights, 2n bytes), over the R = dp·cp ranks that hold them:

    zero 0–2       all-reduce(2n, R) (ZeRO 1/2's reduce-scatter + all-gather move the same bytes)
    zero 3         all-gather(2n, R) for forward, all-gather(2n, R) for backward, reduce-scatter(2n, R)
    HSDP           ZeRO inside groups of S = dp_shard·cp ranks (spanning dp_shard·pp·cp·tp GPUs), the
                   R/S groups replicas of each other: reduce-scatter(2n, S), all-reduce(2n/S, R/S)
                   of the shard across the replicas (spanning the cluster), all-gather(2n, S) of the
                   updated weights (zero 3: that gather twice, for forward and for backward)

(torchtitan's ``data_parallel_shard_degree`` × ``data_parallel_replicate_degree``, FSDP's
HYBRID_SHARD: Zhao et al. 2023, "PyTorch FSDP", §3.2.2). A routed expert's parameters go over
their R/ep replicas. Bytes a rank sends in a call of S bytes on n ranks: nccl-tests' bus factor,
2(n−1)/n·S for all-reduce, (n−1)/n·S for the others (:func:`~labkit.plan.wire.bus_factor`).

**Per step, per rank** (the heaviest pipeline rank, m micro-batches, L its layers, a = 2·b·(s/cp)·h
bytes of activations): tp 4·L·m all-reduces of a (6 with full recomputation; sequence
parallelism's all-gathers and reduce-scatters move the same bytes); pp 2·v·m sends of a/tp;
cp 3·L·m K/V exchanges (forward once, backward twice); ep 4 all-to-alls of 2·b·(s/cp)·k·h a MoE
layer and micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..wire import bus_factor
from .hardware import Cluster
from .layout import ClusterStrategy
from .memory import kv_width, replica_groups, stage_kinds


@dataclass(frozen=True)
class Call:
    """One collective of the step: its family, bytes (nccl-tests' size), ranks and the GPUs its group spans."""

    family: str
    nbytes: float
    ranks: int
    span: int
    forward: bool = False
    """ZeRO-3's all-gather before the forward (what FSDP prefetches behind it)."""

    def seconds(self, cluster: Cluster) -> float:
        return cluster.seconds(self.family, self.nbytes, self.ranks, self.span)

    def sent(self) -> float:
        """Bytes one rank sends in this call."""
        return bus_factor(self.family, self.ranks) * self.nbytes if self.ranks > 1 else 0.0


def dp_calls(model, s: ClusterStrategy) -> list[Call]:
    """The dp calls of one step on the pipeline rank with the most parameters (module docstring)."""
    groups = max(replica_groups(model, s), key=lambda g: sum(g.values()))
    out = []
    for ranks, n in groups.items():
        shard = ranks * s.shard_group // s.replicas           # S (all of R without HSDP)
        if shard == ranks:
            if s.zero < 3:
                out.append(Call("all_reduce", 2 * n, ranks, s.gpus))
            else:
                out += [Call("all_gather", 2 * n, ranks, s.gpus, forward=True), Call("all_gather", 2 * n, ranks, s.gpus),
                        Call("reduce_scatter", 2 * n, ranks, s.gpus)]
            continue
        span = (s.dp_shard or s.dp) * s.pp * s.cp * s.tp
        out += [Call("reduce_scatter", 2 * n, shard, span), Call("all_reduce", 2 * n / shard, ranks // shard, s.gpus),
                Call("all_gather", 2 * n, shard, span)]
        if s.zero >= 3:
            out.append(Call("all_gather", 2 * n, shard, span, forward=True))
    return out


def tier(cluster: Cluster, span: int) -> str:
    """"intra" when a group of ``span`` consecutive GPUs fits in a node, else "inter"."""
    return "intra" if span <= cluster.gpus_per_node else "inter"


def axis_calls(model, s: ClusterStrategy, m: int) -> dict[str, list[tuple[Call, float]]]:
    """Per axis, (call, how many of it a step) on the heaviest pipeline rank (module docstring)."""
    tokens = s.tokens(model.seq)
    act = 2 * tokens * model.hidden
    stages = stage_kinds(model, s.pp * s.chunks)
    per_rank = [[stages[g] for g in range(r, len(stages), s.pp)] for r in range(s.pp)]
    layers = max(sum(sum(k.values()) for k in held) for held in per_rank)
    moe_layers = max(sum(k.get("moe", 0) for k in held) for held in per_rank)
    out = {"dp": [(c, 1) for c in dp_calls(model, s)]}
    if s.tp > 1:
        out["tp"] = [(Call("all_reduce", act, s.tp, s.tp), (6 if s.recompute == "full" else 4) * layers * m)]
    if s.pp > 1:
        out["pp"] = [(Call("send", act / s.tp, 2, s.pp * s.cp * s.tp), 2 * s.chunks * m)]
    if s.cp > 1:
        kv = 2 * 2 * s.microbatch_size * model.seq * kv_width(model) / s.tp
        call = Call("all_gather", kv, s.cp, s.cp * s.tp) if s.cp_mode == "allgather" else \
            Call("send", kv / s.cp, 2, s.cp * s.tp)
        out["cp"] = [(call, 3 * layers * m * (1 if s.cp_mode == "allgather" else s.cp - 1))]
    if s.ep > 1 and moe_layers:
        out["ep"] = [(Call("all_to_all", 2 * tokens * model.top_k * model.hidden, s.ep, s.ep * s.pp * s.cp * s.tp),
                      4 * moe_layers * m)]
    return out


def bytes_by_tier(model, cluster: Cluster, s: ClusterStrategy, m: int) -> dict[str, float]:
    """Bytes one rank sends in a step on each tier: {"intra": …, "inter": …}."""
    out = {"intra": 0.0, "inter": 0.0}
    for calls in axis_calls(model, s, m).values():
        for call, count in calls:
            out[tier(cluster, call.span)] += count * call.sent()
    return out
