"""Which ranks held the others back, and why: ``timeline.stragglers()``.

The trap: a synchronous all-reduce equalises step time. Every rank leaves the collective
together, so the slow rank's step is no longer than anyone's; the others spent the
difference *inside* the collective, waiting for it. So we look at who *entered* each
collective last (Holistic Trace Analysis reads NCCL kernel start skew the same way).

For each step and each group of ranks that run collectives together (the dp groups of the
Timeline's grid, else all ranks), the k-th collective of every member is matched (same
order on every rank: the collective contract). A rank's lateness at collective k is its
entry time minus the group's median entry; its score is its lateness summed over the
collectives of a step, averaged over steps: the time it made its peers wait.

What made it late is read from the time before it entered, split into compute, waiting on a
peer (``wait`` spans: a receive before its sender posted), earlier comm, and the rest, each
compared with the group's median rank at the same collective. The largest excess names
the cause: ``compute``, ``waiting on rank p``, ``a late collective`` (its earlier comm took
longer than its peers': a slow link or a late collective upstream), or ``other`` (gaps
between recorded spans: host-side work the recorder does not see).

The report lists the slowest first, except that a rank late only because it waited on
another named straggler comes right after that rank (in a pipeline the slow stage's partner
enters its collective about as late as the slow rank itself).

A run with no collectives (a pipeline alone) has nothing to enter late; there a rank's
score is its compute time beyond its group's median.

    >>> run.timeline.stragglers()
    rank 2 (dp2): 3.1 ms late per step at the collective — compute (+3.0 ms)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .table import EventTable, union_lengths

COLLECTIVE_KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "all_to_all")
PARTS = ("compute", "wait", "comm", "other")
_CAUSE = {"compute": "compute", "wait": "waiting on a peer", "comm": "a late collective", "other": "other"}


@dataclass
class Straggler:
    """One slow rank: how late per step, and the excess time before it entered, by part."""

    rank: int
    coords: dict
    late_s: float
    excess_s: dict
    peer: int | None = None

    @property
    def cause(self) -> str:
        part = max(PARTS, key=lambda p: self.excess_s[p])
        if self.excess_s[part] <= 0.25 * self.late_s:
            part = "other"
        if part == "wait" and self.peer is not None:
            return f"waiting on rank {self.peer}"
        return _CAUSE[part]

    def __str__(self) -> str:
        where = " ".join(f"{k}{v}" for k, v in self.coords.items())
        where = f" ({where})" if where else ""
        parts = ", ".join(f"{p} {self.excess_s[p] * 1e3:+.2f} ms" for p in PARTS if abs(self.excess_s[p]) > 1e-5)
        return f"rank {self.rank}{where}: {self.late_s * 1e3:.2f} ms late per step — {self.cause} ({parts})"


class Stragglers(list):
    """The slowest ranks, slowest first (a list of :class:`Straggler`); ``scores``: every
    rank's lateness per step in seconds; ``step_time_s``: the median step time."""

    def __init__(self, found=(), scores: dict | None = None, step_time_s: float = 0.0):
        super().__init__(found)
        self.scores = scores or {}
        self.step_time_s = step_time_s

    def __repr__(self) -> str:
        if not self:
            return ("no straggler: no rank kept its peers waiting over the threshold "
                    f"(step {self.step_time_s * 1e3:.2f} ms)")
        return "\n".join(str(s) for s in self)

    def ranks(self) -> list[int]:
        return [s.rank for s in self]

    def plot(self, ax=None):
        """Every rank's lateness, the stragglers named with their cause
        (labkit.view.paths.plot_stragglers)."""
        from ..view.paths import plot_stragglers

        return plot_stragglers(self, ax=ax)


def find(tl, top: int = 3, threshold: float = 0.1) -> Stragglers:
    """The `top` ranks whose score (time they made peers wait per step, see the module
    docstring) is at least `threshold` × the median step time, slowest first (a waiter right
    after the rank it waited on)."""
    groups = _groups(tl)
    late = np.zeros(tl.world_size)
    excess = np.zeros((tl.world_size, len(PARTS)))
    peers: dict[int, list[int]] = {}
    steps = tl.steps
    for s in steps:
        table = tl.table.select(tl.table["step"] == s)
        for group in groups:
            _score_group(table, group, late, excess, peers)
    n = max(len(steps), 1)
    late, excess = late / n, excess / n
    durations = list(tl.step_durations().values())
    step_time = float(np.median(durations)) if durations else 0.0
    order = [r for r in np.argsort(-late, kind="stable").tolist() if late[r] > 0 and late[r] >= threshold * step_time]
    found = []
    for r in order:
        peer = max(set(peers.get(r, [])), key=peers[r].count) if peers.get(r) else None
        found.append(Straggler(r, tl.coords(r), float(late[r]), dict(zip(PARTS, excess[r].tolist())), peer))
    return Stragglers(_roots_first(found)[:top], scores=dict(enumerate(late.tolist())), step_time_s=step_time)


def _roots_first(found: list[Straggler]) -> list[Straggler]:
    """Slowest first, except that a rank late only because it waited on another straggler
    comes right after that rank: in a pipeline the slow stage's partner enters its collective
    about as late as the slow rank itself (sometimes later), but the cause is the one it waited on."""
    by_rank = {s.rank: s for s in found}

    def root(s: Straggler) -> Straggler:
        seen = {s.rank}
        while s.cause.startswith("waiting on rank") and s.peer in by_rank and s.peer not in seen:
            s = by_rank[s.peer]
            seen.add(s.rank)
        return s

    return sorted(found, key=lambda s: (-root(s).late_s, root(s).rank, root(s) is not s, -s.late_s))


def _groups(tl) -> list[list[int]]:
    """Ranks that run collectives together: the grid's gradient-averaging groups (dp × cp),
    else everyone."""
    if tl.grid is not None and getattr(tl.grid, "dp", 1) > 1:
        return tl.grid.dp_cp_groups()
    return [tl.ranks]


def _score_group(table: EventTable, group: list[int], late, excess, peers) -> None:
    """Add one step's lateness and excess of each member of `group` (see the module docstring)."""
    entries = {r: np.sort(table["start"][(table["rank"] == r) & np.isin(table["kind"], COLLECTIVE_KINDS)])
               for r in group}
    n = min(len(e) for e in entries.values())
    if n == 0:          # no collective to enter late: compute beyond the group's median
        parts = np.array([_parts_before(table, r, np.array([np.inf]))[0] for r in group])
        extra = parts[:, 0] - np.median(parts[:, 0])
        for i, r in enumerate(group):
            late[r] += max(0.0, extra[i])
            excess[r] += parts[i] - np.median(parts, axis=0)
        return
    entry = np.array([entries[r][:n] for r in group])                   # members × collectives
    parts = np.array([_parts_before(table, r, entry[i]) for i, r in enumerate(group)])  # m × n × 4
    lateness = entry - np.median(entry, axis=0)
    typical = np.median(parts, axis=0)                                   # n × 4
    for i, r in enumerate(group):
        k = lateness[i] > 0
        late[r] += lateness[i][k].sum()
        excess[r] += (parts[i][k] - typical[k]).sum(axis=0)
        waits = (table["rank"] == r) & (table["kind"] == "wait") & (table["peer"] >= 0)
        peers.setdefault(r, []).extend(table["peer"][waits].tolist())


def _parts_before(table: EventTable, rank: int, until: np.ndarray) -> np.ndarray:
    """For each time in `until`: the rank's compute, wait and other comm time before it, and
    the rest of [0, until) (len(until) × 4)."""
    mine = table.select(table["rank"] == rank)
    kind, stream = mine["kind"], mine["stream"]
    masks = (stream == "compute", kind == "wait", (stream != "compute") & (kind != "wait"))
    cut = np.where(np.isfinite(until), until, float(np.max(mine["end"], initial=0.0)))
    out = np.zeros((len(until), len(PARTS)))
    for j, m in enumerate(masks):
        start, end = mine["start"][m], mine["end"][m]
        group = np.repeat(np.arange(len(cut)), len(start))
        out[:, j] = union_lengths(group, np.tile(start, len(cut)),
                                  np.minimum(np.tile(end, len(cut)), np.repeat(cut, len(start))), len(cut))
    out[:, 3] = np.maximum(0.0, cut - out[:, :3].sum(axis=1))
    return out
