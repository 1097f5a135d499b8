"""The replay of a sharded (ZeRO) step, block by block: the calls :mod:`labkit.parallel.zero` makes.

What each stage issues over the dp group (Rajbhandari et al. 2020; the code in
``parallel/zero/sync.py`` and ``zero3.py``), with the dp group's async calls on one link per rank
(:class:`Link`: on gloo two run at once, sharing it; the cost table's ``lanes``) and at most
``MAX_IN_FLIGHT`` reduce-scatters outstanding — issuing one more first waits for the oldest, on
the compute thread:

* zero=1 — after the schedule, each bucket is packed and reduce-scattered; all are waited for,
  the shard's gradient divided by dp; the optimizer steps 1/dp of the parameters; the updated
  shards are all-gathered back (all issued, then waited).
* zero=2 — each bucket is packed and reduce-scattered the moment its gradients exist, in every
  micro-batch's backward (so while backward still computes); the same tail.
* zero=3 — one unit per block: gathered before its forward (waited; ``prefetch`` = k issues the
  next k as well), freed after; gathered again before its backward (the previous k prefetched),
  reduce-scattered once its parameters' gradients exist, which is inside its backward span (their
  hooks run before the one on its input's gradient that closes the span: ``scatter_at``); no
  gather after the step (the next forward does it).

A wait inside a block's backward is part of that block's span, as the recorder draws it (the
hook that waits runs inside ``backward()``); a gather waited before a block is not.

    >>> events = replay_sharded(prog)        # one rank's step; copied to every dp and tp rank
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_IN_FLIGHT = 2       # parallel/zero/sync.py: Zero1Sync.MAX_IN_FLIGHT


@dataclass
class Call:
    """A blocking collective made inside a forward or backward (tensor parallelism's f and g)."""

    name: str
    bytes: int          # on the wire from each rank
    cost: float         # seconds the compute thread waits
    at: float           # compute seconds into the action when it is made
    kind: str = "allreduce"


@dataclass
class Unit:
    """One flat, padded unit of parameters: a bucket (zero=1/2) or a block (zero=3)."""

    name: str
    nbytes: int             # the whole padded buffer
    gather: float           # seconds of its all-gather
    scatter: float          # … of its reduce-scatter
    first_block: int        # its gradients all exist once this block's backward is done
    pack: float = 0.0       # compute-thread seconds to pack its gradients (torch.cat)
    unpack: float = 0.0     # … to add the received slice and divide by dp
    wire: int = 0           # bytes each rank sends per call: (n−1)/n of nbytes


@dataclass
class Block:
    """One top-level block, per micro-batch."""

    name: str
    fwd: float
    bwd: float
    fwd_calls: list[Call] = field(default_factory=list)
    bwd_calls: list[Call] = field(default_factory=list)


@dataclass
class ShardedProgram:
    blocks: list[Block]
    units: list[Unit]
    zero: int
    microbatches: int = 1
    prefetch: int = 0
    optimizer: float = 0.0          # the shards' step: 1/dp of the whole model's
    loss_fwd: float = 0.0
    loss_bwd: float = 0.0
    busy_factor: float = 1.0        # a transfer beside compute progresses 1/busy_factor as fast
    gap: float = 0.0                # the executor's untimed seconds per action (labkit.plan.in_step)
    compute_factor: float = 1.0     # compute beside an in-flight transfer runs 1/compute_factor as fast
    lanes: int = 1                  # calls of the dp group that run at once (gloo: its threads; see Link)
    call_gap: float = 0.0           # untimed seconds before each call (zero=3's bookkeeping: in_step.zero3_fit)
    scatter_at: float = 1.0         # zero=3: where in a block's backward span its reduce-scatter is issued


@dataclass(eq=False)
class Transfer:
    """One async call on a link: ``work`` seconds at full speed, from ``start`` on."""

    start: float
    work: float
    busy_until: float = 0.0     # before this it runs 1/busy of its speed (compute beside it)
    busy: float = 1.0
    event: dict | None = None   # its comm event, whose start and end the link keeps
    began: float = 0.0
    ended: float = 0.0


class Link:
    """A group's transfers: up to ``lanes`` at once sharing its speed, the rest queued in order.

    gloo runs a group's async calls on a pool of worker threads (``ProcessGroupGloo`` options:
    2 threads), so two calls run at once; on CPU both are the cores' copying and reducing, so
    each goes at half speed (processor sharing: the pair ends when the two run one after the
    other would, but a short call issued behind a long one no longer waits for all of it).
    A later call can slow one already running, so ends are computed from every call issued
    so far, and are final when waited for (the compute thread issues nothing while it waits).
    ``lanes`` = 1 is one comm stream in issue order (NCCL's; a table calibrated before lanes were
    recorded).
    """

    def __init__(self, lanes: int = 1):
        self.lanes, self.transfers, self.floor = max(1, lanes), [], 0.0

    def add(self, t: Transfer) -> Transfer:
        self.transfers.append(t)
        self._run()
        return t

    def busy_until(self, t: float) -> None:
        """Nothing starts on the link before ``t`` (a stream already busy until then)."""
        self.floor = max(self.floor, t)
        self._run()

    def free(self) -> float:
        return max([self.floor] + [t.ended for t in self.transfers])

    def _run(self) -> None:
        """Processor sharing over every transfer issued so far; writes each one's span."""
        waiting = sorted(self.transfers, key=lambda t: t.start)
        left = {id(t): t.work for t in waiting}
        active: list[Transfer] = []
        now = self.floor
        while waiting or active:
            while waiting and len(active) < self.lanes and waiting[0].start <= now:
                t = waiting.pop(0)
                t.began = now
                active.append(t)
            if not active:
                now = max(now, waiting[0].start)
                continue
            k = len(active)
            rate = {id(t): 1.0 / (k * (t.busy if now < t.busy_until else 1.0)) for t in active}
            step = min(left[id(t)] / rate[id(t)] for t in active)
            for t in active:
                if now < t.busy_until:
                    step = min(step, t.busy_until - now)
            if waiting and len(active) < self.lanes:
                step = min(step, waiting[0].start - now)
            step = max(step, 0.0)
            for t in active:
                left[id(t)] -= rate[id(t)] * step
            now += step
            for t in [t for t in active if left[id(t)] <= 1e-12]:
                active.remove(t)
                t.ended = now
        for t in self.transfers:
            if t.event is not None:
                t.event["start"], t.event["end"] = t.began, t.ended


class Rank:
    """One rank's clocks and events: the compute thread, the dp group's link."""

    def __init__(self, busy_factor: float = 1.0, gap: float = 0.0, compute_factor: float = 1.0, lanes: int = 1,
                 call_gap: float = 0.0):
        self.clock = 0.0
        self.busy_factor, self.gap, self.compute_factor, self.call_gap = busy_factor, gap, compute_factor, call_gap
        self.link = Link(lanes)
        self.in_flight: deque = deque()
        self.events: list[dict] = []

    @property
    def comm_free(self) -> float:
        """When the last transfer issued so far ends (given what is issued so far)."""
        return self.link.free()

    @comm_free.setter
    def comm_free(self, t: float) -> None:
        self.link.busy_until(t)

    def event(self, stream, kind, name, start, end, microbatch=None, nbytes=0, peer=None):
        self.events.append({"rank": 0, "stream": stream, "kind": kind, "name": name, "step": 0,
                            "microbatch": microbatch, "start": start, "end": end, "bytes": nbytes, "peer": peer})

    def compute(self, kind: str, name: str, seconds: float, calls: list[Call], microbatch=None,
                midway: tuple | None = None) -> None:
        """``seconds`` of compute with the blocking ``calls`` made inside it (spans cut around them);
        ``midway`` = (seconds in, hook): the hook runs there on the compute thread, inside the span."""
        before, done = len(self.events), 0.0
        marks = [(c.at, c) for c in calls] + ([midway] if midway else [])
        for at, c in sorted(marks, key=lambda m: m[0]):
            self._span(kind, name, at - done, microbatch)
            if isinstance(c, Call):
                self.event("comm", c.kind, c.name, self.clock, self.clock + c.cost, microbatch, c.bytes)
                self.clock += c.cost
            else:
                c()
            done = at
        self._span(kind, name, seconds - done, microbatch)
        if midway and not calls:        # one span, as the recorder draws it, the hook inside
            spans = [e for e in self.events[before:] if e["stream"] == "compute"]
            spans[0]["end"] = self.clock
            self.events = [e for e in self.events if not any(e is x for x in spans[1:])]

    def _span(self, kind, name, seconds, microbatch):
        """``seconds`` of compute; while a transfer is still in flight it runs 1/compute_factor
        as fast (on CPU gloo's threads reduce and copy on the same cores)."""
        if seconds <= 0:
            return
        c, wall = self.compute_factor, seconds
        if c > 1 and self.comm_free > self.clock:
            shared = min(seconds * c, self.comm_free - self.clock)
            wall = shared + seconds - shared / c
        self.event("compute", kind, name, self.clock, self.clock + wall, microbatch)
        self.clock += wall

    def issue(self, kind: str, name: str, cost: float, nbytes: int, beside: float = 0.0, microbatch=None) -> "Transfer":
        """An async call issued now; it runs on the group's link (see :class:`Link`), at
        1/busy_factor of its speed while the next ``beside`` seconds of compute run, at full
        speed after (as the overlap mode's buckets). Returns it, to wait on."""
        self.clock += self.call_gap
        self.event("comm", kind, name, self.clock, self.clock, microbatch, nbytes)
        return self.link.add(Transfer(self.clock, cost, self.clock + beside, self.busy_factor, self.events[-1]))

    def wait(self, until) -> None:
        """Until a time, or until a transfer ends."""
        end = until.ended if isinstance(until, Transfer) else until
        self.clock = max(self.clock, end)

    def scatter(self, unit: Unit, beside: float = 0.0, microbatch=None, collect: bool = True) -> None:
        """Pack, reduce-scatter (async); beyond MAX_IN_FLIGHT the oldest is waited for (zero=3:
        ``collect`` False, before the next block's backward instead)."""
        self.clock += unit.pack
        end = self.issue("reduce_scatter", f"reduce-scatter {unit.name}", unit.scatter, unit.wire, beside, microbatch)
        self.in_flight.append((end, unit))
        if collect:
            self.collect(MAX_IN_FLIGHT)

    def collect(self, limit: int = 0) -> None:
        """Wait for the oldest reduce-scatters until at most ``limit`` are in flight; each received
        slice is added to the shard's gradient (and divided by dp: ``unpack``)."""
        while len(self.in_flight) > limit:
            end, unit = self.in_flight.popleft()
            self.wait(end)
            self.clock += unit.unpack


def sharded_tail(rank: Rank, units: list[Unit], zero: int, optimizer: float, label: str = "SGD step (shards)") -> None:
    """After the schedule: zero=1's reduce-scatters, every stage's wait, the shards' optimizer
    step, and (zero=1/2) the updated shards all-gathered back."""
    if zero == 1:
        for unit in units:
            rank.scatter(unit)
    rank.collect()
    if optimizer > 0:
        rank.clock += rank.gap
        rank.event("compute", "optimizer", label, rank.clock, rank.clock + optimizer)
        rank.clock += optimizer
    if zero in (1, 2):
        for t in [rank.issue("allgather", f"gather {u.name}", u.gather, u.wire) for u in units]:
            rank.wait(t)


def _forward(rank: Rank, prog: ShardedProgram, mb: int) -> None:
    units = {u.first_block: k for k, u in enumerate(prog.units)} if prog.zero == 3 else {}
    if prog.zero != 3:
        total = sum(b.fwd for b in prog.blocks) + prog.loss_fwd
        calls, at = [], 0.0
        for b in prog.blocks:
            calls += [Call(c.name, c.bytes, c.cost, at + c.at, c.kind) for c in b.fwd_calls]
            at += b.fwd
        rank.compute("fwd", f"F{mb}", total, calls, mb)
        return
    gathered: dict[int, float] = {}
    for i, b in enumerate(prog.blocks):
        k = units.get(i)
        if k is not None:
            _gather(rank, prog, k, gathered, mb, 0.0)
            rank.wait(gathered.pop(k))
            for j in range(k + 1, min(k + 1 + prog.prefetch, len(prog.units))):
                _gather(rank, prog, j, gathered, mb, b.fwd)
        loss = prog.loss_fwd if i == len(prog.blocks) - 1 else 0.0
        rank.compute("fwd", f"F block {b.name.split()[-1]}", b.fwd + loss, b.fwd_calls, mb)


def _gather(rank: Rank, prog: ShardedProgram, k: int, gathered: dict, mb, beside: float) -> None:
    """Issue unit k's all-gather unless in flight; ``beside``: the compute it runs beside (prefetch)."""
    if k not in gathered:
        u = prog.units[k]
        gathered[k] = rank.issue("allgather", f"gather {u.name}", u.gather, u.wire, beside, microbatch=mb)


def _backward(rank: Rank, prog: ShardedProgram, mb: int) -> None:
    ready: dict[int, list[int]] = {}          # block → the units whose last gradient it makes
    for k, u in enumerate(prog.units):
        ready.setdefault(u.first_block, []).append(k)
    gathered: dict[int, float] = {}
    last = len(prog.blocks) - 1
    for i in range(last, -1, -1):
        b = prog.blocks[i]
        mine = ready.get(i, [])
        if prog.zero == 3:
            rank.collect(MAX_IN_FLIGHT)
            for k in mine:               # one unit per block
                _gather(rank, prog, k, gathered, mb, 0.0)
                rank.wait(gathered.pop(k))
                for j in range(k - 1, max(k - 1 - prog.prefetch, -1), -1):
                    _gather(rank, prog, j, gathered, mb, b.bwd)
        loss = prog.loss_bwd if i == last else 0.0
        before = len(rank.events)
        calls = [Call(c.name, c.bytes, c.cost, loss + c.at, c.kind) for c in b.bwd_calls]
        # zero=3: issued from its parameters' hooks, inside the span; the first block's span (no
        # input gradient to wait for) closes with those gradients, before the call
        at = prog.scatter_at if i > 0 else 1.0
        if prog.zero == 3 and mine and at < 1.0:
            ahead = sum(x.bwd for x in prog.blocks[:i]) + (1.0 - at) * (loss + b.bwd)
            hook = lambda: [rank.scatter(prog.units[k], ahead, microbatch=mb, collect=False) for k in mine]
            rank.compute("bwd", b.name, loss + b.bwd, calls, mb, midway=(at * (loss + b.bwd), hook))
            continue
        rank.compute("bwd", b.name, loss + b.bwd, calls, mb)
        if prog.zero >= 2 and mine:
            spans = [e for e in rank.events[before:] if e["stream"] == "compute"]
            ahead = sum(x.bwd for x in prog.blocks[:i])       # the backward still to run beside it
            for k in mine:
                rank.scatter(prog.units[k], ahead, microbatch=mb, collect=prog.zero == 2)
            if spans and prog.zero == 2:      # the hook's pack and any wait sit inside the block's span
                spans[-1]["end"] = rank.clock


def replay_sharded(prog: ShardedProgram) -> list[dict]:
    """One rank's events of one step (rank 0, times from the step's start); dp ranks are alike."""
    rank = Rank(prog.busy_factor, prog.gap, prog.compute_factor, prog.lanes, prog.call_gap)
    for mb in range(prog.microbatches):
        rank.clock += prog.gap
        _forward(rank, prog, mb)
        rank.clock += prog.gap
        _backward(rank, prog, mb)
    sharded_tail(rank, prog.units, prog.zero, prog.optimizer)
    return rank.events
