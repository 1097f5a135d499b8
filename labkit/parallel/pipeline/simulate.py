"""The schedules' discrete-event model: action lists in, labkit events out, no processes.

Each rank runs its list in order; compute ops take their cost, a RECV waits for the matching
SEND. The same lists the executor runs thus draw the ideal timeline, give the predicted
bubble, and prove a schedule free of deadlock (:mod:`labkit.schedules` builds the lists).
"""
from __future__ import annotations

from ...analysis.events import make_event

COMPUTE_OPS = ("F", "B", "I", "W")
# Event kind of each compute op (docs/design.md, "Events": bwd_input / bwd_weight when split).
OP_KINDS = {"F": "fwd", "B": "bwd", "I": "bwd_input", "W": "bwd_weight"}


def simulate(actions_per_rank: list[list], fwd_cost=1.0, bwd_cost=2.0,
             comm_cost=0.0, costs: dict | None = None) -> list[dict]:
    """Run the lists as a discrete-event model; return labkit events (one step, step 0).

    Each rank runs its list in order. A compute op takes its cost, ``costs[op]`` (a dict op
    → cost: F and B default to `fwd_cost` and `bwd_cost`, I and W to half of B each); SEND
    is non-blocking; RECV blocks until the k-th matching SEND from the peer was posted, then
    comm_cost more. The blocked part is a ``wait`` (bubble), the transfer part a ``recv``
    (exposed comm). Costs may be Fractions for exact arithmetic.

    >>> from labkit.parallel.pipeline.schedules import build_schedule
    >>> ev = simulate(build_schedule("gpipe", stages=2, microbatches=1), 1, 1)
    >>> max(e["end"] for e in ev)
    4
    """
    cost = {"F": fwd_cost, "B": bwd_cost, "I": bwd_cost / 2, "W": bwd_cost / 2, **(costs or {})}
    zero = 0 * cost["F"]  # keeps Fraction costs exact: a float 0.0 would turn them to floats
    comm_cost = comm_cost or zero
    clock = [zero] * len(actions_per_rank)
    pos = [0] * len(actions_per_rank)
    posted: dict[tuple, list] = {}  # (src, dst, "F"|"B") -> [(time, action)] in send order
    taken: dict[tuple, int] = {}  # how many of those have been received
    events: list[dict] = []
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(actions_per_rank):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if a.op.startswith("RECV") and not _try_recv(r, a, clock, posted, taken,
                                                             comm_cost, events):
                    break  # blocked: let the other ranks run
                if a.op.startswith("SEND"):
                    posted.setdefault((r, a.peer, a.op[-1]), []).append((clock[r], a))
                    events.append(_event(r, "comm", "send", a, clock[r], clock[r] + comm_cost))
                if a.op in COMPUTE_OPS:
                    end = clock[r] + cost[a.op]
                    events.append(_event(r, "compute", OP_KINDS[a.op], a, clock[r], end))
                    clock[r] = end
                pos[r] += 1
                progress = True
    _check_finished(actions_per_rank, pos, posted, taken)
    return events


def _try_recv(r, a, clock, posted, taken, comm_cost, events) -> bool:
    key = (a.peer, r, a.op[-1])
    k = taken.get(key, 0)
    if k >= len(posted.get(key, [])):
        return False
    sent_at, send = posted[key][k]
    step = 1 if a.op == "RECV_F" else -1  # the sender is the stage before (F) / after (B)
    if (send.microbatch, send.stage + step) != (a.microbatch, a.stage):
        raise RuntimeError(f"mismatch: rank {r} {a} got {send} from rank {a.peer}")
    taken[key] = k + 1
    start, ready = clock[r], max(clock[r], sent_at)
    if ready > start:
        events.append(_event(r, "comm", "wait", a, start, ready))
    clock[r] = max(ready, sent_at + comm_cost)
    events.append(_event(r, "comm", "recv", a, ready, clock[r]))
    return True


def _check_finished(actions_per_rank, pos, posted, taken) -> None:
    stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(actions_per_rank)
             if pos[r] < len(acts)}
    if stuck:
        where = ", ".join(f"rank {r} blocked at {a}" for r, a in stuck.items())
        raise RuntimeError(f"deadlock: {where} (each RECV waits for a SEND never posted)")
    unread = {key: len(sends) - taken.get(key, 0) for key, sends in posted.items()}
    unread = {key: n for key, n in unread.items() if n}
    if unread:
        raise RuntimeError("unmatched sends (src, dst, F|B): count " + repr(unread))


def _event(rank: int, stream: str, kind: str, a, start, end) -> dict:
    return make_event(rank, kind, str(a), 0, start, end, a.microbatch, 0, a.peer, stream)
