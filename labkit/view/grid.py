"""The rank grid drawn: which ranks form the pipeline and data-parallel groups.

>>> from labkit.view.grid import ParallelDims, draw_grid
>>> draw_grid(ParallelDims(dp=2, pp=2))
"""
from __future__ import annotations

from ..grid import Grid, ParallelDims  # what draw_grid draws, here for notebooks to import beside it
from .timeline import _new_figure

NODE_EDGES = ("#000000", "#CC3311", "#0077BB", "#EE7733")
"""Box edges by emulated node (two-tier link), repeating past four nodes."""


def draw_grid(dims: ParallelDims, ax=None, gpus_per_node: int | None = None):
    """Draw the rank grid: one box per rank (pipeline stages across, dp replicas down, each
    replica's tp ranks stacked), each pipeline group joined by arrows (activations flow
    right), each dp group by a dashed band (its gradients are averaged together), each tp
    group framed in green (its ranks split every layer). Returns the Figure.

    ``gpus_per_node``: engines per node of a two-tier link (``labkit.Link``; ranks 0..g-1 form
    node 0): each box names its node and is edged in the node's colour, so a group whose boxes
    differ in colour crosses nodes (its bytes take the slower link).

    >>> draw_grid(ParallelDims(dp=2, pp=2))
    >>> draw_grid(labkit.Strategy(dp=2, tp=2), gpus_per_node=2)   # tp inside each node
    """
    from matplotlib.patches import FancyBboxPatch

    if not isinstance(dims, ParallelDims):      # a Strategy: its degrees
        dims = Grid.of(dims)

    if ax is None:
        _, ax = _new_figure((1.2 + 2.2 * dims.pp, 0.8 + 1.3 * dims.dp * dims.tp))
    colors = ["#56B4E9", "#E69F00", "#009E73", "#CC79A7", "#0072B2", "#D55E00"]
    rows = dims.dp * dims.tp
    for rank in range(dims.world_size):
        dp_i, pp_i, tp_i = dims.coords(rank)
        x, y = 2.2 * pp_i, 1.3 * (dp_i * dims.tp + tp_i)
        node = rank // gpus_per_node if gpus_per_node else None
        edge = (NODE_EDGES[node % len(NODE_EDGES)], 3.0) if node is not None else ("#333333", 1.0)
        ax.add_patch(FancyBboxPatch((x, y), 1.6, 0.8, boxstyle="round,pad=0.05",
                                    facecolor=colors[pp_i % len(colors)], edgecolor=edge[0], lw=edge[1]))
        tp_text = f", tp {tp_i}" if dims.tp > 1 else ""
        node_text = f"\nnode {node}" if node is not None else ""
        ax.text(x + 0.8, y + 0.4, f"rank {rank}{node_text}\ndp {dp_i}, pp {pp_i}{tp_text}", ha="center",
                va="center", fontsize="small")
        if pp_i + 1 < dims.pp:      # pipeline group: activations to the next stage, grads back
            ax.annotate("", xy=(x + 2.2, y + 0.4), xytext=(x + 1.65, y + 0.4),
                        arrowprops={"arrowstyle": "<->", "color": "#882255", "lw": 1.5})
    if dims.tp > 1:                 # tp group: neighbours (tp innermost), one layer's shards
        for group in dims.tp_groups():
            dp_i, pp_i, _ = dims.coords(group[0])
            y0 = 1.3 * dp_i * dims.tp
            ax.add_patch(FancyBboxPatch((2.2 * pp_i - 0.15, y0 - 0.15), 1.9, 1.3 * dims.tp - 0.2,
                                        boxstyle="round,pad=0.02", facecolor="none", edgecolor="#009E73",
                                        lw=2.5, zorder=3))
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
    title = (f"dp={dims.dp} × pp={dims.pp}" + (f" × tp={dims.tp}" if dims.tp > 1 else "")
             + ": arrows = pipeline (p2p), dashed = dp group (all-reduce)"
             + (", green box = tp group (f/g all-reduces)" if dims.tp > 1 else "")
             + (f"; edge colour = node of {gpus_per_node} engines" if gpus_per_node else ""))
    from .canvas import fit_title        # ipywidgets comes with it: only when a grid is drawn

    ax.set_title(fit_title(ax.figure, title, fontsize="small"), fontsize="small")
    return ax.figure
