"""The engine's side of an emulated link (:class:`labkit.Link`): when each call may complete.

Each rank's link has a "busy until" clock per tier (inside a node, between nodes) and per
direction (sending, receiving), on ``time.perf_counter`` (system-wide: the ranks of one host
read one clock). A call is given a deadline when it is issued; its handle completes no
earlier, and the wait beyond gloo's real transfer is a sleep or a timer, off the CPU, as a NIC
or a copy engine would leave the compute free.

* A collective occupies both directions of its tier for its α-β time (:meth:`Link.seconds`)
  from the moment the last member's link is free for it: each rank's own start, max(issue,
  link free), travels in a small all-reduce (MAX) posted just before the payload, so a rank
  that issues early waits for a late one, as on a real link. Calls issued back to back
  queue, as on one NCCL stream. An all-to-all's members may send and receive unequal bytes
  (expert parallelism's routed tokens): the same MAX carries each rank's busier direction,
  and the exchange takes as long as the busiest rank's bytes, on every member.
* A message leaves when the sender's link is free and occupies it for α + S/β; it arrives
  once the receiver's link is free as well, and occupies that as long. The sender's departure
  time travels ahead of the payload (one float64 message), so n-1 messages arriving at one
  rank at once take (n-1)·(α + S/β) to arrive: the receiver's inbound side is shared by them
  (incast), as the sender's outbound side is by the messages it sends. The sender's call
  completes when its message has left (its side; a parameter server's workers finish their
  push before the server has taken in all of them).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import time


INBOUND_KEPT = 256
"""Busy stretches of a receiving side remembered (a step's messages, many times over)."""


class LinkClock:
    """This rank's link: deadlines for the calls it issues, and when each direction is free."""

    def __init__(self, link, rank: int):
        self.link, self.rank = link, rank
        self.free: dict[tuple[str, str], float] = {}     # (tier, "tx" | "rx") → busy until
        self.inbound: dict[str, list] = {}     # tier → the receiving side's busy (start, end), by start
        self._lock = threading.Lock()     # calls come from the main thread and autograd's

    def collective(self, op: str, nbytes: int, ranks: list[int], now: float) -> tuple[str, float, float]:
        """(tier, this rank's start, seconds) of a collective of ``nbytes`` over ``ranks`` issued
        at ``now``; the link is held from this rank's start until :meth:`joined` knows better."""
        tier = self.link.tier(ranks)
        cost = self.link.seconds(op, nbytes, len(ranks), tier, self.link.nics(ranks))
        with self._lock:
            start = max(now, self.free.get((tier, "tx"), 0.0), self.free.get((tier, "rx"), 0.0))
            self.free[(tier, "tx")] = self.free[(tier, "rx")] = start + cost
            self._hold_inbound(tier, start, start + cost)
        return tier, start, cost

    def exchange_seconds(self, busiest: float, n: int, tier: str) -> float:
        """An all-to-all's time when its busiest rank sends or receives ``busiest`` bytes:
        (n-1)·α + busiest/β (pairwise exchange; that rank's link is the bottleneck)."""
        alpha, beta = self.link.alpha_beta(tier)
        return (n - 1) * alpha + busiest / beta if n > 1 else 0.0

    def joined(self, tier: str, start: float, cost: float) -> float:
        """The deadline of a collective whose last member was ready at ``start``."""
        with self._lock:
            for side in ("tx", "rx"):
                self.free[(tier, side)] = max(self.free.get((tier, side), 0.0), start + cost)
            self._hold_inbound(tier, start, start + cost)
        return start + cost

    def depart(self, dst: int, nbytes: int, now: float) -> tuple[float, float]:
        """(departure, deadline) of a message to ``dst`` issued at ``now``: it leaves when the
        sending side is free and holds it for α + S/β."""
        tier = self.link.tier([self.rank, dst])
        with self._lock:
            start = max(now, self.free.get((tier, "tx"), 0.0))
            end = self.free[(tier, "tx")] = start + self.link.seconds("send", nbytes, 2, tier)
        return start, end

    def arrive(self, src: int, nbytes: int, departed: float) -> float:
        """The deadline of a message from ``src`` that left at ``departed``: the receiving side
        takes it in its first free stretch of α + S/β from then (cut-through: it cannot end
        before it was sent). Messages arriving at once take it one after another; one that
        left earlier than a message this rank waited for first still takes its own time."""
        tier = self.link.tier([self.rank, src])
        cost = self.link.seconds("send", nbytes, 2, tier)
        with self._lock:
            start = departed
            for b0, b1 in self.inbound.get(tier, ()):      # by start: step past each overlap
                if b0 >= start + cost:
                    break
                start = max(start, b1)
            self._hold_inbound(tier, start, start + cost)
            self.free[(tier, "rx")] = max(self.free.get((tier, "rx"), 0.0), start + cost)
        return start + cost

    def _hold_inbound(self, tier: str, start: float, end: float) -> None:
        """Mark the receiving side of ``tier`` busy from ``start`` to ``end`` (the latest
        INBOUND_KEPT stretches are kept: a message never left so long ago)."""
        busy = self.inbound.setdefault(tier, [])
        bisect.insort(busy, (start, end))
        if len(busy) > INBOUND_KEPT:
            del busy[0]


class Joined:
    """A collective's deadline, known once every member's start has arrived (``stamp``, reduced
    with MAX by ``work``, which completes before the payload's call on the same group).

    ``stamp`` is [start, busiest bytes]: the second is an all-to-all's busier direction per
    rank (0 for the other collectives, whose members all move the same bytes), so after the
    MAX it is the busiest member's and prices the exchange (:meth:`LinkClock.exchange_seconds`)."""

    def __init__(self, clock: LinkClock, work, stamp, tier: str, cost: float, n: int = 0):
        self.clock, self.work, self.stamp, self.tier, self.cost, self.n = clock, work, stamp, tier, cost, n
        self.deadline = None

    def __call__(self) -> float:
        if self.deadline is None:
            self.work.wait()
            start, busiest = float(self.stamp[0]), float(self.stamp[1])
            cost = self.clock.exchange_seconds(busiest, self.n, self.tier) if busiest > 0 else self.cost
            self.deadline = self.clock.joined(self.tier, start, cost)
        return self.deadline


def hold_until(deadline: float) -> None:
    """Sleep until ``deadline`` (perf_counter): the core is free meanwhile, as beside a NIC."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class Timer:
    """One thread that runs callbacks at given times (the futures a DDP comm hook returns
    complete through it, so no compute thread blocks for the link)."""

    def __init__(self):
        self._heap: list = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        threading.Thread(target=self._run, daemon=True, name="labkit-link").start()

    def at(self, when: float, fn) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                when, _, fn = self._heap[0]
                delay = when - time.perf_counter()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
            try:
                fn()
            except Exception:        # a callback settles its own future; never end the thread
                pass


_timer: Timer | None = None
_timer_lock = threading.Lock()


def timer() -> Timer:
    """This process's timer thread (started on first use)."""
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = Timer()
    return _timer
