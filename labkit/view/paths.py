"""Who held the step: the critical path outlined on a timeline, and each rank's lateness as bars.

Drawn from :mod:`labkit.analysis.graph` (``plot(critical_path=True)``) and
:mod:`labkit.analysis.stragglers` (``stragglers().plot()``); the lanes are
:mod:`labkit.view.timeline`'s.
"""
from __future__ import annotations

import numpy as np

from ..analysis.graph import bound_of

from .timeline import _lane, _new_figure, _window


def outline_path(ax, tl, step, lane_ranks: list[int]) -> None:
    """The critical path's spans outlined on their lanes; what holds it under the title."""
    shown = None if step == "all" else (tl.steps[-1] if step is None and tl.steps else step)
    path = tl.critical_path(shown)
    table, shift, _ = _window(path, step)
    for rank, stream, start, end, sh in zip(table["rank"].tolist(), table["stream"].tolist(),
                                             table["start"].tolist(), table["end"].tolist(), shift.tolist()):
        if rank not in lane_ranks:
            continue
        y = _lane(lane_ranks, rank, "compute" if stream != "comm" else "comm")
        ax.broken_barh([((sh + start) * 1e3, (end - start) * 1e3)], (y - 0.45, 0.9), facecolors="none",
                       edgecolors="black", linewidth=1.8, zorder=5)
    verdict = bound_of(path)                   # the path found above, not walked again
    ax.set_title(f"{ax.get_title()}\ncritical path (outlined): {verdict}", fontsize="medium")


def plot_stragglers(found, ax=None):
    """Each rank's lateness per step (the time its peers waited for it at collectives) as a
    bar, the stragglers in red with their cause; returns the Figure."""
    if ax is None:
        _, ax = _new_figure((10, 2.8))
    ranks = sorted(found.scores)
    late_ms = np.array([found.scores[r] for r in ranks]) * 1e3
    slow = set(found.ranks())
    ax.bar(ranks, late_ms, width=1.0 if len(ranks) > 64 else 0.8,
           color=["#D55E00" if r in slow else "#999999" for r in ranks])
    for i, s in enumerate(found):       # stacked, so neighbouring stragglers' names never overlap
        ax.annotate(f"rank {s.rank}: {s.cause}", (s.rank, s.late_s * 1e3), xytext=(0, 3 + 12 * i),
                    textcoords="offset points", ha="center", fontsize="small")
    ax.margins(y=0.12 + 0.1 * len(found))
    ax.set_xlabel("rank")
    ax.set_ylabel("late per step (ms)")
    ax.set_title(repr(found).splitlines()[0] if found else repr(found), fontsize="medium")
    return ax.figure


