"""A strategy on a cluster: the degrees and knobs the planner ranks, and where they land.

:class:`ClusterStrategy` is the at-scale twin of :class:`labkit.Strategy`: it adds what only
matters at scale (micro-batch size, recomputation, sequence parallelism) and keeps tp and
zero analytic. Ranks are laid out as labkit's grid lays them out, ``arange(world).view(dp,
pp, cp, tp)``, tp innermost (Megatron's order), so a tp group is consecutive GPUs of one node
and a cp group the cp·tp GPUs around it.

    >>> s = ClusterStrategy(dp=8, pp=16, tp=8, microbatch_size=1, recompute="full")
    >>> s.check(ModelShape(layers=96, hidden=12288, heads=96), Cluster(nodes=128), global_batch=1536)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .hardware import Cluster, ModelShape, require_whole

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CP_MODES = ("ring", "allgather")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class ClusterStrategy:
    """Degrees and knobs of one training strategy on a cluster; dp·pp·cp·tp = GPUs."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp."""
    microbatch_size: int = 1
    """Sequences per micro-batch on one pipeline (the micro-batch count follows from the batch)."""
    schedule: str = "1f1b"
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved only)."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" (attention core) or "full" (every layer)."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism in the tp group (Korthikanti et al. 2022)."""
    dp_overlap: bool = False
    """Gradient all-reduce overlapped with the last micro-batch's backward (DDP buckets);
    Megatron-LM in 2021 reduced after backward, so the published table uses False."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep dp ranks (the ranks
    ``pp·tp`` apart, so the group spans ep·pp·tp consecutive GPUs), tokens sent to them and
    back by two all-to-alls per layer and pass (DeepSeek-V3, Megatron-Core)."""
    ep_overlap: bool = False
    """The all-to-alls hidden behind the experts' compute (DeepSeek-V3's two-micro-batch overlap)."""
    cp: int = 1
    """Context-parallel degree: every sequence cut over cp ranks (two chunks each, i and
    2·cp−1−i, so causal attention costs every rank the same); the weights are replicated
    over cp as over dp, so gradients are reduced, and ZeRO shards, over dp·cp."""
    cp_mode: str = "ring"
    """How attention reaches the other chunks' keys and values: "ring" (K/V blocks passed one
    hop per round under the round's attention, Liu et al. 2023) or "allgather" (K/V gathered
    before attention, exposed; the Llama 3 paper, §3.3.2)."""

    def __post_init__(self):
        require_whole(self, ("dp", "pp", "tp", "microbatch_size", "chunks", "ep", "cp"))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ClusterStrategy.zero={self.zero!r} must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ClusterStrategy.schedule={self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"ClusterStrategy.recompute={self.recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"ClusterStrategy.cp_mode={self.cp_mode!r} is unknown; use one of {', '.join(CP_MODES)}")
        if self.dp % self.ep:
            raise ValueError(f"ClusterStrategy.ep={self.ep} must divide dp={self.dp}: experts are spread over dp "
                             f"ranks; use an ep dividing {self.dp}")
        if self.ep_overlap and self.ep == 1:
            raise ValueError("ClusterStrategy.ep_overlap=True hides the experts' all-to-alls, and ep=1 has none; "
                             "use ep > 1, or ep_overlap=False")
        if (self.chunks > 1) != (self.schedule == "interleaved" and self.pp > 1):
            raise ValueError(f"ClusterStrategy.chunks={self.chunks} with schedule={self.schedule!r}, pp={self.pp}: "
                             "chunks ≥ 2 goes with schedule='interleaved' and pp > 1, chunks=1 otherwise")

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: dp·cp (the gradient all-reduce's and ZeRO's group)."""
        return self.dp * self.cp

    def tokens(self, seq: int) -> int:
        """Tokens of one micro-batch on one rank: microbatch_size · seq / cp."""
        return self.microbatch_size * seq // self.cp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each pipeline: global_batch / (dp · microbatch_size)."""
        return global_batch // (self.dp * self.microbatch_size)

    def check(self, model: ModelShape, cluster: Cluster, global_batch: int) -> None:
        """Raise ValueError naming the field and the fix unless this strategy can be placed."""
        if self.gpus != cluster.gpus:
            axes = ("dp", "pp", "cp", "tp") if self.cp > 1 else ("dp", "pp", "tp")
            raise ValueError(f"{'*'.join(axes)} = {'*'.join(str(getattr(self, a)) for a in axes)} = {self.gpus} "
                             f"but the cluster has {cluster.gpus} GPUs; choose degrees whose product is {cluster.gpus}")
        if model.seq % (2 * self.cp) and self.cp > 1:
            raise ValueError(f"cp={self.cp} cuts each sequence into 2·cp = {2 * self.cp} chunks, but seq={model.seq} "
                             f"does not divide by {2 * self.cp}; use a cp with 2·cp dividing the sequence")
        if self.tp > cluster.gpus_per_node:
            raise ValueError(f"tp={self.tp} is larger than a node ({cluster.gpus_per_node} GPUs): tensor "
                             f"parallelism needs NVLink; use tp ≤ {cluster.gpus_per_node}")
        if model.heads % self.tp or model.hidden % self.tp:
            raise ValueError(f"tp={self.tp} must divide heads={model.heads} and hidden={model.hidden}")
        if not model.can_split(self.pp * self.chunks):
            how = ("equal stages; choose pp (and chunks) dividing the layer count" if isinstance(model, ModelShape)
                   else "stages of a layer, two of none at most; choose pp*chunks ≤ the layer count + 2")
            raise ValueError(f"layers={model.layers} do not split into pp*chunks = {self.pp * self.chunks} {how}")
        if self.ep > 1 and (not getattr(model, "experts", 0) or model.experts % self.ep):
            raise ValueError(f"ep={self.ep} needs a model whose MoE layers' experts divide over {self.ep} ranks "
                             f"(experts={getattr(model, 'experts', 0)}); use an ep dividing the experts, or ep=1")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch={global_batch!r} must be a whole number ≥ 1")
        if global_batch % (self.dp * self.microbatch_size):
            raise ValueError(f"global_batch={global_batch} does not divide by dp*microbatch_size = "
                             f"{self.dp}*{self.microbatch_size}; change the batch or the micro-batch size")
        if self.schedule == "interleaved" and self.microbatches(global_batch) % self.pp:
            raise ValueError(f"the interleaved schedule needs micro-batches ({self.microbatches(global_batch)}) "
                             f"to be a multiple of pp={self.pp}")

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        extra = (f" v{self.chunks}" if self.chunks > 1 else "") + (" sp" if self.sequence_parallel else "")
        ep = f" ep{self.ep}" + (" a2a-overlap" if self.ep_overlap else "") if self.ep > 1 else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        mode = f" cp:{self.cp_mode}" if self.cp > 1 else ""
        return (f"dp{self.dp} pp{self.pp}{cp} tp{self.tp} z{self.zero} mbs{self.microbatch_size} "
                f"{self.schedule}{extra} rc:{self.recompute}{ep}{mode}")
