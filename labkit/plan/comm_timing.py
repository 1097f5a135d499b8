"""On the engines: what a step's calls cost beyond the sweep's bare transport.

Called through ``lab.apply`` by :func:`labkit.plan.costs.calibrate`: the recorded α of a small
call as a step makes it, how much slower a transfer runs while its rank computes (and compute
beside a transfer), and the compute thread's bytes per second for packing buckets.
"""
from __future__ import annotations

import time
from statistics import median

from .block_timing import _timed

def time_calls(iters: int = 20) -> dict:
    """This rank's seconds per labkit.comm call as a step makes them (recording on, each call
    waited): a 4-byte all-reduce, all-gather and reduce-scatter, and one way of a 4-byte ping-pong between ranks 0 and 1.

    The sweep times bare transport with calls back to back; a step also pays the flight
    recorder, the recording and a thread wake-up per message, which is the α a step sees.
    """
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..engine import session

    recorder = session().recorder
    was_recording, recorder.enabled = recorder.enabled, True
    me, x = dist.get_rank(), torch.zeros(1)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, name="calibrate")
        all_reduce = (time.perf_counter() - t0) / iters
        n = dist.get_world_size()
        whole, part = torch.zeros(n), torch.zeros(1)
        sharded = {}
        for op, call in (("all_gather", lambda: comm.all_gather(whole, part, name="calibrate")),
                         ("reduce_scatter", lambda: comm.reduce_scatter(part, whole, name="calibrate"))):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            sharded[op] = (time.perf_counter() - t0) / iters
        dist.barrier()
        p2p = 0.0
        if me in (0, 1):
            peer = 1 - me
            t0 = time.perf_counter()
            for _ in range(iters):
                for sending in ((True, False) if me == 0 else (False, True)):
                    call = comm.isend if sending else comm.irecv
                    call(x, peer, None, "calibrate", tag=7, check=False).wait()
            p2p = (time.perf_counter() - t0) / iters / 2
        dist.barrier()
    finally:
        recorder.drain()
        recorder.enabled = was_recording
    return {"all_reduce": all_reduce, "sendrecv": p2p, **sharded}


def time_busy_all_reduce(nbytes: int, iters: int = 8) -> dict:
    """Seconds of one all-reduce of ``nbytes`` with this rank idle, and with it computing
    meanwhile (issue, then small matmuls until the work completes), medians over ``iters``.

    On CPU the comm thread and the compute thread share the cores, so a transfer that
    overlaps compute (a bucket launched during backward, a pipeline send) takes longer
    than the same call on an idle rank; the ratio is the table's ``busy_factor``.
    """
    import torch
    import torch.distributed as dist

    x, a = torch.zeros(max(1, nbytes // 4)), torch.randn(128, 128)
    idle, busy, alone, beside = [], [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        alone.append((time.perf_counter() - t0) / 20)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        idle.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        deadline = t0 + max(1.0, 50 * idle[-1])     # a starved comm thread must not stall calibration
        done = 0
        while not work.is_completed() and time.perf_counter() < deadline:
            a @ a           # polled between small matmuls: a Python callback would wait for the GIL
            done += 1
        busy.append(time.perf_counter() - t0)
        if done:
            beside.append(busy[-1] / done)
        work.wait()
    # and the other way round: each matmul beside the transfer against one alone
    compute = median(beside) / median(alone) if beside else 1.0
    return {"idle_s": median(idle), "busy_s": median(busy), "compute_factor": compute}


def time_copies(nbytes: int, parts: int = 4, iters: int = 9) -> dict:
    """Bytes per second of what a bucket costs the compute thread: packing gradients into one
    flat buffer (``torch.cat``), copying the average back and dividing, and dividing alone
    (the naive mode's per-tensor ``div_``). The lab times none of them as compute."""
    import torch

    grads = [torch.randn(max(1, nbytes // 4 // parts)) for _ in range(parts)]
    flat = torch.cat(grads)

    def unpack():
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()]).div_(2)
            offset += g.numel()

    size = flat.numel() * 4
    rate = lambda fn: size / max(_timed(fn, iters), 1e-9)
    return {"pack_Bps": rate(lambda: torch.cat(grads)), "unpack_Bps": rate(unpack),
            "div_Bps": rate(lambda: [g.div_(2) for g in grads])}
