"""Measure a :class:`~labkit.plan.machine.Machine` on the lab's engines: its own micro-benchmarks.

Each number is the median of a few timed runs: matmuls of a
few sizes and an elementwise loop on one engine while the others wait; tiny autograd ops for
the host cost per op; the same product on every engine at once for the cores they share; the
four families of collectives at three sizes (or the emulated link's α and β); one message
delivered while its sender computes, against while it waits, for the wait for a core; an
all-reduce beside a product for the cores a transfer takes; a trivial model's step at 1 and 8
micro-batches for the executor's host costs per action and per step. No model of the user's
and no strategy it will predict runs.
"""
from __future__ import annotations

from dataclasses import replace
from statistics import median

from .machine import FAMILIES, VIEWS, Machine, bus_factor, ring_steps

MATMUL_SHAPES = ((16, 128, 128), (64, 256, 256), (64, 512, 512), (128, 1024, 1024), (256, 1024, 2048))


def _loop(fn, seconds: float, chunks: int = 5) -> float:
    """Seconds per call of ``fn``: the median of ``chunks`` timed runs over ~``seconds`` in all.
    The median, not the best: on a host shared with other work a step meets the typical share
    of the cores, not the quietest moment's."""
    import time
    fn()
    runs = []
    for _ in range(chunks):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / chunks or n < 2:
            fn()
            n += 1
        runs.append(elapsed / n)
    return median(runs)


def _alone(seconds: float, rank_only: int | None = 0):
    """On one engine (the others return at once): the compute fields (matmul table, in-cache memory
    rate and the cache's size, elementwise and setup costs, attention, host cost per op and per
    view, a sleep's lateness) and the CPUs it may use. The rates beyond the cache are
    :func:`_shared`'s."""
    import time

    import torch
    import torch.distributed as dist

    if rank_only is not None and dist.get_rank() != rank_only:
        return None

    def timed(m, k, n, seconds=seconds, chunks=5):
        a, b = torch.randn(m, k), torch.randn(k, n)
        return _loop(lambda: a @ b, seconds, chunks)
    # the same FLOPs at smallest dimension 16 and 64, timed in turn (a drift of the host's load
    # meets both): the median r = e(16)/e(64) with e(d) = d/(d + d½) gives d½
    r = median(timed(64, 256, 256, seconds / 5, 1) / timed(16, 512, 512, seconds / 5, 1) for _ in range(7))
    half = max(0.0, 1024 * (1 - r) / (64 * r - 16)) if 64 * r > 16 else 64.0
    table = [(2.0 * m * k * n, 2.0 * m * k * n / timed(m, k, n) / (min(m, k, n) / (min(m, k, n) + half)))
             for m, k, n in MATMUL_SHAPES]
    memory = _stream(1, seconds / 2)
    cache, _ = _cache(seconds)
    elementwise = {name: _loop(lambda f=f, x=torch.randn(1024, 512): f(x), seconds / 8) / (1024 * 512)
                   for name, f in ELEMENTWISE.items()}
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
    import os
    x = torch.randn(4, 8, requires_grad=True)
    view_s = median(_loop(f, seconds / 8) for f in (lambda: x.view(8, 4), x.t, lambda: x.transpose(0, 1)))
    views = sum(op.name in VIEWS for op in counter.sink)
    op_s = (_loop(chain, seconds) - views * view_s) / (len(counter.sink) - views)
    elementwise = {name: max(0.0, t - op_s / (1024 * 512)) for name, t in elementwise.items()}
    tiny = torch.randn(4, 4)
    base = _loop(lambda: _aten("add")(tiny, tiny), seconds / 16)
    setup = {name: max(0.0, _loop(lambda f=f: f(tiny), seconds / 40) - base) for name, f in SETUP.items()}
    late = []
    for _ in range(max(9, int(seconds * 100))):       # 1 ms sleeps: how late the thread wakes
        t0 = time.perf_counter()
        time.sleep(1e-3)
        late.append(time.perf_counter() - t0 - 1e-3)
    return {"matmul": tuple(table), "memory_Bps": memory, "op_s": op_s, "view_s": view_s, "matmul_half_dim": half,
            "cache_bytes": cache, "elementwise": elementwise, "setup_s": setup,
            "attention_Fps": _attention(seconds), "sleep_s": max(0.0, median(late))}, len(os.sched_getaffinity(0))


def _stream(mib: int, seconds: float) -> float:
    """Bytes per second of add_ on two ``mib`` MiB tensors (read two, write one)."""
    import torch
    x, y = torch.zeros(mib << 18), torch.zeros(mib << 18)
    return 3 * x.numel() * 4 / _loop(lambda: x.add_(y), seconds, chunks=3)


def _shared(seconds: float) -> tuple[float, tuple]:
    """On every engine at once: (bytes/s of add_ on 64 MiB tensors, the cold rows of
    :func:`_cache`), what each gets of the memory bus it shares with the others."""
    return _stream(64, seconds / 2), _cache(seconds, knee=False)[1]


def _cache(seconds: float, knee: bool = True) -> tuple[float, tuple]:
    """(bytes of weights that products keep in the cache, (rows, bytes/s) of reading one that is
    not). Products of ``rows``×512 by 512×512 weights go round N weights of 1 MiB; from N = 1
    to 128 a product's time climbs from hot to cold; the cache holds the largest N whose time
    is nearer hot than cold. The cold read rate, at 16 and at 64 rows (a product of few rows
    hides less of it behind arithmetic): 1 MiB / (cold − hot). Each time is the median of
    five, each taken beside the hot one, so a change of the host's load meets both."""
    import torch
    weights = [torch.randn(512, 512) for _ in range(128)]

    def extra(rows: int, n: int) -> float:
        """Seconds a product going round n weights takes beyond one going round one."""
        a = torch.randn(rows, 512)

        def timed(k):
            turn = iter(range(1 << 62))
            return _loop(lambda: a @ weights[next(turn) % k], seconds / 40, chunks=1)
        return median(timed(n) - timed(1) for _ in range(5))
    cold = {rows: extra(rows, 128) for rows in (16, 64)}
    warm = [n for n in (2, 4, 8, 16, 32, 64) if extra(64, n) < cold[64] / 2] if knee else []
    rates = tuple((rows, (1 << 20) / max(t, 1e-9)) for rows, t in cold.items())
    return float(max(warm, default=1) << 20), rates


def _attention(seconds: float) -> tuple:
    """(query length, FLOP/s) of torch's CPU scaled-dot-product attention, causal, forward and
    backward, on 4×4×T×32 queries at T = 32, 64 and 256."""
    import torch
    import torch.nn.functional as F

    from .work import _Counter
    rows = []
    for t in (32, 64, 256):
        q, k, v = (torch.randn(4, 4, t, 32, requires_grad=True) for _ in range(3))

        def once():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        counter = _Counter()
        with counter:
            once()
        rows.append((t, sum(op.flops for op in counter.sink) / _loop(once, seconds / 3)))
    return tuple(rows)


def _aten(name):
    import torch
    return getattr(torch.ops.aten, name)


ELEMENTWISE = {
    "gelu": lambda x: _aten("gelu")(x), "gelu_backward": lambda x: _aten("gelu_backward")(x, x),
    "silu": lambda x: _aten("silu")(x), "silu_backward": lambda x: _aten("silu_backward")(x, x),
    "tanh": lambda x: _aten("tanh")(x), "tanh_backward": lambda x: _aten("tanh_backward")(x, x),
    "sigmoid": lambda x: _aten("sigmoid")(x), "sigmoid_backward": lambda x: _aten("sigmoid_backward")(x, x),
    "exp": lambda x: _aten("exp")(x), "erf": lambda x: _aten("erf")(x), "rsqrt": lambda x: _aten("rsqrt")(x),
    "_softmax": lambda x: _aten("_softmax")(x, -1, False),
    "_softmax_backward_data": lambda x: _aten("_softmax_backward_data")(x, x, -1, x.dtype),
    "_log_softmax": lambda x: _aten("_log_softmax")(x, -1, False),
    "_log_softmax_backward_data": lambda x: _aten("_log_softmax_backward_data")(x, x, -1, x.dtype),
}
"""Elementwise ops whose arithmetic can bound them, each timed alone (``Machine.elementwise``)."""

SETUP = ELEMENTWISE | {
    "mse_loss": lambda x: _aten("mse_loss")(x, x), "mean": lambda x: _aten("mean")(x),
    "index_add": lambda x: _aten("index_add")(x, 0, _aten("arange")(x.shape[0]), x),
    "_scaled_dot_product_flash_attention_for_cpu":
        lambda x: _aten("_scaled_dot_product_flash_attention_for_cpu")(*(x.view(1, 1, 4, 4),) * 3, 0.0, True),
}
"""Ops whose kernels take a setup of their own, beyond an add's, each timed on a 4×4 tensor (``Machine.setup_s``)."""


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


def _messages(rounds: int, busy_s: float = 0.03):
    """On ranks 0 and 1 (the others return at once), 32 KiB messages with labkit.comm's
    isend/irecv, as a pipeline sends an activation: (the CPU seconds posting one takes on the
    issuing thread, and on rank 1 the mean delivery while the sender computes ``busy_s``
    after posting, less the mean while the sender waits; :func:`_trimmed_mean`). ``busy_s`` is long beside the wait,
    so the sender's span ending (which frees its core) does not cut the wait short."""
    import time

    import torch
    import torch.distributed as dist

    from .. import comm
    from ..engine import session

    me = dist.get_rank()
    if me > 1:
        return None
    rec = session().recorder
    was, rec.enabled = rec.enabled, False
    a, b = torch.randn(64, 512), torch.randn(512, 512)
    x = torch.zeros(8192)
    delivered, posting = {True: [], False: []}, []
    try:
        for k in range(2 * rounds):
            busy = k % 2 == 1               # alternate, so a change of the host's load meets both
            stamp = torch.zeros(1, dtype=torch.float64)
            dist.barrier(group=_pair())
            cpu, stamp[0] = time.thread_time(), time.perf_counter()
            if me == 0:
                handle = comm.isend(x, 1, name="probe", check=False)
                posting.append(time.thread_time() - cpu)
                end = time.perf_counter() + busy_s * busy
                while time.perf_counter() < end:          # the stage's next compute
                    a @ b
                handle.wait()
                dist.send(stamp, 1)
            else:
                handle = comm.irecv(x, 0, name="probe", check=False)
                posting.append(time.thread_time() - cpu)
                handle.wait()
                done = time.perf_counter()
                dist.recv(stamp, 0)
                delivered[busy].append(done - float(stamp[0]))
    finally:
        rec.enabled = was
    wake = max(0.0, _trimmed_mean(delivered[True]) - _trimmed_mean(delivered[False])) if me == 1 else None
    return median(posting), wake


def _trimmed_mean(values, cut: float = 0.1) -> float:
    """The mean of ``values`` without the highest and lowest ``cut`` of them. A message's extra
    wait is either none or a scheduler's turn of milliseconds: what a step's many messages add
    up to is the mean, where the median jumps from one to the other as the odds pass a half."""
    xs = sorted(values)
    k = int(len(xs) * cut)
    xs = xs[k:len(xs) - k] or xs
    return sum(xs) / len(xs)


_PAIR = {}


def _make_pair() -> None:
    _pair()


def _pair():
    """A process group of ranks 0 and 1 (made once per process; every rank must create it)."""
    import torch.distributed as dist
    if "g" not in _PAIR:
        _PAIR["g"] = dist.new_group([0, 1])
    return _PAIR["g"]


COMM_SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 24)
"""Bytes per call the collectives are timed at: a pipeline's activations up to a large bucket."""


def _ping_pong(nbytes: int, n: int, me: int, both: bool = False):
    """One message each way between neighbour pairs (0↔1, 2↔3, …; an odd last rank idles), sent
    as a pipeline sends them (labkit.comm's isend and irecv, no header); the call's
    time is half the round trip, one message's (OSU's osu_latency). ``both``: the two messages
    at once, crossing (a 1F1B pipeline's activation and gradient), the call's time is both."""
    import torch

    from .. import comm

    out, inbox = torch.zeros(max(1, nbytes // 4)), torch.zeros(max(1, nbytes // 4))
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= n:
        return lambda: None
    # no header, as a stage sends every activation after its first
    send = lambda: comm.isend(out, peer, name="probe", check=False)       # noqa: E731
    recv = lambda: comm.irecv(inbox, peer, name="probe", check=False)     # noqa: E731
    if both:
        return lambda: [h.wait() for h in (recv(), send())]
    if me % 2 == 0:
        return lambda: (send().wait(), recv().wait())
    return lambda: (recv().wait(), send().wait())


def _comm(seconds: float):
    """On every engine: the median seconds per call of each family at each of COMM_SIZES (through
    labkit.comm as a step issues them, recording off; a send's is half a ping-pong's round
    trip), the slowest rank's; and a message crossing one the other way."""
    import torch
    import torch.distributed as dist

    from ..bench.sweep import _operation
    from ..engine import session

    n, me = dist.get_world_size(), dist.get_rank()
    rec = session().recorder
    was, rec.enabled = rec.enabled, False
    out = {}
    try:
        for family in FAMILIES:
            for nbytes in COMM_SIZES:
                call = _ping_pong(nbytes, n, me) if family == "send" else \
                    _operation(family, "torch", nbytes, n, me)[0]
                out[(family, nbytes)] = _per_message(call, 6 if family == "send" else 3)
        stamp = torch.zeros(1, dtype=torch.float64)       # an emulated link's start stamp
        out[("join", 8)] = _per_message(lambda: dist.all_reduce(stamp, op=dist.ReduceOp.MAX), 3)
        # both ways at once between the same pair, the smallest size
        exchange, one_way = _ping_pong(COMM_SIZES[0], n, me, both=True), _ping_pong(COMM_SIZES[0], n, me)
        out[("exchange", COMM_SIZES[0])] = _per_message(exchange, 1, runs=30, calls=1, summary=_trimmed_mean)
        out[("one way", COMM_SIZES[0])] = _per_message(one_way, 2, runs=30, calls=1, summary=_trimmed_mean)
    finally:
        rec.enabled = was
    return out


def _per_message(call, messages: int, runs: int = 5, calls: int = 3, summary=None) -> float:
    """Seconds per message of ``call`` (warmed once): ``runs`` timed runs of ``calls`` calls, each
    run started together after a barrier, ``messages`` messages in a run; their median, or
    ``summary`` of them (:func:`_trimmed_mean` for a wait that is none or a scheduler's turn)."""
    import time

    import torch.distributed as dist

    call()
    times = []
    for _ in range(runs):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / messages)
    return (summary or median)(times)


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
    alone, cpus = next(r for r in lab.apply(_alone, seconds) if r is not None)
    table, half = alone["matmul"], alone["matmul_half_dim"]
    together = lab.apply(_together, seconds, False)
    # engines' worth of one alone, at most the engines and the CPUs they may run on
    # the together-product is 64×512×512, table row 2's shape: compare at its efficiency
    cores = max(0.25, min(float(world), float(cpus), sum(together) / (table[2][1] * 64 / (64 + half))))
    shared = lab.apply(_shared, seconds)     # beyond the cache the engines share the memory bus
    alone["dram_Bps"] = median(d for d, _ in shared)
    alone["cold_Bps"] = tuple((rows, median(dict(c)[rows] for _, c in shared)) for rows, _ in shared[0][1])
    comm, link_name, link_ab, load, wake, call_s, cross, join = ({f: (0.0, 1e12) for f in FAMILIES}, "", (), 0.0, 0.0,
                                                                 0.0, 0.0, 0.0)
    if world > 1:
        link = getattr(lab, "link", None)
        if link is not None:        # gloo's own calls, timed without the link; the link's are known
            link_ab, link_name = link.alpha_beta("intra"), str(link)
            lab.link = None
        try:
            per_rank = lab.apply(_comm, seconds)
        finally:
            if link is not None:
                lab.link = link
        times = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        comm = {f: _fit(f, world, times) for f in FAMILIES}
        cross = max(0.0, times[("exchange", COMM_SIZES[0])] - times[("one way", COMM_SIZES[0])])
        join = times[("join", 8)]
        lab.apply(_make_pair)
        probes = [r for r in lab.apply(_messages, max(8, int(seconds * 100))) if r is not None]
        call_s, wake = sum(p[0] for p in probes) / 2, probes[1][1]
        # each engine's compute thread plus a transfer of load c: world·(1+c) asks on the cores;
        # without and with the transfer in turn, three times (a change of the host's load meets both)
        slower = median(sum(lab.apply(_together, seconds / 3, False)) / sum(lab.apply(_together, seconds / 3, True))
                        for _ in range(3))
        load = max(0.0, min(1.0, slower * min(world, cores) / world - 1))
    machine = Machine(cores, **alone, comm=comm, comm_load=load,
                      wake_s=wake, call_s=call_s, cross_s=cross, join_s=join,
                      engines=world,
                      link=link_name, link_alpha_beta=tuple(link_ab))
    action_s, step_s = _host_costs(lab, machine)
    return replace(machine, action_s=action_s, step_s=step_s)


def _host_costs(lab, machine: Machine) -> tuple[float, float]:
    """The executor's host seconds per action and per step: a trivial model (one Linear of width
    8) run at 1 and 8 micro-batches, against the simulator's price of its ops alone."""
    from ..config import Strategy
    from ..models import mlp
    from .physical import simulate

    model, world = mlp(width=8, depth=2), lab.world_size
    bare = replace(machine, action_s=0.0, step_s=0.0)
    plans = [Strategy(dp=world, microbatches=m, dp_mode="bucketed") if world > 1 else Strategy(microbatches=m)
             for m in (1, 8)]
    # 1 and 8 micro-batches in turn, three times (a change of the host's load meets both)
    runs = [[lab.run(s, model=model, batch=8 * world, steps=8, record=True).metrics["step_time_s"] for s in plans]
            for _ in range(3)]
    measured = [median(r[k] for r in runs) for k in range(2)]
    simulated = [simulate(s, bare, model=model, batch=8 * world).metrics["step_time_s"] for s in plans]
    slow = max(1.0, world / machine.cores)            # the engines share the cores
    action_s = max(0.0, (measured[1] - measured[0]) - (simulated[1] - simulated[0])) / (2 * 7 * slow)
    step_s = max(0.0, measured[0] - simulated[0] - 2 * action_s * slow) / slow
    return action_s, step_s
