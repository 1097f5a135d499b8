"""Tensor-parallel step time: labkit's megatron TP (with and without sequence parallelism) ÷
torch's DTensor TP for the same GPT on 2 ranks, TP=2 ÷ one process, and TP bytes per step
measured against Megatron's formula.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tensor_parallel.py          # ~1 minute
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tensor_parallel.py --rounds 7 --steps 20

Plain processes (torch.multiprocessing spawn, gloo on loopback, one thread each), no
ipyparallel, so the figures are the layers' own cost, not the lab's harness. The modes are
interleaved round by round (drift in machine load hits all of them alike); each figure is
the median over rounds of the median step time of a round (first step of each warm-up).
The one-process baseline runs in the parent while the ranks sleep on their queues (a rank
waiting in a gloo barrier keeps a core busy), with 1 thread (one rank's share of the
machine) and with 2 (the whole of a 2-core machine).

Bytes (Megatron-LM, Shoeybi et al. 2019, §3): per layer 2 all-reduces forward and 2 backward
of b·s·h values; a ring all-reduce puts 2(t−1)/t of the payload on the wire per rank.
Measured: the bytes labkit.comm recorded for the f/g all-reduces of one step. DTensor's
collectives bypass labkit.comm; torch's CommDebugMode counts them.
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("megatron", "megatron SP", "dtensor", "one process, 1 thread", "one process, 2 threads")
TP_MODES = {"megatron": ("megatron", False), "megatron SP": ("megatron", True), "dtensor": ("dtensor", False)}


def build(args, tp_mode: str | None, rank: int, world: int):
    import labkit
    from labkit.parallel.tensor import build_tensor_parallel
    from labkit.training import build_model

    data = labkit.data.text(batch=args.batch, block_size=args.block)
    make = labkit.models.gpt(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block,
                             vocab_size=data.vocab_size)
    model = build_model(make, 0)
    if tp_mode is not None:
        mode, sequence_parallel = TP_MODES[tp_mode]
        model = build_tensor_parallel(model, mode, None, rank, world, sequence_parallel=sequence_parallel)
    return model, data, make


def time_steps(model, data, steps: int, barrier: bool) -> list[float]:
    from labkit.training import resolve_loss

    loss_fn = resolve_loss("cross_entropy")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(steps):
        x, y = data(step)
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    return times[1:]


def tp_bytes(args, rank: int, world: int) -> dict:
    """Bytes and counts of one step's TP all-reduces, megatron (recorded) and dtensor (counted)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from labkit import comm

    ctx = comm.context()
    ctx.recorder.enabled = True
    recorded = {}
    for mode in ("megatron", "megatron SP"):
        model, data, _ = build(args, mode, rank, world)
        time_steps(model, data, 1, barrier=False)             # warm-up
        ctx.recorder.start_step(1)
        time_steps(model, data, 1, barrier=False)
        recorded[mode] = [e for e in ctx.recorder.drain() if e["stream"] == "comm"]
    ctx.recorder.enabled = False
    model, data, _ = build(args, "dtensor", rank, world)
    x, y = data(0)
    from labkit.training import resolve_loss
    with CommDebugMode() as counter:
        resolve_loss("cross_entropy")(model(x), y).backward()
    params = sum(p.numel() * p.element_size() for p in build(args, "megatron", rank, world)[0].parameters())
    return {"megatron_bytes": sum(e["bytes"] for e in recorded["megatron"]),
            "megatron_calls": len(recorded["megatron"]),
            "sp_bytes": sum(e["bytes"] for e in recorded["megatron SP"]),
            "sp_calls": {k: sum(e["kind"] == k for e in recorded["megatron SP"])
                         for k in ("allgather", "reduce_scatter", "allreduce")},
            "dtensor_calls": counter.get_total_counts(), "param_bytes": params}


def worker(rank: int, world: int, port: int, args, orders, results):
    """A TP rank: runs the modes the parent asks for, one at a time, until told to stop."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from labkit import comm
    from labkit.record.recorder import Recorder

    # labkit.comm outside the lab: this process's context, recording off while timing
    comm.bind(comm.CommContext(rank, Recorder(rank, enabled=False), 120.0))
    while (mode := orders[rank].get()) is not None:
        if mode == "bytes":
            results.put(tp_bytes(args, rank, world))
        else:
            model, data, _ = build(args, mode, rank, world)
            results.put(median(time_steps(model, data, args.steps, barrier=True)))
    dist.destroy_process_group()


def one_process(args, threads: int) -> float:
    """The whole model in this process (the ranks sleep on their queues meanwhile)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, data, _ = build(args, None, 0, 1)
        return median(time_steps(model, data, args.steps, barrier=False))
    finally:
        torch.set_num_threads(previous)


def measure(args, world: int = 2) -> dict:
    """Interleaved rounds over every mode; the ranks stay up between them."""
    ctx = mp.get_context("spawn")
    orders, results = [ctx.SimpleQueue() for _ in range(world)], ctx.SimpleQueue()
    procs = mp.start_processes(worker, args=(world, free_port(), args, orders, results), nprocs=world,
                               start_method="spawn", join=False)
    times = {m: [] for m in MODES}
    try:
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                if mode in TP_MODES:
                    for q in orders:
                        q.put(mode)
                    times[mode].append(max(results.get() for _ in range(world)))
                else:
                    times[mode].append(one_process(args, 2 if "2 threads" in mode else 1))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        for q in orders:
            q.put("bytes")
        counts = [results.get() for _ in range(world)][0]
    finally:
        for q in orders:
            q.put(None)
        procs.join()
    return {"times": times, **counts}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    world = 2
    result = measure(args, world)
    med = {m: median(v) for m, v in result["times"].items()}
    b, s, h, t = args.batch, args.block, args.width, world
    formula = args.layers * 4 * b * s * h * 4 * 2 * (t - 1) / t       # fp32: 4 bytes a value
    print(f"\nGPT {args.layers} layers, {args.heads} heads, width {args.width}, block {args.block}, batch "
          f"{args.batch}; tp={world}, gloo, 1 thread a rank; {args.rounds} rounds × {args.steps - 1} steps")
    print(f"{'mode':>24} {'step ms':>9} {'÷ dtensor':>10} {'megatron tp=2 ÷ this':>21}")
    for mode in MODES:
        speedup = "" if mode in TP_MODES else f"{med['megatron'] / med[mode]:21.3f}"
        print(f"{mode:>24} {1e3 * med[mode]:9.2f} {med[mode] / med['dtensor']:10.3f} {speedup}")
    print(f"\nTP all-reduces per step: megatron {result['megatron_calls']} (formula {4 * args.layers}), "
          f"dtensor {result['dtensor_calls']} collectives")
    print(f"TP bytes on the wire per rank per step: measured {result['megatron_bytes']:,} B, "
          f"formula 4·L·b·s·h·4 B·2(t−1)/t = {formula:,.0f} B "
          f"(ratio {result['megatron_bytes'] / formula:.3f})")
    print(f"sequence parallel: {result['sp_calls']} calls, {result['sp_bytes']:,} B per rank per step "
          f""
          f"(per layer the same bytes as TP; plus the cut after the embedding and the join before the head, "
          f"and the LayerNorm and bias gradients' all-reduces)")
    print(f"parameter bytes per rank (megatron, tied embedding replicated): {result['param_bytes']:,} B")


if __name__ == "__main__":
    main()
