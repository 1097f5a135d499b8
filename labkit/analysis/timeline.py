"""A run's events, every rank and step, as data: metrics, stragglers, trace files in and out.

A :class:`Timeline` holds its events as columns (:class:`labkit.analysis.table.EventTable`,
layout there and in docs/design.md, "Events") and answers

* ``tl.metrics(global_batch=64)``: the docs/design.md metrics, vectorised over ranks;
* ``tl.stragglers()``: the slowest ranks and what made them slow (labkit.analysis.stragglers);
* ``tl.save_trace("t.json")`` / ``Timeline.load("t.json")``: a Chrome trace for Perfetto,
  read back; ``Timeline.from_profiler(paths)`` reads torch profiler traces
  (labkit.analysis.traces);
* ``tl.to_pandas()``: a DataFrame in the same column layout;
* ``tl.plot()``: drawn by :mod:`labkit.view.timeline` (this module imports no matplotlib).

Event times restart at 0 each step. Wherever steps are shown together (``plot(step="all")``
and the trace file) they are laid back to back: step s starts where step s−1 ended, its
end being the latest end over all ranks.

    >>> tl = Timeline(run_events)            # a list of event dicts, as the recorder makes them
    >>> tl                                   # Timeline(4 ranks, 3 steps, 212 events, ...)
    >>> tl.step(2).plot()
"""
from __future__ import annotations

import json
from statistics import median

import numpy as np

from ..grid import Grid
from . import metrics as _metrics
from .table import EventTable

# Trace thread ids. Integers with thread_name metadata, as the trace format specifies:
# Perfetto reads string tids only through a "quick-and-dirty" hack, and tid 0 is Linux's
# idle thread, which it treats specially (perfetto json_trace_parser_impl.cc; issue #394).
STREAM_TIDS = {"compute": 1, "comm": 2}


class Timeline:
    """Events of a run, every rank and step; see the module docstring.

    events: event dicts, an :class:`EventTable`, or a Chrome trace dict that
    :meth:`save_trace` wrote (``Timeline(json.load(f))``). grid: the run's rank grid (a
    Strategy or ParallelDims: anything with dp, pp and tp), so views name each rank's place
    (dp/pp/tp) and group the replicas of a pipeline stage, and stragglers compare dp peers.
    """

    def __init__(self, events=(), world_size: int | None = None, title: str | None = None, grid=None):
        if isinstance(events, dict):        # a saved trace: its world size and title come back too
            saved = (events.get("otherData") or {}).get("labkit") or {}
            world_size = world_size if world_size is not None else saved.get("world_size")
            title = title if title is not None else saved.get("title")
            events = _from_saved(events)
        if isinstance(events, EventTable):
            self._parts, self._dicts = [events], None
        else:
            dicts = [dict(e) for e in events]
            self._parts, self._dicts = [EventTable.from_dicts(dicts)], dicts
        inferred = 1 + int(self.table["rank"].max()) if len(self.table) else 1
        self.world_size = world_size if world_size is not None else max(inferred, 1)
        self.title = title
        # any object with dp/pp/tp (a Strategy, a ParallelDims) becomes the rank grid
        self.grid = Grid.of(grid)
        self.gpus_per_node: int | None = None
        """Engines per node of the run's emulated link (labkit.Link), so lanes name each rank's
        node; None: one node, or not known."""

    # --- the events -----------------------------------------------------------------------

    @property
    def table(self) -> EventTable:
        """The events as columns (labkit.analysis.table)."""
        if len(self._parts) > 1:
            self._parts = [EventTable.concat(self._parts)]
        return self._parts[0]

    @property
    def events(self) -> list[dict]:
        """The events as dicts, in the schema (made from the columns once, then kept). Read
        them; to add events use :meth:`extend`."""
        if self._dicts is None:
            self._dicts = self.table.to_dicts()
        return self._dicts

    def extend(self, events) -> None:
        """Append more events (a step's, as it arrives); those already held are not copied again."""
        new = [dict(e) for e in events]
        self._parts.append(EventTable.from_dicts(new))
        if self._dicts is not None:
            self._dicts.extend(new)

    def to_pandas(self):
        """The events as a pandas DataFrame (columns as in labkit.analysis.table). Needs pandas."""
        return self.table.to_pandas()

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts)

    def __repr__(self) -> str:
        durations = list(self.step_durations().values())
        time = f", step {median(durations) * 1e3:.2f} ms" if durations else ""
        name = f"{self.title!r}, " if self.title else ""
        return (f"Timeline({name}{self.world_size} ranks, {len(self.steps)} steps, "
                f"{len(self)} events{time})")

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def steps(self) -> list[int]:
        return np.unique(self.table["step"]).tolist()

    def step(self, s: int) -> "Timeline":
        """The events of step `s` only, as a new Timeline."""
        return self._subset(self.table["step"] == s)

    def _subset(self, mask) -> "Timeline":
        part = Timeline(self.table.select(mask), self.world_size, self.title, self.grid)
        part.gpus_per_node = self.gpus_per_node
        return part

    def step_durations(self) -> dict[int, float]:
        """Each step's duration: the latest end over all ranks."""
        t = self.table
        if not len(t):
            return {}
        steps, index = np.unique(t["step"], return_inverse=True)
        ends = np.zeros(len(steps))
        np.maximum.at(ends, index, t["end"])
        return dict(zip(steps.tolist(), ends.tolist()))

    def step_offsets(self) -> dict[int, float]:
        """Start of each step on a continuous axis: the sum of the durations before it."""
        offsets, t = {}, 0.0
        for s, duration in self.step_durations().items():
            offsets[s], t = t, t + duration
        return offsets

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's place in the grid, {"dp": i, "pp": j, "tp": k}, with "cp" and "ep" where the
        grid has those axes ({} without a grid)."""
        if self.grid is None or rank >= self.grid.world_size:
            return {}
        return self.grid.place(rank)

    # --- analysis -------------------------------------------------------------------------

    def metrics(self, global_batch: int, peak_activation_bytes=None) -> dict:
        """docs/design.md metrics of these events (see labkit.analysis.metrics.step_metrics)."""
        return _metrics.step_metrics(self.table, self.world_size, global_batch, peak_activation_bytes)

    def stragglers(self, top: int = 3, threshold: float = 0.1):
        """The ranks that held the others back and why (labkit.analysis.stragglers.find)."""
        from .stragglers import find

        return find(self, top=top, threshold=threshold)

    # --- the step as a graph (labkit.analysis.graph) --------------------------------------

    def critical_path(self, step: int | None = None, groups: str = "require", rank: int | None = None) -> "Timeline":
        """The spans that set each step's length (or ``step``'s), cut to their part on the path,
        as a Timeline: every view works on it. Time between a rank's recorded spans on the path
        is an ``untraced`` span. groups="world": join collectives that do not name their ranks
        as one group of every rank (a profiler trace without process-group info); rank=R: that
        rank's own path, without edges to other ranks (labkit.analysis.graph)."""
        from .graph import critical_path

        return critical_path(self, step, groups, rank)

    def bound_by(self, step: int | None = None, groups: str = "require"):
        """What holds the critical path, largest first; ``str()`` of it is one line, e.g.
        "rank 2's compute (61% of the path), then the allreduces of ranks 0–3 (22% of the path)"."""
        from .graph import bound_by

        return bound_by(self, step, groups)

    def straggler_scores(self, groups: str = "require"):
        """Per rank: the share of steps in which it lay on (and bounded) the critical path, and
        its compute time against its peers' median and the fastest peer's (labkit.analysis.graph)."""
        from .graph import straggler_scores

        return straggler_scores(self, groups)

    # --- files ----------------------------------------------------------------------------

    def to_chrome_trace(self) -> dict:
        """Chrome trace JSON (pid = rank, one thread per stream, ph "X", times in µs)."""
        offsets = self.step_offsets()
        return {"traceEvents": self._trace_metadata() + _trace_spans(self.table, offsets),
                "displayTimeUnit": "ms",
                "otherData": {"labkit": {"world_size": self.world_size, "title": self.title}}}

    def save_trace(self, path) -> None:
        """Write the Chrome trace to `path`; open it in ui.perfetto.dev or chrome://tracing,
        or read it back with :meth:`load`."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)

    @classmethod
    def load(cls, path) -> "Timeline":
        """A trace file read back: one :meth:`save_trace` wrote, or a torch profiler trace
        (then as :meth:`from_profiler` with one path)."""
        from .traces import read_json

        trace = read_json(path)
        if _is_labkit_trace(trace):
            return cls(trace)
        return cls.from_profiler([path])

    @classmethod
    def from_profiler(cls, paths, title: str | None = None, ranks=None, grid=None) -> "Timeline":
        """Torch profiler (Kineto) Chrome traces, one per rank, plain or gzipped, as one
        Timeline (labkit.analysis.traces.read_profiler). ranks: each path's rank, for
        traces without distributedInfo; grid: the job's rank grid (anything with dp, pp, tp),
        so lanes name each rank's place and stragglers compare dp peers."""
        from .traces import read_profiler

        tl = read_profiler(paths, title=title, ranks=ranks)
        tl.grid = Grid.of(grid)
        return tl

    def temporal_breakdown(self) -> list[dict]:
        """Per rank: compute, non-compute and idle seconds in its own window, comparable with
        Holistic Trace Analysis's temporal breakdown (labkit.analysis.traces)."""
        from .traces import temporal_breakdown

        return temporal_breakdown(self)

    def _trace_metadata(self) -> list[dict]:
        """Name and order the processes "rank N" and their threads "compute"/"comm"."""
        meta = []
        for rank in self.ranks:
            meta.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
            meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
            for stream, tid in STREAM_TIDS.items():
                meta.append(_meta("thread_name", rank, tid, {"name": stream}))
                meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
        return meta

    # --- views (labkit.view.timeline) -----------------------------------------------------

    def plot(self, *args, **kwargs):
        """Draw the timeline; see :func:`labkit.view.timeline.plot_timeline`."""
        from ..view.timeline import plot_timeline

        return plot_timeline(self, *args, **kwargs)


# --- trace files --------------------------------------------------------------------------


def _trace_spans(table: EventTable, offsets: dict[int, float]) -> list[dict]:
    """Every event as a Chrome "complete" event, its step shifted by its offset."""
    shift = np.array([offsets[s] for s in table["step"].tolist()]) if len(table) else np.zeros(0)
    ts = ((shift + table["start"]) * 1e6).tolist()
    dur = ((table["end"] - table["start"]) * 1e6).tolist()
    rows = table.to_dicts()
    tids = [STREAM_TIDS.get(s, len(STREAM_TIDS) + 1) for s in table["stream"].tolist()]
    return [{"name": e["name"] or e["kind"], "cat": e["kind"], "ph": "X", "pid": e["rank"], "tid": tid,
             "ts": t, "dur": d,
             "args": {k: e[k] for k in ("stream", "kind", "step", "microbatch", "bytes", "peer", "group", "waited",
                                "posted", "moved", "tier")
                      if k in e}}
            for e, tid, t, d in zip(rows, tids, ts, dur)]


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _is_labkit_trace(trace) -> bool:
    """A trace :meth:`Timeline.save_trace` wrote: its spans carry the schema in ``args``."""
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        return False
    if "labkit" in (trace.get("otherData") or {}):
        return True
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return bool(spans) and all("step" in e.get("args", {}) and "kind" in e.get("args", {}) for e in spans)


def _from_saved(trace: dict) -> EventTable:
    """Events back from a saved trace. Steps were laid back to back, step s+1 starting at the
    latest end of step s, so each step's offset is recovered from the spans themselves."""
    if not _is_labkit_trace(trace):
        raise ValueError("Timeline(dict): the dict is not a trace that Timeline.save_trace wrote "
                         "(no 'traceEvents' whose spans carry args.kind and args.step); read a "
                         "torch profiler trace with Timeline.from_profiler(paths)")
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ends: dict[int, float] = {}
    for e in spans:
        s = e["args"]["step"]
        ends[s] = max(ends.get(s, 0.0), (e["ts"] + e["dur"]) * 1e-6)
    offsets, t = {}, 0.0
    for s in sorted(ends):
        offsets[s], t = t, ends[s]
    events = []
    for e in spans:
        a, start = e["args"], e["ts"] * 1e-6 - offsets[e["args"]["step"]]
        event = {"rank": e["pid"], "stream": a["stream"], "kind": a["kind"], "name": e["name"],
                 "step": a["step"], "microbatch": a.get("microbatch"), "start": start,
                 "end": start + e["dur"] * 1e-6, "bytes": a.get("bytes") or 0, "peer": a.get("peer")}
        event.update({k: a[k] for k in ("group", "waited", "posted", "moved", "tier") if a.get(k) is not None})
        events.append(event)
    return EventTable.from_dicts(events)
