"""One event-driven simulator: ranks' programs on shared cores, with one place that matches calls.

Each rank runs a program, a list of items, on its compute thread:

* :class:`Compute` — work of ``seconds`` on one core (a span of ``kind``, or host time with
  ``kind=None``: no span, as the recorder sees none);
* :class:`Issue` — post a call (a collective or one side of a point-to-point message) on the
  rank's comm stream and go on; the calls of a stream run one after another, in order;
* :class:`Wait` — block until a posted call has finished on this rank.

A call is identified by its ``key``; it starts when every member of its ``group`` has posted
it and it is at the head of each member's stream (:meth:`Sim._start_ready`, the one place where
sends meet receives and collectives meet their members), and it takes ``seconds`` of work on the
cores (gloo's own) and, on an emulated link, at least ``link`` seconds of wall time.

The cores are shared by processor sharing (Kleinrock 1967): a running compute span asks for
one core; when the asks exceed ``cores`` every span progresses at cores / asks of its speed. A
waiting thread asks for nothing, and neither does a call in flight: gloo's own work goes at the
same shared speed, its copies showing no cost of their own beside a step's compute.

On an emulated link (``links=True``) each rank's link is one more resource, as
:class:`labkit.Link` imposes it: a call takes its poster's link when posted (a collective both
sides, a message the sending side), once the calls posted before it are through, and a message
takes its receiver's receiving side when it arrives; so a pipeline's gradient sent after a
backward's buckets waits for all of them to leave. The link's time is a wait off the cores
(``labkit.Link`` sleeps it off).

With ``gloo_queue`` gloo's work and the link's time run on queues of their own, as
:mod:`labkit.comm.emulate` keeps them: gloo works through a group's calls in order (the next
begins once gloo has moved this one's bytes) while each call's link time waits only for its
members' links (their reservations); a call completes once both are done. Without it a call
holds its stream until its link time too is through.

With ``refetch`` a compute span that carries ``touches`` pays for what its rank's cache lost
since the rank last touched those bytes: bytes × (refetch(age) − what its own seconds paid),
the age on the wall clock (:mod:`labkit.plan.local.price`'s formula).

With ``wake`` a rank's first compute after it blocked at a :class:`Wait` pays wake(τ) more, τ
the time from blocking to going on (the host's own working set lost while its thread slept).

A message may be ``eager`` (a buffered send, as the pipeline schedules' model takes it): it
leaves on its sender's post alone, and the receiver takes it when it posts its receive.

Times keep the type of the programs' numbers: Fractions in, Fractions out (the zeros here are
integers), so a schedule's bubble comes out exact.

Events come out in labkit's schema (:mod:`labkit.analysis.events`), so metrics and timelines
read a simulated step as a measured one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EPS = 1e-12


@dataclass(frozen=True)
class Compute:
    seconds: float
    kind: str | None = None
    name: str = ""
    microbatch: int | None = None
    touches: tuple = ()
    """(key, bytes, seconds per byte already in ``seconds``) of what it reads and writes, for a
    ``refetch`` simulator: a byte the rank last touched long ago costs more (:class:`Sim`)."""


@dataclass(frozen=True)
class Issue:
    key: object
    group: tuple
    seconds: float
    kind: str                    # the comm kind drawn (allreduce, send, recv, ...)
    name: str = ""
    bytes: int = 0               # bytes this rank puts on the wire
    peer: int | None = None
    microbatch: int | None = None
    ordered: bool = True
    """In order on the rank's comm stream (collectives); False: matched by key alone, as
    point-to-point messages are matched by tag."""
    link: float = 0.0
    """The call's time on an emulated link (0: none), a wait off the cores: the call takes the
    longer of that and gloo's own ``seconds``."""
    tail: float = 0.0
    """Wall time after its link time before the call completes on this rank (its thread's
    wake-up), the stream and link already free for the next call: a replayed call's measured
    excess on that member (labkit.analysis.whatif); each member's Issue carries its own."""
    eager: bool = False
    """A message (``ordered=False``, group (sender, receiver)) that leaves on its sender's post
    alone; the receiver takes it when it posts (module docstring)."""


@dataclass(frozen=True)
class Wait:
    key: object


class Deadlock(RuntimeError):
    """Programs that cannot finish: ``stuck`` maps each unfinished rank to its program position."""

    def __init__(self, message: str, stuck: dict):
        super().__init__(message)
        self.stuck = stuck


@dataclass
class _Job:
    remaining: float              # work on the shared cores
    ask: float                    # the cores it asks for while that work remains
    start: float
    what: object                  # ("compute", rank, item), ("call", key) or ("tail", key, rank)
    until: float = 0.0            # a call's end on its emulated link: wall time, off the cores
    released: bool = False        # its stream freed for the next call (gloo_queue)


@dataclass
class Sim:
    """Run ``programs`` (one list of items per rank) on ``cores`` shared cores."""

    programs: list
    cores: float = 1.0
    links: bool = False
    gloo_queue: bool = False
    """On an emulated link, whether a collective frees its members' streams once gloo's own work
    is done, its link time then running on the link's own queue (module docstring)."""
    refetch: object = None
    """age seconds → seconds per byte a piece pays for a byte its rank last touched that long
    ago (a cache that loses what it does not use as the wall clock runs): a compute span with
    ``touches`` takes that much longer, less what its own ``seconds`` paid (its third field)."""
    touched: dict = field(default_factory=dict)
    """(rank, key) → when the rank last began a span touching it (before the step: negative);
    the run leaves each last touch here."""
    wake: object = None
    """idle seconds → seconds a rank's first compute after it blocked pays beyond a hot one."""
    events: list = field(default_factory=list)

    def run(self) -> list[dict]:
        n = len(self.programs)
        self.t, self.pc = 0, [0] * n
        self.busy = [None] * n                     # the compute job of each rank
        self.streams = [[] for _ in range(n)]      # posted, unfinished calls, in order
        self.posts, self.done, self.calls, self.loose = {}, set(), {}, {}
        self.waited, self.recorded = {}, {}       # (key, rank) → when it reached the Wait; its event
        self.left, self.arrived = set(), set()     # eager messages sent; (key, receiver) not yet received
        self.running: list[_Job] = []
        self.idle = {}                             # rank → when it blocked at a Wait (wake)
        self.tx, self.rx, self.reserved = [0.0] * n, [0.0] * n, {}    # each rank's link, busy until (links)
        while True:
            self._advance()
            self._start_ready()
            if not self.running:
                break
            self._step()
        stuck = {r: self.pc[r] for r in range(n) if self.pc[r] < len(self.programs[r])}
        if stuck:
            r = next(iter(stuck))
            raise Deadlock(f"simulate: deadlock, rank {r} waits at {self.programs[r][self.pc[r]]} "
                           f"(its stream holds {[c for c in self.streams[r]][:3]})", stuck)
        return self.events

    # -- the ranks' threads ------------------------------------------------------------------
    def _advance(self) -> None:
        moved = True
        while moved:
            moved = False
            for r, prog in enumerate(self.programs):
                while self.busy[r] is None and self.pc[r] < len(prog):
                    item = prog[self.pc[r]]
                    if isinstance(item, Compute):
                        seconds = item.seconds + self._refetched(item, r)
                        if r in self.idle:
                            since = self.idle.pop(r)
                            seconds += self.wake(self.t - since) if self.wake else 0
                        if seconds > EPS:
                            self.busy[r] = _Job(seconds, 1.0, self.t, ("compute", r, item))
                            self.running.append(self.busy[r])
                    elif isinstance(item, Issue):
                        self._reserve(item, r)
                        self.posts[(item.key, r)] = (self.t, item)
                        self.calls.setdefault(item.key, item)
                        if item.ordered:
                            self.streams[r].append(item.key)
                        elif (item.key, r) in self.arrived:      # an eager message already here
                            self.arrived.remove((item.key, r))
                            self._deliver(item.key, r)
                        elif item.key not in self.left:
                            self.loose.setdefault(item.key, set()).add(r)
                    elif isinstance(item, Wait):
                        self.waited.setdefault((item.key, r), self.t)
                        if (item.key, r) not in self.done:
                            self.idle.setdefault(r, self.t)
                            break
                        if (item.key, r) in self.recorded:         # where the rank consumed it
                            self.recorded.pop((item.key, r))["waited"] = self.waited[(item.key, r)]
                    self.pc[r] += 1
                    moved = True

    def _refetched(self, item: Compute, r: int) -> float:
        """Seconds ``item`` pays on rank r for what it touches that r's cache has lost since."""
        if self.refetch is None or not item.touches:
            return 0
        extra = 0.0
        for key, nbytes, paid in item.touches:
            last = self.touched.get((r, key))
            if last is not None:
                extra += nbytes * max(0.0, self.refetch(self.t - last) - paid)
            self.touched[(r, key)] = self.t
        return extra

    def _start_ready(self) -> None:
        """Start every call whose members have all posted it and hold it at their streams' head."""
        for key, posted in list(self.loose.items()):
            call = self.calls[key]
            if posted.issuperset(call.group) or (call.eager and call.group[0] in posted):
                del self.loose[key]
                if call.eager:
                    self.left.add(key)
                until = self.t + self._queue(key, call.link, call.group, False) + call.link
                self.running.append(_Job(call.seconds, 0.0, self.t, ("call", key), until))
        started = True
        while started:
            started = False
            for r in range(len(self.programs)):
                if not self.streams[r] or self.streams[r][0] is None:
                    continue
                key = self.streams[r][0]
                call = self.calls[key]
                group = call.group
                if all(self.streams[m] and self.streams[m][0] == key for m in group):
                    for m in group:
                        self.streams[m][0] = None          # in flight: the stream is busy
                    until = self.t + self._queue(key, call.link, group, True) + call.link
                    job = _Job(call.seconds, 0.0, self.t, ("call", key), until)
                    self.running.append(job)
                    started = True

    def _reserve(self, item: Issue, r: int) -> None:
        """Rank r posts ``item``: it takes r's link once the calls posted before are through (a
        collective both sides, a message its sender's sending side; ``links``)."""
        if not self.links or not (item.ordered or r == item.group[0]):
            return
        begin = max(self.t, self.tx[r], self.rx[r] if item.ordered else 0.0)
        self.tx[r] = begin + item.link
        if item.ordered:
            self.rx[r] = begin + item.link
        self.reserved[(item.key, r)] = begin

    def _queue(self, key, seconds: float, group, ordered: bool) -> float:
        """Seconds a call starting now waits for its links (module docstring): a collective for
        its members' reservations, a message for its sender's and its receiver's receiving side."""
        if not self.links:
            return 0
        if ordered:
            begin = max([self.t] + [self.reserved.pop((key, m)) for m in group])
            for m in group:
                self.tx[m], self.rx[m] = max(self.tx[m], begin + seconds), max(self.rx[m], begin + seconds)
        else:
            sender, receiver = group
            begin = max(self.t, self.reserved.pop((key, sender)), self.rx[receiver])
            self.rx[receiver] = begin + seconds
        return begin - self.t

    # -- time --------------------------------------------------------------------------------
    def _step(self) -> None:
        """Advance to the next end of a job's work or of a call's time on its link: the jobs with
        work left share the cores (each at most one), the links' waits run on the wall clock."""
        asks = sum(j.ask for j in self.running if j.remaining > 0)
        speed = 1 if asks <= self.cores else self.cores / asks
        dt = min((j.remaining if speed == 1 else j.remaining / speed) if j.remaining > 0
                 else max(0, j.until - self.t) for j in self.running)
        self.t += dt
        for j in self.running:
            if j.remaining > 0:
                left = j.remaining - dt * speed
                j.remaining = left if left > EPS * max(1.0, j.remaining) else 0.0
        if self.gloo_queue:
            for j in self.running:
                if j.what[0] == "call" and j.remaining <= 0 and not j.released:
                    self._release(j)
        finished = [j for j in self.running if j.remaining <= 0 and j.until <= self.t + EPS]
        self.running = [j for j in self.running if j not in finished]
        for j in finished:
            self._finish(j)

    def _finish(self, job: _Job) -> None:
        if job.what[0] == "compute":
            _, r, item = job.what
            self.busy[r] = None
            if item.kind is not None:
                self.events.append(_event(r, "compute", item.kind, item.name, item.microbatch, job.start, self.t))
            return
        key = job.what[1]
        members = self.calls[key].group if job.what[0] == "call" else (job.what[2],)
        if job.what[0] == "call" and not job.released:
            self._release(job)
        for m in members:
            if (key, m) not in self.posts:                 # an eager message before its receive
                self.arrived.add((key, m))
                continue
            if job.what[0] == "call" and self.posts[(key, m)][1].tail > 0:   # this member sees it a tail later
                self.running.append(_Job(0, 0, job.start, ("tail", key, m), self.t + self.posts[(key, m)][1].tail))
                continue
            self.done.add((key, m))
            posted, item = self.posts[(key, m)]
            if item.kind == "recv" and job.start > posted + EPS:      # a receive before its sender posted
                self.events.append(_event(m, "comm", "wait", item.name, item.microbatch, posted, job.start,
                                          peer=item.peer))
            group = item.group if item.ordered and len(item.group) > 1 else None
            # a collective's span runs from this member's post, as labkit.comm records one: a member
            # that came early shows its wait for the others inside the call
            begin = posted if item.ordered and item.kind not in ("send", "recv") else max(posted, job.start)
            event = _event(m, "comm", item.kind, item.name, item.microbatch, begin, self.t, item.bytes,
                           item.peer, group)
            if item.kind == "send" and job.start > posted + EPS:      # posted before its receiver was
                event["posted"] = posted
            if (key, m) in self.waited:
                event["waited"] = self.waited[(key, m)]
            else:
                self.recorded[(key, m)] = event
            self.events.append(event)

    def _release(self, job: _Job) -> None:
        """The call's stream free for the next call (its link already queued for it)."""
        job.released = True
        call = self.calls[job.what[1]]
        if call.ordered:
            for m in call.group:
                self.streams[m].pop(0)

    def _deliver(self, key, r: int) -> None:
        """Rank r posts the receive of an eager message that has arrived: it is done at once."""
        self.done.add((key, r))
        item = self.posts[(key, r)][1]
        self.recorded[(key, r)] = _event(r, "comm", item.kind, item.name, item.microbatch, self.t, self.t,
                                         item.bytes, item.peer)
        self.events.append(self.recorded[(key, r)])


def _event(rank, stream, kind, name, microbatch, start, end, nbytes=0, peer=None, group=None) -> dict:
    event = {"rank": rank, "stream": stream, "kind": kind, "name": name, "step": 0, "microbatch": microbatch,
             "start": start, "end": end, "bytes": int(nbytes), "peer": peer}
    if group is not None:                # a collective's members: the step graph joins them
        event["group"] = ",".join(str(r) for r in sorted(group))
    return event
