"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V.

A schedule is a pure function of (schedule, p ranks, m micro-batches, v chunks per rank):
one ordered list of `Action`s per pipeline rank. The executor runs those lists; `simulate`
runs the same lists as a discrete-event model (:mod:`labkit.parallel.pipeline.simulate`) to
draw the ideal timeline and to test them with no processes at all (STYLE rule 7, after
torchtitan's CSV schedules like ``0F3``).

Compute ops: ``F`` forward, ``B`` the fused backward, or the backward split in two as the
zero-bubble schedules do (torch.distributed.pipelining's names): ``I`` the gradient w.r.t.
the stage input, sent upstream at once, and ``W`` the weight gradients, run later.

Placement (which rank holds which virtual stage) is a function, :func:`stage_rank`:
``loop`` is Megatron's interleaving, rank r holds stages r, r+p, r+2p, ... (local chunk c
on rank r is global stage ``c * p + r``, and a neighbour stage always lives on another rank
when p > 1); ``v`` is ZB-V's / DualPipeV's, rank r holds stages r and 2p-1-r, so stages p-1
and p share a rank and hand over locally, with no message.

    >>> [str(a) for a in build_schedule("gpipe", stages=2, microbatches=2)[1]]
    ['1RECV_F0', '1F0', '1RECV_F1', '1F1', '1B0', '1SEND_B0', '1B1', '1SEND_B1']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .simulate import COMPUTE_OPS, OP_KINDS, simulate  # noqa: F401 (API)
from .zero_bubble import zb_h1, zbv

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
OPS = (*COMPUTE_OPS, "SEND_F", "RECV_F", "SEND_B", "RECV_B")
PLACEMENTS = ("loop", "v")


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


_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


def parse_action(text: str, stages: int = 1, placement: str = "loop") -> Action:
    """Inverse of ``str(action)``, given p = `stages` pipeline ranks and the placement (to
    recover chunk, peer).

    >>> parse_action("2SEND_F1", stages=2)
    Action(op='SEND_F', microbatch=1, chunk=1, stage=2, peer=1)
    >>> parse_action("2SEND_F1", stages=2, placement="v")
    Action(op='SEND_F', microbatch=1, chunk=1, stage=2, peer=0)
    """
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(f"bad action {text!r}: expected stage, op, microbatch, e.g. '0F3'")
    stage, op, mb = int(match[1]), match[2], int(match[3])
    return _action(op, mb, stage, stages, placement)


def stage_rank(stage: int, stages: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, local chunk) holding global virtual `stage` among p = `stages` pipeline ranks.

    ``loop`` (Megatron's interleaving): stage s on rank s mod p. ``v`` (ZB-V, DualPipeV; as
    torch's ``generate_stage_to_rank_mapping(style="v")``): down the ranks, then back up.

    >>> [stage_rank(s, 2, "v") for s in range(4)]
    [(0, 0), (1, 0), (1, 1), (0, 1)]
    """
    lap, k = divmod(stage, stages)
    if placement == "loop":
        return k, lap
    if placement == "v":
        return (k if lap % 2 == 0 else stages - 1 - k), lap
    raise ValueError(f"unknown placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def global_stage(rank: int, chunk: int, stages: int, placement: str = "loop") -> int:
    """The global virtual stage of local `chunk` on `rank` (inverse of :func:`stage_rank`)."""
    if placement == "v" and chunk % 2:
        return chunk * stages + stages - 1 - rank
    return chunk * stages + rank


def placement_of(schedule: str) -> str:
    """The placement a schedule's stages follow: ``v`` for zbv, ``loop`` otherwise."""
    return "v" if schedule == "zbv" else "loop"


def _action(op: str, microbatch: int, stage: int, p: int, placement: str = "loop") -> Action:
    # Forward traffic flows to stage+1, backward to stage-1; a RECV names where it comes from.
    step = {"SEND_F": 1, "RECV_B": 1, "SEND_B": -1, "RECV_F": -1}.get(op)
    peer = None if step is None else stage_rank(stage + step, p, placement)[0]
    return Action(op, microbatch, stage_rank(stage, p, placement)[1], stage, peer)


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
    if schedule == "zbv":
        if chunks != 2:
            raise ValueError(f"zbv places exactly two chunks per rank in a V (got chunks={chunks}): "
                             "set chunks=2")
        return
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
    order = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved,
             "zb-h1": zb_h1, "zbv": zbv}[schedule]
    place = placement_of(schedule)
    lists = [_with_comms(order(r, stages, microbatches, chunks), r, stages, chunks, place)
             for r in range(stages)]
    return _recv_in_send_order(lists, stages, place)


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


def _with_comms(order: list[tuple], r: int, p: int, v: int, place: str = "loop") -> list[Action]:
    """Wrap each compute with the RECV it needs just before and the SEND it owes just after.

    A RECV placed right before its consumer blocks only when the data is truly late, so a
    compute order that respects the dependencies cannot deadlock. I consumes and produces
    the same messages as a fused B; W has none. A neighbour stage on this same rank (V
    placement's turn, or p = 1) hands over locally: no message.
    """
    last = p * v - 1
    actions = []
    for op, mb, chunk in order:
        stage = global_stage(r, chunk, p, place)
        flow = "F" if op == "F" else "B"
        src, dst = (stage - 1, stage + 1) if flow == "F" else (stage + 1, stage - 1)
        remote = [op != "W" and 0 <= s <= last and stage_rank(s, p, place)[0] != r
                  for s in (src, dst)]
        if remote[0]:
            actions.append(_action("RECV_" + flow, mb, stage, p, place))
        actions.append(_action(op, mb, stage, p, place))
        if remote[1]:
            actions.append(_action("SEND_" + flow, mb, stage, p, place))
    return actions


def _recv_in_send_order(lists: list[list[Action]], p: int, place: str) -> list[list[Action]]:
    """Receive each peer's messages in the order that peer sends them.

    Point-to-point messages between two ranks match in posting order (NCCL always; gloo per
    tag), so a receiver must take them in the sender's order, activations and gradients
    mixed. ZB-V breaks that when placed naively: rank r sends chunk 0's activations and chunk
    1's gradients down the same link, and rank r+1 may need the gradient first. A RECV whose
    message comes after others on its link pulls their RECVs just before it; they were posted
    earlier by the sender, so nothing waits longer. The older schedules already agree: no-op.
    """
    sent = {}       # (src, dst) -> the messages src sends dst, in order, as the RECV names them
    for r, actions in enumerate(lists):
        for a in actions:
            if a.op.startswith("SEND"):
                to = a.stage + (1 if a.op == "SEND_F" else -1)
                sent.setdefault((r, a.peer), []).append(("RECV_" + a.op[-1], a.microbatch, to))
    out = []
    for r, actions in enumerate(lists):
        mine, taken, nxt = [], set(), {}
        for a in actions:
            key = (a.op, a.microbatch, a.stage)
            if not a.op.startswith("RECV"):
                mine.append(a)
                continue
            while key not in taken:      # take the link's older messages first
                queue, k = sent[a.peer, r], nxt.get(a.peer, 0)
                op, mb, stage = queue[k]
                nxt[a.peer] = k + 1
                taken.add(queue[k])
                mine.append(_action(op, mb, stage, p, place))
        out.append(mine)
    return out


def ideal_bubble(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of the step, bubble / total, with uniform stages and free comm.

    GPipe and 1F1B: (p-1)/(m+p-1) (GPipe, arXiv 1811.06965; 1F1B saves memory, not bubble).
    Interleaved with v chunks per rank: (p-1)/(v*m+p-1) (Megatron-LM, arXiv 2104.04473).
    The zero-bubble schedules, with equal F, I and W costs T (Qi et al., ICLR 2024, arXiv
    2401.10241), are simulated, since their bubble depends on m's range:
    ZB-H1 for m >= p: each rank idles (p-1)(T_F + T_B - T_W) = (p-1)T against 3mT of work
    (paper §2.1, Figure 3), so (p-1)/(3m+p-1). ZB-V for m >= 2p-1: no rank idles between its
    first forward and its last W (the paper's zero bubble); a flushed step still has the V's
    skew, rank r starts r chunk-forwards late and ends as late, so (p-1)/(6m+p-1).
    The HF Ultra-Scale Playbook's (p-1)/m is bubble / ideal compute, not bubble / total.

    >>> ideal_bubble("gpipe", stages=4, microbatches=8)
    0.2727272727272727
    >>> ideal_bubble("zb-h1", stages=4, microbatches=8) == 3 / (3 * 8 + 3)
    True
    """
    validate(schedule, stages, microbatches, chunks)
    if schedule not in ("zb-h1", "zbv"):
        return (stages - 1) / (chunks * microbatches + stages - 1)
    t = Fraction(1, chunks)     # a chunk's share of a stage's work
    events = simulate(build_schedule(schedule, stages, microbatches, chunks),
                      costs={"F": t, "I": t, "W": t})
    total = max(e["end"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events if e["stream"] == "compute")
    return float(1 - busy / (stages * total))


def in_flight(actions: list[Action], released_by: tuple = ("B", "W")) -> int:
    """Most (stage, microbatch) activations held at once on one rank: forward done, backward not.

    A split backward frees them at W (its weight gradients still need the saved inputs);
    ``released_by=("B", "I")`` counts until the input gradient instead.

    >>> in_flight(build_schedule("gpipe", stages=2, microbatches=4)[0])
    4
    """
    live, peak = set(), 0
    for a in actions:
        if a.op == "F":
            live.add((a.stage, a.microbatch))
            peak = max(peak, len(live))
        elif a.op in released_by:
            live.discard((a.stage, a.microbatch))
    return peak
