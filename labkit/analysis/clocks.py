"""One clock for a step's events: the ranks of one machine read the same one.

Each rank counts a step's times from the moment it leaves the barrier that starts the step
(:func:`labkit.engine.run_step`). The ranks do not leave it at once: the last one to arrive
releases the others by message, and on shared cores a released rank may wait for a core
before it reads its clock. Times taken from each rank's own exit put a late rank's spans
early, so a receive can seem to end before its send was posted, and a wait is read as
moving bytes.

The ranks of one host share its clock (``time.perf_counter`` is system-wide), so their events
are put on it: each rank's spans move later by how much later it left the barrier than the
first rank of its host, whose exit is the step's time zero. Ranks on different hosts keep
the barrier's alignment, as they have no shared clock.

>>> events = aligned(results)     # results: what each rank's run_step returned
"""
from __future__ import annotations


def offsets(clocks: dict[int, dict]) -> dict[int, float]:
    """Per rank, seconds after the first rank of its host that it started the step.

    ``clocks``: rank → ``{"host", "origin_s"}`` (the rank's time zero on its host's clock)."""
    first: dict[str, float] = {}
    for c in clocks.values():
        first[c["host"]] = min(first.get(c["host"], c["origin_s"]), c["origin_s"])
    return {rank: c["origin_s"] - first[c["host"]] for rank, c in clocks.items()}


def aligned(results: list[dict]) -> list[dict]:
    """Every rank's events of one step, on its host's clock (see the module docstring).

    A result without a ``clock`` (a rank that did not report one) keeps its own times."""
    shift = offsets({r["rank"]: r["clock"] for r in results if r.get("clock")})
    out = []
    for r in results:
        d = shift.get(r.get("rank"), 0.0)
        out.extend(r["events"] if d == 0.0 else [_shifted(e, d) for e in r["events"]])
    return out


def _shifted(event: dict, d: float) -> dict:
    """``event`` moved ``d`` seconds later (its ``waited``, ``posted`` and ``moved`` instants too)."""
    out = dict(event, start=event["start"] + d, end=event["end"] + d)
    for instant in ("waited", "posted", "moved"):
        if instant in out:
            out[instant] = out[instant] + d
    return out
