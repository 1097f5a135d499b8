"""The rank grid: which ranks form the data-, pipeline-, context- and tensor-parallel groups.

By default ranks are laid out as ``arange(world).view(dp, pp, cp, tp)``: tp varies fastest, then
cp, then pp, then dp (tensor-parallel peers are neighbours on one node, as Megatron places them,
and a ring of context-parallel ranks stays close; Megatron and torchtitan put pp outermost, dp
inside it, where labkit keeps dp outermost: a pipeline's stages are consecutive ranks). With
engines filling nodes in rank order, the axes that vary fastest stay inside a node.
``order`` (``Strategy.order``) changes that on purpose: ``"dp,cp,pp,tp"`` makes dp the fastest
and tp the slowest, so on two nodes the tp groups cross them (what that costs is the lesson).
Every group lists its ranks by the axis's index (stage 0 first), which with any order is also
their rank order along one axis. This module
is the one place that turns a rank into its coordinates and back. It imports no torch and
nothing of labkit, so the engine (:mod:`labkit.engine.grid` builds torch process groups from
a :class:`ParallelDims`), the timeline and its views (:class:`Grid`) and the planner
(:mod:`labkit.plan.local.physical`) all read the same layout.

Expert parallelism draws its groups from the dp ranks (DeepSeek-V3, Megatron-Core): each dp
group is cut into runs of ``ep`` consecutive ranks (the ep groups, which exchange tokens), and
the ranks at the same place in every run hold the same experts (the expert-dp groups, which
average those experts' gradients).

>>> dims = ParallelDims(dp=2, pp=2, tp=1)
>>> dims.dp_groups(), dims.pp_groups()
([[0, 2], [1, 3]], [[0, 1], [2, 3]])
>>> ParallelDims(dp=4).ep_groups(2), ParallelDims(dp=4).expert_dp_groups(2)
([[0, 1], [2, 3]], [[0, 2], [1, 3]])
>>> dims = ParallelDims(dp=2, cp=2)
>>> dims.cp_groups(), dims.dp_groups(), dims.dp_cp_groups()
([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3]])
>>> Grid(dp=2, pp=2, ep=2).place(3)
{'dp': 1, 'pp': 1, 'tp': 0, 'ep': 1}
>>> ParallelDims(dp=2, tp=2).tp_groups(), ParallelDims(dp=2, tp=2, order="dp,cp,pp,tp").tp_groups()
([[0, 1], [2, 3]], [[0, 2], [1, 3]])
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product


ORDER = "tp,cp,pp,dp"      # Megatron's tp innermost; labkit keeps dp outermost


def check_order(order) -> None:
    """Raise ValueError unless ``order`` names tp, cp, pp and dp once each, fastest first."""
    if not isinstance(order, str) or sorted(order.split(",")) != sorted(ORDER.split(",")):
        raise ValueError(f"order={order!r} must name tp, cp, pp and dp once each, separated by commas, the "
                         f"fastest-varying first (the default {ORDER!r}; 'dp,cp,pp,tp' puts tp across nodes)")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of every axis, validated once (torchtitan's ``ParallelDims``): each rank's
    coordinates and every group's ranks, as plain lists."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    order: str = ORDER
    """The axes from the fastest-varying rank index to the slowest (``"tp,cp,pp,dp"``)."""

    def __post_init__(self):
        if min(self.dp, self.pp, self.tp, self.cp) < 1:
            raise ValueError(f"degrees must be ≥ 1, got dp={self.dp} pp={self.pp} tp={self.tp} cp={self.cp}")
        check_order(self.order)

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

    def strides(self) -> dict[str, int]:
        """How far apart two ranks are whose index differs by one along each axis: 1 for the
        fastest axis of :attr:`order`, the product of the faster axes' degrees for the others."""
        strides, stride = {}, 1
        for axis in self.order.split(","):
            strides[axis] = stride
            stride *= getattr(self, axis)
        return strides

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp index, pp stage, tp index) of ``rank``; its cp index is :meth:`cp_index`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size}")
        step = self.strides()
        return rank // step["dp"] % self.dp, rank // step["pp"] % self.pp, rank // step["tp"] % self.tp

    def cp_index(self, rank: int) -> int:
        """Which slice of every sequence ``rank`` holds (its place in its cp ring)."""
        self.coords(rank)
        return rank // self.strides()["cp"] % self.cp

    def rank_of(self, dp: int, pp: int, tp: int = 0, cp: int = 0) -> int:
        step = self.strides()
        return dp * step["dp"] + pp * step["pp"] + cp * step["cp"] + tp * step["tp"]

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

    def group(self, varying: str, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> list[int]:
        """The ranks that differ from the cell (dp, pp, cp, tp) only along the axes in ``varying``
        ("d", "p", "c", "t"), in rank order: ``group("dc", pp=p, tp=t)`` is a stage's
        gradient-averaging ranks, ``group("t", dp=d, pp=p)`` one tensor-parallel group."""
        cell = {"d": dp, "p": pp, "c": cp, "t": tp}
        sizes = {"d": self.dp, "p": self.pp, "c": self.cp, "t": self.tp}
        ranges = [range(sizes[axis]) if axis in varying else (cell[axis],) for axis in "dpct"]
        return [self.rank_of(d, p, t, c) for d, p, c, t in product(*ranges)]

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

    def dp_runs(self, size: int) -> list[list[int]]:
        """Runs of ``size`` consecutive ranks of each dp group (``size`` divides dp): the ep
        groups, and zero's shard groups under HSDP (``Strategy.dp_shard``)."""
        self._check_divides_dp(size)
        return [ranks[i:i + size] for ranks in self.dp_groups() for i in range(0, self.dp, size)]

    def dp_strides(self, size: int) -> list[list[int]]:
        """The dp ranks at the same place in each run of :meth:`dp_runs`: the replicas of one
        run's piece (expert-dp groups; HSDP's replicate groups)."""
        self._check_divides_dp(size)
        return [ranks[i::size] for ranks in self.dp_groups() for i in range(size)]

    def ep_groups(self, ep: int) -> list[list[int]]:
        """Runs of ``ep`` consecutive ranks of each dp group: one MoE layer's experts are spread
        over a run, and its all-to-alls stay inside it."""
        self._check_ep(ep)
        return self.dp_runs(ep)

    def expert_dp_groups(self, ep: int) -> list[list[int]]:
        """The dp ranks holding the same experts (the same place in each ep run): dp/ep replicas
        that average those experts' gradients."""
        self._check_ep(ep)
        return self.dp_strides(ep)

    def _check_ep(self, ep: int) -> None:
        if ep < 1 or self.dp % ep:
            raise ValueError(f"ep={ep} must divide dp={self.dp}")

    def _check_divides_dp(self, size: int) -> None:
        if size < 1 or self.dp % size:
            raise ValueError(f"a run of {size} dp ranks must divide dp={self.dp}")

    def embedding_groups(self) -> list[list[int]]:
        """First and last rank of each pipeline (Megatron's embedding group): with a tied
        embedding and head they hold the two copies, whose gradients are summed."""
        if self.pp == 1:
            return []
        return [[self.rank_of(d, 0, t, c), self.rank_of(d, self.pp - 1, t, c)] for d in range(self.dp)
                for c in range(self.cp) for t in range(self.tp)]


@dataclass(frozen=True)
class Grid(ParallelDims):
    """The grid as a run's timeline, its views and the straggler report name ranks: the
    degrees of :class:`ParallelDims` and ``ep``, which only names a rank's place (expert groups
    are runs of ep consecutive dp indexes)."""

    ep: int = 1

    @classmethod
    def of(cls, grid) -> "Grid | None":
        """The grid of anything with dp, pp and tp (and maybe cp, ep): a Strategy, a ParallelDims."""
        if grid is None:
            return None
        return cls(dp=grid.dp, pp=grid.pp, tp=grid.tp, cp=getattr(grid, "cp", 1), order=getattr(grid, "order", ORDER),
                   ep=getattr(grid, "ep", 1))

    def place(self, rank: int) -> dict[str, int]:
        """Every axis's index of ``rank``: {"dp", "pp", "tp"} and, where the grid has them, "cp"
        and "ep" (its expert group's index, dp index mod ep)."""
        dp_i, pp_i, tp_i = self.coords(rank)
        place = {"dp": dp_i, "pp": pp_i}
        if self.cp > 1:
            place["cp"] = self.cp_index(rank)
        place["tp"] = tp_i
        if self.ep > 1:
            place["ep"] = dp_i % self.ep
        return place
