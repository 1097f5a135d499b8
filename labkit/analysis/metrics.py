"""Step metrics from timeline events, defined once for plots, widgets, the CLI and tests.

An event is a plain dict (docs/design.md, "Events")::

    {"rank", "stream": "compute"|"comm", "kind", "name", "step", "microbatch",
     "start", "end", "bytes", "peer"}

with times in seconds from the start of its step, aligned across ranks. For one rank in one
step we take three sets of time (docs/design.md, "Metrics"):

    T = the step's duration: the latest end over *all* ranks (steps start at 0)
    C = union of the rank's compute spans
    X = union of the rank's comm-stream spans other than ``wait``

A ``wait`` span is the part of a receive before the sender posted its send: a pipeline
dependency, so it is bubble, never comm. Everything else on the comm stream (unknown kinds
included) is comm. From those sets:

    comm_fraction         |X| / T
    exposed_comm_fraction |X − C| / T        comm that the compute lane had to wait out
    overlap_fraction      |X ∩ C| / |X|      HTA's "comm/compute overlap"; 0 with no comm
    bubble_fraction       (T − |C ∪ X|) / T  idle: neither computing nor communicating

Idle time on the compute lane, T − |C|, splits three ways (the first is the one above):

    exposed_comm_fraction     |X − C| / T                comm the compute lane waited out
    schedule_bubble_fraction  |(W ∪ tail) − (C ∪ X)| / T waiting for a peer: W = union of
                              ``wait`` spans (a receive before its sender posted), tail = from
                              the rank's last event to T (done, the step not yet over)
    lab_overhead_fraction     the rest of (T − |C ∪ X|) / T: gaps between actions that are
                              neither, i.e. the harness's own per-action work (Python, hooks)

so ``bubble_fraction = schedule_bubble_fraction + lab_overhead_fraction``. With tiny
micro-batches the per-action overhead is a large share of the step; a lab that calls it all
bubble teaches that the bubble does not shrink with m (FACTS.md, "The lab as a measuring
instrument").

T is the step's duration rather than the rank's own last end because a rank that finishes
early still idles until the step ends; with per-rank T the last pipeline stage's idle tail
would vanish and GPipe's bubble would not come out as (p−1)/(m+p−1) (GPipe, Huang et al.
2019, §2.3).

Run the tests with ``python -m pytest tests/test_metrics.py``.
"""

from __future__ import annotations

from statistics import mean, median

import numpy as np

Span = tuple[float, float]

# From the kind table: kinds whose `bytes` left this rank (moves_bytes: recv counts on the
# sender's side, wait moves nothing, compress is compute that shrinks what is sent), and
# kinds that wait for a peer (waits: bubble, never comm).
from .events import SEND_KINDS, WAIT_KINDS  # noqa: E402
from .table import EventTable, union_lengths  # noqa: E402

TIERS = ("intra", "inter")
"""An emulated link's tiers (:meth:`labkit.Link.tier`): inside a node, between nodes. With one,
every comm event carries its ``tier`` and the metrics add ``bytes_sent_by_tier``: {tier: the
mean bytes per step each rank sent over it}."""
FRACTION_KEYS = ("comm_fraction", "exposed_comm_fraction", "overlap_fraction", "bubble_fraction",
                 "schedule_bubble_fraction", "lab_overhead_fraction")


# --- interval arithmetic on sorted, disjoint unions ----------------------------------------


def union(spans) -> list[Span]:
    """Merge (start, end) spans into a sorted list of disjoint spans; empty spans drop out."""
    merged: list[list[float]] = []
    for start, end in sorted((float(s), float(e)) for s, e in spans if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total(spans) -> float:
    """Length of the union of `spans` (overlaps counted once)."""
    return sum(e - s for s, e in union(spans))


def intersection_length(a, b) -> float:
    """|A ∩ B| for two collections of spans, by one sweep over both unions."""
    a, b = union(a), union(b)
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        length += max(0.0, hi - lo)
        # Advance whichever span ends first; the other may still meet the next one.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


def difference_length(a, b) -> float:
    """|A − B|: the part of A that B does not cover."""
    return total(a) - intersection_length(a, b)


# --- per rank, per step ---------------------------------------------------------------------


def is_comm(event: dict) -> bool:
    """True for time spent communicating: comm stream, not waiting for a peer."""
    return event["stream"] == "comm" and event["kind"] not in WAIT_KINDS


def step_duration(step_events) -> float:
    """T of a step: the latest end over all ranks (times are aligned, steps start at 0)."""
    return max((float(e["end"]) for e in step_events), default=0.0)


def per_rank_metrics(events, rank: int, step: int) -> dict:
    """The fractions of one rank in one step (plots label each lane with these).

    `events` may hold every rank and step: T comes from all ranks of `step`.
    Returns step_time_s, comm_fraction, exposed_comm_fraction, overlap_fraction,
    bubble_fraction, schedule_bubble_fraction, lab_overhead_fraction and bytes_sent.
    """
    step_events = [e for e in events if e["step"] == step]
    world = max(rank + 1, 1 + max((e["rank"] for e in step_events), default=0))
    return step_entry(step_events, world)[1][rank]


def table_entries(table: EventTable, world_size: int) -> dict[int, tuple[float, list[dict]]]:
    """Every step's :func:`step_entry`, from columns: the four unions per (step, rank) are
    each one vectorised sweep (:func:`labkit.analysis.table.union_lengths`), so the metrics
    of 100,000 events cost a few numpy calls rather than a Python loop per rank."""
    if not len(table):
        return {}
    steps, step_index = np.unique(table["step"], return_inverse=True)
    duration = np.full(len(steps), -np.inf)
    np.maximum.at(duration, step_index, table["end"])
    duration = np.maximum(duration, 0.0)
    mine = table["rank"] < world_size           # ranks past world_size count toward T only
    groups = len(steps) * world_size
    group = (step_index * world_size + table["rank"])[mine]
    start, end = table["start"][mine], table["end"][mine]
    stream, kind = table["stream"][mine], table["kind"][mine]
    waits = np.isin(kind, list(WAIT_KINDS))
    compute = stream == "compute"
    comm = (stream == "comm") & ~waits
    busy = compute | comm
    # the tail: from the rank's last event to T (done, the step not yet over)
    last = np.zeros(groups)
    np.maximum.at(last, group, end)
    tail_group = np.arange(groups)
    tail_end = np.repeat(duration, world_size)
    span = lambda m: union_lengths(group[m], start[m], end[m], groups)  # noqa: E731
    c, x, cx = span(compute), span(comm), span(busy)
    everything = union_lengths(np.concatenate([group[busy | waits], tail_group]),
                               np.concatenate([start[busy | waits], last]),
                               np.concatenate([end[busy | waits], tail_end]), groups)
    sent = np.bincount(group, np.where(np.isin(kind, list(SEND_KINDS)), table["bytes"][mine], 0),
                       minlength=groups)
    t = tail_end
    per_t = np.divide(1.0, t, out=np.zeros_like(t), where=t > 0)
    schedule = everything - cx
    columns = {
        "step_time_s": t,
        "comm_fraction": x * per_t,
        "exposed_comm_fraction": (cx - c) * per_t,
        "overlap_fraction": np.divide(x + c - cx, x, out=np.zeros_like(x), where=x > 0),
        "bubble_fraction": (t - cx) * per_t,
        "schedule_bubble_fraction": schedule * per_t,
        "lab_overhead_fraction": np.maximum(0.0, t - cx - schedule) * per_t,
        "bytes_sent": sent.astype(np.int64),
    }
    tier = table["tier"][mine]
    if (tier != "").any():          # on an emulated link: what crossed each tier (bytes_sent_by_tier)
        for name in TIERS:
            columns[f"bytes_{name}"] = np.bincount(
                group, np.where(np.isin(kind, list(SEND_KINDS)) & (tier == name), table["bytes"][mine], 0),
                minlength=groups).astype(np.int64)
    rows = {k: v.tolist() for k, v in columns.items()}
    out = {}
    for i, s in enumerate(steps.tolist()):
        ranks = [{k: rows[k][g] for k in rows} for g in range(i * world_size, (i + 1) * world_size)]
        out[s] = (float(duration[i]), ranks)
    return out


# --- whole run ------------------------------------------------------------------------------


def step_metrics(events, world_size: int | None, global_batch: int,
                 peak_activation_bytes: list[int] | None = None) -> dict:
    """The docs/design.md metrics of a run's events (one or several steps).

    step_time_s is the median over steps of the step's T (the slowest rank's last end).
    Fractions are averaged per rank over steps, then over ranks 0..world_size-1; a rank with
    no event in a step was idle for all of it. bytes_sent is a list per rank of the mean
    bytes sent per step, bytes_sent_total their sum. peak_activation_bytes is not in the
    events: the caller passes it through (a list per rank), else zeros.

        >>> step_metrics(run_events, world_size=4, global_batch=64)["bubble_fraction"]
    """
    table = _as_table(events)
    if world_size is None:
        world_size = 1 + int(table["rank"].max()) if len(table) else 1
    entries = list(table_entries(table, world_size).values())
    return combine_steps(entries, world_size, global_batch, peak_activation_bytes)


def step_entry(step_events, world_size: int) -> tuple[float, list[dict]]:
    """One step's part of the metrics: its T and each rank's fractions and bytes. A run keeps
    these per step, so refreshing its metrics after a step costs that step's events only."""
    entries = table_entries(_as_table(step_events), world_size)
    if not entries:   # nothing timed: every fraction 0 rather than a guess
        idle = dict.fromkeys(("step_time_s",) + FRACTION_KEYS, 0.0) | {"bytes_sent": 0}
        return 0.0, [dict(idle) for _ in range(world_size)]
    return next(iter(entries.values()))


def combine_steps(entries: list[tuple[float, list[dict]]], world_size: int, global_batch: int,
                  peak_activation_bytes: list[int] | None = None) -> dict:
    """step_metrics from the steps' :func:`step_entry` parts."""
    durations = [t for t, _ in entries]
    per_rank = [[ranks[rank] for _, ranks in entries] for rank in range(world_size)]
    step_time = median(durations) if durations else 0.0
    out = {
        "step_time_s": step_time,
        # 0 rather than inf when nothing was timed, so a table shows "0" and not a guess.
        "throughput_samples_s": global_batch / step_time if step_time > 0 else 0.0,
    }
    for key in FRACTION_KEYS:
        out[key] = _mean_over_ranks(per_rank, key)
    bytes_sent = [_mean([m["bytes_sent"] for m in rows]) for rows in per_rank]
    out["bytes_sent"] = bytes_sent
    out["bytes_sent_total"] = sum(bytes_sent)
    if per_rank and all(f"bytes_{TIERS[0]}" in m for rows in per_rank for m in rows):
        out["bytes_sent_by_tier"] = {name: [_mean([m[f"bytes_{name}"] for m in rows]) for rows in per_rank]
                                     for name in TIERS}
    out["peak_activation_bytes"] = (list(peak_activation_bytes) if peak_activation_bytes
                                    is not None else [0] * world_size)
    return out


def _as_table(events) -> EventTable:
    return events if isinstance(events, EventTable) else EventTable.from_dicts(events)


def _mean(values) -> float:
    return mean(values) if values else 0.0


def _mean_over_ranks(per_rank, key: str) -> float:
    """Mean over steps for each rank, then mean over ranks."""
    return _mean([_mean([m[key] for m in rows]) for rows in per_rank])


def speedup(step_time_1: float, step_time_n: float, n: int) -> dict:
    """Strong-scaling speed-up of an n-engine run against a one-engine run.

    Both runs train the same global batch, so

        speedup            = step_time_1 / step_time_n
        scaling_efficiency = speedup / n     (1.0 is perfect linear scaling)
    """
    s = step_time_1 / step_time_n if step_time_n > 0 else 0.0
    return {"speedup": s, "scaling_efficiency": s / n if n else 0.0}
