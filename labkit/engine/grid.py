"""The rank grid: which ranks form the data-, pipeline- and tensor-parallel groups.

Ranks are laid out as ``arange(world).view(dp, pp, tp)`` (tp innermost, as Megatron does,
so tensor-parallel peers are neighbours on one node). :class:`ParallelDims` is pure and
validated once; :func:`build_groups` turns it into torch process groups on the engines, each
with an explicit timeout, because sub-groups do not inherit the world group's.

>>> dims = ParallelDims(dp=2, pp=2, tp=1)
>>> dims.dp_groups(), dims.pp_groups()
([[0, 2], [1, 3]], [[0, 1], [2, 3]])
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        if min(self.dp, self.pp, self.tp) < 1:
            raise ValueError(f"degrees must be ≥ 1, got dp={self.dp} pp={self.pp} tp={self.tp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

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
        """(dp index, pp stage, tp index) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size}")
        dp_i, rest = divmod(rank, self.pp * self.tp)
        pp_i, tp_i = divmod(rest, self.tp)
        return dp_i, pp_i, tp_i

    def rank_of(self, dp: int, pp: int, tp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same model part: they average gradients together."""
        return [[self.rank_of(d, p, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks forming one pipeline, stage 0 first."""
        return [[self.rank_of(d, p, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, p, t) for t in range(self.tp)] for d in range(self.dp) for p in range(self.pp)]


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

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords(self.rank)


def build_groups(dims: ParallelDims, rank: int, timeout_s: float, backend: str | None = None) -> ProcessGroups:
    """Create every group of the grid (each rank must create all of them, in the same order)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    mine = {}
    for kind, groups in (("dp", dims.dp_groups()), ("pp", dims.pp_groups()), ("tp", dims.tp_groups())):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                mine[kind] = (group, ranks)
    return ProcessGroups(dims, rank, mine["dp"][0], mine["pp"][0], mine["tp"][0],
                         mine["dp"][1], mine["pp"][1], mine["tp"][1])


def draw_grid(dims: ParallelDims, ax=None):
    """Draw the rank grid: one box per rank (pipeline stages across, dp replicas down),
    each pipeline group joined by arrows (activations flow right), each dp group by a
    dashed band (its gradients are averaged together). Returns the Figure.

    >>> labkit.grid.draw_grid(ParallelDims(dp=2, pp=2))
    """
    from matplotlib.patches import FancyBboxPatch

    from ..view.timeline import _new_figure

    if ax is None:
        _, ax = _new_figure((1.2 + 2.2 * dims.pp, 0.8 + 1.3 * dims.dp * dims.tp))
    colors = ["#56B4E9", "#E69F00", "#009E73", "#CC79A7", "#0072B2", "#D55E00"]
    rows = dims.dp * dims.tp
    for rank in range(dims.world_size):
        dp_i, pp_i, tp_i = dims.coords(rank)
        x, y = 2.2 * pp_i, 1.3 * (dp_i * dims.tp + tp_i)
        ax.add_patch(FancyBboxPatch((x, y), 1.6, 0.8, boxstyle="round,pad=0.05",
                                    facecolor=colors[pp_i % len(colors)], edgecolor="#333333"))
        tp_text = f", tp {tp_i}" if dims.tp > 1 else ""
        ax.text(x + 0.8, y + 0.4, f"rank {rank}\ndp {dp_i}, pp {pp_i}{tp_text}", ha="center",
                va="center", fontsize="small")
        if pp_i + 1 < dims.pp:      # pipeline group: activations to the next stage, grads back
            ax.annotate("", xy=(x + 2.2, y + 0.4), xytext=(x + 1.65, y + 0.4),
                        arrowprops={"arrowstyle": "<->", "color": "#882255", "lw": 1.5})
    if dims.dp > 1:                 # dp group: same stage (and tp index), every replica
        for group in dims.dp_groups():
            _, pp_i, tp_i = dims.coords(group[0])
            x = 2.2 * pp_i + 0.8 + 0.5 * (tp_i - (dims.tp - 1) / 2)    # tp groups side by side
            ys = [1.3 * (dims.coords(r)[0] * dims.tp + tp_i) + 0.4 for r in group]
            ax.plot([x, x], [min(ys), max(ys)], color="#D55E00", linestyle="--", lw=2, zorder=0)
    ax.set_xlim(-0.4, 2.2 * dims.pp - 0.2)
    ax.set_ylim(1.3 * rows - 0.2, -0.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dp={dims.dp} × pp={dims.pp}" + (f" × tp={dims.tp}" if dims.tp > 1 else "")
                 + ": arrows = pipeline (p2p), dashed = dp group (all-reduce)", fontsize="small")
    return ax.figure
