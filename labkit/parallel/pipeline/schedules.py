"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B.

A schedule is a pure function of (schedule, p ranks, m micro-batches, v chunks per rank):
one ordered list of `Action`s per pipeline rank. The executor runs those lists; `simulate`
runs the same lists as a discrete-event model to draw the ideal timeline and to test them
with no processes at all (STYLE rule 7, after torchtitan's CSV schedules like ``0F3``).

Virtual stages follow Megatron's layout: rank r holds stages r, r+p, r+2p, ...; so local
chunk c on rank r is global stage ``c * p + r``, and a neighbour stage always lives on
another rank when p > 1.

    >>> [str(a) for a in build_schedule("gpipe", stages=2, microbatches=2)[1]]
    ['1RECV_F0', '1F0', '1RECV_F1', '1F1', '1B0', '1SEND_B0', '1B1', '1SEND_B1']
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")
OPS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of one rank's list.

    `stage` is the global virtual stage acting on this rank (for a SEND the sender's
    stage, for a RECV the receiver's, as in torch.distributed.pipelining); `chunk` is its
    local index on this rank; `peer` is the pipeline rank at the other end of a SEND/RECV.
    """

    op: str
    microbatch: int
    chunk: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"  # torch's form: "0F3", "2SEND_B1"


_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


def parse_action(text: str, stages: int = 1) -> Action:
    """Inverse of ``str(action)``, given p = `stages` pipeline ranks (to recover chunk, peer).

    >>> parse_action("2SEND_F1", stages=2)
    Action(op='SEND_F', microbatch=1, chunk=1, stage=2, peer=1)
    """
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(f"bad action {text!r}: expected stage, op, microbatch, e.g. '0F3'")
    stage, op, mb = int(match[1]), match[2], int(match[3])
    return _action(op, mb, stage, stages)


def _action(op: str, microbatch: int, stage: int, p: int) -> Action:
    # Forward traffic flows to stage+1, backward to stage-1; a RECV names where it comes from.
    step = {"SEND_F": 1, "RECV_B": 1, "SEND_B": -1, "RECV_F": -1}.get(op)
    peer = None if step is None else (stage + step) % p
    return Action(op, microbatch, stage // p, stage, peer)


def validate(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raise ValueError naming the field and the fix for an impossible schedule.

    >>> validate("interleaved", stages=2, microbatches=3, chunks=2)
    Traceback (most recent call last):
    ...
    ValueError: interleaved needs microbatches % stages == 0 (got 3 % 2): use 2 or 4 microbatches
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1 (got {stages})")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (got {microbatches})")
    if schedule != "interleaved" and chunks != 1:
        raise ValueError(f"chunks={chunks} needs schedule='interleaved'; or set chunks=1")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError(f"interleaved needs chunks >= 2 (got {chunks}): "
                         "use 1f1b or set chunks >= 2")
    if schedule == "interleaved" and microbatches % stages:
        lo = microbatches - microbatches % stages
        fix = f"{lo} or {lo + stages}" if lo else f"{stages}"
        raise ValueError(f"interleaved needs microbatches % stages == 0 "
                         f"(got {microbatches} % {stages}): use {fix} microbatches")


def build_schedule(schedule: str, stages: int, microbatches: int,
                   chunks: int = 1) -> list[list[Action]]:
    """One ordered action list per pipeline rank (`stages` = p ranks, m micro-batches, v chunks).

    >>> [str(a) for a in build_schedule("1f1b", stages=2, microbatches=2)[0]]
    ['0F0', '0SEND_F0', '0F1', '0SEND_F1', '0RECV_B0', '0B0', '0RECV_B1', '0B1']
    """
    validate(schedule, stages, microbatches, chunks)
    order = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[schedule]
    return [_with_comms(order(r, stages, microbatches, chunks), r, stages, chunks)
            for r in range(stages)]


# Each builder returns a rank's compute order as (op, microbatch, chunk) triples.

def _gpipe(r: int, p: int, m: int, v: int) -> list[tuple]:
    # All forwards, then all backwards in the same order (torch's ScheduleGPipe).
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int, v: int) -> list[tuple]:
    # Megatron schedules.py / picotron: rank r runs p-r-1 forwards ahead, so at most
    # min(p-r, m) micro-batches hold activations at once (GPipe holds all m).
    warmup = min(p - r - 1, m)
    order = [("F", i, 0) for i in range(warmup)]  # warm-up: fill the pipe
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warmup, m)]  # cool-down: drain the pipe
    return order


def _interleaved(r: int, p: int, m: int, v: int) -> list[tuple]:
    # Megatron's forward_backward_pipelining_with_interleaving: the same three phases
    # over m*v (microbatch, chunk) units, visited in groups of p micro-batches per chunk.
    total = m * v
    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    fwd = [("F", *_unit(k, p, v, forward=True)) for k in range(total)]
    bwd = [("B", *_unit(k, p, v, forward=False)) for k in range(total)]
    order = fwd[:warmup]  # warm-up
    for k in range(total - warmup):  # steady state
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[total - warmup:]  # cool-down


def _unit(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward or backward (Megatron's get_model_chunk_id)."""
    chunk = (k % (p * v)) // p
    microbatch = (k // (p * v)) * p + k % p
    return microbatch, chunk if forward else v - 1 - chunk


def _with_comms(order: list[tuple], r: int, p: int, v: int) -> list[Action]:
    """Wrap each compute with the RECV it needs just before and the SEND it owes just after.

    A RECV placed right before its consumer blocks only when the data is truly late, so a
    compute order that respects the dependencies cannot deadlock.
    """
    last = p * v - 1
    actions = []
    for op, mb, chunk in order:
        stage = chunk * p + r
        recv = p > 1 and (stage > 0 if op == "F" else stage < last)
        send = p > 1 and (stage < last if op == "F" else stage > 0)
        if recv:
            actions.append(_action("RECV_" + op, mb, stage, p))
        actions.append(_action(op, mb, stage, p))
        if send:
            actions.append(_action("SEND_" + op, mb, stage, p))
    return actions


def ideal_bubble(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of the step, bubble / total, with uniform stages and free comm.

    GPipe and 1F1B: (p-1)/(m+p-1) (GPipe, arXiv 1811.06965; 1F1B saves memory, not bubble).
    Interleaved with v chunks per rank: (p-1)/(v*m+p-1) (Megatron-LM, arXiv 2104.04473).
    The HF Ultra-Scale Playbook's (p-1)/m is bubble / ideal compute, not bubble / total.

    >>> ideal_bubble("gpipe", stages=4, microbatches=8)
    0.2727272727272727
    """
    validate(schedule, stages, microbatches, chunks)
    return (stages - 1) / (chunks * microbatches + stages - 1)


def in_flight(actions: list[Action]) -> int:
    """Most (stage, microbatch) activations held at once on one rank: forward done, backward not.

    >>> in_flight(build_schedule("gpipe", stages=2, microbatches=4)[0])
    4
    """
    live, peak = set(), 0
    for a in actions:
        if a.op == "F":
            live.add((a.stage, a.microbatch))
            peak = max(peak, len(live))
        elif a.op == "B":
            live.discard((a.stage, a.microbatch))
    return peak


def simulate(actions_per_rank: list[list[Action]], fwd_cost=1.0, bwd_cost=2.0,
             comm_cost=0.0) -> list[dict]:
    """Run the lists as a discrete-event model; return labkit events (one step, step 0).

    Each rank runs its list in order. F and B take their cost; SEND is non-blocking; RECV
    blocks until the k-th matching SEND from the peer was posted, then comm_cost more. The
    blocked part is a ``wait`` (bubble), the transfer part a ``recv`` (exposed comm).
    Costs may be Fractions for exact arithmetic.

    >>> ev = simulate(build_schedule("gpipe", stages=2, microbatches=1), 1, 1)
    >>> max(e["end"] for e in ev)
    4
    """
    zero = 0 * fwd_cost  # keeps Fraction costs exact: a float 0.0 would turn them to floats
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
                if a.op in ("F", "B"):
                    cost = fwd_cost if a.op == "F" else bwd_cost
                    kind = "fwd" if a.op == "F" else "bwd"
                    events.append(_event(r, "compute", kind, a, clock[r], clock[r] + cost))
                    clock[r] += cost
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


def _event(rank: int, stream: str, kind: str, a: Action, start, end) -> dict:
    return {"rank": rank, "stream": stream, "kind": kind, "name": str(a), "step": 0,
            "microbatch": a.microbatch, "start": start, "end": end, "bytes": 0, "peer": a.peer}
