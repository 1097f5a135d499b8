"""The rank grid's torch process groups, built on the engines from a
:class:`~labkit.grid.ParallelDims` (the layout itself, pure, lives in :mod:`labkit.grid`).

Which groups exist is the axes' to say (:data:`labkit.parallel.axes.AXES`, each axis's
``groups``). Every group is created with an explicit timeout, because sub-groups do not inherit
the world group's. The drawing is notebook-side: :func:`labkit.view.grid.draw_grid`. Groups
that live inside dp and depend on a degree the grid does not hold are built on first use:
expert groups (ep and expert-dp, :meth:`ParallelDims.ep_groups`) by :meth:`ProcessGroups.expert`,
others (zero's shards) by :meth:`ProcessGroups.within`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ..grid import ParallelDims


def _kind(name: str) -> tuple[property, property]:
    """A group kind's two attributes: this rank's group of that kind, and its ranks (None when
    the grid has no such group, or this rank is in none)."""
    return (property(lambda self: self.named.get(name, (None, None))[0], doc=f"this rank's {name} group"),
            property(lambda self: self.named.get(name, (None, None))[1], doc=f"the ranks of its {name} group"))


@dataclass
class ProcessGroups:
    """This rank's torch process groups for a grid (engine side): every kind the axes declare
    (:func:`labkit.parallel.axes.grid_groups`), as ``groups.dp`` / ``groups.dp_ranks``, and
    the groups that live inside dp, built on first use (:meth:`expert`, :meth:`within`)."""

    dims: ParallelDims
    rank: int
    named: dict                   # kind → (this rank's group, its ranks)
    timeout_s: float = 60.0
    backend: str | None = None
    experts: dict = field(default_factory=dict)      # ep → ExpertGroups, built on first use
    lazy: dict = field(default_factory=dict)         # (kind, ranks) → (group, ranks), built on first use

    dp, dp_ranks = _kind("dp")
    pp, pp_ranks = _kind("pp")
    tp, tp_ranks = _kind("tp")
    cp, cp_ranks = _kind("cp")                       # the context-parallel ring (cp > 1)
    dp_cp, dp_cp_ranks = _kind("dp_cp")              # the gradient-averaging group: dp × cp (cp > 1)
    embedding, embedding_ranks = _kind("embedding")  # first and last stage, if this rank is one

    def expert(self, ep: int) -> "ExpertGroups":
        """This rank's ep and expert-dp groups for ``ep`` (built the first time it is asked,
        collectively: every rank of the world must ask for the same ``ep`` together)."""
        if ep not in self.experts:
            self.experts[ep] = build_expert_groups(self.dims, self.rank, ep, self.timeout_s, self.backend)
        return self.experts[ep]

    def within(self, kind: str, groups: list[list[int]]) -> tuple[object, list[int]]:
        """This rank's group among ``groups`` (which cover the world), built the first time
        these are asked for, collectively like :meth:`expert`: an axis whose groups depend on
        a degree the grid does not hold (zero's ``dp_shard``)."""
        key = (kind, tuple(map(tuple, groups)))
        if key not in self.lazy:
            self.lazy[key] = _build(groups, self.rank, timedelta(seconds=self.timeout_s), self.backend)
        return self.lazy[key]

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords(self.rank)

    @property
    def cp_index(self) -> int:
        return self.dims.cp_index(self.rank)


def build_groups(dims: ParallelDims, rank: int, timeout_s: float, backend: str | None = None) -> ProcessGroups:
    """Create every group the axes declare on the grid (each rank creates all, in the same order)."""
    from ..parallel.axes import grid_groups

    timeout = timedelta(seconds=timeout_s)
    named = {kind: _build(groups, rank, timeout, backend) for kind, groups in grid_groups(dims)}
    return ProcessGroups(dims, rank, {k: v for k, v in named.items() if v[0] is not None}, timeout_s, backend)


def _build(groups: list[list[int]], rank: int, timeout, backend) -> tuple[object, list[int] | None]:
    """Create every group of ``groups`` (all ranks must, in the same order); this rank's one."""
    import torch.distributed as dist

    mine = (None, None)
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine = (group, ranks)
    return mine


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
    timeout = timedelta(seconds=timeout_s)
    ep_group = _build(dims.ep_groups(ep), rank, timeout, backend)
    edp = _build(dims.expert_dp_groups(ep), rank, timeout, backend)
    replicas = _build(dims.expert_replica_groups(ep), rank, timeout, backend) if dims.cp > 1 or dims.tp > 1 else edp
    return ExpertGroups(ep_group[0], edp[0], ep_group[1], edp[1], rank, *replicas)
