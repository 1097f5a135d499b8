"""The aggregated view's heatmap: every rank's state over time (idle, comm not hidden, compute),
one row per rank, below the representative lanes (:mod:`labkit.view.timeline`)."""
from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.patches import Patch

from ..analysis.table import EventTable
from .timeline import _rank_name

HEAT_STATES = (("idle", "#F2F2F2"), ("comm, not hidden", "#D55E00"), ("compute", "#0072B2"))
HEAT_BINS = 400


def heat_states(table: EventTable, shift, ranks: list[int], extent_ms: float, bins: int = HEAT_BINS):
    """ranks × bins of 0 idle, 1 comm not hidden by compute, 2 compute: the state covering
    most of each bin (compute if at least half of it computes, else comm if at least half of
    it communicates, else idle). Coverage sums spans, so overlapping spans of one stream
    count twice; clipped at a full bin."""
    width = extent_ms / bins if extent_ms > 0 else 1.0
    index = {r: i for i, r in enumerate(ranks)}
    row = np.array([index.get(r, -1) for r in table["rank"].tolist()], dtype=int)
    keep = row >= 0
    u0 = (shift + table["start"])[keep] * 1e3 / width
    u1 = (shift + table["end"])[keep] * 1e3 / width
    row, stream, kind = row[keep], table["stream"][keep], table["kind"][keep]
    covered = {}
    for name, m in (("compute", stream == "compute"), ("comm", (stream != "compute") & (kind != "wait"))):
        covered[name] = np.clip(_ramp(row[m], u1[m], len(ranks), bins) - _ramp(row[m], u0[m], len(ranks), bins), 0, 1)
    states = np.zeros((len(ranks), bins), dtype=int)
    states[covered["comm"] >= 0.5] = 1
    states[covered["compute"] >= 0.5] = 2
    return states


def _ramp(row, u, nrows: int, bins: int):
    """Σ clip(u − k, 0, 1) per (row, bin k): the part of bin k before each time u (in bins)."""
    u = np.clip(u, 0, bins)
    whole = np.floor(u).astype(int)
    out = np.zeros((nrows, bins + 1))
    np.add.at(out, (row, 0), 1.0)                         # bins 0 .. whole−1 are full ...
    np.add.at(out, (row, whole), -1.0)
    out = np.cumsum(out, axis=1)
    np.add.at(out, (row, whole), u - whole)               # ... and bin `whole` partly
    return out[:, :bins]


def draw_heatmap(ax, table: EventTable, shift, ranks: list[int], extent_ms: float, tl=None) -> None:
    """Every rank's state over time as one image (rank 0 at the top)."""
    states = heat_states(table, shift, ranks, extent_ms)
    cmap = matplotlib.colors.ListedColormap([c for _, c in HEAT_STATES])
    ax.imshow(states, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=2.5,
              extent=(0, extent_ms or 1.0, len(ranks) - 0.5, -0.5))
    ticks = np.unique(np.linspace(0, len(ranks) - 1, min(len(ranks), 9)).astype(int)).tolist()
    names = [_rank_name(tl, ranks[i]) if tl is not None else f"rank {ranks[i]}" for i in ticks]
    ax.set_yticks(ticks, names, fontsize="small")
    ax.set_title("every rank: what it was doing", fontsize="medium")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#777777", label=n) for n, c in reversed(HEAT_STATES)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
