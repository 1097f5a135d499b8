"""A discrete-event replay of one training step: the executor's actions, timed by costs.

The same per-rank action lists the executor runs (:func:`labkit.schedules.build_schedule`;
with pp = 1 the data-parallel job's F0 B0 F1 B1 …), and the same gradient calls:

* ``naive`` / ``bucketed`` — one blocking all-reduce per tensor / per bucket after backward;
* ``overlap`` — each bucket launched when its gradients exist during the last micro-batch's
  backward, waited for before the optimizer;
* ``ddp`` — the same launches, but backward itself returns only once every bucket is done;
* tensor parallelism's f and g — blocking all-reduces inside a forward or backward
  (``fwd_calls``/``bwd_calls``), the compute span cut around each, as the recorder cuts it;
* the zero-bubble schedules (zb-h1, zbv) — backward split into I (``bwd_input``: the input
  gradient, sent upstream at once) and W (``bwd_weight``: the weight gradients, later); the
  gradients exist in W, so overlap's buckets launch from a chunk's last W; tp's f calls lie
  on the input path, so I makes them (a first stage has no input gradient: its W is its whole
  backward, calls included); zbv's stages sit in a V (rank r holds stages r and 2p−1−r);
* zero=1 — after the schedule, each stage's buckets reduce-scattered, the shards stepped and
  all-gathered back (:func:`labkit.plan.sharded.sharded_tail`; zero 2 and 3 need pp = 1 and
  are replayed block by block there).

Each rank has one compute stream and one comm stream. A collective starts once the comm
stream is free and every peer issued it; dp replicas are alike, so one pipeline is replayed
and copied. A point-to-point transfer starts when both ends are posted (gloo and NCCL
rendezvous): the receiver's blocked time before the sender posted is ``wait`` (bubble), the
transfer ``recv``/``send`` (comm), as :mod:`labkit.waits` splits a measured run.

    >>> events = replay(program, pp=2, dp=1, schedule="1f1b", microbatches=4)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.pipeline.schedules import Action, build_schedule, global_stage, placement_of
from .sharded import Call, Rank, Unit, sharded_tail


@dataclass
class Message:
    """One gradient all-reduce of a stage: a tensor (naive) or a bucket."""

    name: str
    bytes: int          # put on the wire by each rank
    cost: float         # seconds on the comm stream
    ready: float        # seconds after the stage's backward starts when its gradients all exist
    pack: float = 0.0   # compute-thread seconds to pack the bucket before sending (untimed by the lab)
    unpack: float = 0.0  # … and to copy the average back into the gradients (and divide)


@dataclass
class StageProgram:
    """Per global stage: seconds per micro-batch and what its gradients send."""

    fwd: list[float]
    bwd: list[float]
    p2p: list[float]                      # sending stage g's activation to g+1 (its gradient back: same)
    p2p_bytes: list[int]
    grads: list[list[Message]] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    busy_factor: float = 1.0
    """How much slower a collective progresses while its rank computes (CPU: the comm and
    compute threads share the cores; 1 where comm has its own engine, as on a GPU)."""
    fwd_calls: list[list[Call]] = field(default_factory=list)    # per stage: tp's g in each forward
    bwd_calls: list[list[Call]] = field(default_factory=list)    # … and f in each backward
    units: list[list[Unit]] = field(default_factory=list)        # per stage: zero=1's buckets
    zero: int = 0
    tp: int = 1
    gap: float = 0.0
    """The executor's untimed seconds before each action and each call after the schedule
    (Python between actions: link polling, hooks, bookkeeping; measured, labkit.plan.in_step)."""
    overlap_busy: float | None = None
    """``busy_factor`` for the buckets launched inside backward (overlap, ddp), where measured
    in a real overlapped step; None: ``busy_factor``."""
    overlap_stretch: float = 1.0
    """How much longer the backward that launches buckets takes than the same backward alone
    (its compute shares the cores with the transfers; measured in the same step)."""
    lanes: int = 1
    """zero=1's calls of the dp group that run at once (labkit.plan.sharded.Link)."""
    call_gap: float = 0.0
    """zero=1's untimed seconds before each of its calls (measured: labkit.plan.in_step.zero1_fit)."""
    bwd_input: list[float] = field(default_factory=list)    # per stage: I of a split backward
    bwd_weight: list[float] = field(default_factory=list)   # … and W (zero-bubble schedules)


def _actions(pp: int, schedule: str, m: int, chunks: int) -> list[list[Action]]:
    if pp == 1:         # the data-parallel job: forward then backward of each micro-batch
        return [[Action(op, mb, 0, 0) for mb in range(m) for op in ("F", "B")]]
    return build_schedule(schedule, pp, m, chunks)


class _Replay:
    def __init__(self, prog: StageProgram, pp: int, dp: int, schedule: str, m: int, chunks: int, dp_mode: str,
                 replicas: int):
        self.prog, self.pp, self.dp, self.chunks, self.dp_mode = prog, pp, dp, chunks, dp_mode
        self.replicas = replicas
        self.actions = _actions(pp, schedule, m, chunks)
        if any(a.op in ("I", "W") for a in self.actions[0]) and len(prog.bwd_input) != pp * chunks:
            raise ValueError(f"schedule {schedule!r} splits backward: the program needs bwd_input and bwd_weight per stage")
        self.placement = placement_of(schedule)
        # the gradients of a chunk are complete after its last B, or its last W when split
        self.last_b = [{a.chunk: a.microbatch for a in acts if a.op in ("B", "W")} for acts in self.actions]
        self.clock = [0.0] * pp
        self.comm_free = [0.0] * pp
        self.inflight = [dict() for _ in range(pp)]      # chunk → end of its launched buckets
        self.posted: dict[tuple, list] = {}
        self.taken: dict[tuple, int] = {}
        self.events: list[dict] = []

    def event(self, rank, stream, kind, name, start, end, microbatch=None, nbytes=0, peer=None):
        self.events.append({"rank": rank, "stream": stream, "kind": kind, "name": name, "step": 0,
                            "microbatch": microbatch, "start": start, "end": end, "bytes": nbytes, "peer": peer})

    def label(self, op: str, a: Action) -> str:
        return f"{op}{a.microbatch}" + (f" c{a.chunk}" if self.chunks > 1 else "")

    def run(self) -> list[dict]:
        pos, progress = [0] * self.pp, True
        while progress:
            progress = False
            for r, acts in enumerate(self.actions):
                while pos[r] < len(acts):
                    if not self.act(r, acts[pos[r]]):
                        break            # a receive whose send is not posted yet: let the others run
                    pos[r] += 1
                    progress = True
        stuck = [f"rank {r} at {acts[pos[r]]}" for r, acts in enumerate(self.actions) if pos[r] < len(acts)]
        if stuck:
            raise RuntimeError("replay deadlocked: " + ", ".join(stuck))
        for r in range(self.pp):
            self.finish(r)
        return self.replicate()

    def calls(self, which: list, stage: int) -> list:
        return which[stage] if which else []

    def compute(self, r: int, kind: str, name: str, seconds: float, calls: list, microbatch) -> None:
        """``seconds`` of compute on rank r with blocking ``calls`` inside (the span cut around them)."""
        rank = Rank()
        rank.clock = self.clock[r]
        rank.compute(kind, name, seconds, calls, microbatch)
        self.events += [dict(e, rank=r) for e in rank.events]
        self.clock[r] = rank.clock

    def act(self, r: int, a: Action) -> bool:
        if not a.op.startswith("RECV"):
            self.clock[r] += self.prog.gap
        prog, t = self.prog, self.clock[r]
        if a.op == "F":
            self.compute(r, "fwd", self.label("F", a), prog.fwd[a.stage], self.calls(prog.fwd_calls, a.stage),
                         a.microbatch)
        elif a.op == "I":
            self.compute(r, "bwd_input", self.label("I", a), prog.bwd_input[a.stage],
                         self.calls(prog.bwd_calls, a.stage) if a.stage > 0 else [], a.microbatch)
        elif a.op in ("B", "W"):
            launches = self.dp > 1 and self.dp_mode in ("overlap", "ddp") and self.last_b[r][a.chunk] == a.microbatch
            stretch = prog.overlap_stretch if launches and prog.grads[a.stage] else 1.0
            seconds, calls = prog.bwd[a.stage], self.calls(prog.bwd_calls, a.stage)
            if a.op == "W":
                seconds, calls = prog.bwd_weight[a.stage], calls if a.stage == 0 else []
            self.compute(r, "bwd" if a.op == "B" else "bwd_weight", self.label(a.op, a), seconds * stretch,
                         calls, a.microbatch)
            if launches:
                self.launch(r, a.chunk, a.stage, t, stretch)
        elif a.op.startswith("SEND"):
            self.posted.setdefault((r, a.peer, a.op[-1]), []).append((t, a))
        else:
            return self.recv(r, a)
        return True

    def launch(self, r: int, chunk: int, stage: int, bwd_start: float, stretch: float = 1.0) -> None:
        """Buckets of the chunk's last backward, each issued once its gradients exist."""
        f, packed = self.prog.overlap_busy or self.prog.busy_factor, 0.0
        for msg in self.prog.grads[stage]:     # packing runs in the hooks, holding backward up
            packed += msg.pack
        self.clock[r] += packed
        bwd_end, packed = self.clock[r], 0.0
        for msg in self.prog.grads[stage]:
            packed += msg.pack
            start = max(bwd_start + msg.ready * stretch + packed, self.comm_free[r])
            # processor sharing: at rate 1/f while backward still computes, at full rate after
            shared = max(0.0, bwd_end - start)
            end = start + msg.cost * f if msg.cost * f <= shared else max(start, bwd_end) + msg.cost - shared / f
            self.comm_free[r] = end
            self.event(r, "comm", "allreduce", msg.name, start, end, nbytes=msg.bytes)
            self.inflight[r].setdefault(chunk, []).append((end, msg.unpack))
        if self.dp_mode == "ddp":      # DDP's backward() returns after its buckets, copied back
            self.wait_and_unpack(r, chunk)

    def wait_and_unpack(self, r: int, chunk: int) -> None:
        for end, unpack in self.inflight[r].pop(chunk, []):
            self.clock[r] = max(self.clock[r], end) + unpack

    def recv(self, r: int, a: Action) -> bool:
        key = (a.peer, r, a.op[-1])
        k = self.taken.get(key, 0)
        if k >= len(self.posted.get(key, [])):
            return False
        sent_at, send = self.posted[key][k]
        self.taken[key] = k + 1
        self.clock[r] += self.prog.gap
        sender_stage = send.stage
        cost, nbytes = self.prog.p2p[min(sender_stage, a.stage)], self.prog.p2p_bytes[min(sender_stage, a.stage)]
        posted_at = self.clock[r]
        start = max(posted_at, sent_at)
        if sent_at > posted_at:
            self.event(r, "comm", "wait", str(a), posted_at, sent_at, a.microbatch, peer=a.peer)
        self.event(r, "comm", "recv", str(a), start, start + cost, a.microbatch, peer=a.peer)
        self.event(a.peer, "comm", "send", str(send), start, start + cost, send.microbatch, nbytes, peer=r)
        self.clock[r] = start + cost
        return True

    def finish(self, r: int) -> None:
        """After the schedule: each chunk's gradient sync, then the optimizer step."""
        stages = [global_stage(r, c, self.pp, self.placement) for c in range(self.chunks)]
        if self.prog.zero:
            rank = Rank(gap=self.prog.gap, lanes=self.prog.lanes, call_gap=self.prog.call_gap)
            rank.clock, rank.comm_free = self.clock[r], self.comm_free[r]
            optimizer = sum(self.prog.optimizer[g] for g in stages) if self.prog.optimizer else 0.0
            sharded_tail(rank, [u for g in stages for u in self.prog.units[g]], self.prog.zero, optimizer)
            self.events += [dict(e, rank=r) for e in rank.events]
            self.clock[r] = rank.clock
            return
        if self.dp > 1:
            for chunk, stage in enumerate(stages):
                if self.dp_mode in ("naive", "bucketed"):
                    for msg in self.prog.grads[stage]:
                        self.clock[r] += self.prog.gap
                        start = max(self.clock[r] + msg.pack, self.comm_free[r])
                        self.comm_free[r] = start + msg.cost
                        self.event(r, "comm", "allreduce", msg.name, start, self.comm_free[r], nbytes=msg.bytes)
                        self.clock[r] = self.comm_free[r] + msg.unpack
                elif self.dp_mode == "overlap":
                    self.wait_and_unpack(r, chunk)
        cost = sum(self.prog.optimizer[g] for g in stages) if self.prog.optimizer else 0.0
        if cost > 0:
            self.clock[r] += self.prog.gap
            t = self.clock[r]
            self.event(r, "compute", "optimizer", "SGD step", t, t + cost)
            self.clock[r] = t + cost

    def replicate(self) -> list[dict]:
        """The pipeline's events for every dp replica and tp rank (rank = (dp_index·pp + stage)·tp
        + tp_index, labkit's grid, tp innermost)."""
        tp = self.prog.tp
        return [dict(e, rank=(d * self.pp + e["rank"]) * tp + t,
                     peer=None if e["peer"] is None else (d * self.pp + e["peer"]) * tp + t)
                for d in range(self.replicas) for t in range(tp) for e in self.events]


def replay(prog: StageProgram, pp: int, dp: int, schedule: str = "1f1b", microbatches: int = 1,
           chunks: int = 1, dp_mode: str = "overlap", replicas: int | None = None) -> list[dict]:
    """Events of one step (step 0, times from its start) in labkit's event schema, for
    ``replicas`` dp replicas (default all dp; 1 draws one pipeline)."""
    if len(prog.fwd) != pp * chunks:
        raise ValueError(f"the program has {len(prog.fwd)} stages but pp*chunks = {pp * chunks}")
    return _Replay(prog, pp, dp, schedule, microbatches, chunks, dp_mode, dp if replicas is None else replicas).run()
