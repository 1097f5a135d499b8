"""Zero-bubble schedules and activation recomputation, measured on torch's own pipelining.

    .venv/bin/python benchmarks/bench_zero_bubble.py                    # pp=2, ~1-2 minutes
    .venv/bin/python benchmarks/bench_zero_bubble.py --microbatches 4 --rounds 5

Plain processes (torch.multiprocessing spawn, gloo on CPU, one thread each), no lab: the
comparators labkit's own schedules are held against. On the same model and batch:

* torch's ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1,
  the paper's ZB1P) and ``ScheduleZBVZeroBubble`` (two stages per rank in a V). The model is
  cut by labkit's balanced split (``labkit.parallel.pipeline.stages.split_blocks``) into pp stages,
  or 2·pp for ZB-V; beside each, labkit's simulated bubble for equal F/I/W costs;
* ``Schedule1F1B`` with each stage under ``apply_recompute(stage, "none" | "full")``, on an
  MLP whose blocks hold several ops (Linear, GELU, Linear), where recompute frees memory:
  step time, and the activation bytes one micro-batch's forward leaves held (torch profiler).

Each figure is the median over rounds × steps of the slowest rank's step (barrier, step,
optimizer step), first step of each run left out; variants interleave round by round so
drifting machine load hits all alike.

Then labkit's own ``schedule="1f1b" | "zb-h1" | "zbv"`` through ``lab.run`` (recording off),
on the same mlp, batch and micro-batches, on ``pp`` local engines started after the torch
processes have exited, with the ratio labkit ÷ torch per schedule (target ≤ 1.00). The two
halves run one after the other, not interleaved (engines and plain processes on two cores
at once would time each other), so load that drifts between them shows in the ratio.
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from statistics import median

SCHEDULES = ("1f1b", "zb-h1", "zbv")
RECOMPUTE = ("none", "full")


def build_model(kind: str, width: int, depth: int, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if kind == "flat":                                  # labkit's mlp: one op per block
        import labkit
        return labkit.models.mlp(width=width, depth=depth)()
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def build_pipe(schedule: str, model, rank: int, pp: int, microbatches: int, recompute: str = "none"):
    """This rank's stages of `model` and torch's schedule over them (V placement for zbv)."""
    import torch
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    from labkit.parallel.recompute import apply_recompute
    from labkit.parallel.pipeline.schedules import global_stage, placement_of
    from labkit.parallel.pipeline.stages import split_blocks

    n = 2 * pp if schedule == "zbv" else pp
    bounds = split_blocks([sum(p.numel() for p in b.parameters()) for b in model], n)
    ids = [global_stage(rank, c, pp, placement_of(schedule)) for c in range(n // pp)]
    mods = [apply_recompute(torch.nn.Sequential(*(model[i] for i in bounds[s])), recompute) for s in ids]
    stages = [PipelineStage(m, s, n, torch.device("cpu")) for m, s in zip(mods, ids)]
    loss = torch.nn.functional.mse_loss
    if schedule == "1f1b":
        pipe = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss)
    else:
        kind = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleInterleavedZeroBubble
        pipe = kind(stages, n_microbatches=microbatches, loss_fn=loss)
    return pipe, mods, ids, n


def run_steps(pipe, mods, ids, n, x, y, steps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    times = []
    for _ in range(steps):
        kwargs = {}
        if n - 1 in ids:
            kwargs = {"target": y, "losses": []}
        args = (x,) if 0 in ids else ()
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def worker(rank: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, args.pp, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.pp, timeout=timedelta(seconds=120))
    from labkit.parallel.recompute import held_activation_bytes

    out = {}
    try:
        torch.manual_seed(1)
        x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
        variants = [("schedule", s, "none", "flat") for s in SCHEDULES]
        variants += [("recompute", "1f1b", r, "blocks") for r in RECOMPUTE]
        for _ in range(args.rounds):
            for group, schedule, recompute, kind in variants:
                depth = args.depth if kind == "flat" else args.depth // 2
                model = build_model(kind, args.width, depth, seed=0)
                pipe, mods, ids, n = build_pipe(schedule, model, rank, args.pp, args.microbatches, recompute)
                key = (group, schedule if group == "schedule" else recompute)
                out.setdefault(key, []).append(run_steps(pipe, mods, ids, n, x, y, args.steps)[1:])
                if group == "recompute" and (key, "held") not in out:
                    mb = x[: args.batch // args.microbatches].clone().requires_grad_(0 not in ids)
                    out[key, "held"] = held_activation_bytes(mods[0], mb)
    finally:
        dist.destroy_process_group()
    queue.put((rank, out))


def main() -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    store = dist.TCPStore("127.0.0.1", 0, args.pp, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(store.port, args, queue), nprocs=args.pp, join=True,
                       start_method="spawn")
    results = dict(queue.get() for _ in range(args.pp))
    report(args, results)
    report_labkit(args, results, run_labkit(args))


def run_labkit(args) -> dict:
    """labkit's executor on the same schedules: {schedule: measured step times (slowest rank)}."""
    import labkit

    times: dict[str, list[float]] = {}
    with labkit.Lab.start(engines=args.pp, progress=False) as lab:
        for _ in range(args.rounds):
            for schedule in SCHEDULES:
                s = labkit.Strategy(pp=args.pp, schedule=schedule, microbatches=args.microbatches,
                                    chunks=2 if schedule == "zbv" else 1)
                run = lab.run(s, model=labkit.models.mlp(width=args.width, depth=args.depth), batch=args.batch,
                              steps=args.steps, lr=0.01, seed=0, record=False)
                times.setdefault(schedule, []).extend(run.step_times[1:])
    return times


def report_labkit(args, results, times) -> None:
    def torch_ms(schedule):
        per_rank = [sum(results[r][("schedule", schedule)], []) for r in results]
        return median(max(ts) for ts in zip(*per_rank)) * 1e3

    print(f"\nlabkit's executor through lab.run (recording off), {args.pp} local engines, same mlp and batch")
    print(f"{'schedule':>10} {'labkit ms':>10} {'torch ms':>9} {'labkit ÷ torch':>15}")
    for schedule in SCHEDULES:
        ours = median(times[schedule]) * 1e3
        print(f"{schedule:>10} {ours:10.2f} {torch_ms(schedule):9.2f} {ours / torch_ms(schedule):15.3f}")


def report(args, results) -> None:
    from labkit.parallel.pipeline.schedules import ideal_bubble

    def step_ms(key):     # slowest rank per step, median over rounds × steps
        per_rank = [sum(results[r][key], []) for r in results]
        return median(max(ts) for ts in zip(*per_rank)) * 1e3

    print(f"\npp={args.pp} processes (gloo, 1 thread each), batch {args.batch}, {args.microbatches} "
          f"micro-batches, {args.rounds}×{args.steps - 1} measured steps per variant")
    print(f"mlp width {args.width} depth {args.depth} (labkit.models.mlp), balanced split; torch's schedules")
    print(f"{'schedule':>28} {'step ms':>9} {'÷ 1f1b':>7} {'sim. bubble':>12}")
    base = step_ms(("schedule", "1f1b"))
    names = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
    for s in SCHEDULES:
        t = step_ms(("schedule", s))
        bubble = ideal_bubble(s, args.pp, args.microbatches, 2 if s == "zbv" else 1)
        print(f"{names[s]:>28} {t:9.2f} {t / base:7.3f} {bubble:12.3f}")
    print(f"\nSchedule1F1B, {args.depth // 2} blocks of Linear({args.width},{4 * args.width})-GELU-Linear, "
          "each stage under apply_recompute")
    print(f"{'recompute':>10} {'step ms':>9} {'÷ none':>7} {'held KiB/mb rank0':>18} {'rank1':>8}")
    none = step_ms(("recompute", "none"))
    for mode in RECOMPUTE:
        t = step_ms(("recompute", mode))
        held = [results[r][("recompute", mode), "held"] / 1024 for r in sorted(results)]
        print(f"{mode:>10} {t:9.2f} {t / none:7.3f} {held[0]:18.0f} {held[-1]:8.0f}")


if __name__ == "__main__":
    main()
