"""The rank grid: which ranks form the data-, pipeline-, context- and tensor-parallel groups.

Ranks are laid out as ``arange(world).view(dp, pp, cp, tp)`` (tp innermost, then cp, as
Megatron does, so tensor-parallel peers are neighbours on one node and a ring of context-
parallel ranks stays close; with cp = 1 it is the ``view(dp, pp, tp)`` of before).
:class:`ParallelDims` is pure and validated once; :func:`build_groups` turns it into torch process groups on the engines, each
with an explicit timeout, because sub-groups do not inherit the world group's. The drawing
is notebook-side: :func:`labkit.view.grid.draw_grid`.

Expert parallelism draws its groups from the dp ranks (DeepSeek-V3, Megatron-Core): each dp
group is cut into runs of ``ep`` consecutive ranks (the ep groups, which exchange tokens), and
the ranks at the same place in every run hold the same experts (the expert-dp groups, which
average those experts' gradients). They are built on first use, by :meth:`ProcessGroups.expert`.

>>> dims = ParallelDims(dp=2, pp=2, tp=1)
>>> dims.dp_groups(), dims.pp_groups()
([[0, 2], [1, 3]], [[0, 1], [2, 3]])
>>> ParallelDims(dp=4).ep_groups(2), ParallelDims(dp=4).expert_dp_groups(2)
([[0, 1], [2, 3]], [[0, 2], [1, 3]])
>>> dims = ParallelDims(dp=2, cp=2)
>>> dims.cp_groups(), dims.dp_groups(), dims.dp_cp_groups()
([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3]])
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self):
        if min(self.dp, self.pp, self.tp, self.cp) < 1:
            raise ValueError(f"degrees must be ≥ 1, got dp={self.dp} pp={self.pp} tp={self.tp} cp={self.cp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp index, pp stage, tp index) of ``rank``; its cp index is :meth:`cp_index`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size}")
        dp_i, rest = divmod(rank, self.pp * self.cp * self.tp)
        pp_i, rest = divmod(rest, self.cp * self.tp)
        return dp_i, pp_i, rest % self.tp

    def cp_index(self, rank: int) -> int:
        """Which slice of every sequence ``rank`` holds (its place in its cp ring)."""
        self.coords(rank)
        return rank // self.tp % self.cp

    def rank_of(self, dp: int, pp: int, tp: int = 0, cp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def expert_replica_groups(self, ep: int) -> list[list[int]]:
        """Every rank holding the same experts: their dp replicas (:meth:`expert_dp_groups`)
        across cp and tp too, whose ranks route other tokens through the same copies (ZeRO
        shards the experts over them, as Megatron-Core's expert-data-parallel group spans cp)."""
        self._check_ep(ep)
        groups: dict = {}
        for d, p, c, t in self._cells():
            groups.setdefault((p, d % ep), []).append(self.rank_of(d, p, t, c))
        return list(groups.values())

    def _cells(self):
        return [(d, p, c, t) for d in range(self.dp) for p in range(self.pp) for c in range(self.cp)
                for t in range(self.tp)]

    def _groups(self, varying: str) -> list[list[int]]:
        """Ranks that differ only along the axes in ``varying`` ("d", "p", "c", "t"), one group per
        setting of the other axes, each group in rank order."""
        groups: dict = {}
        for d, p, c, t in self._cells():
            key = tuple(v for v, axis in zip((d, p, c, t), "dpct") if axis not in varying)
            groups.setdefault(key, []).append(self.rank_of(d, p, t, c))
        return list(groups.values())

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same model part and the same slice of the sequence."""
        return self._groups("d")

    def pp_groups(self) -> list[list[int]]:
        """Ranks forming one pipeline, stage 0 first."""
        return self._groups("p")

    def tp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        """Ranks holding the slices of the same sequences: the ring of context parallelism."""
        return self._groups("c")

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks holding the same model part: they average gradients together (dp × cp; with
        cp = 1, the dp groups)."""
        return self._groups("dc")

    def ep_groups(self, ep: int) -> list[list[int]]:
        """Runs of ``ep`` consecutive ranks of each dp group: one MoE layer's experts are spread
        over a run, and its all-to-alls stay inside it."""
        self._check_ep(ep)
        return [ranks[i:i + ep] for ranks in self.dp_groups() for i in range(0, self.dp, ep)]

    def expert_dp_groups(self, ep: int) -> list[list[int]]:
        """The dp ranks holding the same experts (the same place in each ep run): dp/ep replicas
        that average those experts' gradients."""
        self._check_ep(ep)
        return [ranks[i::ep] for ranks in self.dp_groups() for i in range(ep)]

    def _check_ep(self, ep: int) -> None:
        if ep < 1 or self.dp % ep:
            raise ValueError(f"ep={ep} must divide dp={self.dp}")

    def embedding_groups(self) -> list[list[int]]:
        """First and last rank of each pipeline (Megatron's embedding group): with a tied
        embedding and head they hold the two copies, whose gradients are summed."""
        if self.pp == 1:
            return []
        return [[self.rank_of(d, 0, t, c), self.rank_of(d, self.pp - 1, t, c)] for d in range(self.dp)
                for c in range(self.cp) for t in range(self.tp)]


@dataclass
class ProcessGroups:
    """This rank's torch process groups for a grid (engine side)."""

    dims: ParallelDims
    rank: int
    dp: object
    pp: object
    tp: object
    dp_ranks: list[int]
    pp_ranks: list[int]
    tp_ranks: list[int]
    embedding: object = None              # this rank's embedding group, if it is in one
    embedding_ranks: list[int] | None = None
    timeout_s: float = 60.0
    backend: str | None = None
    experts: dict = None          # ep → ExpertGroups, built on first use
    cp: object = None             # this rank's context-parallel ring (cp > 1)
    cp_ranks: list[int] | None = None
    dp_cp: object = None          # the gradient-averaging group: dp × cp (cp > 1)
    dp_cp_ranks: list[int] | None = None

    def expert(self, ep: int) -> "ExpertGroups":
        """This rank's ep and expert-dp groups for ``ep`` (built the first time it is asked,
        collectively: every rank of the world must ask for the same ``ep`` together)."""
        if self.experts is None:
            self.experts = {}
        if ep not in self.experts:
            self.experts[ep] = build_expert_groups(self.dims, self.rank, ep, self.timeout_s, self.backend)
        return self.experts[ep]

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords(self.rank)

    @property
    def cp_index(self) -> int:
        return self.dims.cp_index(self.rank)


def build_groups(dims: ParallelDims, rank: int, timeout_s: float, backend: str | None = None) -> ProcessGroups:
    """Create every group of the grid (each rank must create all of them, in the same order)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    mine = {"embedding": (None, None), "cp": (None, None), "dp_cp": (None, None)}
    kinds = [("dp", dims.dp_groups()), ("pp", dims.pp_groups()), ("tp", dims.tp_groups()),
             ("embedding", dims.embedding_groups())]
    if dims.cp > 1:           # cp = 1 builds exactly the groups it built before the axis existed
        kinds += [("cp", dims.cp_groups()), ("dp_cp", dims.dp_cp_groups())]
    for kind, groups in kinds:
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                mine[kind] = (group, ranks)
    return ProcessGroups(dims, rank, mine["dp"][0], mine["pp"][0], mine["tp"][0],
                         mine["dp"][1], mine["pp"][1], mine["tp"][1], *mine["embedding"], timeout_s, backend,
                         cp=mine["cp"][0], cp_ranks=mine["cp"][1], dp_cp=mine["dp_cp"][0], dp_cp_ranks=mine["dp_cp"][1])


@dataclass
class ExpertGroups:
    """This rank's expert-parallel groups: ``ep`` (the all-to-all) and ``edp`` (the experts'
    gradient average), their ranks, and this rank's index in its ep group."""

    ep: object
    edp: object
    ep_ranks: list[int]
    edp_ranks: list[int]
    rank: int
    replicas: object = None       # edp across cp and tp (built when either is > 1); else edp
    replica_ranks: list[int] | None = None

    @property
    def index(self) -> int:
        return self.ep_ranks.index(self.rank)


def build_expert_groups(dims: ParallelDims, rank: int, ep: int, timeout_s: float,
                        backend: str | None = None) -> ExpertGroups:
    """Create every ep and expert-dp group of the grid (each rank creates all, in the same order)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    mine = {}
    kinds = [("ep", dims.ep_groups(ep)), ("edp", dims.expert_dp_groups(ep))]
    if dims.cp > 1 or dims.tp > 1:
        kinds.append(("replicas", dims.expert_replica_groups(ep)))
    for kind, groups in kinds:
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                mine[kind] = (group, ranks)
    replicas = mine.get("replicas", mine["edp"])
    return ExpertGroups(mine["ep"][0], mine["edp"][0], mine["ep"][1], mine["edp"][1], rank, *replicas)
