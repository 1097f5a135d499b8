"""The step as a graph: which chain of spans across ranks sets a step's length.

A step's spans are the nodes. Three kinds of edge say what a span waited for:

* **program order** on a rank: a span starts once the rank's thread got there, so its
  predecessor is what the rank did last before it — the compute span that issued it (an
  asynchronous bucket leaves in the middle of a backward) or the call it blocked on;
* **a message**: a receive that had to wait (a ``wait`` span before it) could start only when
  its sender posted the matching send (the k-th send from a to b is the k-th receive on b
  from a, as :mod:`labkit.analysis.waits` matches them); a send whose receiver posted later
  waited for the receiver;
* **a collective's members joining**: the k-th collective of a process group on one member
  is the k-th on every member (the collective contract); it moves bytes once its last member
  has entered, and once the group's previous collective is through (a group's calls run in
  order). Members are read from the ``group`` each comm span carries (labkit records it;
  torch's profiler writes it as the kernel's "Process Group Ranks", or through
  ``distributedInfo.pg_config``).

The **critical path** is found walking back from the span that ends last: at each span, take
the edge that was satisfied last (the latest member to join, the sender, or the rank's own
last span), and continue from there. Time on the path between a rank's recorded spans (host
work the recorder does not see) is kept as ``untraced`` spans, so the path covers the step.
This is the longest path of the measured graph, read off the times (the walk of Yang & Miller,
"Critical path analysis for the execution of parallel and distributed programs", ICDCS 1988).

    >>> path = run.timeline.critical_path()        # a Timeline of the spans on the path
    >>> run.timeline.bound_by()                    # one line: what holds the path
    rank 2's compute (61% of the path), then the allreduces of ranks 0–3 (22% of the path)
    >>> run.timeline.straggler_scores()            # per rank: share of steps on the path, slowdown
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .events import group_ranks
from .table import EventTable

COLLECTIVES = frozenset(("allreduce", "reduce_scatter", "allgather", "broadcast", "all_to_all"))
UNTRACED = "untraced"
EPS = 1e-7
"""Seconds within which two instants on one clock count as one (perf_counter's resolution
is far finer; spans recorded back to back differ by more than this only when time passed)."""


# --- one step's graph ------------------------------------------------------------------------
class StepGraph:
    """The spans of one step with their cross-rank edges (see the module docstring).

    events: one step's events (an EventTable or event dicts). groups: "require" (default)
    refuses collectives whose members are unknown when more than one rank runs collectives;
    "world" takes every rank that runs collectives as one group, in order; "none" joins nothing
    (one rank's own path).
    """

    def __init__(self, events, groups: str = "require"):
        t = events if isinstance(events, EventTable) else EventTable.from_dicts(list(events))
        self.table, self._events = t, None
        self.rank = t["rank"].astype(np.int64)
        self.start, self.end = t["start"], t["end"]
        self.compute = t["stream"] != "comm"
        self.kind = t["kind"]
        self.peer, self.group = t["peer"], t["group"]
        self.is_wait = self.kind == "wait"
        order = np.lexsort((self.start, self.rank)) if len(t) else np.zeros(0, dtype=np.int64)
        cuts = np.flatnonzero(np.diff(self.rank[order])) + 1
        self.by_rank = {int(self.rank[rows[0]]): rows for rows in np.split(order, cuts) if len(rows)}
        self.members: dict[int, np.ndarray] = {}      # a collective's row → every member's row
        self.previous: dict[int, np.ndarray] = {}     # a collective's row → its group's previous call's rows
        self.partner: dict[int, int] = {}            # a send's row ↔ its receive's row
        self.wait_of: dict[int, int] = {}            # a receive's row → its wait span's row
        self._join_collectives(groups)
        self._match_messages()

    @property
    def events(self) -> list[dict]:
        """The step's events as dicts (made once, when asked)."""
        if self._events is None:
            self._events = self.table.to_dicts()
        return self._events

    def __len__(self) -> int:
        return len(self.table)

    def _join_collectives(self, groups: str) -> None:
        rows = np.flatnonzero(np.isin(self.kind, list(COLLECTIVES)))
        if groups == "none" or not len(rows):          # one rank's own path: no cross-rank edges
            return
        named = self.group[rows] != ""
        ranks_with = np.unique(self.rank[rows])
        if not named.all() and len(ranks_with) > 1 and groups == "require":
            i = int(rows[~named][0])
            raise ValueError(
                f"critical_path: rank {self.rank[i]}'s {self.kind[i]} '{self.table['name'][i]}' (step "
                f"{self.table['step'][i]}) does not say which ranks took part, so its members cannot be joined "
                f"across ranks. labkit's own runs record it; a profiler trace has it as the NCCL kernel's "
                f"'Process Group Ranks' (torch ≥ 2.4) or in distributedInfo.pg_config. Pass groups='world' if "
                f"every collective spans all ranks that run collectives, or read one rank's own path with rank=R")
        everyone = ",".join(map(str, ranks_with.tolist()))
        ids: dict[str, int] = {}            # a dict, not np.unique: a world's group is a long string
        gid = np.array([ids.setdefault(g or everyone, len(ids)) for g in self.group[rows].tolist()], dtype=np.int64)
        # k: the call's index among its rank's calls of that group, in time order (the collective contract)
        order = np.lexsort((self.start[rows], self.rank[rows], gid))
        key = gid[order] * (int(self.rank.max()) + 1) + self.rank[rows][order]
        first = np.r_[0, np.flatnonzero(np.diff(key)) + 1]
        k = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
        call = np.empty(len(rows), dtype=np.int64)
        call[order] = gid[order] * len(rows) + k
        by_call = np.argsort(call, kind="stable")
        cuts = np.flatnonzero(np.diff(call[by_call])) + 1
        groups_of = {int(call[m[0]]): rows[m] for m in np.split(by_call, cuts)}
        for c, members in groups_of.items():
            before = groups_of.get(c - 1) if c % len(rows) else None
            for i in members:
                self.members[int(i)] = members
                if before is not None:
                    self.previous[int(i)] = before

    def _match_messages(self) -> None:
        p2p = np.flatnonzero(self.peer >= 0)
        if not len(p2p):
            return
        sends, recvs, waits = defaultdict(list), defaultdict(list), {}
        for i in p2p.tolist():
            kind, r, peer = self.kind[i], int(self.rank[i]), int(self.peer[i])
            if kind == "send":
                sends[(r, peer)].append(i)
            elif kind == "recv":
                recvs[(peer, r)].append(i)
            elif kind == "wait":
                waits[(r, peer, round(float(self.end[i]), 9))] = i
        for pair, sent in sends.items():
            got = sorted(recvs.get(pair, []), key=lambda i: self.start[i])
            for s, r in zip(sorted(sent, key=lambda i: self.start[i]), got):
                self.partner[s], self.partner[r] = r, s
        for (src, dst), got in recvs.items():
            for r in got:
                w = waits.get((dst, src, round(float(self.start[r]), 9)))
                if w is not None:
                    self.wait_of[r] = w

    # -- what a span waited for ---------------------------------------------------------------
    def ready(self, i: int) -> tuple[float, int, int | None]:
        """(when span i could start, the rank to look back on from then, or a span that was
        itself the last thing i waited for)."""
        r, kind = int(self.rank[i]), self.kind[i]
        if i in self.members:
            members = self.members[i]
            m = int(members[np.argmax(self.start[members])])
            entry = (float(self.start[m]), int(self.rank[m]), None)
            previous = self.previous.get(i)
            if previous is not None:
                p = int(previous[np.argmax(self.end[previous])])
                if self.end[p] >= entry[0]:                 # the group's previous call held it up
                    return float(self.end[p]), int(self.rank[p]), p
            return max(entry[0], float(self.start[i])), entry[1], None
        if kind in ("recv", "wait"):
            sender = self.partner.get(i) if kind == "recv" else None
            if kind == "wait" or i in self.wait_of:      # the receiver was there first: the sender bounds it
                t = self.end[i] if kind == "wait" else self.start[i]
                return float(t), int(self.peer[i] if sender is None else self.rank[sender]), None
            return float(self.start[i]), r, None
        if kind == "send" and i in self.partner:
            recv = self.partner[i]
            posted = self.start[self.wait_of[recv]] if recv in self.wait_of else self.start[recv]
            if recv not in self.wait_of and posted >= self.start[i] - EPS:   # the receiver came last
                return float(self.start[i]), int(self.rank[recv]), None
        return float(self.start[i]), r, None

    def before(self, rank: int, t: float, exclude: int) -> int | None:
        """The span on ``rank`` that was last done before ``t``: a compute span that began before
        it (cut at t: the thread issued from inside it), or a call that had ended by then.
        Ties go to compute, then to the innermost span."""
        rows = self.by_rank.get(rank)
        if rows is None or not len(rows):
            return None
        rows = rows[: np.searchsorted(self.start[rows], t - EPS)]        # began before t
        if not len(rows):
            return None
        ends, compute = self.end[rows], self.compute[rows]
        ok = ~self.is_wait[rows] & (rows != exclude) & (compute | (ends <= t + EPS))
        if not ok.any():
            return None
        reach = np.where(ok, np.minimum(ends, t), -np.inf)
        tied = ok & (reach >= reach.max() - EPS)
        pick = np.lexsort((self.start[rows], compute.astype(int), tied.astype(int)))[-1]
        return int(rows[pick])

    # -- the walk -------------------------------------------------------------------------------
    def critical_path(self, rank: int | None = None) -> list[dict]:
        """The spans on the path, in time order, each cut to the part on the path; gaps as
        ``untraced`` spans. rank: that rank's own path only (no cross-rank edges)."""
        if not len(self):
            return []
        candidates = np.arange(len(self)) if rank is None else self.by_rank.get(rank, np.zeros(0, dtype=np.int64))
        if not len(candidates):
            return []
        i = int(candidates[np.argmax(self.end[candidates])])
        t, path, step = float(self.end[i]), [], int(self.table["step"][i])
        for _ in range(2 * len(self) + 2):
            ready, on, span = self.ready(i) if rank is None else (float(self.start[i]), int(self.rank[i]), None)
            ready = min(ready, t)
            path.append((i, ready, t))
            if span is not None:                              # the group's previous call
                i, t = span, ready
                continue
            j = self.before(on, ready, exclude=i)
            reached = min(float(self.end[j]), ready) if j is not None else 0.0
            if ready - reached > EPS:
                path.append((None, on, reached, ready))
            if j is None:
                break
            i, t = j, reached
        return [self._piece(p, step) for p in path[::-1]]

    def _piece(self, p: tuple, step: int) -> dict:
        """A path entry as an event: span i cut to [start, end], or an untraced gap."""
        if p[0] is None:
            _, rank, start, end = p
            return _untraced(rank, step, start, end)
        i, start, end = p
        e = self.table.select(np.array([i])).to_dicts()[0]
        e["start"], e["end"] = float(max(min(start, end), self.start[i])), float(end)
        return e


def _untraced(rank: int, step: int, start: float, end: float) -> dict:
    return {"rank": rank, "stream": "compute", "kind": UNTRACED, "name": "between recorded spans", "step": step,
            "microbatch": None, "start": float(start), "end": float(end), "bytes": 0, "peer": None}


# --- over a Timeline ---------------------------------------------------------------------------
def critical_path(timeline, step: int | None = None, groups: str = "require", rank: int | None = None):
    """The critical path of each step (or of ``step``) as a Timeline (module docstring)."""
    from .timeline import Timeline

    steps = _steps(timeline, step)
    path = []
    for s in steps:
        path += StepGraph(timeline.step(s).table, groups if rank is None else "none").critical_path(rank)
    title = f"critical path of {timeline.title}" if timeline.title else "critical path"
    return Timeline(path, timeline.world_size, title, timeline.grid)


def _steps(timeline, step) -> list[int]:
    steps = timeline.steps
    if not steps:
        raise ValueError("critical_path: the timeline holds no events (was the run recorded? record=True)")
    if step is None:
        return steps
    if step not in steps:
        raise ValueError(f"critical_path(step={step!r}): the timeline holds steps {steps}")
    return [step]


@dataclass
class BoundBy:
    """What holds the critical path: ``parts`` is [(what, seconds, share of the path)], largest
    first, summed over the steps read; ``str()`` is the one-line verdict."""

    parts: list
    path_s: float
    steps: int
    rank: int | None = None
    """The rank whose compute holds the most of the path (None when no compute lies on it)."""

    def __str__(self) -> str:
        if not self.parts:
            return "no spans on the path"
        lines = [f"{what} ({share:.0%} of the path)" for what, _, share in self.parts[:2]]
        return ", then ".join(lines)

    __repr__ = __str__


def bound_by(timeline, step: int | None = None, groups: str = "require") -> BoundBy:
    """Sum the critical path's time by what it is: each rank's compute, each kind of collective
    in each group (a dp group's bucket all-reduces together), the messages between each pair,
    each rank's untraced time."""
    return bound_of(critical_path(timeline, step, groups))


def bound_of(path) -> BoundBy:
    """:func:`bound_by` of a critical path already found (a Timeline of its spans)."""
    totals: dict[str, float] = defaultdict(float)
    compute: dict[int, float] = defaultdict(float)
    for e in path.events:
        totals[_label(e)] += e["end"] - e["start"]
        if e["stream"] != "comm" and e["kind"] != UNTRACED:
            compute[e["rank"]] += e["end"] - e["start"]
    total = sum(totals.values())
    parts = sorted(((what, s, s / total if total > 0 else 0.0) for what, s in totals.items()),
                   key=lambda p: -p[1])
    return BoundBy(parts, total, len(path.steps), max(compute, key=compute.get) if compute else None)


def _label(e: dict) -> str:
    kind, rank = e["kind"], e["rank"]
    if kind == UNTRACED:
        return f"rank {rank}'s untraced host time"
    if e["stream"] != "comm":
        return f"rank {rank}'s compute"
    if kind in COLLECTIVES:                  # every call of one kind in one group together
        members = group_ranks(e.get("group", ""))
        return f"the {kind}s of ranks {_ranges(members)}" if members else f"the {kind}s"
    if e.get("peer") is not None:
        a, b = (rank, e["peer"]) if kind == "send" else (e["peer"], rank)
        return f"messages {a}→{b}"
    return f"rank {rank}'s {kind}"


def _ranges(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return ",".join(map(str, ranks))


# --- per-rank scores ------------------------------------------------------------------------------
@dataclass
class RankScore:
    """One rank over the steps read: ``on_path``, the share of steps in which some of its compute
    lay on the critical path; ``bounds``, the share in which it held more of the path's compute
    than any other rank; ``slowdown``, its compute time per step over the median of its peers'
    (the ranks of its pipeline stage when the grid is known, else all); ``score``, the fastest
    peer's compute time over its own (1 = fastest; NVRx's relative straggler score)."""

    rank: int
    on_path: float
    bounds: float
    slowdown: float
    score: float

    def __str__(self) -> str:
        return (f"rank {self.rank}: on the path in {self.on_path:.0%} of steps, bounds {self.bounds:.0%}, "
                f"compute ×{self.slowdown:.2f} the median, score {self.score:.2f}")


class StragglerScores(list):
    """Every rank's :class:`RankScore`, in rank order."""

    def __repr__(self) -> str:
        return "\n".join(str(s) for s in self) if self else "StragglerScores([])"

    def worst(self) -> RankScore:
        """The rank that bounds the most steps (then the slowest)."""
        return max(self, key=lambda s: (s.bounds, s.slowdown))


def straggler_scores(timeline, groups: str = "require") -> StragglerScores:
    """Per rank, over every step: how often it bounds the step and how much slower it computes."""
    steps = _steps(timeline, None)
    ranks = timeline.ranks
    on_path, bounds = np.zeros(len(ranks)), np.zeros(len(ranks))
    busy = np.zeros((len(steps), len(ranks)))
    for k, s in enumerate(steps):
        table = timeline.step(s).table
        path_compute = np.zeros(len(ranks))
        for e in StepGraph(table, groups).critical_path():
            if e["stream"] != "comm" and e["kind"] != UNTRACED:
                path_compute[e["rank"]] += e["end"] - e["start"]
        on_path += path_compute > 0
        if path_compute.max() > 0:
            bounds[int(np.argmax(path_compute))] += 1
        comp = table["stream"] != "comm"
        np.add.at(busy[k], table["rank"][comp], (table["end"] - table["start"])[comp])
    per_step = np.median(busy, axis=0)
    scores = StragglerScores()
    for r in ranks:
        peers = _peers(timeline, r)
        median = float(np.median(per_step[peers]))
        fastest = float(per_step[peers].min())
        own = float(per_step[r])
        scores.append(RankScore(r, on_path[r] / len(steps), bounds[r] / len(steps),
                                own / median if median > 0 else 1.0, fastest / own if own > 0 else 1.0))
    return scores


def _peers(timeline, rank: int) -> list[int]:
    """The ranks that do the same work as ``rank``: its pipeline stage's, given a grid."""
    grid = timeline.grid
    if grid is None or grid.world_size != timeline.world_size or grid.pp == 1:
        return timeline.ranks
    stage = grid.coords(rank)[1]
    return [r for r in timeline.ranks if grid.coords(r)[1] == stage]
