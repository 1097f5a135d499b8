"""What if: a measured step replayed with another link, faster compute, or a straggler healed.

``run.whatif(link=labkit.Link(bandwidth=200e6), compute=1.0, straggler=None)`` turns each
measured step into programs of the one event-driven core (:mod:`labkit.analysis.des`, which
:func:`labkit.plan.simulate` runs too) and runs them again: compute spans as measured (times
``compute``; a ``straggler``'s, kind by kind, brought to its peers' median), host time between
spans as measured (not compute a faster chip shortens), each call issued where it was posted and
waited for where it was waited. A call's measured time is cut into gloo's own work (kept), the
link's α-β time (replaced by the new link's, on the link's own queue) and each member's rest (kept
on that member): it ends at max(gloo, new link) plus its member's rest, so a faster link cannot
make a call shorter than gloo made it (docs/design.md, "The step as a graph"). A run on an
emulated link cannot be replayed on raw gloo (``link=None``): the link hid how long gloo's calls
would wait on one another. ``bucket_mb`` changes the graph's shape and rebuilds it
(:mod:`labkit.analysis.rebucket`); the other shape knobs are :func:`labkit.plan.simulate`'s.

    >>> fast = run.whatif(link=labkit.Link(bandwidth=200e6, latency=2e-4))
    >>> fast.step_time_s, fast.timeline.bound_by()
    >>> run.whatif(bucket_mb=0.05).step_time_s           # a rebuild: smaller buckets, leaving sooner
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from .events import group_ranks
from .graph import COLLECTIVES, EPS, StepGraph
from .timeline import Timeline
from .des import Compute, Issue, Sim, Wait
from ..link import OPS
from .rebucket import check as check_rebucket, rebucket

@dataclass
class WhatIf:
    """A replayed run: ``timeline`` (every measured step replayed), ``metrics`` (the design's
    metrics over it), and the measured and replayed median step times."""

    timeline: Timeline
    metrics: dict
    measured_step_s: float
    what: str

    @property
    def step_time_s(self) -> float:
        return self.metrics["step_time_s"]

    @property
    def speedup(self) -> float:
        """Measured step time over the replayed one (> 1: the change would help)."""
        return self.measured_step_s / self.step_time_s if self.step_time_s > 0 else float("inf")

    def __repr__(self) -> str:
        return (f"what if {self.what}: step {self.measured_step_s * 1e3:.2f} ms measured → "
                f"{self.step_time_s * 1e3:.2f} ms replayed (×{self.speedup:.2f})")


def whatif(run, link="same", compute: float = 1.0, straggler: int | None = None, **knobs) -> WhatIf:
    """``run``'s steps replayed with ``link`` (a labkit.Link; "same": the run's own), compute
    times ``compute``, and ``straggler``'s compute brought to its peers' median (module
    docstring); ``bucket_mb``: the gradient buckets rebuilt at that size (labkit.analysis.rebucket)."""
    bucket_mb = knobs.pop("bucket_mb", None)
    if knobs:
        raise TypeError(f"whatif({', '.join(knobs)}=…): these knobs change the step's shape, which a replay "
                        f"of the measured graph cannot do (only bucket_mb is rebuilt); predict them with "
                        f"labkit.plan.simulate(strategy, machine, model=…), which builds the executor's action lists")
    params = check_rebucket(run, bucket_mb) if bucket_mb is not None else None
    if isinstance(compute, bool) or not isinstance(compute, (int, float)) or not 0 < compute < float("inf"):
        raise ValueError(f"whatif(compute={compute!r}): give the factor on compute time, e.g. 0.1 for ten times "
                         f"faster compute, 1.0 for as measured")
    measured_link = getattr(run, "link", None)
    new_link = measured_link if isinstance(link, str) and link == "same" else link
    if new_link is None and measured_link is not None:
        raise ValueError("whatif(link=None): this run's calls were held by an emulated link, which hid gloo's own "
                         "time; replay it on another Link, or run it on raw gloo to see raw gloo")
    tl = run.timeline
    if straggler is not None and straggler not in tl.ranks:
        raise ValueError(f"whatif(straggler={straggler!r}): give a rank from 0 to {tl.world_size - 1}")
    if not tl.steps:
        raise ValueError("whatif: the run holds no events (run it with record=True)")
    reshape = None
    if params is not None:
        def reshape(events, priced):
            return rebucket(events, params, run.strategy.bucket_mb, bucket_mb, priced)
    replayed = []
    for s in tl.steps:
        events = replay_step(tl.step(s).events, tl.world_size, measured_link, new_link, compute, straggler, reshape)
        replayed += [dict(e, step=s) for e in events]
    what = ", ".join(w for w in (
        f"link {new_link}" if new_link is not measured_link else "",
        f"compute ×{compute:g}" if compute != 1.0 else "",
        f"rank {straggler} healed" if straggler is not None else "",
        f"buckets of {bucket_mb:g} MiB (rebuilt)" if bucket_mb is not None else "") if w) or "nothing changed"
    out = Timeline(replayed, tl.world_size, f"what if {what}", tl.grid)
    batch = getattr(run, "batch", None) or 1
    measured = float(np.median(list(tl.step_durations().values())))
    return WhatIf(out, out.metrics(global_batch=batch), measured, what)


# --- one step --------------------------------------------------------------------------------
def replay_step(events: list[dict], world_size: int, old_link=None, new_link=None, compute: float = 1.0,
                straggler: int | None = None, reshape=None) -> list[dict]:
    """One step's events replayed on :class:`labkit.analysis.des.Sim` (module docstring). ``reshape``:
    (events, each call's (gloo seconds, excess) by (rank, name)) → (new events, the new calls'
    prices by (rank, name)), a rebuild of the step's shape before it is replayed."""
    graph = StepGraph(events)
    calls = _calls(graph, old_link, new_link)
    if reshape is not None:
        priced = {(e["rank"], e["name"]): (calls[i].seconds, calls[i].tail)
                  for i, e in enumerate(graph.events) if i in calls}
        events, prices = reshape(graph.events, priced)
        graph = StepGraph(events)
        calls = _calls(graph, old_link, new_link)
        for i, e in enumerate(graph.events):
            if i in calls and (e["rank"], e["name"]) in prices:
                seconds, tail = prices[(e["rank"], e["name"])]
                calls[i] = replace(calls[i], seconds=seconds, tail=tail)
    scale = _compute_scale(events, world_size, compute, straggler)
    programs = [_program(graph, r, calls, scale[r]) for r in range(world_size)]
    return Sim(programs, cores=float(world_size), links=new_link is not None, gloo_queue=True).run()


@dataclass
class _Call:
    key: object
    group: tuple
    seconds: float
    link: float
    tail: float
    ordered: bool


def _calls(graph: StepGraph, old_link, new_link) -> dict[int, _Call]:
    """Each comm span's call: its key (one per collective or message), members and price,
    priced in the order the calls entered (their last member's start), as their links took them."""
    out, through, link_free = {}, {}, {}      # a collective's key → when gloo was through; a rank's link → free
    calls = _members(graph)
    for key, group, ordered, rows in sorted(calls, key=lambda c: max(graph.start[m] for m in c[3])):
        i, kind = rows[0], graph.kind[rows[0]]
        nbytes = max(graph.events[m]["bytes"] for m in rows)
        ranks = group if kind not in COLLECTIVES else (group_ranks(graph.events[i].get("group", "")) or group)
        old = _link_seconds(old_link, kind, nbytes, ranks)
        new = _link_seconds(new_link, kind, nbytes, ranks)
        begin = _began(graph, i, rows, through)
        moved = [graph.events[m].get("moved") for m in rows]
        # gloo is through the call once its first member is; each other member notes it later
        # (its own thread's wake-up): that lag is the member's own excess
        done = {m: graph.events[m]["moved"] if None not in moved else graph.end[m] for m in rows}
        through[key] = min(done.values())
        if old_link is None:                     # raw gloo: its time and the new link's run at once
            gloo = max(0.0, through[key] - begin)
            out.update({m: _Call(key, group, gloo, new, float(graph.end[m] - through[key]), ordered) for m in rows})
            continue
        # on the old link: gloo's own part (from when gloo reached the call to when it had moved
        # the bytes), the link's part (from when every member's link was free), and each member's rest
        entered = max(graph.start[m] for m in rows)
        link_end = max([entered] + [link_free.get(r, 0.0) for r in group]) + old
        link_free.update({r: link_end for r in group})
        gloo = through[key] - begin if None not in moved else 0.0
        freed = max(through[key] if None not in moved else begin, link_end)
        out.update({m: _Call(key, group, max(0.0, gloo), new, max(0.0, float(graph.end[m] - freed)), ordered)
                    for m in rows})
    return out


def _members(graph: StepGraph) -> list[tuple]:
    """(key, ranks, ordered, rows) of each call in the step: a collective's members, a message's
    two ends, or a call alone on its rank (its peers unrecorded)."""
    seen, out = set(), []
    for i in range(len(graph)):
        e, kind = graph.events[i], graph.kind[i]
        if e["stream"] != "comm" or kind == "wait" or i in seen:
            continue
        if kind in COLLECTIVES and len(graph.members.get(i, ())) > 1:
            members = graph.members[i]
            ranks = tuple(sorted(int(graph.rank[m]) for m in members))
            call = (("c", int(min(members))), ranks, True, members.tolist())
        elif kind in ("send", "recv") and i in graph.partner:
            s, r = (i, graph.partner[i]) if kind == "send" else (graph.partner[i], i)
            call = (("p", s), (int(graph.rank[s]), int(graph.rank[r])), False, [s, r])
        else:
            call = (("a", i), (int(graph.rank[i]),), True, [i])
        seen.update(call[3])
        out.append(call)
    return out


def _began(graph: StepGraph, i: int, rows, through: dict) -> float:
    """When gloo began call i: its last member's entry, and, for a collective, once gloo was
    through its group's previous call (gloo runs a group's calls in order; ``through``: when it
    had moved that call's bytes, recorded on an emulated link, else the call's end)."""
    begin = max(graph.start[m] for m in rows)        # a message's spans start once both ends are there
    if graph.kind[i] not in COLLECTIVES or i not in graph.members:
        return float(begin)
    previous = graph.previous.get(i)
    if previous is not None:
        key = ("c", int(min(previous)))
        begin = max(begin, through.get(key, max(graph.end[p] for p in previous)))
    return float(begin)


def _link_seconds(link, kind: str, nbytes: int, ranks) -> float:
    """The call's α-β time on ``link`` (0 without one): :meth:`labkit.Link.seconds` of the size
    whose wire bytes (``nbytes``, one rank's) the event recorded, on the tier its ranks span and
    the links they have there. A kind outside the table: n−1 messages of its bytes, on one link."""
    if link is None or len(ranks) < 2:
        return 0.0
    n = len(ranks)
    op = {"allreduce": "all_reduce", "allgather": "all_gather", "recv": "send"}.get(kind, kind)
    op = op if op in OPS else "all_to_all"
    wire = 2 * (n - 1) / n if op == "all_reduce" else 1.0 if op in ("send", "broadcast") else (n - 1) / n
    return link.seconds(op, nbytes / wire, n, link.tier(ranks), link.nics(ranks))


def _compute_scale(events, world_size: int, compute: float, straggler) -> list[dict]:
    """Each rank's factor on its compute spans, by kind: ``compute``, and for the straggler what
    brings its time in each kind (forward, backward, optimizer, …) to the median of the other
    ranks' (a planted delay in the forward is removed there alone)."""
    scale = [defaultdict(lambda: compute) for _ in range(world_size)]
    if straggler is None or world_size < 2:
        return scale
    busy = defaultdict(lambda: np.zeros(world_size))
    for e in events:
        if e["stream"] != "comm":
            busy[e["kind"]][e["rank"]] += e["end"] - e["start"]
    for kind, per_rank in busy.items():
        others = float(np.median(np.delete(per_rank, straggler)))
        if per_rank[straggler] > 0:
            scale[straggler][kind] = compute * min(1.0, others / per_rank[straggler])
    return scale


def _program(graph: StepGraph, rank: int, calls: dict[int, _Call], scale: dict) -> list:
    """Rank ``rank``'s items in the order its thread met them: compute spans (cut where a call
    was issued or waited for inside them), host time between, each call's Issue and Wait."""
    rows = graph.by_rank.get(rank, np.zeros(0, dtype=int))
    spans = _outermost([i for i in rows if graph.compute[i]], graph)
    points = []
    for i in rows:
        if i not in calls:
            continue
        call, e = calls[i], graph.events[i]
        issue = Issue(call.key, call.group, call.seconds, e["kind"], e["name"], e["bytes"], e.get("peer"),
                      e.get("microbatch"), call.ordered, link=call.link, tail=call.tail)
        posted = e.get("posted", graph.start[graph.wait_of[i]] if i in graph.wait_of else graph.start[i])
        points.append((float(posted), 0, issue, None))
        points.append((float(_consumed(graph, i, spans)), 1, Wait(call.key), float(graph.end[i])))
    points.sort(key=lambda p: (p[0], p[1]))
    prog, cursor, k = [], 0.0, 0

    def host(until: float):
        nonlocal cursor
        if until - cursor > EPS:
            prog.append(Compute(until - cursor))
        cursor = max(cursor, until)

    def point(p):
        nonlocal cursor
        t, _, item, ends = p
        host(t)
        prog.append(item)
        if ends is not None:                    # a wait: the thread resumes once the call is through
            cursor = max(cursor, ends)

    for i in spans:
        start, end, e = float(graph.start[i]), float(graph.end[i]), graph.events[i]
        while k < len(points) and points[k][0] <= start + EPS:
            point(points[k])
            k += 1
        host(start)
        t = max(start, cursor)
        while k < len(points) and points[k][0] < end - EPS:
            piece = points[k][0] - t
            if piece > EPS:
                prog.append(Compute(piece * scale[e["kind"]], e["kind"], e["name"], e.get("microbatch")))
            t = max(t, points[k][0])
            prog.append(points[k][2])
            if points[k][3] is not None:
                t = max(t, points[k][3])
            k += 1
        if end - t > EPS:
            prog.append(Compute((end - t) * scale[e["kind"]], e["kind"], e["name"], e.get("microbatch")))
        cursor = max(cursor, end, t)         # a wait inside the span may have held the rank past its end
    for p in points[k:]:
        point(p)
    return prog


def _outermost(rows: list[int], graph: StepGraph) -> list[int]:
    """Compute spans not inside another of the rank's (a ring round inside its block's forward)."""
    out, reach = [], -np.inf
    for i in sorted(rows, key=lambda i: (graph.start[i], -graph.end[i])):
        if graph.end[i] <= reach + EPS:
            continue
        out.append(i)
        reach = graph.end[i]
    return out


def _consumed(graph: StepGraph, i: int, spans: list[int]) -> float:
    """Where the rank waited for call i: its recorded ``waited``; else, for a trace without it,
    where the compute lane sat idle until the call ended (the next span starting then), else
    before the step's last compute span."""
    e = graph.events[i]
    if e.get("waited") is not None:
        return float(e["waited"])
    end = graph.end[i]
    later = [j for j in spans if graph.start[j] >= end - EPS]
    if not later:
        return float(end)
    first = min(later, key=lambda j: graph.start[j])
    busy_until = max([graph.end[j] for j in spans if graph.start[j] < end - EPS], default=0.0)
    if busy_until <= end + EPS and graph.start[first] - end < 1e-3:
        return float(graph.start[first])
    return float(graph.start[max(later, key=lambda j: graph.start[j])])
