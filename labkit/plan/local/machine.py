"""The machine the lab's engines run on, as a handful of measured physical numbers.

In the shape of Calculon's system description (a compute rate by size, per network α and β)
and ASTRA-sim's: a :class:`Machine` is what :func:`labkit.plan.local.measure.measure` finds with its
own micro-benchmarks on the engines, with no model and no strategy; :func:`labkit.plan.simulate`
prices any model's counted operations (:mod:`labkit.plan.local.work`) with it, by the formulas of
:mod:`labkit.plan.local.price`, the model's own pieces timed in sequence sharing out what they took
(:func:`labkit.plan.local.profile.profile`). Six fields: the cores, the matmul curve, the memory
hierarchy, the host's costs, the α-β per family, and what it was measured on.

    >>> machine = labkit.plan.measure(lab)
    >>> machine.save("machine.json"); machine = labkit.plan.Machine.load("machine.json")
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from . import price
from ..wire import AlphaBeta

FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "send")
DELETED = ("cold_Bps", "attention_Fps", "step_s", "comm_load", "sleep_s", "view_s", "link", "matmul_half_dim", "wake_s",
           "cross_s", "join_s", "elementwise", "setup_s", "op_s", "memory_Bps")
"""Fields earlier machines had, dropped when the held-out cases on the emulated link priced as
well without them (bench_plan.py's ablation, or its rounds' runs priced again: docs/design.md),
or, as step_s, a residual of the simulator rather than a measurement."""


def _link(value) -> AlphaBeta:
    """A family's AlphaBeta: itself, a saved one's dict, or an (α seconds per ring step, β bytes/s) pair."""
    if isinstance(value, AlphaBeta):
        return value
    if isinstance(value, dict):
        return AlphaBeta(**value)
    alpha, beta = value
    return AlphaBeta(alpha=alpha, beta=beta, per_step=True)


@dataclass(frozen=True, kw_only=True)
class Memory:
    """One engine's memory hierarchy: a cache and the memory bus beyond it."""

    cache_bytes: float = float("inf")
    """Bytes the cores keep close: an op's operands beyond them come from memory (each op's
    ``cold`` bytes, :func:`labkit.plan.local.work.warm`, least recently used out first). Measured:
    products going round N weights of 1 MiB; the largest N whose product stays nearer its
    in-cache time than its cold one."""
    dram_Bps: float = 5e9
    """Bytes per second an op streams, reads plus writes, each engine's share of the memory bus
    while every engine streams (a step runs on all engines at once): an elementwise op's bytes,
    a product's operands beyond the cache. Measured: add_ on 64 MiB tensors on every engine at
    once, the median."""
    refetch: tuple = ()
    """(age seconds, seconds per byte) rows, ascending: what a piece pays for a byte its rank
    last touched ``age`` ago, beyond a byte touched a moment ago. The cache loses what a rank
    does not use as the wall clock runs (a cache shared with the host's other work), whatever
    the rank computes meanwhile. Measured: a product over 1 MiB of weight (within the cache, so
    hot back to back), each pass after a sleep, at sleeps from 0.5 to 100 ms; per byte, the
    median pass's time beyond back-to-back passes', by the time between the passes' starts.
    () prices none."""

    def __post_init__(self):
        object.__setattr__(self, "refetch", tuple(tuple(r) for r in self.refetch))      # a file's lists too


@dataclass(frozen=True, kw_only=True)
class Host:
    """Seconds the host adds outside the model's pieces (whose own dispatch their timing holds)."""

    action_s: float = 1e-4
    """Per action of the executor (a forward or backward of a micro-batch: hooks, recording).
    Measured: a trivial model's step at 8 micro-batches against 1, per extra action, less the
    host and arithmetic of the ops those actions counted."""
    wake: tuple = ()
    """(idle seconds, seconds) rows, ascending: what a rank's first compute after it waited that
    long pays beyond a hot one. While a rank's thread sleeps in a wait, whatever else runs on its
    core takes the caches and the branch predictors the host's own code and objects were in (the
    interpreter's, the dispatcher's, autograd's); the rank's next piece fetches them again, a
    cost per wake-up, not per byte of the piece. Measured: a tiny MLP's forward and backward
    (width 8, one row: host work, arithmetic nil) after sleeps from 0.1 to 50 ms; by the median
    idle, the median pass's time beyond back-to-back passes'. () prices none."""
    call_s: float = 0.0
    """Per labkit.comm call posted (bookkeeping, gloo's post; on an emulated link the departure
    stamp too). Measured: the thread's CPU time around posting a 32 KiB isend and irecv."""
    message_s: float = 0.0
    """Per point-to-point message posted (an isend or irecv) while the peer computes: the post's
    wall time on the issuing thread. gloo posts a message in the caller's thread under its
    pair's lock, which gloo's device thread holds while it takes in the peer's messages and
    answers them; with every core computing that thread waits for a core, and so does the post
    (a collective's post only queues work for gloo's own threads). Measured: ranks 0 and 1 each
    post a 32 KiB irecv, compute 1 ms, post the isend, 200 times; the mean post. 0: as any
    call (``call_s``)."""

    def __post_init__(self):
        object.__setattr__(self, "wake", tuple(tuple(r) for r in self.wake))      # a file's lists too


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What the machine was measured on: not physics, but what prices its calls."""

    engines: int = 1
    """Engines the measurement ran on."""
    link: tuple = ()
    """(α seconds per message, β bytes/s per rank) of the emulated link the lab ran on, as it
    imposes them (() for gloo as it is): a call takes the link's time or gloo's own (``comm``;
    a collective's with the 16-byte all-reduce that joins it on the link), whichever is longer
    (labkit.Link, :func:`labkit.plan.local.price.comm_parts`)."""


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What one step costs on this machine; every field a physical quantity, measured alone."""

    cores: float
    """Cores the engines' threads share (may be fractional on a loaded host). Measured: a product
    on every engine at once against one engine alone, five pairs back to back, the median (at
    most the engines and the CPUs they may run on). The simulator shares them among runnable
    threads."""
    matmul: tuple = ((1e6, 1e9),)
    """(FLOPs of one product, FLOP/s of one thread) rows, ascending, interpolated in log FLOPs.
    Measured: float32 matmuls of a few sizes on one engine alone (median of five runs)."""
    memory: Memory = Memory()
    """The cache, the memory bus's rate and what the cache loses by age (:class:`Memory`)."""
    host: Host = Host()
    """Host seconds per action, per wake-up after a wait, per posted call and per posted message
    (:class:`Host`)."""
    comm: dict = field(default_factory=lambda: {f: AlphaBeta(alpha=50e-6, beta=1e9, per_step=True) for f in FAMILIES})
    """family → :class:`~labkit.plan.wire.AlphaBeta` with α per ring step (gloo sends each
    step as a message) and β bytes/s per rank. Measured: each family at four sizes on every
    engine (a send as half a ping-pong's round trip), gloo's own even on an emulated link."""
    measured: Measured = Measured()
    """The engines and the emulated link it was measured on (:class:`Measured`)."""

    def __post_init__(self):
        if not self.engines >= 1:
            raise ValueError(f"Machine.engines={self.engines!r} must be >= 1")
        if not self.cores > 0:
            raise ValueError(f"Machine.cores={self.cores!r} must be > 0")
        if not self.matmul or any(len(r) != 2 or r[1] <= 0 for r in self.matmul):
            raise ValueError("Machine.matmul must be (FLOPs, FLOP/s > 0) rows")
        object.__setattr__(self, "matmul", tuple(tuple(r) for r in self.matmul))
        missing = [f for f in FAMILIES if f not in self.comm]
        if missing:
            raise ValueError(f"Machine.comm lacks {missing}; give an AlphaBeta (or α seconds, β bytes/s) for each of "
                             f"{FAMILIES}")
        object.__setattr__(self, "comm", {f: _link(v) for f, v in self.comm.items()})

    @classmethod
    def of(cls, **numbers) -> "Machine":
        """A Machine from its numbers by their own names (``dram_Bps=``, ``call_s=``, ``engines=``,
        ``link_alpha_beta=`` …), as :func:`~labkit.plan.local.measure.measure` finds them and a file keeps them."""
        records = {}
        for name, record in (("memory", Memory), ("host", Host), ("measured", Measured)):
            own = {f.name: numbers.pop(f.name) for f in fields(record) if f.name in numbers}
            if name == "measured" and "link_alpha_beta" in numbers:
                own["link"] = tuple(numbers.pop("link_alpha_beta"))
            records[name] = record(**own)
        return cls(**numbers, **records)

    def numbers(self) -> dict:
        """Every number by its own name, the records unpacked (what :meth:`save` writes)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("memory", "host", "measured")}
        out.update(asdict(self.memory), **asdict(self.host), engines=self.engines, link_alpha_beta=self.link_alpha_beta)
        out["comm"] = {f: asdict(ab) for f, ab in self.comm.items()}
        return out

    # -- the records' numbers by their own names ---------------------------------------------
    cache_bytes = property(lambda self: self.memory.cache_bytes)
    dram_Bps = property(lambda self: self.memory.dram_Bps)
    refetch = property(lambda self: self.memory.refetch)
    action_s = property(lambda self: self.host.action_s)
    wake = property(lambda self: self.host.wake)
    call_s = property(lambda self: self.host.call_s)
    message_s = property(lambda self: self.host.message_s)
    engines = property(lambda self: self.measured.engines)
    link_alpha_beta = property(lambda self: self.measured.link)

    # -- prices: labkit.plan.local.price's formulas on this machine ---------------------------------
    def rate(self, flops: float) -> float:
        return price.rate(self, flops)

    def op_seconds(self, op, k: float = 1.0) -> float:
        return price.op_seconds(self, op, k)

    def seconds(self, ops, scale=lambda op: 1.0) -> float:
        return price.seconds(self, ops, scale)

    def comm_s(self, family: str, nbytes: float, n: int, gloo: float | None = None) -> float:
        return price.comm_seconds(self, family, nbytes, n, gloo)

    def comm_parts(self, family: str, nbytes: float, n: int, gloo: float | None = None) -> tuple[float, float]:
        return price.comm_parts(self, family, nbytes, n, gloo)

    # -- files -------------------------------------------------------------------------------
    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.numbers(), f, indent=1)

    @classmethod
    def load(cls, path) -> "Machine":
        with open(path) as f:
            d = json.load(f)
        gone = sorted(set(d) & set(DELETED))
        if gone:
            raise ValueError(f"{path} was measured by an earlier labkit: {gone} are no longer part of a Machine "
                             "(they did not make the planner's held-out predictions better); measure it again with "
                             "labkit.plan.measure(lab)")
        return cls.of(**d)

    def __str__(self) -> str:
        rows = ", ".join(f"{f:.0e} FLOP: {r / 1e9:.1f} GFLOP/s" for f, r in self.matmul)
        comm = "; ".join(f"{k} α {c.alpha * 1e6:.0f} µs{' a step' if c.per_step else ''} β {c.beta / 1e9:.2f} GB/s"
                         for k, c in self.comm.items())
        refetch = (f", {self.refetch[-1][1] * 1e9:.2f} ns/B again for a byte untouched "
                   f"{self.refetch[-1][0] * 1e3:.0f} ms" if self.refetch else "")
        wake = (f", {self.wake[-1][1] * 1e6:.0f} µs a wake-up after {self.wake[-1][0] * 1e3:.0f} ms idle"
                if self.wake else "")
        link = (f"; link α {self.link_alpha_beta[0] * 1e6:.0f} µs β {self.link_alpha_beta[1] / 1e6:.0f} MB/s"
                if self.link_alpha_beta else "")
        return (f"Machine({self.engines} engines on {self.cores:.2f} cores; matmul {rows}; "
                f"a cache of {self.cache_bytes / 2 ** 20:.0f} MiB, memory {self.dram_Bps / 1e9:.1f} GB/s{refetch}; host "
                f"{self.action_s * 1e6:.0f} µs/action{wake}, {self.call_s * 1e6:.0f} "
                f"µs/call, {self.message_s * 1e6:.0f} µs/message; {comm}{link})")
