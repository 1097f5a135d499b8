"""labkit against plain torch: what the lab's harness costs a step.

    .venv/bin/python benchmarks/bench_vs_torch.py                  # 2 ranks, ~3 minutes
    .venv/bin/python benchmarks/bench_vs_torch.py --rounds 7 --steps 30

torch runs in its own plain processes (``torch.multiprocessing`` spawn, gloo, no ipyparallel,
the same threads per rank as labkit's engines): ``DistributedDataParallel`` with the same
bucket size, and ``torch.distributed.pipelining``'s ``Schedule1F1B`` on labkit's stage split.
labkit runs its ``ddp`` and ``overlap`` data-parallel modes and its ``1f1b`` pipeline on the
same model, batch, data and buckets, with the timeline recorded and without.

Each figure is the median over all measured steps of all rounds of the slowest rank's step
wall time, taken the same way on both sides (after an aligning barrier, to the end of the
optimizer step; the first step of each run is warm-up). Rounds interleave every variant, so
drift in machine load hits both sides alike. Ratios are labkit ÷ plain torch.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings
from datetime import timedelta
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import labkit
from labkit.strategies.pipeline import stage_blocks
from labkit.training import build_model, resolve_data

MiB = 1024 * 1024


# -- plain torch, one process per rank -------------------------------------------------------
def plain_ddp(rank: int, world: int, a: dict) -> list[float]:
    """torch's DDP loop as a user writes it; per-step wall times from the aligning barrier."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(labkit.models.mlp(width=a["width"], depth=a["depth"]), a["seed"])
    data = resolve_data(None, model, a["batch"], a["seed"])
    ddp = DDP(model, bucket_cap_mb=a["bucket_mb"], broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = a["batch"] // world
    times = []
    for step in range(a["steps"]):
        x, y = data(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def plain_1f1b(rank: int, world: int, a: dict) -> list[float]:
    """torch.distributed.pipelining's Schedule1F1B on labkit's split of the same model."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    full = build_model(labkit.models.mlp(width=a["width"], depth=a["depth"]), a["seed"])
    blocks = stage_blocks(full, labkit.Strategy(pp=world))[rank]
    submod = torch.nn.Sequential(*(full[i] for i in blocks))
    data = resolve_data(None, full, a["pp_batch"], a["seed"])
    stage = PipelineStage(submod, rank, world, torch.device("cpu"))
    pipe = Schedule1F1B(stage, n_microbatches=a["microbatches"], loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(submod.parameters(), lr=0.1)
    times = []
    for step in range(a["steps"]):
        x, y = data(step)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            pipe.step(x)
        elif rank == world - 1:
            pipe.step(target=y, losses=[])
        else:
            pipe.step()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    return times


PLAIN = {"ddp": plain_ddp, "1f1b": plain_1f1b}


def _worker(rank: int, world: int, port: int, threads: int, commands, results) -> None:
    warnings.filterwarnings("ignore", message=".*broadcast_buffers")     # torch 2.13 renames it; same meaning
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    while (command := commands[rank].get()) is not None:
        name, a = command
        results.put((rank, PLAIN[name](rank, world, a)))
    dist.destroy_process_group()


class PlainTorch:
    """``world`` spawned processes that stay up between rounds and run one loop per command."""

    def __init__(self, world: int, threads: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.store.port, threads, self.commands,
                                                        self.results), daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name: str, a: dict) -> list[float]:
        for q in self.commands:
            q.put((name, a))
        per_rank = dict(self.results.get(timeout=600) for _ in range(self.world))
        return [max(ts) for ts in zip(*per_rank.values())][1:]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# -- labkit, on a lab's engines --------------------------------------------------------------
def labkit_times(lab, variant: str, a: dict, record: bool) -> list[float]:
    model = labkit.models.mlp(width=a["width"], depth=a["depth"])
    if variant == "1f1b":
        s = labkit.Strategy(pp=lab.world_size, schedule="1f1b", microbatches=a["microbatches"])
        run = lab.run(s, model=model, batch=a["pp_batch"], steps=a["steps"], seed=a["seed"], record=record)
    else:
        s = labkit.Strategy(dp=lab.world_size, dp_mode=variant, bucket_mb=a["bucket_mb"])
        run = lab.run(s, model=model, batch=a["batch"], steps=a["steps"], seed=a["seed"], record=record)
    return run.step_times[1:]


VARIANTS = (  # (row label, plain torch comparator, labkit mode or None for torch itself, record)
    ("torch DDP", "ddp", None, None),
    ("labkit ddp", "ddp", "ddp", True), ("labkit ddp", "ddp", "ddp", False),
    ("labkit overlap", "ddp", "overlap", True), ("labkit overlap", "ddp", "overlap", False),
    ("torch Schedule1F1B", "1f1b", None, None),
    ("labkit 1f1b", "1f1b", "1f1b", True), ("labkit 1f1b", "1f1b", "1f1b", False),
)


def measure(args) -> dict:
    a = dict(width=args.width, depth=args.depth, batch=args.batch, bucket_mb=args.bucket_mb, steps=args.steps,
             seed=0, pp_batch=args.pp_batch, microbatches=args.microbatches)
    times = {v: [] for v in VARIANTS}
    with labkit.Lab.start(engines=args.ranks, timeout=120, progress=False) as lab:
        args.threads = lab.threads or 1
        plain = PlainTorch(args.ranks, args.threads)
        try:
            for r in range(args.rounds):
                for v in VARIANTS:
                    label, comparator, mode, record = v
                    times[v] += plain.run(comparator, a) if mode is None else labkit_times(lab, mode, a, record)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            plain.close()
    return {v: median(ts) for v, ts in times.items()}


def print_table(med: dict, args) -> None:
    print(f"\n{args.ranks} ranks, {args.threads} thread(s) per rank on both sides; "
          f"mlp width {args.width} depth {args.depth}; dp: batch {args.batch}, bucket {args.bucket_mb} MiB; "
          f"pp: batch {args.pp_batch}, {args.microbatches} micro-batches; "
          f"{args.rounds} rounds × {args.steps - 1} measured steps; medians")
    print(f"{'':20} {'step ms':>9} {'÷ torch':>8}   {'no-record ms':>12} {'÷ torch':>8}")
    base = {"ddp": med[VARIANTS[0]], "1f1b": med[VARIANTS[5]]}
    for label, comparator, mode, record in VARIANTS:
        if mode is None:
            print(f"{label:20} {1e3 * med[label, comparator, mode, record]:9.2f} {1.0:8.3f}")
        elif record:
            on, off = med[label, comparator, mode, True], med[label, comparator, mode, False]
            b = base[comparator]
            print(f"{label:20} {1e3 * on:9.2f} {on / b:8.3f}   {1e3 * off:12.2f} {off / b:8.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="data-parallel global batch")
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--pp-batch", type=int, default=64, help="pipeline global batch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
