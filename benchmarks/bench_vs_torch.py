"""labkit against plain torch: what the lab's harness costs a step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vs_torch.py        # 2 ranks, ~5 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vs_torch.py --rounds 15 --steps 30

torch runs in its own plain processes (``torch.multiprocessing`` spawn, gloo, no ipyparallel,
the same threads per rank as labkit's engines): ``DistributedDataParallel`` with the same
bucket size, and ``torch.distributed.pipelining``'s ``Schedule1F1B`` on labkit's stage split.
labkit runs its ``ddp`` and ``overlap`` data-parallel modes and its ``1f1b`` pipeline on the
same model, batch, data and buckets, with the timeline recorded and without. A second torch
row registers torch's own Python ``allreduce_hook``: recorded ddp times each bucket through a
Python comm hook (no other way to see a DDP bucket end on gloo), so that row is the floor any
per-bucket timing of DDP pays, and recorded ddp is also shown against it.

Each round runs every variant once; a variant's figure for the round is the median over its
measured steps of the slowest rank's step, taken the same way on both sides (after an aligning
barrier, to the end of the optimizer step; the first step of each run is warm-up). A ratio is
labkit ÷ plain torch *in the same round*, so drift in machine load between rounds cancels; the
table gives the median ratio over rounds and the middle half of them, which is the honest
resolution of the figure (on a shared 2-core VM a round's ratio swings by ±10 %). CPU time
(every thread of the process, gloo's included) is far steadier than wall time: it says what
labkit's code costs; wall time adds what the harness's processes take from the cores.

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
from labkit.training import build_model, resolve_data

MiB = 1024 * 1024


# -- plain torch, one process per rank -------------------------------------------------------
def plain_ddp(rank: int, world: int, a: dict) -> list[float]:
    """torch's DDP loop as a user writes it; per-step wall times from the aligning barrier."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(labkit.models.mlp(width=a["width"], depth=a["depth"]), a["seed"])
    data = resolve_data(None, model, a["batch"], a["seed"])
    ddp = DDP(model, bucket_cap_mb=a["bucket_mb"], broadcast_buffers=False)
    if a.get("hook"):           # torch's own Python all-reduce hook: what timing each bucket costs DDP
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp.register_comm_hook(None, allreduce_hook)
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
    from labkit.engine.grid import build_groups
    from labkit.grid import ParallelDims
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


PLAIN = {"ddp": plain_ddp, "ddp_hook": lambda rank, world, a: plain_ddp(rank, world, dict(a, hook=True)),
         "1f1b": plain_1f1b, "job": labkit_job}


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
    return run.step_times[1:], run.step_cpu_times[1:]


# (row, comparator, labkit mode or None for plain torch itself); labkit rows run recorded and not
ROWS = (("torch DDP", "ddp", None), ("torch DDP, Python hook", "ddp_hook", None),
        ("labkit ddp", "ddp", "ddp"), ("labkit overlap", "ddp", "overlap"),
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
    """Per variant, per round: (median wall, median CPU) of its measured steps."""
    a = dict(width=args.width, depth=args.depth, batch=args.batch, bucket_mb=args.bucket_mb, steps=args.steps,
             seed=0, pp_batch=args.pp_batch, microbatches=args.microbatches, gap_s=args.gap_ms / 1e3)
    rounds = {v: [] for v in variants()}
    with labkit.Lab.start(engines=args.ranks, timeout=120, progress=False) as lab:
        args.threads = lab.threads or 1
        plain = PlainTorch(args.ranks, args.threads)
        try:
            for r in range(args.rounds):
                for v in rounds:
                    row, comparator, mode, where, record = v
                    if mode is None:
                        wall, cpu = plain.run(comparator, a)
                    elif where == "engines":
                        wall, cpu = engine_times(lab, mode, a, record)
                    else:
                        wall, cpu = plain.run("job", dict(a, mode=mode, record=record))
                    rounds[v].append((median(wall), median(cpu)))
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            plain.close()
    return rounds


def ratio_text(mine: list, base: list, k: int) -> str:
    """Median over rounds of (this variant ÷ torch in the same round), with the middle half of
    the rounds' ratios: machine load drifts between rounds, so one round's pair is compared."""
    ratios = sorted(m[k] / b[k] for m, b in zip(mine, base))
    q = len(ratios) // 4
    return f"{median(ratios):6.3f} {ratios[q]:5.2f}–{ratios[-q - 1]:<5.2f}"


def print_table(rounds: dict, args) -> None:
    print(f"\n{args.ranks} ranks, {args.threads} thread(s) per rank on both sides; "
          f"mlp width {args.width} depth {args.depth}; dp: batch {args.batch}, bucket {args.bucket_mb} MiB; "
          f"pp: batch {args.pp_batch}, {args.microbatches} micro-batches; "
          f"{args.rounds} rounds × {args.steps - 1} measured steps; the slowest rank's step, median per round;")
    print("ratios: median over rounds of labkit ÷ torch in the same round (middle half of the rounds)\n")
    print(f"{'':34} {'wall, recorded':>21}   {'wall, not recorded':>21}   {'CPU, rec':>18}   {'CPU, no rec':>18}")
    print(f"{'':34} {'ms':>7} {'÷ torch':>13}   {'ms':>7} {'÷ torch':>13}   {'÷ torch':>18}   {'÷ torch':>18}")
    base = {}
    for v, per_round in rounds.items():
        row, comparator, mode, where, record = v
        wall = median(w for w, _ in per_round)
        if mode is None and comparator == "ddp_hook":       # torch's own price of a Python hook
            b = base["ddp"]
            print(f"{row:34} {1e3 * wall:7.2f} {ratio_text(per_round, b, 0)}   {'':>21}   "
                  f"{ratio_text(per_round, b, 1):>18}")
            base[comparator] = per_round
        elif mode is None:
            base[comparator] = per_round
            cpu = median(c for _, c in per_round)
            print(f"{row + ' (plain processes)':34} {1e3 * wall:7.2f} {'1':>13}   {'':>21}   CPU {1e3 * cpu:.2f} ms")
        elif record:
            off = rounds[row, comparator, mode, where, False]
            b = base[comparator]
            print(f"{row + ', ' + where:34} {1e3 * wall:7.2f} {ratio_text(per_round, b, 0)}   "
                  f"{1e3 * median(w for w, _ in off):7.2f} {ratio_text(off, b, 0)}   "
                  f"{ratio_text(per_round, b, 1):>18}   {ratio_text(off, b, 1):>18}")
            if mode == "ddp":        # recorded ddp times each bucket through a Python hook, as this row does
                print(f"{'  recorded ÷ torch with its hook':34} {'':7} {ratio_text(per_round, base['ddp_hook'], 0)}")


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
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--gap-ms", type=float, default=10.0, help="rest before each plain torch step (see above)")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
