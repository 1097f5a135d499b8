"""Events as columns: one numpy array per field of the event schema.

A run of 256 ranks × 400 spans is 100,000 events; as dicts every metric and every plot walks
them one by one in Python. An :class:`EventTable` holds the same events as ten arrays of
equal length, in the schema's order (docs/design.md, "Events"):

    =========== ========= ==================================================
    column      dtype     meaning
    =========== ========= ==================================================
    rank        int32     the rank whose lane the span is on
    stream      str       "compute" or "comm" (a profiler trace may add more)
    kind        str       a row of the kind table (labkit.analysis.events)
    name        object    free text: "F3", "block 2", a kernel's name
    step        int32     the training step
    microbatch  int32     the micro-batch, -1 for none
    start, end  float64   seconds from the step's start, one clock for all ranks
    bytes       int64     bytes moved (0 for compute)
    peer        int32     the other rank of a send/recv/wait, -1 for none
    group       str       optional: a collective's ranks, "0,2" ("" for none)
    waited      float64   optional: when the caller waited on an async call (NaN: unknown)
    posted      float64   optional: when a send was posted, where ``start`` is later (NaN: at start)
    moved       float64   optional: on an emulated link, when gloo had moved a collective's bytes
    tier        str       optional: on an emulated link, "intra" (inside a node) or "inter" ("")
    =========== ========= ==================================================

The optional columns are what the step graph (labkit.analysis.graph, labkit.analysis.whatif) needs
to join a collective's members across ranks, to know where a rank consumed a call's result, and
where a send whose receiver came later was posted (labkit.analysis.waits trims its span); events
without them (older traces) read as "" and NaN, and dicts carry them only when set.

Why numpy and not pandas or pyarrow: numpy is already here (torch needs it), it runs on
every engine, and the hot operations — masks, sorts, ``bincount`` and a running maximum —
are single numpy calls. pandas is used only by :meth:`EventTable.to_pandas`, imported there,
so labkit never needs it installed.

>>> t = EventTable.from_dicts([{"rank": 0, "stream": "compute", "kind": "fwd", "name": "F0",
...     "step": 0, "microbatch": 0, "start": 0.0, "end": 0.001, "bytes": 0, "peer": None}])
>>> len(t), t.to_dicts()[0]["peer"]
(1, None)
"""
from __future__ import annotations

import numpy as np

COLUMNS = ("rank", "stream", "kind", "name", "step", "microbatch", "start", "end", "bytes", "peer")
OPTIONAL = {"group": "", "waited": float("nan"), "posted": float("nan"), "moved": float("nan"), "tier": ""}
"""Columns an event may carry beyond the schema's ten, with the value that stands for none."""
ALL_COLUMNS = COLUMNS + tuple(OPTIONAL)
_INT32 = ("rank", "step", "microbatch", "peer")
_NONE_AS = -1          # microbatch and peer: -1 stands for None (ranks and micro-batches are ≥ 0)


def _column(name: str, values) -> np.ndarray:
    """One column with its schema dtype (see the table in the module docstring)."""
    if name in ("microbatch", "peer"):
        return np.array([_NONE_AS if v is None else v for v in values], dtype=np.int32)
    if name in _INT32:
        return np.array(values, dtype=np.int32)
    if name in ("start", "end"):
        return np.array(values, dtype=np.float64)
    if name == "bytes":
        return np.array([int(v or 0) for v in values], dtype=np.int64)
    if name in ("waited", "posted", "moved"):
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    if name in ("name", "group", "tier"):
        out = np.empty(len(values), dtype=object)
        out[:] = ["" if v is None else str(v) for v in values]
        return out
    return np.array([str(v) for v in values], dtype=str) if len(values) else np.array([], dtype="<U1")


class EventTable:
    """The events of a run as columns; see the module docstring for the layout."""

    def __init__(self, columns: dict[str, np.ndarray]):
        missing = [c for c in COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"EventTable: columns {missing} missing; the schema is {COLUMNS}")
        lengths = {len(columns[c]) for c in COLUMNS}
        if len(lengths) > 1:
            raise ValueError(f"EventTable: columns of different lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        self.columns = {c: columns[c] for c in COLUMNS}
        for c, none in OPTIONAL.items():
            self.columns[c] = columns[c] if c in columns else _column(c, [none] * n)

    @classmethod
    def from_dicts(cls, events) -> "EventTable":
        """Columns from event dicts (the recorder's, the simulator's, a run.json's)."""
        events = list(events)
        try:
            columns = {c: _column(c, [e[c] for e in events]) for c in COLUMNS}
        except KeyError as missing:
            raise ValueError(f"an event has no {missing} field; events follow the schema "
                             f"{COLUMNS} (labkit.analysis.events.make_event builds one)") from None
        for c, none in OPTIONAL.items():
            if any(c in e for e in events):
                columns[c] = _column(c, [e.get(c, none) for e in events])
        return cls(columns)

    @classmethod
    def empty(cls) -> "EventTable":
        return cls.from_dicts([])

    @classmethod
    def concat(cls, tables) -> "EventTable":
        tables = [t for t in tables if len(t)] or [cls.empty()]
        return cls({c: np.concatenate([t.columns[c] for t in tables]) for c in ALL_COLUMNS})

    def __len__(self) -> int:
        return len(self.columns["rank"])

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def select(self, mask) -> "EventTable":
        """The rows where `mask` holds (a boolean array or an index array)."""
        return EventTable({c: v[mask] for c, v in self.columns.items()})

    def to_dicts(self) -> list[dict]:
        """Back to event dicts (None where microbatch or peer is -1; the optional columns only
        where set)."""
        cols = {c: v.tolist() for c, v in self.columns.items()}
        for c in ("microbatch", "peer"):
            cols[c] = [None if v == _NONE_AS else v for v in cols[c]]
        rows = [dict(zip(COLUMNS, row)) for row in zip(*(cols[c] for c in COLUMNS))]
        for k, row in enumerate(rows):
            for text in ("group", "tier"):
                if cols[text][k]:
                    row[text] = cols[text][k]
            for instant in ("waited", "posted", "moved"):
                if cols[instant][k] == cols[instant][k]:          # not NaN
                    row[instant] = cols[instant][k]
        return rows

    def to_pandas(self):
        """A pandas DataFrame in the column layout above; microbatch and peer as nullable
        integers (<NA> for none), stream and kind as categories. Needs pandas."""
        import pandas as pd  # here: labkit itself never needs pandas

        frame = pd.DataFrame({c: self.columns[c] for c in ALL_COLUMNS})
        for c in ("microbatch", "peer"):
            frame[c] = frame[c].astype("Int32").mask(frame[c] == _NONE_AS)
        for c in ("stream", "kind"):
            frame[c] = frame[c].astype("category")
        return frame


def union_lengths(group: np.ndarray, start: np.ndarray, end: np.ndarray, groups: int) -> np.ndarray:
    """|∪ spans| of each group 0..groups-1, overlaps counted once, in one vectorised sweep.

    Sort by (group, start); a span adds the part of it past the furthest end seen before it in
    its group: max(0, end − max(start, running max of earlier ends)). The running maximum
    restarts at each group because every group is lifted above the one before it.
    """
    keep = end > start
    group, start, end = group[keep], start[keep], end[keep]
    if not len(group):
        return np.zeros(groups, dtype=np.float64)
    order = np.lexsort((start, group))
    group, start, end = group[order], start[order], end[order]
    before = reach_before(group, start, end)
    return np.bincount(group, np.maximum(0.0, end - np.maximum(start, before)), minlength=groups)


def reach_before(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For spans sorted by (group, start): the furthest end of the spans before each one in
    its group (−inf for a group's first span)."""
    if not len(group):
        return np.zeros(0)
    # Lift group g by g·(range + 1): each group's times lie above all earlier groups', so one
    # running maximum over the whole array never carries an end across a group boundary.
    lo = min(start.min(), 0.0)
    lift = group * (end.max() - lo + 1.0)
    reach = np.maximum.accumulate(end - lo + lift)
    before = np.concatenate(([-np.inf], reach[:-1])) - lift + lo
    first = np.concatenate(([True], group[1:] != group[:-1]))
    before[first] = -np.inf
    return before
