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
stream is free and every peer issued it. dp replicas are alike, so one pipeline is replayed
and copied; or, given ``paces``, each replica runs its pipeline at its own pace and each
gradient all-reduce starts once the slowest replica has issued it (:func:`finish`). Overlap's
buckets share the cores with what the schedule runs beside them: a rank's actions and receives
run at 1/``overlap_stretch`` of their speed while its buckets fly (:meth:`_Replay.shared`). A
point-to-point transfer starts when both ends are posted (gloo and NCCL rendezvous): the receiver's blocked time before the sender posted is ``wait`` (bubble), the
transfer ``recv``/``send`` (comm), as :mod:`labkit.waits` splits a measured run.

    >>> events = replay(program, pp=2, dp=1, schedule="1f1b", microbatches=4)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..analysis.metrics import union
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
    """The executor's untimed seconds before each action, and each call after the schedule where
    ``tail_gap`` is not set: Python between actions (link polling, hooks, bookkeeping; measured,
    labkit.plan.in_step)."""
    overlap_busy: float | None = None
    """``busy_factor`` for the buckets launched inside backward (overlap, ddp), where measured
    in a real overlapped step; None: ``busy_factor``."""
    overlap_stretch: float = 1.0
    """How much longer the backward that launches buckets takes than the same backward alone
    (its compute shares the cores with the transfers; measured in the same step)."""
    sync_lag: float = 0.0
    """How much later than the typical rank the slowest of its dp peers issues a bucket (pp = 1,
    one replica copied: an all-reduce cannot start before the last rank issues it; measured,
    labkit.plan.in_step.overlap_fit)."""
    lanes: int = 1
    """zero=1's calls of the dp group that run at once (labkit.plan.sharded.Link)."""
    call_gap: float = 0.0
    """zero=1's untimed seconds before each of its calls (measured: labkit.plan.in_step.zero1_fit)."""
    bwd_input: list[float] = field(default_factory=list)    # per stage: I of a split backward
    bwd_weight: list[float] = field(default_factory=list)   # … and W (zero-bubble schedules)
    tail_gap: float | None = None
    """Untimed seconds before each blocking gradient call after the schedule, where it differs
    from ``gap`` (a pipeline's naive tail: measured, labkit.plan.in_step.pipeline_fit)."""
    p2p_delay: float = 0.0
    """How much later than its sender posts it a message reaches a receiver that waits for it
    (a pipeline's ranks do not keep one pace on shared cores: measured, in_step.pipeline_fit)."""


def _actions(pp: int, schedule: str, m: int, chunks: int) -> list[list[Action]]:
    if pp == 1:         # the data-parallel job: forward then backward of each micro-batch
        return [[Action(op, mb, 0, 0) for mb in range(m) for op in ("F", "B")]]
    return build_schedule(schedule, pp, m, chunks)


class _Replay:
    def __init__(self, prog: StageProgram, pp: int, dp: int, schedule: str, m: int, chunks: int, dp_mode: str,
                 replicas: int, beside: list[list[tuple[float, float]]] | None = None):
        self.prog, self.pp, self.dp, self.chunks, self.dp_mode = prog, pp, dp, chunks, dp_mode
        self.replicas = replicas
        self.beside = beside or [[] for _ in range(pp)]     # per rank: its buckets in flight (a previous pass)
        self.actions = _actions(pp, schedule, m, chunks)
        if any(a.op in ("I", "W") for a in self.actions[0]) and len(prog.bwd_input) != pp * chunks:
            raise ValueError(f"schedule {schedule!r} splits backward: the program needs bwd_input and bwd_weight per stage")
        self.placement = placement_of(schedule)
        # the gradients of a chunk are complete after its last B, or its last W when split
        self.last_b = [{a.chunk: a.microbatch for a in acts if a.op in ("B", "W")} for acts in self.actions]
        self.clock = [0.0] * pp
        self.comm_free = [0.0] * pp
        self.inflight = [dict() for _ in range(pp)]      # chunk → end of its launched buckets
        self.launched = [[] for _ in range(pp)]          # chunks whose buckets are issued, not yet timed
        self.posted: dict[tuple, list] = {}
        self.taken: dict[tuple, int] = {}
        self.events: list[dict] = []

    def event(self, rank, stream, kind, name, start, end, microbatch=None, nbytes=0, peer=None):
        self.events.append({"rank": rank, "stream": stream, "kind": kind, "name": name, "step": 0,
                            "microbatch": microbatch, "start": start, "end": end, "bytes": nbytes, "peer": peer})

    def label(self, op: str, a: Action) -> str:
        return f"{op}{a.microbatch}" + (f" c{a.chunk}" if self.chunks > 1 else "")

    def run(self) -> list[dict]:
        self.schedule()
        for r in range(self.pp):
            finish([self], r)
        return self.replicate()

    def schedule(self) -> None:
        """Every rank's actions, in the order their receives allow."""
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

    def calls(self, which: list, stage: int) -> list:
        return which[stage] if which else []

    def compute(self, r: int, kind: str, name: str, seconds: float, calls: list, microbatch,
                shared: bool = True) -> None:
        """``seconds`` of compute on rank r with blocking ``calls`` inside (the span cut around
        them); ``shared``: slower while the rank's buckets are in flight (:meth:`shared`)."""
        if shared and seconds > 0:
            wall = self.shared(r, self.clock[r], seconds)
            calls = [replace(c, at=c.at * wall / seconds) for c in calls]
            seconds = wall
        rank = Rank()
        rank.clock = self.clock[r]
        rank.compute(kind, name, seconds, calls, microbatch)
        self.events += [dict(e, rank=r) for e in rank.events]
        self.clock[r] = rank.clock

    def shared(self, r: int, start: float, seconds: float, peer: int | None = None) -> float:
        """Wall seconds of ``seconds`` of work on rank r (and ``peer``) from ``start``, at
        1/``overlap_stretch`` of its speed while a bucket of either is in flight: the backward
        that launches buckets is measured that much longer beside them, and what the schedule
        runs after it (the other chunk's actions, the receives) shares the same cores."""
        spans = self.beside[r] if peer is None or not self.beside[peer] else union(self.beside[r] + self.beside[peer])
        if not spans or self.prog.overlap_stretch <= 1.0:
            return seconds
        return shared_end(start, seconds, spans, self.prog.overlap_stretch) - start

    def flight_spans(self) -> list[list[tuple[float, float]]]:
        """Per rank, when its launched buckets were in flight (issue to end), for the next pass."""
        out = [[] for _ in range(self.pp)]
        for e in self.events if self.dp_mode == "overlap" else []:
            if e["kind"] == "allreduce":
                out[e["rank"]].append((e["start"], e["end"]))
        return [union(spans) for spans in out]

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
                         calls, a.microbatch, shared=not launches)
            if launches:
                self.launch(r, a.chunk, a.stage, t, stretch)
        elif a.op.startswith("SEND"):
            self.posted.setdefault((r, a.peer, a.op[-1]), []).append((t, a))
        else:
            return self.recv(r, a)
        return True

    def launch(self, r: int, chunk: int, stage: int, bwd_start: float, stretch: float = 1.0) -> None:
        """Buckets of the chunk's last backward, each issued once its gradients exist; timed
        by :func:`settle` once every replica has issued them. Packing them runs in backward's
        hooks, inside the backward span as the recorder draws it."""
        pack = sum(msg.pack for msg in self.prog.grads[stage])
        if pack:
            last = next(e for e in reversed(self.events) if e["rank"] == r and e["stream"] == "compute")
            last["end"] += pack
            self.clock[r] += pack
        self.launched[r].append((chunk, stage, bwd_start, self.clock[r], stretch))
        if self.dp_mode == "ddp":      # DDP's backward() returns after its buckets, copied back
            settle([self], r)
            self.wait_and_unpack(r, chunk)

    def issues(self, r: int) -> list[tuple]:
        """(chunk, message, issue time, busy spans) of rank r's launched buckets, in issue order.
        The busy spans are the backward that launched the bucket and every compute span of the
        rank after it: with two chunks a rank the schedule goes on beside the transfer."""
        out = []
        for chunk, stage, bwd_start, bwd_end, stretch in self.launched[r]:
            busy = [(bwd_start, bwd_end)] + sorted((e["start"], e["end"]) for e in self.events if e["rank"] == r
                                                   and e["stream"] == "compute" and e["start"] >= bwd_end)
            packed = 0.0
            for msg in self.prog.grads[stage]:
                packed += msg.pack
                out.append((chunk, msg, bwd_start + msg.ready * stretch + packed, busy))
        self.launched[r] = []
        return out

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
        sent_at += self.prog.p2p_delay
        start = max(posted_at, sent_at)
        cost = self.shared(r, start, cost, a.peer)
        if sent_at > posted_at:
            self.event(r, "comm", "wait", str(a), posted_at, sent_at, a.microbatch, peer=a.peer)
        self.event(r, "comm", "recv", str(a), start, start + cost, a.microbatch, peer=a.peer)
        self.event(a.peer, "comm", "send", str(send), start, start + cost, send.microbatch, nbytes, peer=r)
        self.clock[r] = start + cost
        return True

    def finish_sharded(self, r: int) -> None:
        """zero=1 after the schedule: each chunk's buckets reduce-scattered, the shards stepped
        and gathered back (every replica alike)."""
        stages = [global_stage(r, c, self.pp, self.placement) for c in range(self.chunks)]
        rank = Rank(gap=self.prog.gap, lanes=self.prog.lanes, call_gap=self.prog.call_gap)
        rank.clock, rank.comm_free = self.clock[r], self.comm_free[r]
        optimizer = sum(self.prog.optimizer[g] for g in stages) if self.prog.optimizer else 0.0
        sharded_tail(rank, [u for g in stages for u in self.prog.units[g]], self.prog.zero, optimizer)
        self.events += [dict(e, rank=r) for e in rank.events]
        self.clock[r] = rank.clock

    def step(self, r: int) -> None:
        """The optimizer step of rank r's stages."""
        stages = [global_stage(r, c, self.pp, self.placement) for c in range(self.chunks)]
        cost = sum(self.prog.optimizer[g] for g in stages) if self.prog.optimizer else 0.0
        if cost > 0:
            self.clock[r] += self.prog.gap
            t = self.clock[r]
            self.event(r, "compute", "optimizer", "SGD step", t, t + cost)
            self.clock[r] = t + cost

    def replicate(self, first: int = 0) -> list[dict]:
        """The pipeline's events for every dp replica and tp rank (rank = (dp_index·pp + stage)·tp
        + tp_index, labkit's grid, tp innermost), dp indices from ``first``."""
        tp = self.prog.tp
        return [dict(e, rank=(d * self.pp + e["rank"]) * tp + t,
                     peer=None if e["peer"] is None else (d * self.pp + e["peer"]) * tp + t)
                for d in range(first, first + self.replicas) for t in range(tp) for e in self.events]


def settle(group: list[_Replay], r: int) -> None:
    """Time the buckets rank r launched in each replica of ``group`` (rank r's dp group), in
    issue order on the comm stream: an all-reduce starts once every replica has issued it and
    the one before it has ended, progresses at 1/f of its speed (f: ``overlap_busy``) inside a
    replica's busy spans, and ends when the slowest replica's share does. One replica standing
    for all (pp = 1) issues each bucket ``sync_lag`` before its slowest peer does."""
    f = group[0].prog.overlap_busy or group[0].prog.busy_factor
    lag = group[0].prog.sync_lag if len(group) == 1 and group[0].dp > 1 else 0.0
    plans = [rep.issues(r) for rep in group]
    for calls in zip(*plans):
        last_issue = max(issue for _, _, issue, _ in calls)
        # each replica's comm stream reaches the call once it issued it and its previous call ended
        reached = [max(issue, rep.comm_free[r]) for rep, (_, _, issue, _) in zip(group, calls)]
        start = max(max(reached), last_issue + lag)
        # … and its peer computes ``lag`` later too: the transfer shares the cores that long
        end = max(shared_end(start, msg.cost, [(a + lag, b + lag) for a, b in busy], f)
                  for _, msg, _, busy in calls)
        for rep, (chunk, msg, _, _), own in zip(group, calls, reached):
            rep.comm_free[r] = end
            # drawn from when this rank's stream reached it, as the recorder draws a call it
            # waits in: a replica ahead of its peer waits inside the call (comm, not idle)
            rep.event(r, "comm", "allreduce", msg.name, own, end, nbytes=msg.bytes)
            rep.inflight[r].setdefault(chunk, []).append((end, msg.unpack))


def finish(group: list[_Replay], r: int) -> None:
    """After the schedule, rank r in every replica of ``group``: each chunk's gradient sync
    (an all-reduce starts once every replica has issued it), then the optimizer step."""
    first = group[0]
    if first.prog.zero:
        for rep in group:
            rep.finish_sharded(r)
        return
    if first.dp > 1:
        for chunk in range(first.chunks):
            stage = global_stage(r, chunk, first.pp, first.placement)
            if first.dp_mode in ("naive", "bucketed"):
                for msgs in zip(*(rep.prog.grads[stage] for rep in group)):
                    for rep in group:
                        rep.clock[r] += rep.prog.gap if rep.prog.tail_gap is None else rep.prog.tail_gap
                    start = max([rep.clock[r] + msg.pack for rep, msg in zip(group, msgs)] +
                                [rep.comm_free[r] for rep in group])
                    for rep, msg in zip(group, msgs):
                        rep.comm_free[r] = start + msg.cost
                        # drawn from its own call, as the recorder draws a call it waits in
                        rep.event(r, "comm", "allreduce", msg.name, min(start, rep.clock[r] + msg.pack),
                                  start + msg.cost, nbytes=msg.bytes)
                        rep.clock[r] = start + msg.cost + msg.unpack
            elif first.dp_mode == "overlap":
                settle(group, r)
                for rep in group:
                    rep.wait_and_unpack(r, chunk)
    for rep in group:
        rep.step(r)


def shared_end(start: float, work: float, busy: list[tuple[float, float]], f: float) -> float:
    """When ``work`` seconds of transfer issued at ``start`` end, at 1/``f`` of full speed inside
    the ``busy`` spans (sorted by start) and at full speed outside them: processor sharing with
    the rank's compute."""
    t, left = start, work
    for b0, b1 in busy:
        if b1 <= t:
            continue
        if b0 > t:                          # free until the next busy span
            if left <= b0 - t:
                return t + left
            left, t = left - (b0 - t), b0
        if left * f <= b1 - t:
            return t + left * f
        left, t = left - (b1 - t) / f, b1
    return t + left


def at_pace(prog: StageProgram, pace: float) -> StageProgram:
    """``prog`` on a rank that runs ``pace`` times as long: its compute, messages and gaps (not
    its collectives, which run at the group's speed)."""
    scale = lambda xs: [pace * x for x in xs]
    return replace(prog, fwd=scale(prog.fwd), bwd=scale(prog.bwd), p2p=scale(prog.p2p),
                   bwd_input=scale(prog.bwd_input), bwd_weight=scale(prog.bwd_weight),
                   optimizer=scale(prog.optimizer), gap=pace * prog.gap, p2p_delay=pace * prog.p2p_delay,
                   tail_gap=None if prog.tail_gap is None else pace * prog.tail_gap,
                   fwd_calls=[[replace(c, at=pace * c.at) for c in calls] for calls in prog.fwd_calls],
                   bwd_calls=[[replace(c, at=pace * c.at) for c in calls] for calls in prog.bwd_calls],
                   grads=[[replace(m, ready=pace * m.ready, pack=pace * m.pack, unpack=pace * m.unpack)
                           for m in msgs] for msgs in prog.grads])


PASSES = 4
"""Replays of a step whose buckets fly beside the schedule (overlap, pp > 1): each pass slows
the schedule where the previous one had buckets in flight; the times settle within a few."""


def replay(prog: StageProgram, pp: int, dp: int, schedule: str = "1f1b", microbatches: int = 1,
           chunks: int = 1, dp_mode: str = "overlap", replicas: int | None = None,
           paces: list[float] | None = None) -> list[dict]:
    """Events of one step (step 0, times from its start) in labkit's event schema, for
    ``replicas`` dp replicas (default all dp; 1 draws one pipeline).

    ``paces`` (one per dp replica): each replica's pipeline runs at its own pace (× its compute,
    messages and gaps), and each gradient all-reduce starts once the slowest replica has issued
    it. Without them every replica is the same pipeline, copied.

    With overlap's buckets launched while a pipeline's schedule goes on (pp > 1: the other
    chunk's actions, the receives that follow), the step is replayed again with that work
    slowed where the buckets were in flight (:meth:`_Replay.shared`), until it settles."""
    if len(prog.fwd) != pp * chunks:
        raise ValueError(f"the program has {len(prog.fwd)} stages but pp*chunks = {pp * chunks}")
    if paces and (len(paces) != dp or prog.zero or dp_mode == "ddp"):
        raise ValueError(f"paces: one per dp replica ({dp}), for naive, bucketed or overlap dp without zero")
    passes = PASSES if pp > 1 and dp > 1 and dp_mode == "overlap" and prog.overlap_stretch > 1 else 1
    beside = [None] * (len(paces) if paces else 1)
    for _ in range(passes):
        if not paces:
            group = [_Replay(prog, pp, dp, schedule, microbatches, chunks, dp_mode,
                             dp if replicas is None else replicas, beside[0])]
            events = group[0].run()
        else:
            group = [_Replay(at_pace(prog, pace), pp, dp, schedule, microbatches, chunks, dp_mode, 1, spans)
                     for pace, spans in zip(paces, beside)]
            for rep in group:
                rep.schedule()
            for r in range(pp):
                finish(group, r)
            events = [e for d, rep in enumerate(group) for e in rep.replicate(first=d)]
        flights = [rep.flight_spans() for rep in group]
        if flights == beside:
            break
        beside = flights
    return events
