"""Sharding step time in plain processes (torchrun-style, no ipyparallel): labkit's hand-built
zero=3 with prefetch ÷ torch's FSDP2 with prefetch, same model, same optimizer; and labkit's
zero=1/2/3 ÷ labkit's plain overlap DP.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero.py            # 2 ranks, ~1 minute
    .venv/bin/python benchmarks/bench_zero.py --rounds 5 --steps 30 --width 1024

Each rank builds labkit's job with the same builder ``lab.run`` uses (recording off), or, for
FSDP2, torch's own loop: ``fully_shard`` on each block and the root, ``reshard_after_forward``,
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, AdamW. Variants are
interleaved round by round; each figure is the median step over all measured steps (the first
of each round is warm-up). Times are wall seconds of the slowest rank.

Measured on the shared 2-core machine under load (load average 3–5, other developers'
tests running), defaults (mlp 512×8, batch 32, AdamW, 1 MiB buckets, prefetch 1, 3×11 steps):

    variant            step ms   ÷ overlap dp
    overlap dp           32.12          1.000
    zero=1               52.91          1.647
    zero=2               53.70          1.672
    zero=3               71.23          2.218
    zero=3 prefetch      69.39          2.160
    fsdp2 prefetch       98.29          3.060
    hand zero=3 prefetch ÷ FSDP2 prefetch: 0.706   (earlier runs, heavier load: 0.593, 0.718)

On 2 CPU cores the gloo threads doing the gathers compete with compute for the same cores,
so prefetch moves gathers under compute on the timeline without shortening the step.
"""
from __future__ import annotations

import argparse
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("overlap dp", "zero=1", "zero=2", "zero=3", "zero=3 prefetch", "fsdp2 prefetch")


def labkit_steps(rank: int, variant: str, args) -> list[float]:
    import labkit
    from labkit import comm
    from labkit.engine.grid import build_groups
    from labkit.grid import ParallelDims
    from labkit.parallel.build import RunSpec, build_job
    from labkit.record.recorder import Recorder

    zero = {"overlap dp": 0, "zero=1": 1, "zero=2": 2}.get(variant, 3)
    s = labkit.Strategy(dp=2, zero=zero, prefetch=args.prefetch if "prefetch" in variant else 0,
                        bucket_mb=args.bucket_mb)
    recorder = Recorder(rank, enabled=False)
    comm.bind(comm.CommContext(rank, recorder, 120))
    groups = build_groups(ParallelDims(2, 1, 1), rank, 120)
    spec = RunSpec(s, labkit.models.mlp(width=args.width, depth=args.depth), batch=args.batch,
                   steps=args.steps, lr=1e-3, record=False, optimizer="adamw")
    job = build_job(spec, groups, recorder, torch.device("cpu"))
    times = []
    for step in range(args.steps):
        batch = job.batch(step)
        dist.barrier()
        t0 = time.perf_counter()
        job.step(step, batch)
        times.append(time.perf_counter() - t0)
    return times[1:]


def fsdp2_steps(rank: int, args) -> list[float]:
    """torch's own: FSDP2 per block, prefetch k ahead, AdamW, the same model and batch."""
    import labkit
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from labkit.training import SyntheticRegression

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = labkit.models.mlp(width=args.width, depth=args.depth)()
    blocks = [b for b in model if any(True for _ in b.parameters())]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    k = args.prefetch
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + k])
        block.set_modules_to_backward_prefetch(blocks[max(i - k, 0):i][::-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticRegression(args.width, args.width, args.batch, 0)
    rows = slice(rank * args.batch // 2, (rank + 1) * args.batch // 2)
    times = []
    for step in range(args.steps):
        x, y = data(step)
        dist.barrier()
        t0 = time.perf_counter()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[1:]


def worker(rank: int, args, port: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)     # the parent holds the master
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    result = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            steps = fsdp2_steps(rank, args) if variant.startswith("fsdp2") else labkit_steps(rank, variant, args)
            result[variant] += steps
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)   # binds, exposes .port
    port = store.port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    per_rank = dict(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    med = {v: median(max(a, b) for a, b in zip(per_rank[0][v], per_rank[1][v])) for v in VARIANTS}
    print(f"2 ranks (plain processes, gloo), mlp width {args.width} depth {args.depth}, batch {args.batch}, "
          f"AdamW, bucket {args.bucket_mb} MiB, prefetch {args.prefetch}, {args.rounds}×{args.steps - 1} steps")
    print(f"{'variant':>16} {'step ms':>9} {'÷ overlap dp':>13}")
    for v in VARIANTS:
        print(f"{v:>16} {1e3 * med[v]:9.2f} {med[v] / med['overlap dp']:13.3f}")
    print(f"hand zero=3 prefetch ÷ FSDP2 prefetch: {med['zero=3 prefetch'] / med['fsdp2 prefetch']:.3f}")


if __name__ == "__main__":
    main()
