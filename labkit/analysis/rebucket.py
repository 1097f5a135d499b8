"""What if the gradient buckets were another size: the measured step rebuilt with the executor's buckets.

A bucket size changes the step's shape, so ``run.whatif(bucket_mb=…)`` rebuilds the calls and
replays the rest as measured (:mod:`labkit.analysis.whatif`). The run's parameters are filled again
by :func:`labkit.parallel.data.fill_buckets` at the run's size (each bucket matched to its
recorded call by tensor count; a mismatch is refused) and at the new size. A new bucket leaves
once its last gradient is ready (within a measured bucket the gradients are taken to arrive
evenly by bytes since the previous post: the recorder sees buckets, not gradients), is waited
for where the bucket holding that gradient was, and is priced by the link's α-β on its bytes
plus gloo's measured median time per byte (gloo's own α is not resolved from one run's few
calls) and that bucket's members' rest. A new bucket equal to a measured one keeps its measured
price, so a rebuild at the run's own size is the plain replay. Only plain data parallelism is
rebuilt (dp > 1, dp_mode bucketed, overlap or ddp, nothing else); other shapes are refused.
"""
from __future__ import annotations

import re
from statistics import median


MiB = 1024 * 1024
BUCKET = re.compile(r"^bucket (\d+) \((\d+) tensors\)$")


def check(run, bucket_mb) -> list[tuple[str, int]]:
    """The run's parameters as (name, bytes) in registration order, once the run is one this
    rebuild covers (ValueError naming what is not)."""
    s = run.strategy
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"whatif(bucket_mb={bucket_mb!r}): give the bucket size in MiB, e.g. 0.5")
    others = [f"{axis}={getattr(s, axis)}" for axis in ("pp", "tp", "cp", "ep") if getattr(s, axis) > 1]
    if s.dp < 2 or s.dp_mode not in ("bucketed", "overlap", "ddp") or s.zero or others or s.compression != "none":
        raise ValueError(f"whatif(bucket_mb=…) rebuilds plain data parallelism's buckets (dp > 1, dp_mode bucketed, "
                         f"overlap or ddp, zero=0, no other axis, no compression); this run is {s.label()}. "
                         f"Predict it with labkit.plan.simulate(strategy, machine, model=…)")
    if not run.params:
        raise ValueError("whatif(bucket_mb=…): the run kept no parameters (run.params), so its buckets cannot be "
                         "filled again")
    return [(name, t.numel() * t.element_size()) for name, t in run.params.items()]


def rebucket(events: list[dict], params, old_mb: float, new_mb: float, priced) -> tuple[list[dict], dict]:
    """One step's events with its buckets filled again at ``new_mb``, and each new bucket's
    (gloo seconds, this member's rest) by (rank, name): ``priced`` maps a measured bucket's
    (rank, name) to its replayed (gloo seconds, rest) (module docstring)."""
    from ..parallel.data import fill_buckets       # the run's own filling (analysis sits below parallel)

    old = [[name for name, _ in b] for b in fill_buckets(params, lambda p: p[1], old_mb * MiB)]
    new = [[name for name, _ in b] for b in fill_buckets(params, lambda p: p[1], new_mb * MiB)]
    size = dict(params)
    kept = [e for e in events if not _is_bucket(e)]
    out, prices = list(kept), {}
    per_byte = _per_byte(events, size, old, priced)
    for rank in sorted({e["rank"] for e in events}):
        measured = sorted((e for e in events if e["rank"] == rank and _is_bucket(e)),
                          key=lambda e: int(BUCKET.match(e["name"])[1]))
        if not measured:
            continue
        counts = [int(BUCKET.match(e["name"])[2]) for e in measured]
        if counts != [len(b) for b in old]:
            raise ValueError(f"whatif(bucket_mb=…): rank {rank}'s recorded buckets hold {counts} tensors, but its "
                             f"parameters fill {[len(b) for b in old]} at bucket_mb={old_mb}: the run's parameters "
                             f"are not the ones its buckets carried, so they cannot be filled again")
        ready = _ready(events, rank, measured, old, size)
        home = {name: k for k, b in enumerate(old) for name in b}
        for j, bucket in enumerate(new):
            last = measured[home[bucket[-1]]]
            nbytes = sum(size[n] for n in bucket)
            name = f"bucket {j} ({len(bucket)} tensors)"
            start = ready[bucket[-1]]
            out.append({**last, "name": name, "bytes": nbytes, "start": start, "end": max(last["end"], start),
                        "waited": max(last.get("waited", last["end"]), start)})
            out[-1].pop("moved", None)
            gloo, rest = priced.get((rank, last["name"]), (0.0, 0.0))
            prices[(rank, name)] = (gloo if bucket == old[home[bucket[-1]]] else per_byte * nbytes, rest)
    return out, prices


def _is_bucket(e: dict) -> bool:
    return e["stream"] == "comm" and e["kind"] == "allreduce" and BUCKET.match(e["name"]) is not None


def _per_byte(events, size: dict, old, priced) -> float:
    """gloo's own seconds per byte: the median over the step's measured buckets (one bucket whose
    gloo thread was descheduled on a loaded machine does not set the rate of all)."""
    rates = []
    for e in events:
        if _is_bucket(e) and (e["rank"], e["name"]) in priced:
            nbytes = sum(size[n] for n in old[int(BUCKET.match(e["name"])[1])])
            rates.append(priced[(e["rank"], e["name"])][0] / nbytes if nbytes else 0.0)
    return median(rates) if rates else 0.0


def _ready(events, rank: int, measured, old, size: dict) -> dict:
    """When each parameter's gradient was ready on ``rank``: its bucket's post, spread evenly by
    bytes from the previous bucket's post (the first: the rank's first backward span)."""
    backward = [e["start"] for e in events if e["rank"] == rank and e["stream"] == "compute"
                and e["kind"] in ("bwd", "bwd_input", "bwd_weight")]
    since = min(backward, default=measured[0]["start"])
    out = {}
    for e, bucket in zip(measured, old):
        total, seen = sum(size[n] for n in bucket), 0
        since = min(since, e["start"])
        for name in bucket:
            seen += size[name]
            out[name] = since + (e["start"] - since) * (seen / total if total else 1.0)
        since = e["start"]
    return out
