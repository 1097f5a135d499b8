"""A strategy on a cluster: :class:`labkit.Strategy`'s vocabulary, plus what only a cluster needs.

:class:`ClusterStrategy` shares every name and choice it has in common with
:class:`labkit.Strategy` (``dp_mode``, ``schedule``, ``cp_mode``, ``ep_overlap``, ``recompute``,
…; the choices are read from Strategy's own fields) and adds what only matters at scale: the
micro-batch size (at scale the batch is fixed by the recipe and the size is the knob;
``Strategy.microbatches`` = global batch / (dp · microbatch_size)) and ``dp_shard`` (HSDP). The
planner prices a subset of Strategy's choices (:data:`PRICED`); another one is refused by name.
:meth:`ClusterStrategy.to_strategy` is the lab's Strategy that runs it, field for field.

Ranks are laid out as labkit's grid lays them out, ``arange(world).view(dp, pp, cp, tp)``, tp
innermost (Megatron's order), so a tp group is consecutive GPUs of one node and a cp group the
cp·tp GPUs around it; a dp_shard group is dp_shard consecutive dp ranks, pp·cp·tp GPUs apart.

    >>> s = ClusterStrategy(dp=8, pp=16, tp=8, microbatch_size=1, recompute="full")
    >>> s.check(ModelShape(layers=96, hidden=12288, heads=96), Cluster(nodes=128), global_batch=1536)
    >>> s.to_strategy(global_batch=1536).microbatches
    192
"""
from __future__ import annotations

import warnings
from dataclasses import InitVar, asdict, dataclass, fields

from ...config import Strategy
from .hardware import Cluster, ModelShape, require_whole

PRICED = {
    "schedule": ("gpipe", "1f1b", "interleaved", "zb-h1"),
    "cp_mode": ("ring", "allgather"),
    "dp_mode": ("bucketed", "overlap", "ddp"),
    "ep_overlap": ("none", "microbatch"),
    "recompute": ("none", "selective", "full"),
}
"""Of Strategy's choices, those the planner prices (zbv, Ulysses and the naive per-tensor
all-reduce are run by the lab and not priced at scale)."""

OVERLAPPED_DP_MODES = ("overlap", "ddp")
"""dp modes whose gradient reduction runs under the backward (the others reduce after it)."""

REMOVAL = "2027-03-01"
"""When the deprecated boolean spellings (dp_overlap=, ep_overlap=True/False) go."""


def strategy_choices(name: str) -> tuple:
    """Strategy's choices for field ``name`` (one definition, in :mod:`labkit.config`)."""
    return Strategy.__dataclass_fields__[name].metadata["choices"]


@dataclass(frozen=True, kw_only=True)
class ClusterStrategy:
    """Degrees and knobs of one training strategy on a cluster; dp·pp·cp·tp = GPUs."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
    (over dp_shard with HSDP)."""
    microbatch_size: int = 1
    """Sequences per micro-batch on one pipeline (only at scale: Strategy counts micro-batches,
    global_batch / (dp · microbatch_size) of them)."""
    schedule: str = "1f1b"
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved only)."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" (a GPT: the attention core; a Decoder:
    torchtitan's op policy) or "full" (every layer)."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism in the tp group (Korthikanti et al. 2022)."""
    dp_mode: str = "bucketed"
    """Strategy's dp modes: "bucketed" reduces the gradients after backward (Megatron-LM in
    2021, so the published table's default here); "overlap" and "ddp" under the last
    micro-batch's backward."""
    dp_shard: int | None = None
    """HSDP: ZeRO (zero ≥ 1) inside groups of dp_shard consecutive dp ranks, replicated across
    the dp / dp_shard groups (torchtitan's data_parallel_shard_degree, FSDP's HYBRID_SHARD), as
    ``Strategy.dp_shard``; None means ZeRO over all of dp·cp."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep dp ranks (the ranks
    ``pp·tp`` apart, so the group spans ep·pp·tp consecutive GPUs), tokens sent to them and
    back by two all-to-alls per layer and pass (DeepSeek-V3, Megatron-Core)."""
    ep_overlap: str = "none"
    """"microbatch": the all-to-alls hidden behind the experts' compute (DeepSeek-V3's
    two-micro-batch overlap)."""
    cp: int = 1
    """Context-parallel degree: every sequence cut over cp ranks (two chunks each, i and
    2·cp−1−i, so causal attention costs every rank the same); the weights are replicated
    over cp as over dp, so gradients are reduced, and ZeRO shards, over dp·cp."""
    cp_mode: str = "ring"
    """How attention reaches the other chunks' keys and values: "ring" (K/V blocks passed one
    hop per round under the round's attention, Liu et al. 2023) or "allgather" (K/V gathered
    before attention, exposed; the Llama 3 paper, §3.3.2)."""
    dp_overlap: InitVar[bool | None] = None
    """Deprecated: dp_mode="overlap" (True) or "bucketed" (False)."""

    def __post_init__(self, dp_overlap):
        self._deprecated(dp_overlap)
        require_whole(self, ("dp", "pp", "tp", "microbatch_size", "chunks", "ep", "cp"))
        if self.dp_shard is not None:
            require_whole(self, ("dp_shard",))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ClusterStrategy.zero={self.zero!r} must be 0, 1, 2 or 3")
        for name, priced in PRICED.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in strategy_choices(name):
                raise ValueError(f"ClusterStrategy.{name}={value!r} is unknown; use one of {', '.join(priced)}")
            if value not in priced:
                raise ValueError(f"ClusterStrategy.{name}={value!r} runs on the lab (labkit.Strategy) but is not "
                                 f"priced at scale; use one of {', '.join(priced)}")
        if self.dp_shard and (self.dp % self.dp_shard or self.zero == 0):
            raise ValueError(f"ClusterStrategy.dp_shard={self.dp_shard} shards ZeRO inside groups of dp ranks: it "
                             f"must divide dp={self.dp} and needs zero ≥ 1 (got zero={self.zero})")
        if self.dp_shard and self.ep > 1:
            raise ValueError(f"ClusterStrategy.dp_shard={self.dp_shard} with ep={self.ep}: HSDP is priced for "
                             "dense weights only; use ep=1, or dp_shard=None")
        if self.dp % self.ep:
            raise ValueError(f"ClusterStrategy.ep={self.ep} must divide dp={self.dp}: experts are spread over dp "
                             f"ranks; use an ep dividing {self.dp}")
        if self.ep_overlap != "none" and self.ep == 1:
            raise ValueError(f"ClusterStrategy.ep_overlap={self.ep_overlap!r} hides the experts' all-to-alls, and "
                             "ep=1 has none; use ep > 1, or ep_overlap='none'")
        if (self.chunks > 1) != (self.schedule == "interleaved" and self.pp > 1):
            raise ValueError(f"ClusterStrategy.chunks={self.chunks} with schedule={self.schedule!r}, pp={self.pp}: "
                             "chunks ≥ 2 goes with schedule='interleaved' and pp > 1, chunks=1 otherwise")

    def _deprecated(self, dp_overlap) -> None:
        """The boolean spellings of dp_mode and ep_overlap, warned and translated."""
        old = {"dp_overlap": dp_overlap, "ep_overlap": self.ep_overlap if isinstance(self.ep_overlap, bool) else None}
        for name, value in old.items():
            if value is None:
                continue
            new = ("dp_mode", "overlap" if value else "bucketed") if name == "dp_overlap" else \
                ("ep_overlap", "microbatch" if value else "none")
            warnings.warn(f"ClusterStrategy({name}={value}) is deprecated and goes on {REMOVAL}: write "
                          f"{new[0]}={new[1]!r} (labkit.Strategy's name)", FutureWarning, stacklevel=4)
            object.__setattr__(self, *new)

    @property
    def overlaps_dp(self) -> bool:
        """Whether the gradient reduction runs under the backward (dp_mode "overlap" or "ddp")."""
        return self.dp_mode in OVERLAPPED_DP_MODES

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: dp·cp (the gradient reduction's group)."""
        return self.dp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards over: dp_shard·cp with HSDP, else all dp·cp replicas."""
        return (self.dp_shard or self.dp) * self.cp

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

    def to_strategy(self, global_batch: int) -> Strategy:
        """The labkit.Strategy that runs this: every field of the same name, and the micro-batch
        count for ``global_batch``. ValueError (Strategy's own) where the lab cannot run it."""
        shared = {f.name for f in fields(Strategy)} & {f.name for f in fields(self)}
        if self.dp_shard and "dp_shard" not in shared:
            raise ValueError(f"ClusterStrategy.dp_shard={self.dp_shard} has no labkit.Strategy field to run it with; "
                             "run it without, or price it only")
        kept = {n: getattr(self, n) for n in shared}
        return Strategy(**kept, microbatches=self.microbatches(global_batch))

    def label(self) -> str:
        extra = (f" v{self.chunks}" if self.chunks > 1 else "") + (" sp" if self.sequence_parallel else "")
        ep = f" ep{self.ep}" + (" a2a-overlap" if self.ep_overlap != "none" else "") if self.ep > 1 else ""
        hsdp = f" shard{self.dp_shard}" if self.dp_shard and self.dp_shard < self.dp else ""
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        mode = f" cp:{self.cp_mode}" if self.cp > 1 else ""
        return (f"dp{self.dp}{hsdp} pp{self.pp}{cp} tp{self.tp} z{self.zero} mbs{self.microbatch_size} "
                f"{self.schedule}{extra} rc:{self.recompute}{ep}{mode}")
