"""The schedules' discrete-event model: action lists in, labkit events out, no processes.

Each rank runs its list in order; compute ops take their cost, a RECV waits for the matching
SEND. The same lists the executor runs thus draw the ideal timeline, give the predicted
bubble, and prove a schedule free of deadlock (:mod:`labkit.schedules` builds the lists).

The lists run on the one replay core that the planner and ``run.whatif`` run on
(:class:`labkit.analysis.des.Sim`), each rank on a core of its own: a compute op is a
:class:`~labkit.analysis.des.Compute`, a SEND an eager message (it leaves when posted, the
sender goes on), a RECV that message's receiving side and a wait for it. Messages pair in order per (sender, receiver, direction), as NCCL pairs them.
"""
from __future__ import annotations

from collections import defaultdict

from ...analysis.des import Compute, Deadlock, Issue, Sim, Wait
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
    keys, unread = _pair(actions_per_rank)
    programs = [_program(r, actions, cost, comm_cost, zero, keys) for r, actions in enumerate(actions_per_rank)]
    try:
        events = Sim([[item for item, _ in prog] for prog in programs], cores=max(1, len(programs))).run()
    except Deadlock as stuck:
        where = ", ".join(f"rank {r} blocked at {programs[r][k][1]}" for r, k in sorted(stuck.stuck.items()))
        raise RuntimeError(f"deadlock: {where} (each RECV waits for a SEND never posted)") from None
    if unread:
        raise RuntimeError("unmatched sends (src, dst, F|B): count " + repr(unread))
    return [_schema(e) for e in events]


def _pair(actions_per_rank) -> tuple[dict, dict]:
    """Each SEND and RECV's message key, (sender, receiver, F|B, k) for the k-th on that channel
    (by the action's id), and the sends no RECV reads, per channel; a RECV whose k-th SEND is of
    another micro-batch or stage is a mismatch."""
    sends, keys, counts = defaultdict(list), {}, defaultdict(int)
    for r, actions in enumerate(actions_per_rank):
        for a in actions:
            if a.op.startswith("SEND"):
                channel = (r, a.peer, a.op[-1])
                keys[id(a)] = channel + (len(sends[channel]),)
                sends[channel].append(a)
    for r, actions in enumerate(actions_per_rank):
        for a in actions:
            if a.op.startswith("RECV"):
                channel = (a.peer, r, a.op[-1])
                k = counts[channel]
                counts[channel] += 1
                keys[id(a)] = channel + (k,)
                if k < len(sends[channel]):
                    send, step = sends[channel][k], 1 if a.op == "RECV_F" else -1
                    if (send.microbatch, send.stage + step) != (a.microbatch, a.stage):
                        raise RuntimeError(f"mismatch: rank {r} {a} got {send} from rank {a.peer}")
    return keys, {c: len(s) - counts[c] for c, s in sends.items() if len(s) > counts[c]}


def _program(r: int, actions, cost: dict, comm_cost, zero, keys: dict) -> list[tuple]:
    """Rank r's items for the replay core, each with the action it came from."""
    out = []
    for a in actions:
        if a.op in COMPUTE_OPS:
            out.append((Compute(cost[a.op], OP_KINDS[a.op], str(a), a.microbatch), a))
        elif a.op.startswith("SEND") or a.op.startswith("RECV"):
            key = keys[id(a)]
            group = (key[0], key[1])
            kind = "send" if a.op.startswith("SEND") else "recv"
            out.append((Issue(key, group, comm_cost, kind, str(a), peer=a.peer, microbatch=a.microbatch,
                              ordered=False, link=zero, eager=True), a))
            if kind == "recv":
                out.append((Wait(key), a))
    return out


def _schema(e: dict) -> dict:
    """The event as this model has always drawn it (the replay core's ``waited``/``posted`` dropped)."""
    return make_event(e["rank"], e["kind"], e["name"], 0, e["start"], e["end"], e["microbatch"], 0, e["peer"],
                      e["stream"])
