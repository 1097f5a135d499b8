"""Trace files in: torch profiler (Kineto) Chrome traces, one per rank, read as a Timeline.

    >>> tl = Timeline.from_profiler(sorted(Path("traces").glob("rank*.json.gz")))
    >>> tl.metrics(global_batch=64), tl.stragglers(), tl.plot()

What a Kineto trace holds (torch.profiler's ``export_chrome_trace``; FACTS.md): a
``traceEvents`` list of Chrome "complete" events (``ph: "X"``, ``ts``/``dur`` in µs) and a
``distributedInfo`` {backend, rank, world_size}. GPU work is ``cat: "kernel"`` (tid = CUDA
stream), ``gpu_memcpy``, ``gpu_memset``; host work is ``cpu_op`` on the Python threads; each
``profiler.step()`` leaves a ``ProfilerStep#N`` ``user_annotation`` on the main thread.

How it becomes events in labkit's schema:

* **GPU traces** (any kernel present): NCCL kernels (``ncclKernel_AllReduce_…``,
  ``ncclDevKernel_SendRecv``) are comm, kinds from the name (:data:`NCCL_KINDS`); memcpy and
  memset are compute, kind ``memcpy``; every other kernel is compute, kind ``compute``. A
  kernel belongs to the step whose ``ProfilerStep#N`` window holds the host call that
  launched it (matched by ``correlation``), else its own start.
* **CPU traces** (no kernel, as with gloo): the top-level ``cpu_op`` events of the main thread
  (the one with ``ProfilerStep`` annotations) are compute, except ``c10d::`` ops, which are
  comm; gloo's ``gloo:all_reduce``-style annotations on its worker threads are comm too.
  Both names map to kinds by :func:`comm_kind`.
* **Time**: each rank's step s starts at its own ``ProfilerStep#s`` start, as a labkit run's
  ranks count from their step's barrier. Unlike labkit's runs no barrier precedes a profiler
  step, so ranks that entered the step apart keep that skew.

Kinds outside labkit's kind table (``compute``, ``memcpy``) are drawn in the
colours of :data:`TRACE_COLORS`. Bytes are 0: a trace does not record message sizes.

Comparing with Holistic Trace Analysis (HTA): :func:`temporal_breakdown` splits each rank's
window into compute, non-compute and idle as HTA's temporal breakdown does, and labkit's
``overlap_fraction`` |X ∩ C| / |X| is HTA's comm/compute overlap (comm kernel time under
compute kernels over comm kernel time). Where they differ: labkit's fractions divide by the
step time T of the *slowest* rank (a rank that finished early idles until the step ends),
HTA's by the rank's own window; labkit counts memcpy/memset as compute, HTA as non-compute
("memory"); labkit gives compute the overlapping time so the three parts sum to the window.
"""
from __future__ import annotations

import gzip
import json
import re
import warnings
from pathlib import Path

import numpy as np

from .events import group_key
from .table import EventTable, union_lengths

# NCCL kernel name → kind, first match wins (all-to-all runs as grouped SendRecv kernels in
# NCCL, indistinguishable by name from a send/recv pair: read as "send").
NCCL_KINDS = (("AllReduce", "allreduce"), ("AllGather", "allgather"), ("ReduceScatter", "reduce_scatter"),
              ("Broadcast", "broadcast"), ("AllToAll", "all_to_all"), ("SendRecv", "send"),
              ("Send", "send"), ("Recv", "recv"), ("Reduce", "allreduce"))
# A c10d op or gloo annotation, its prefix and underscores dropped ("c10d::_allgather_base_").
_CPU_COMM = (("allreduce", "allreduce"), ("allgather", "allgather"), ("reducescatter", "reduce_scatter"),
             ("broadcast", "broadcast"), ("alltoall", "all_to_all"), ("send", "send"), ("recv", "recv"),
             ("barrier", "barrier"))
TRACE_COLORS = {"compute": "#6699CC", "memcpy": "#AA4499", "barrier": "#999999"}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def read_json(path) -> dict:
    """A trace file's JSON, plain or gzipped; a ValueError naming the file when it is not JSON
    (a truncated file: the profiler was stopped while writing)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (json.JSONDecodeError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as err:
        raise ValueError(f"{path}: not a complete JSON trace ({err}); was the profiler stopped "
                         "before it finished writing?") from None


def comm_kind(name: str) -> str | None:
    """The comm kind of a kernel, c10d op or gloo annotation's name; None for compute."""
    if "nccl" in name.lower():
        return next((kind for key, kind in NCCL_KINDS if key in name), "allreduce")
    if name.startswith(("c10d::", "gloo:")):
        flat = name.split(":")[-1].replace("_", "").lower()
        return next((kind for key, kind in _CPU_COMM if flat.startswith(key)), "barrier")
    return None


def read_profiler(paths, title: str | None = None, ranks=None):
    """Torch profiler traces, one per rank, as one Timeline (see the module docstring).

    ranks: the rank of each path, for traces without ``distributedInfo``.
    """
    from .timeline import Timeline

    paths = [f for p in ([paths] if isinstance(paths, (str, Path)) else paths) for f in _trace_files(Path(p))]
    if not paths:
        raise ValueError("from_profiler(paths): no paths given; pass one trace file per rank")
    if ranks is not None and len(ranks) != len(paths):
        raise ValueError(f"from_profiler: {len(ranks)} ranks for {len(paths)} paths; give one rank per path")
    parts, world, steps_of = [], 0, {}
    for i, path in enumerate(paths):
        trace = read_json(path)
        rank, size = _rank_of(trace, path, None if ranks is None else ranks[i])
        if rank in steps_of:
            raise ValueError(f"{path}: rank {rank} already read from another file; one trace per rank")
        table, steps = _read_rank(trace, path, rank)
        parts.append(table)
        steps_of[rank] = (path, steps)
        world = max(world, size, rank + 1)
    _check_steps(steps_of)
    missing = sorted(set(range(world)) - set(steps_of))
    if missing:
        warnings.warn(f"the traces name a world of {world} ranks but none of these files is rank "
                      f"{_ranges(missing)}; those ranks are empty and the metrics count them idle "
                      f"(pass every rank's trace)", stacklevel=3)
    return Timeline(EventTable.concat(parts), world, title or "profiler trace")


def _trace_files(path: Path) -> list[Path]:
    """A trace file as it is; a folder (torch's ``tensorboard_trace_handler`` writes one file per
    rank into a folder) as its ``.json`` / ``.json.gz`` files, in name order."""
    if not path.is_dir():
        return [path]
    found = sorted(f for f in path.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
    if not found:
        raise ValueError(f"{path}: a folder with no .json or .json.gz trace in it; pass the folder "
                         "torch.profiler's tensorboard_trace_handler wrote, or the trace files themselves")
    return found


def _ranges(ranks: list[int]) -> str:
    """[2, 3, 4, 7] → "2–4, 7"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    return ", ".join(out)


def _rank_of(trace, path: Path, given) -> tuple[int, int]:
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no 'traceEvents' list); "
                         "write one with torch.profiler's export_chrome_trace")
    if "labkit" in (trace.get("otherData") or {}):
        raise ValueError(f"{path}: a trace that Timeline.save_trace wrote, not a profiler trace; "
                         "read it with Timeline.load(path)")
    if given is not None:
        return int(given), int(given) + 1
    info = trace.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info:
        raise ValueError(f"{path}: no distributedInfo.rank (profiled without torch.distributed?); "
                         "pass the ranks yourself: Timeline.from_profiler(paths, ranks=[...])")
    return int(info["rank"]), int(info.get("world_size", info["rank"] + 1))


def _read_rank(trace: dict, path: Path, rank: int) -> tuple[EventTable, list[int]]:
    """One rank's events and its step numbers."""
    # a complete event ("X") is placed by its start and length; one without either cannot be
    spans = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]
    steps = sorted((int(m.group(1)), float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid"))
                   for e in spans if (m := _STEP.match(str(e.get("name", "")))))
    if not steps:
        warnings.warn(f"{path}: no ProfilerStep#N annotations (was profiler.step() called?); "
                      "the whole trace is read as step 0", stacklevel=3)
        ts = [float(e["ts"]) for e in spans] or [0.0]
        steps = [(0, min(ts), max(float(e["ts"]) + float(e["dur"]) for e in spans) if spans else 0.0, None)]
    kernels = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    groups = _process_groups(trace)
    rows = _gpu_rows(spans, kernels, groups) if kernels else _cpu_rows(spans, steps, groups)
    starts = np.array([s[1] for s in steps])
    ends = np.array([s[2] for s in steps])
    events, outside = [], 0
    for kind, stream, name, start, end, anchor, group in rows:
        i = int(np.searchsorted(starts, anchor, side="right")) - 1
        if i < 0 or anchor > ends[i]:
            outside += 1
            continue
        zero = starts[i]
        event = {"rank": rank, "stream": stream, "kind": kind, "name": name, "step": steps[i][0],
                 "microbatch": None, "start": (start - zero) * 1e-6, "end": (end - zero) * 1e-6,
                 "bytes": 0, "peer": None}
        if group:
            event["group"] = group
        events.append(event)
    if outside:
        warnings.warn(f"{path}: {outside} spans outside every ProfilerStep window (before the first "
                      "step or between steps) are left out", stacklevel=3)
    held = {e["step"] for e in events}
    empty = [s[0] for s in steps if s[0] not in held]
    if empty:
        warnings.warn(f"{path}: ProfilerStep {empty} hold no kernel or op; those steps are empty on rank {rank}",
                      stacklevel=3)
    return EventTable.from_dicts(events), [s[0] for s in steps]


def _process_groups(trace: dict) -> dict[str, str]:
    """Process group name → its ranks ("0,1"), from ``distributedInfo.pg_config`` (a list or a
    dict of {pg_name, ranks, …}, as torch's profiler writes it)."""
    config = (trace.get("distributedInfo") or {}).get("pg_config") or []
    entries = config.values() if isinstance(config, dict) else config
    out = {}
    for pg in entries:
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            out[str(pg.get("pg_name", ""))] = group_key(pg["ranks"])
    return out


def _group_of(args: dict, groups: dict[str, str]) -> str:
    """A collective's ranks from a profiler event's args: "Process Group Ranks" ("[0, 1]"), else
    its "Process Group Name" looked up in pg_config; "" when the trace does not say."""
    ranks = args.get("Process Group Ranks")
    if isinstance(ranks, str) and ranks.startswith("["):
        try:
            return group_key(json.loads(ranks))
        except (ValueError, TypeError):
            pass
    if isinstance(ranks, list):
        return group_key(ranks)
    return groups.get(str(args.get("Process Group Name", "")), "")


def _gpu_rows(spans, kernels, groups):
    """(kind, stream, name, start, end, anchor, group) per kernel; anchor: its launch's host time."""
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in spans
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    rows = []
    for e in kernels:
        name, start = str(e.get("name", "")), float(e["ts"])
        kind = "memcpy" if e["cat"] != "kernel" else (comm_kind(name) or "compute")
        stream = "comm" if kind not in ("memcpy", "compute") else "compute"
        anchor = launched.get(e.get("args", {}).get("correlation"), start)
        group = _group_of(e.get("args", {}), groups) if stream == "comm" else ""
        rows.append((kind, stream, name, start, start + float(e["dur"]), anchor, group))
    return rows


def _cpu_rows(spans, steps, groups):
    """Top-level cpu_ops of the main thread (compute, or comm for c10d ops) and gloo's
    annotations (comm), as (kind, stream, name, start, end, anchor, group); a c10d op's group
    is read from the ``record_param_comms`` op inside it."""
    main = steps[0][3]
    if main is None:   # no step annotation: the thread with the most ops
        tids = [e.get("tid") for e in spans if e.get("cat") == "cpu_op"]
        main = max(set(tids), key=tids.count) if tids else None
    rows, reach = [], -np.inf
    for e in sorted((e for e in spans if e.get("cat") == "cpu_op" and e.get("tid") == main),
                    key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if start < reach:          # nested inside an op already kept
            continue
        reach = end
        kind = comm_kind(e["name"]) or "compute"
        group = _group_of(e.get("args", {}), groups) if kind != "compute" else ""
        rows.append([kind, "compute" if kind == "compute" else "comm", e["name"], start, end, start, group])
    params = sorted((float(e["ts"]), _group_of(e.get("args", {}), groups)) for e in spans
                    if e.get("name") == "record_param_comms" and e.get("tid") == main)
    for row in rows:
        if row[1] == "comm" and not row[6]:
            row[6] = next((g for ts, g in params if row[3] <= ts <= row[4] and g), "")
    rows = [tuple(r) for r in rows]
    for e in spans:
        if str(e.get("name", "")).startswith("gloo:"):
            start = float(e["ts"])
            rows.append((comm_kind(e["name"]), "comm", e["name"], start, start + float(e["dur"]), start,
                         _group_of(e.get("args", {}), groups)))
    return rows


def _check_steps(steps_of: dict) -> None:
    counts = {rank: steps for rank, (_, steps) in steps_of.items()}
    if len({tuple(s) for s in counts.values()}) > 1:
        detail = "; ".join(f"{path}: steps {steps}" for path, steps in steps_of.values())
        warnings.warn(f"ranks hold different profiler steps ({detail}); a step a rank lacks is empty "
                      "there, and its metrics count that rank idle", stacklevel=3)


def temporal_breakdown(tl) -> list[dict]:
    """Per rank, summed over steps: compute, non-compute (comm and memcpy not under compute)
    and idle seconds within the rank's own window (its first start to its last end in each
    step), as HTA's temporal breakdown splits GPU time (see the module docstring)."""
    t = tl.table
    if not len(t):
        return []
    steps, step_index = np.unique(t["step"], return_inverse=True)
    groups = len(steps) * tl.world_size
    group = step_index * tl.world_size + t["rank"]
    compute = (t["stream"] == "compute") & (t["kind"] != "memcpy")
    other = ~compute & (t["kind"] != "wait")
    c = union_lengths(group[compute], t["start"][compute], t["end"][compute], groups)
    busy = union_lengths(group[compute | other], t["start"][compute | other], t["end"][compute | other], groups)
    first = np.full(groups, np.inf)
    last = np.full(groups, -np.inf)
    np.minimum.at(first, group, t["start"])
    np.maximum.at(last, group, t["end"])
    window = np.where(np.isfinite(first), last - first, 0.0)
    out = []
    for rank in tl.ranks:
        g = np.arange(len(steps)) * tl.world_size + rank
        total = float(window[g].sum())
        out.append({"rank": rank, "window_s": total, "compute_s": float(c[g].sum()),
                    "non_compute_s": float((busy - c)[g].sum()), "idle_s": float((window - busy)[g].sum())})
    return out
