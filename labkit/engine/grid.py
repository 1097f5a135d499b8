"""The rank grid's torch process groups, built on the engines from a
:class:`~labkit.grid.ParallelDims` (the layout itself, pure, lives in :mod:`labkit.grid`).

Every group is created with an explicit timeout, because sub-groups do not inherit the world
group's. The drawing is notebook-side: :func:`labkit.view.grid.draw_grid`. Expert groups (ep
and expert-dp, :meth:`ParallelDims.ep_groups`) are built on first use, by
:meth:`ProcessGroups.expert`.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..grid import ParallelDims


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
