"""The planner's prices: what one counted op and one call cost on a measured machine.

A step is each rank's program (:mod:`labkit.plan.local.physical`) run through the simulator
(:mod:`labkit.analysis.des`); every piece of a program is priced here, from the
:class:`~labkit.plan.local.machine.Machine`'s measured numbers and nothing else.

**Compute.** An op (:class:`labkit.plan.local.work.Op`: its FLOPs F, bytes moved B of which C come
from beyond the cache), scaled by k (a tensor-parallel shard), takes one thread

    t = f · (k·F / R(k·F) + k·C / B_mem)                  a product (or attention)
    t = f · k·B / B_mem                                   anything else

with R the matmul table (FLOP/s by the product's FLOPs, interpolated in log FLOPs), B_mem the
memory's rate (``dram_Bps``: each engine's share of the bus, every engine streaming; a product's
arithmetic hides its operands' reads while they are in the cache, and streams those beyond it
too), and f the op's ``factor``: its piece of the step (a
block's forward, its backward, the loss, the optimizer) timed in sequence over the piece's
priced sum (:func:`labkit.plan.local.profile.timed`), so that a piece costs what it took and each
op its price's share. The table prices the ops one by one; in sequence a model's ops cost more
(a Linear reads its weight transposed, a slower kernel than a @ b; a module call and its hooks
run between them; each op's dispatch; GELU's arithmetic), which only the sequence itself
measures. A view (a transpose, a reshape) moves nothing and costs nothing of its own.

**Communication.** A call of ``family`` moving S bytes (nccl-tests' size) over n ranks costs
gloo's own work, the α-β of that family measured on the engines (α per ring step):

    t_gloo = steps(n)·α_f + bus(n)·S/β_f

(``steps``: n − 1 for a gather or scatter, 2(n − 1) for an all-reduce, 1 for a send; ``bus``:
the bytes each rank moves per byte of S). On an emulated link a collective first all-reduces
each member's start (a 16-byte stamp: ``labkit.comm``'s ``_join``, from which the link's
deadline follows), one more small call of gloo's ahead of the payload's:

    t_gloo += 2(n − 1)·α_all_reduce + 16·2(n − 1)/n / β_all_reduce        (not for a send)

and the call also waits off the cores for the link's α-β; it takes the longer of the two:

    t_call = max(t_gloo,  steps(n)·α_link + bus(n)·S/β_link)

Posting a call costs the issuing thread ``call_s``; posting a point-to-point message (a
pipeline's activation or gradient, a ring's block) ``message_s``, the post's wall time while
the peer computes: gloo posts a message in the caller's thread under the lock of the pair it
travels on, which gloo's device thread holds while it takes in the peer's messages, and with
the cores computing that thread waits for one (a collective's post only queues its work).

**What the cache lost while the rank waited.** A byte a rank last touched a time a ago costs a
piece beyond what it cost in the piece's own timing (whose age there was a₀):

    t_refetch = Σ_bytes max(0,  ρ(a) − ρ(a₀))

with ρ the machine's ``refetch`` table (seconds per byte by age, interpolated in log age): the
shared cache loses the bytes a rank is not using as the wall clock runs, not as the rank
computes, so a pipeline's backward after a wait for its gradient, or a step's first forward,
streams its weights in again. The ages come from the simulated step itself (its previous
step's touches for the first), a₀ from the pieces' timing in sequence
(:func:`labkit.plan.local.profile.timed`).

**What the host lost while the rank slept.** A rank's first compute after it blocked at a wait
for a time τ (from blocking to going on) pays once, whatever the piece:

    t_wake = W(τ)

with W the machine's ``wake`` table (seconds by idle time, interpolated in log τ, 0 below its
first row): the host's own code and objects, not the piece's bytes, went cold while its thread
slept. A pipeline pays it at every wait for a neighbour's message, a dp step at its last bucket.

**Shared cores.** The engines share ``cores`` cores by processor sharing: each running compute
span asks for one core (a transfer's own work, gloo's copies, showed no cost beside it on the
link); when the asks exceed the cores every one runs at cores/asks of its speed
(:class:`labkit.analysis.des.Sim` runs this).
"""
from __future__ import annotations

import math

from ..wire import AlphaBeta

STAMP_BYTES = 16
"""What a collective on an emulated link all-reduces ahead of its payload: [start, busiest bytes] in float64."""

VIEWS = frozenset(("detach", "view", "_unsafe_view", "t", "transpose", "expand", "alias", "as_strided", "unsqueeze",
                   "squeeze", "permute", "reshape", "slice", "select", "split", "lift_fresh", "unbind", "chunk"))
"""aten ops that make a view or take metadata: no arithmetic and no bytes."""


def rate(machine, flops: float) -> float:
    """R(F): FLOP/s of one thread on a product of ``flops``."""
    return interpolate(machine.matmul, flops)


def op_seconds(machine, op, k: float = 1.0) -> float:
    """t of one counted op, its work scaled by ``k`` (the module docstring's compute formula)."""
    if op.name in VIEWS:
        return 0.0
    flops, cold = op.flops * k, op.cold * k
    if flops:
        return op.factor * (flops / rate(machine, flops) + cold / machine.dram_Bps)
    return op.factor * op.bytes * k / machine.dram_Bps


def seconds(machine, ops, scale=lambda op: 1.0) -> float:
    """Seconds of a list of ops on one thread, each op's work scaled by ``scale(op)``."""
    return sum(op_seconds(machine, op, scale(op)) for op in ops)


def comm_parts(machine, family: str, nbytes: float, n: int, gloo: float | None = None) -> tuple[float, float]:
    """(t_gloo, the link's wait or 0) of one call (the module docstring's communication
    formula); ``gloo``: gloo's seconds given rather than its α-β's. gloo's part is work on the
    cores, the link's a wait off them (``labkit.Link`` sleeps it off)."""
    own = machine.comm[family].seconds(family, nbytes, n) if gloo is None else gloo
    if not machine.link_alpha_beta:
        return own, 0.0
    if family != "send":        # the link's stamp: every member's start, all-reduced ahead of the payload
        own += machine.comm["all_reduce"].seconds("all_reduce", STAMP_BYTES, n)
    alpha, beta = machine.link_alpha_beta
    return own, AlphaBeta(alpha=alpha, beta=beta, per_step=True).seconds(family, nbytes, n)


def comm_seconds(machine, family: str, nbytes: float, n: int, gloo: float | None = None) -> float:
    """t_call: the longer of the call's two parts."""
    return max(comm_parts(machine, family, nbytes, n, gloo))


def refetch(machine, age: float) -> float:
    """ρ(a): seconds per byte a piece pays for a byte last touched ``age`` seconds ago."""
    rows = machine.refetch
    return interpolate(rows, age) if rows and age > 0 else 0.0


def wake(machine, idle: float) -> float:
    """W(τ): seconds a rank's first compute after ``idle`` seconds blocked pays."""
    rows = machine.wake
    return interpolate(rows, idle) if rows and idle > rows[0][0] else 0.0


def simulator(programs, machine, touched=None):
    """The simulator on ``machine``'s shared cores (the module docstring's last paragraph), each
    posted call preceded by its host cost on the issuing thread."""
    from ...analysis.des import Compute, Issue, Sim
    message = machine.message_s or machine.call_s
    posted = [[y for x in prog for y in ((Compute(machine.call_s if x.ordered else message), x)
                                          if isinstance(x, Issue) else (x,))]
              for prog in programs]
    return Sim(posted, machine.cores, links=bool(machine.link_alpha_beta),
               refetch=(lambda age: refetch(machine, age)) if machine.refetch else None, touched=touched or {},
               wake=(lambda idle: wake(machine, idle)) if machine.wake else None)


def step_events(programs, machine) -> list[dict]:
    """One steady step's events: the step run twice, the second's ages of what each rank
    touches measured from the first's last touches (a step follows a step)."""
    first = simulator(programs, machine)
    events = first.run()
    if not machine.refetch:
        return events
    length = max((e["end"] for e in events), default=0.0)
    return simulator(programs, machine, {k: t - length for k, t in first.touched.items()}).run()


def interpolate(rows, x: float) -> float:
    """The value of (x, y) ``rows`` at ``x``, linear in log x between rows, flat beyond them."""
    rows = sorted(rows)
    if x <= rows[0][0]:
        return rows[0][1]
    for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return rows[-1][1]
