"""The machine the lab's engines run on, as a handful of measured physical numbers.

In the shape of Calculon's system description (compute rate with a size → efficiency table,
per network α, β and how much compute a transfer takes) and ASTRA-sim's: a :class:`Machine`
is what :func:`measure` finds with its own micro-benchmarks on the engines (square-ish
matmuls of a few sizes, an elementwise loop, tiny autograd ops, collectives of a few sizes, a
step of a trivial model at two micro-batch counts). It takes no model and runs no strategy
the planner predicts; :func:`labkit.plan.simulate` prices any model's counted operations
(:mod:`labkit.plan.work`) with it. With an emulated link (``lab.link``) the link's α and β
are the machine's, as the link imposes them.

    >>> machine = labkit.plan.measure(lab)
    >>> machine.save("machine.json"); machine = labkit.plan.Machine.load("machine.json")
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "send")


def ring_steps(family: str, n: int) -> int:
    """Messages each rank sends, one after another, in the ring algorithm of ``family`` on n ranks."""
    return 1 if family == "send" else (2 * (n - 1) if family == "all_reduce" else n - 1)


def bus_factor(family: str, n: int) -> float:
    """Bytes each rank sends per byte of the call (nccl-tests' bus factor)."""
    return 1.0 if family == "send" else (2 * (n - 1) / n if family == "all_reduce" else (n - 1) / n)


@dataclass(frozen=True)
class Machine:
    """What one step costs on this machine; every field a physical quantity, measured alone."""

    cores: float
    """Cores the engines' threads share (may be fractional on a loaded host): how many engines
    multiplying at once keep each one's alone rate. Measured: matmuls on every engine at once
    against one engine alone. The simulator shares them among runnable threads."""
    matmul: tuple = ((1e6, 1e9),)
    """(FLOPs of one product, FLOP/s of one thread) rows, ascending: the rate of a product is
    interpolated in log FLOPs. Measured: float32 matmuls of a few sizes on one engine alone."""
    memory_Bps: float = 5e9
    """Bytes per second one thread reads plus writes in an elementwise op. Measured: add_ on
    4 MiB tensors, one engine alone."""
    op_s: float = 5e-6
    """Host seconds per aten op (dispatch, autograd bookkeeping). Measured: forward and backward
    of a chain of one-element ops, divided by the ops counted."""
    action_s: float = 1e-4
    """Host seconds the executor adds per action (a forward or backward of a micro-batch):
    hooks, recording, Python. Measured: a trivial model's step at 1 and 8 micro-batches."""
    step_s: float = 1e-3
    """Host seconds per step outside the actions (barrier, zero_grad, bookkeeping). Same run."""
    comm: dict = field(default_factory=lambda: {f: (50e-6, 1e9) for f in FAMILIES})
    """family → (α seconds per ring step, β bytes/s per rank): a call of S bytes on n ranks
    takes steps(n)·α + bus(n)·S/β. Measured: labkit.bench.comm_sweep on every engine, or the
    emulated link's latency and bandwidth when the lab has one."""
    comm_load: float = 0.5
    """Cores one rank's transfer keeps busy while in flight (gloo copies and reduces on the
    CPU); 0 on a machine whose links run beside compute. Measured: matmuls while an all-reduce
    runs beside them on every engine, against without."""
    engines: int = 1
    """Engines the measurement ran on."""
    link: str = ""
    """The emulated link the comm figures came from ("" for gloo as it is)."""

    def __post_init__(self):
        if not self.cores > 0:
            raise ValueError(f"Machine.cores={self.cores!r} must be > 0")
        if not self.matmul or any(len(r) != 2 or r[1] <= 0 for r in self.matmul):
            raise ValueError("Machine.matmul must be (FLOPs, FLOP/s > 0) rows")
        missing = [f for f in FAMILIES if f not in self.comm]
        if missing:
            raise ValueError(f"Machine.comm lacks {missing}; give (α seconds, β bytes/s) for each of {FAMILIES}")

    # -- prices ------------------------------------------------------------------------------
    def rate(self, flops: float) -> float:
        """FLOP/s of one thread on a product of ``flops``: the table, interpolated in log size."""
        rows = sorted(self.matmul)
        if flops <= rows[0][0]:
            return rows[0][1]
        if flops >= rows[-1][0]:
            return rows[-1][1]
        for (f0, r0), (f1, r1) in zip(rows, rows[1:]):
            if flops <= f1:
                w = math.log(flops / f0) / math.log(f1 / f0)
                return r0 + w * (r1 - r0)
        return rows[-1][1]

    def op_seconds(self, op) -> float:
        """One thread's seconds for one counted op (:class:`labkit.plan.work.Op`)."""
        body = op.flops / self.rate(op.flops) if op.flops else op.bytes / self.memory_Bps
        return self.op_s + body

    def seconds(self, ops, scale=lambda op: 1.0) -> float:
        """Seconds of a list of ops, each op's FLOPs and bytes scaled by ``scale(op)``."""
        total = 0.0
        for op in ops:
            k = scale(op)
            body = op.flops * k / self.rate(op.flops * k) if op.flops else op.bytes * k / self.memory_Bps
            total += self.op_s + body
        return total

    def comm_s(self, family: str, nbytes: float, n: int) -> float:
        """Seconds of one call of ``family`` moving ``nbytes`` (nccl-tests' size) over ``n`` ranks."""
        if family != "send" and n <= 1:
            return 0.0
        alpha, beta = self.comm[family]
        return ring_steps(family, n) * alpha + bus_factor(family, n) * nbytes / beta

    # -- files -------------------------------------------------------------------------------
    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path) -> "Machine":
        with open(path) as f:
            d = json.load(f)
        d["matmul"] = tuple(tuple(r) for r in d["matmul"])
        d["comm"] = {k: tuple(v) for k, v in d["comm"].items()}
        return cls(**d)

    def __str__(self) -> str:
        rows = ", ".join(f"{f:.0e} FLOP: {r / 1e9:.1f} GFLOP/s" for f, r in self.matmul)
        comm = "; ".join(f"{k} α {a * 1e6:.0f} µs β {b / 1e9:.2f} GB/s" for k, (a, b) in self.comm.items())
        return (f"Machine({self.engines} engines on {self.cores:.2f} cores; matmul {rows}; memory "
                f"{self.memory_Bps / 1e9:.1f} GB/s; host {self.op_s * 1e6:.1f} µs/op, {self.action_s * 1e6:.0f} µs/action, "
                f"{self.step_s * 1e3:.2f} ms/step; {comm}; a transfer takes {self.comm_load:.2f} core"
                + (f"; link {self.link}" if self.link else "") + ")")


# -- micro-benchmarks, run on the engines ----------------------------------------------------
MATMUL_SHAPES = ((16, 128, 128), (64, 256, 256), (64, 512, 512), (128, 1024, 1024), (256, 1024, 2048))


def _loop(fn, seconds: float, chunks: int = 5) -> float:
    """Seconds per call of ``fn``: the best of ``chunks`` timed runs over ~``seconds`` in all
    (timeit's rule: on a shared host the fastest run is the one least disturbed)."""
    import time
    fn()
    best = math.inf
    for _ in range(chunks):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / chunks or n < 2:
            fn()
            n += 1
        best = min(best, elapsed / n)
    return best


def _alone(seconds: float, rank_only: int | None = 0):
    """On one engine (the others return at once): matmul table, memory rate, op host cost."""
    import torch
    import torch.distributed as dist

    if rank_only is not None and dist.get_rank() != rank_only:
        return None
    table = []
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        table.append((2.0 * m * k * n, 2.0 * m * k * n / _loop(lambda: a @ b, seconds)))
    x, y = torch.zeros(1 << 20), torch.zeros(1 << 20)
    memory = 3 * x.numel() * 4 / _loop(lambda: x.add_(y), seconds)
    w = torch.ones(1, requires_grad=True)

    def chain():
        h = w
        for _ in range(20):
            h = h * 1.0001 + 0.0
        h.sum().backward()
    from .work import _Counter
    counter = _Counter()
    with counter:
        chain()
    return table, memory, _loop(chain, seconds) / len(counter.sink)


def _together(seconds: float, with_comm: bool):
    """On every engine at once: a 64×512×512 product's rate, with an all-reduce beside it or not."""
    import time

    import torch
    import torch.distributed as dist

    a, b = torch.randn(64, 512), torch.randn(512, 512)
    dist.barrier()
    if not with_comm:
        return 2.0 * 64 * 512 * 512 / _loop(lambda: a @ b, seconds, chunks=1)
    buf = torch.zeros(1 << 18)          # 1 MiB: a bucket's size
    rounds = max(4, int(seconds / 2e-3))     # a fixed count: every rank issues the same calls
    t0, n = time.perf_counter(), 0
    for _ in range(rounds):
        work = dist.all_reduce(buf, async_op=True)
        while not work.is_completed():
            a @ b
            n += 1
        work.wait()
    rate = 2.0 * 64 * 512 * 512 * n / (time.perf_counter() - t0)
    dist.barrier()
    return rate


COMM_SIZES = (1 << 14, 1 << 18, 1 << 21)


def _comm(seconds: float):
    """On every engine: best seconds per call of each family at each of COMM_SIZES (labkit.comm's
    calls, recording off), the slowest rank's."""
    import time

    import torch.distributed as dist

    from ..bench import _operation
    from ..engine import session

    n, me = dist.get_world_size(), dist.get_rank()
    rec = session().recorder
    was, rec.enabled = rec.enabled, False
    out = {}
    try:
        for family in FAMILIES:
            for nbytes in COMM_SIZES:
                call, _ = _operation("sendrecv" if family == "send" else family, "torch", nbytes, n, me)
                call()
                best = math.inf
                for _ in range(5):
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        call()
                    best = min(best, (time.perf_counter() - t0) / 3)
                out[(family, nbytes)] = best
    finally:
        rec.enabled = was
    return out


def _fit(family: str, n: int, times: dict) -> tuple[float, float]:
    """(α per ring step, β) by least squares on t = steps·α + bus·S/β, relative errors."""
    rows = [(ring_steps(family, n), bus_factor(family, n) * s, t) for (f, s), t in times.items() if f == family]
    import numpy as np
    a = np.array([[k / t, x / t] for k, x, t in rows])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    alpha, inv_beta = float(coef[0]), float(coef[1])
    if alpha < 0:
        alpha, inv_beta = 0.0, float(sum(t * x for _, x, t in rows) / sum(x * x for _, x, _ in rows))
    if inv_beta <= 0:
        alpha, inv_beta = float(min(t / k for k, _, t in rows)), 1e-12
    return alpha, 1.0 / inv_beta


def measure(lab, seconds: float = 0.2) -> Machine:
    """Measure this lab's :class:`Machine` (some seconds; no model, no strategy)."""
    world = lab.world_size
    table, memory, op_s = next(r for r in lab.apply(_alone, seconds) if r is not None)
    together = lab.apply(_together, seconds, False)
    cores = max(0.25, min(float(world), sum(together) / table[2][1]))    # engines' worth of one alone
    comm, link_name, load = {f: (0.0, 1e12) for f in FAMILIES}, "", 0.0
    if world > 1:
        link = getattr(lab, "link", None)
        if link is not None:
            alpha, beta = link.alpha_beta("intra")
            comm = {f: (alpha, beta) for f in FAMILIES}
            link_name = str(link)
        else:
            per_rank = lab.apply(_comm, seconds)
            times = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            comm = {f: _fit(f, world, times) for f in FAMILIES}
        beside = sum(lab.apply(_together, seconds, True))
        # each engine's compute thread plus a transfer of load c: world·(1+c) asks on the cores
        if beside < sum(together):
            load = max(0.0, min(1.0, sum(together) / beside * min(world, cores) / world - 1))
    machine = Machine(cores, tuple(table), memory, op_s, comm=comm, comm_load=load, engines=world, link=link_name)
    action_s, step_s = _host_costs(lab, machine)
    from dataclasses import replace
    return replace(machine, action_s=action_s, step_s=step_s)


def _host_costs(lab, machine: Machine) -> tuple[float, float]:
    """The executor's host seconds per action and per step: a trivial model (one Linear of width
    8) run at 1 and 8 micro-batches, against the simulator's price of its ops alone."""
    from dataclasses import replace

    from ..config import Strategy
    from ..models import mlp
    from .physical import simulate

    model, world = mlp(width=8, depth=2), lab.world_size
    bare = replace(machine, action_s=0.0, step_s=0.0)
    measured, simulated = [], []
    for m in (1, 8):
        s = Strategy(dp=world, microbatches=m, dp_mode="bucketed") if world > 1 else Strategy(microbatches=m)
        measured.append(lab.run(s, model=model, batch=8 * world, steps=12, record=True).metrics["step_time_s"])
        simulated.append(simulate(s, bare, model=model, batch=8 * world).metrics["step_time_s"])
    slow = max(1.0, world / machine.cores)            # the engines share the cores
    action_s = max(0.0, (measured[1] - measured[0]) - (simulated[1] - simulated[0])) / (2 * 7 * slow)
    step_s = max(0.0, measured[0] - simulated[0] - 2 * action_s * slow) / slow
    return action_s, step_s
