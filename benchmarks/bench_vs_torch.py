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

labkit's engines rest between steps (each step is its own call from the notebook). On a loaded
machine Linux's scheduler favours a process that has just woken over one that never sleeps,
so a plain loop running its steps back to back came out ~1.5× *slower* than the same DDP on
labkit's engines. The plain loop therefore rests ``--gap-ms`` before each step as well.
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
from labkit.parallel.pipeline.stages import stage_blocks
from labkit.models.training import build_model, resolve_data

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
        time.sleep(a["gap_s"])
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss.item()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
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
        time.sleep(a["gap_s"])
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if rank == 0:
            pipe.step(x)
        elif rank == world - 1:
            pipe.step(target=y, losses=[])
        else:
            pipe.step()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def labkit_job(rank: int, world: int, a: dict) -> list[float]:
    """labkit's own job (the code an engine runs per step) in a plain process, no ipyparallel:
    splits what labkit's strategy code costs from what running it on an engine costs."""
    from labkit import comm
    from labkit.engine.grid import ParallelDims, build_groups
    from labkit.parallel.build import RunSpec, build_job
    from labkit.record.recorder import Recorder

    recorder = Recorder(rank, torch.device("cpu"), enabled=a["record"])
    comm.bind(comm.CommContext(rank, recorder, 120.0))
    mode, model = a["mode"], labkit.models.mlp(width=a["width"], depth=a["depth"])
    if mode == "1f1b":
        s, batch = labkit.Strategy(pp=world, schedule="1f1b", microbatches=a["microbatches"]), a["pp_batch"]
    else:
        s, batch = labkit.Strategy(dp=world, dp_mode=mode, bucket_mb=a["bucket_mb"]), a["batch"]
    groups = build_groups(ParallelDims(s.dp, s.pp, s.tp), rank, 120.0)
    job = build_job(RunSpec(s, model, batch=batch, steps=a["steps"], seed=a["seed"], record=a["record"]),
                    groups, recorder, torch.device("cpu"))
    times = []
    for step in range(a["steps"]):
        data = job.batch(step)
        time.sleep(a["gap_s"])
        comm.barrier()
        recorder.start_step(step)
        t0, c0 = time.perf_counter(), time.process_time()
        job.step(step, data)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
        recorder.drain()
    comm.bind(None)
    return times


PLAIN = {"ddp": plain_ddp, "1f1b": plain_1f1b, "job": labkit_job}


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

    def run(self, name: str, a: dict) -> tuple[list[float], list[float]]:
        """Wall and CPU seconds of each measured step (the slowest rank's), warm-up left out."""
        for q in self.commands:
            q.put((name, a))
        per_rank = [times for _, times in sorted(self.results.get(timeout=600) for _ in range(self.world))]
        steps = list(zip(*per_rank))[1:]
        return [max(w for w, _ in ranks) for ranks in steps], [max(c for _, c in ranks) for ranks in steps]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# -- labkit, on a lab's engines --------------------------------------------------------------
def engine_times(lab, mode: str, a: dict, record: bool) -> tuple[list[float], list[float]]:
    model = labkit.models.mlp(width=a["width"], depth=a["depth"])
    if mode == "1f1b":
        s, batch = labkit.Strategy(pp=lab.world_size, schedule="1f1b", microbatches=a["microbatches"]), a["pp_batch"]
    else:
        s, batch = labkit.Strategy(dp=lab.world_size, dp_mode=mode, bucket_mb=a["bucket_mb"]), a["batch"]
    run = lab.run(s, model=model, batch=batch, steps=a["steps"], seed=a["seed"], record=record)
    return run.step_times[1:], []            # engines report wall time only


# (row, comparator, labkit mode or None for plain torch itself); labkit rows run recorded and not
ROWS = (("torch DDP", "ddp", None), ("labkit ddp", "ddp", "ddp"), ("labkit overlap", "ddp", "overlap"),
        ("torch Schedule1F1B", "1f1b", None), ("labkit 1f1b", "1f1b", "1f1b"))
WHERE = ("engines", "plain process")      # labkit on ipyparallel engines; labkit's job alone


def variants():
    for row, comparator, mode in ROWS:
        if mode is None:
            yield row, comparator, mode, None, None
            continue
        for where in WHERE:
            for record in (True, False):
                yield row, comparator, mode, where, record


def measure(args) -> dict:
    a = dict(width=args.width, depth=args.depth, batch=args.batch, bucket_mb=args.bucket_mb, steps=args.steps,
             seed=0, pp_batch=args.pp_batch, microbatches=args.microbatches, gap_s=args.gap_ms / 1e3)
    times = {v: ([], []) for v in variants()}
    with labkit.Lab.start(engines=args.ranks, timeout=120, progress=False) as lab:
        args.threads = lab.threads or 1
        plain = PlainTorch(args.ranks, args.threads)
        try:
            for r in range(args.rounds):
                for v in times:
                    row, comparator, mode, where, record = v
                    if mode is None:
                        wall, cpu = plain.run(comparator, a)
                    elif where == "engines":
                        wall, cpu = engine_times(lab, mode, a, record)
                    else:
                        wall, cpu = plain.run("job", dict(a, mode=mode, record=record))
                    times[v][0].extend(wall)
                    times[v][1].extend(cpu)
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            plain.close()
    return {v: (median(w), median(c) if c else None) for v, (w, c) in times.items()}


def print_table(med: dict, args) -> None:
    print(f"\n{args.ranks} ranks, {args.threads} thread(s) per rank on both sides; "
          f"mlp width {args.width} depth {args.depth}; dp: batch {args.batch}, bucket {args.bucket_mb} MiB; "
          f"pp: batch {args.pp_batch}, {args.microbatches} micro-batches; "
          f"{args.rounds} rounds × {args.steps - 1} measured steps; medians of the slowest rank's step")
    print(f"{'':34} {'recorded':>19}   {'not recorded':>19}   {'CPU ms ÷ torch':>15}")
    print(f"{'':34} {'ms':>9} {'÷ torch':>9}   {'ms':>9} {'÷ torch':>9}   {'rec':>7} {'no rec':>7}")
    base = {}
    for v, (wall, cpu) in med.items():
        row, comparator, mode, where, record = v
        if mode is None:
            base[comparator] = (wall, cpu)
            print(f"{row + ' (plain processes)':34} {1e3 * wall:9.2f} {1.0:9.3f}   {'':>9} {'':>9}   "
                  f"{1e3 * cpu:7.2f}ms")
        elif record:
            (on, on_cpu), (off, off_cpu) = med[v], med[row, comparator, mode, where, False]
            b, b_cpu = base[comparator]
            cpu_text = f"{on_cpu / b_cpu:7.3f} {off_cpu / b_cpu:7.3f}" if on_cpu is not None else ""
            print(f"{row + ', ' + where:34} {1e3 * on:9.2f} {on / b:9.3f}   {1e3 * off:9.2f} {off / b:9.3f}   {cpu_text}")


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
    p.add_argument("--gap-ms", type=float, default=10.0, help="rest before each plain torch step (see above)")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
