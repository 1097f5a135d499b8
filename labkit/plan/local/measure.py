"""Measure a :class:`~labkit.plan.local.machine.Machine` on the lab's engines: its own micro-benchmarks.

Each number is the median of a few timed runs: matmuls of a
few sizes, products going round more and more weights, and over 1 MiB of
weight after sleeps (the cache, and what it loses by age) and a tiny model's step after sleeps
(what the host loses while a rank waits) on one engine while the others wait;
the same product, and an add over 64 MiB, on every engine at once for the cores and the
memory bus they share; the
four families of collectives at four sizes (the emulated link's α and β are known); the CPU
time of posting a message, and its wall time while the peer computes; a trivial model's step
at 1 and 8 micro-batches for the executor's host cost per action. No model of the user's and
no strategy it will predict runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from statistics import median

from ..wire import bus_factor, ring_steps
from .machine import FAMILIES, Machine

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
    """On one engine (the others return at once): the compute fields (matmul table, the cache's
    size and what it loses by age, the host's wake) and the CPUs it may use. The memory's rate
    is :func:`_shared`'s."""
    import torch
    import torch.distributed as dist

    if rank_only is not None and dist.get_rank() != rank_only:
        return None

    def timed(m, k, n):
        a, b = torch.randn(m, k), torch.randn(k, n)
        return _loop(lambda: a @ b, seconds)
    table = tuple((2.0 * m * k * n, 2.0 * m * k * n / timed(m, k, n)) for m, k, n in MATMUL_SHAPES)
    cache = _cache(seconds)
    refetch, wake = _refetch(), _wake()
    import os
    return ({"matmul": table, "cache_bytes": cache, "refetch": refetch, "wake": wake},
            len(os.sched_getaffinity(0)))


def _stream(mib: int, seconds: float) -> float:
    """Bytes per second of add_ on two ``mib`` MiB tensors (read two, write one)."""
    import torch
    x, y = torch.zeros(mib << 18), torch.zeros(mib << 18)
    return 3 * x.numel() * 4 / _loop(lambda: x.add_(y), seconds, chunks=3)


def _shared(seconds: float) -> float:
    """On every engine at once: bytes/s of add_ on 64 MiB tensors, what each gets of the memory
    bus it shares with the others."""
    return _stream(64, seconds / 2)


def _cache(seconds: float) -> float:
    """Bytes of weights that products keep in the cache. Products of 64×512 by 512×512 weights
    go round N weights of 1 MiB; from N = 1 to 128 a product's time climbs from hot to cold;
    the cache holds N while every size up to N stays nearer hot than cold (a cache that holds
    N holds less: one size that reads warm beyond a cold one is the host's noise, not a
    cache). Each time is the median of five, each taken beside the hot one, so a change of
    the host's load meets both."""
    import torch
    weights, a = [torch.randn(512, 512) for _ in range(128)], torch.randn(64, 512)

    def extra(n: int) -> float:
        """Seconds a product going round n weights takes beyond one going round one."""
        def timed(k):
            turn = iter(range(1 << 62))
            return _loop(lambda: a @ weights[next(turn) % k], seconds / 40, chunks=1)
        return median(timed(n) - timed(1) for _ in range(5))
    cold = extra(128)
    return cache_held(cold, (extra(n) for n in CACHE_MIB))


CACHE_MIB = (2, 4, 8, 16, 32, 64)
"""Working sets :func:`_cache` tries, in MiB, smallest first."""


def cache_held(cold: float, extras) -> float:
    """Bytes of the largest of :data:`CACHE_MIB` up to which every size's extra seconds
    (``extras``, in that order, read lazily: the first cold one ends it) stay below half the
    ``cold`` extra; 1 MiB when even 2 does not."""
    held = 1
    for n, seconds in zip(CACHE_MIB, extras):
        if seconds >= cold / 2:
            break
        held = n
    return float(held << 20)


REFETCH_SLEEPS = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
"""Seconds slept before each pass of :func:`_refetch`: back to back up to a long wait."""


def _after_sleeps(run, sleeps, passes: int) -> list[tuple[float, float, float]]:
    """``run`` timed after each of ``sleeps`` seconds of sleep, ``passes`` times each (after 200
    passes back to back): per sleep, the medians of (the time since the previous pass began, the
    time since it ended, the pass's own time)."""
    import time

    for _ in range(200):
        run()
    rows, begun = [], time.perf_counter()
    ended = begun
    for pause in sleeps:
        ages, idle, took = [], [], []
        for _ in range(passes):
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            ages.append(t0 - begun)
            idle.append(t0 - ended)
            took.append(t1 - t0)
            begun, ended = t0, t1
        rows.append((median(ages), median(idle), median(took)))
    return rows


def _refetch(passes: int = 15) -> tuple:
    """(age, seconds per byte) rows: a product of 16×512 by one 512×512 weight (1 MiB, within
    any cache :func:`_cache` finds, so back to back it is hot: a pass takes ~0.1 ms), each pass
    after a sleep of each of REFETCH_SLEEPS, ``passes`` times; a row's age is the median time
    between its passes' starts, its cost per byte the median pass's time beyond the
    back-to-back passes', over the weight's bytes (0 where it is not beyond). A byte's age is
    that time: the weight was last read a pass's start before. A working set beyond the cache
    would be cold back to back already, its youngest age a pass's own milliseconds, and a
    cache that loses its lines within those would read as losing nothing."""
    import torch
    weight, a = torch.randn(512, 512), torch.randn(16, 512)
    nbytes = weight.numel() * weight.element_size()
    rows = _after_sleeps(lambda: a @ weight, REFETCH_SLEEPS, passes)
    hot = rows[0][2]
    return tuple((age, max(0.0, t - hot) / nbytes) for age, _, t in rows)


WAKE_SLEEPS = (0.0, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
"""Seconds slept before each pass of :func:`_wake`."""


def _wake(passes: int = 15) -> tuple:
    """(idle, seconds) rows: a tiny MLP's forward and backward (width 8, one row: host work, its
    arithmetic nil; ~0.1–0.2 ms back to back), each pass after a sleep of each of WAKE_SLEEPS,
    ``passes`` times; a row's idle is the median time from a pass's end to the next one's start,
    its cost the median pass's time beyond the back-to-back passes' (0 where it is not beyond)."""
    import torch

    from ... import models
    model, x = models.mlp(width=8, depth=2)(), torch.randn(1, 8)
    rows = _after_sleeps(lambda: model(x).square().mean().backward(), WAKE_SLEEPS, passes)
    hot = rows[0][2]
    return tuple((max(idle, 1e-7), max(0.0, t - hot)) for _, idle, t in rows)


def _together(seconds: float, rank_only: int | None = None) -> float | None:
    """On every engine at once (``rank_only``: on that rank alone, the others idle): a
    64×512×512 product's rate."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(64, 512), torch.randn(512, 512)
    dist.barrier()
    if rank_only is not None and dist.get_rank() != rank_only:
        return None
    return 2.0 * 64 * 512 * 512 / _loop(lambda: a @ b, seconds, chunks=1)


def _cores(lab, seconds: float, pairs: int = 5) -> float:
    """Engines' worth of one engine alone when all compute at once: the median over ``pairs``
    of one engine's rate alone and every engine's at once, taken back to back, so a change of
    the host's load between them meets both (on a shared host the cores it lends drift)."""
    ratios = []
    for _ in range(pairs):
        one = next(r for r in lab.apply(_together, seconds / pairs, 0) if r is not None)
        ratios.append(sum(lab.apply(_together, seconds / pairs)) / one)
    return median(ratios)


@contextmanager
def _unrecorded():
    """This engine's recorder off while a probe's calls run (they are not a step's), then as it was."""
    from ...engine import session
    rec = session().recorder
    was, rec.enabled = rec.enabled, False
    try:
        yield
    finally:
        rec.enabled = was


def _posting(rounds: int):
    """On ranks 0 and 1 (the others return at once): the median CPU seconds posting a 32 KiB
    message with labkit.comm's isend (rank 0) or irecv (rank 1) takes on the issuing thread,
    as a pipeline posts an activation (on an emulated link its departure stamp too)."""
    import time

    import torch
    import torch.distributed as dist

    from ... import comm

    me = dist.get_rank()
    if me > 1:
        return None
    x, posting = torch.zeros(8192), []
    with _unrecorded():
        for _ in range(rounds):
            dist.barrier(group=_pair())
            cpu = time.thread_time()
            handle = comm.isend(x, 1, name="probe", check=False) if me == 0 else \
                comm.irecv(x, 0, name="probe", check=False)
            posting.append(time.thread_time() - cpu)
            handle.wait()
    return median(posting)


def _messages(rounds: int = 200, compute_s: float = 1e-3):
    """On ranks 0 and 1 (the others return None): the mean wall seconds a 32 KiB message's post
    takes on the issuing thread while the peer computes, as a pipeline posts: each rank posts
    an irecv from the other, computes ``compute_s`` (16-row products over a 512×512 weight),
    posts an isend and waits for both, ``rounds`` times (the first tenth not counted)."""
    import time

    import torch
    import torch.distributed as dist

    from ... import comm

    me = dist.get_rank()
    if me > 1:
        return None
    peer = 1 - me
    out, inbox = torch.zeros(8192), torch.zeros(8192)
    w, a = torch.randn(512, 512), torch.randn(16, 512)
    posts = []
    with _unrecorded():
        dist.barrier(group=_pair())
        for i in range(rounds):
            t0 = time.perf_counter()
            received = comm.irecv(inbox, peer, name="probe", check=False)
            t1 = time.perf_counter()
            while time.perf_counter() - t1 < compute_s:
                a @ w
            t2 = time.perf_counter()
            sent = comm.isend(out, peer, name="probe", check=False)
            t3 = time.perf_counter()
            received.wait()
            sent.wait()
            if i >= rounds // 10:
                posts += [t1 - t0, t3 - t2]
    return sum(posts) / len(posts)


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


def _ping_pong(nbytes: int, n: int, me: int):
    """One message each way between neighbour pairs (0↔1, 2↔3, …; an odd last rank idles), sent
    as a pipeline sends them (labkit.comm's isend and irecv, no header); the call's
    time is half the round trip, one message's (OSU's osu_latency)."""
    import torch

    from ... import comm

    out, inbox = torch.zeros(max(1, nbytes // 4)), torch.zeros(max(1, nbytes // 4))
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= n:
        return lambda: None
    # no header, as a stage sends every activation after its first
    send = lambda: comm.isend(out, peer, name="probe", check=False)       # noqa: E731
    recv = lambda: comm.irecv(inbox, peer, name="probe", check=False)     # noqa: E731
    if me % 2 == 0:
        return lambda: (send().wait(), recv().wait())
    return lambda: (recv().wait(), send().wait())


def _comm(seconds: float):
    """On every engine: the median seconds per call of each family at each of COMM_SIZES (through
    labkit.comm as a step issues them, recording off, the emulated link off: gloo's own; a
    send's is half a ping-pong's round trip), the slowest rank's."""
    import torch.distributed as dist

    from ...bench.sweep import _operation
    from ...engine import session

    from ...engine.world import set_link

    n, me = dist.get_world_size(), dist.get_rank()
    link = session().link
    set_link(None)           # gloo's own calls (the lab's link stays: this engine's, restored below)
    out = {}
    try:
        with _unrecorded():
            for family in FAMILIES:
                for nbytes in COMM_SIZES:
                    call = _ping_pong(nbytes, n, me) if family == "send" else \
                        _operation(family, "torch", nbytes, n, me)[0]
                    out[(family, nbytes)] = _per_message(call, 6 if family == "send" else 3)
    finally:
        set_link(link)
    return out


def _per_message(call, messages: int, runs: int = 5, calls: int = 3) -> float:
    """Seconds per message of ``call`` (warmed once): ``runs`` timed runs of ``calls`` calls, each
    run started together after a barrier, ``messages`` messages in a run; their median."""
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
    return median(times)


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
    # engines' worth of one alone, at most the engines and the CPUs they may run on
    cores = max(0.25, min(float(world), float(cpus), _cores(lab, seconds)))
    alone["dram_Bps"] = median(lab.apply(_shared, seconds))     # the engines share the bus
    comm, link_ab, call_s, message_s = {f: (0.0, 1e12) for f in FAMILIES}, (), 0.0, 0.0
    if world > 1:
        link = getattr(lab, "link", None)
        if link is not None:        # gloo's own calls, timed without the link; the link's are known
            link_ab = link.alpha_beta("intra")
        per_rank = lab.apply(_comm, seconds)
        times = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        comm = {f: _fit(f, world, times) for f in FAMILIES}
        lab.apply(_make_pair)
        probes = [r for r in lab.apply(_posting, max(8, int(seconds * 100))) if r is not None]
        call_s = sum(probes) / 2
        message_s = sum(r for r in lab.apply(_messages) if r is not None) / 2     # ranks 0 and 1, as call_s
    machine = Machine.of(cores=cores, **alone, comm=comm, call_s=call_s, message_s=message_s, engines=world,
                         link_alpha_beta=link_ab)
    return replace(machine, host=replace(machine.host, action_s=_action_s(lab, machine)))


def _action_s(lab, machine: Machine) -> float:
    """The executor's host seconds per action (a forward or a backward of a micro-batch): a
    trivial model (width 8, depth 2), each rank's 8 samples stepped in 8 micro-batches and in 1,
    in turn three times; the extra time per extra action (14), on one engine's share of the
    cores, less what the extra micro-batches' forwards and backwards take timed in sequence on
    this process (:func:`labkit.plan.local.profile.profile`, as :func:`~labkit.plan.simulate` prices a
    model's). The sync, the optimizer and the step's own bookkeeping are the same at both counts."""
    from ...config import Strategy
    from ...models import mlp
    from .profile import profile

    model, world = mlp(width=8, depth=2), lab.world_size
    plans = [Strategy(dp=world, microbatches=m, dp_mode="bucketed") if world > 1 else Strategy(microbatches=m)
             for m in (1, 8)]
    runs = [[lab.run(s, model=model, batch=8 * world, steps=8, record=True).metrics["step_time_s"] for s in plans]
            for _ in range(3)]
    extra = median(r[1] - r[0] for r in runs) / max(1.0, world / machine.cores)     # the engines share the cores

    def ops_s(size: int) -> float:
        return sum(t for (piece, _), t in profile(model, size).items() if piece != "opt")
    return max(0.0, extra - (8 * ops_s(1) - ops_s(8))) / 14
