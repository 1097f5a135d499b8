"""Pipeline step time: labkit's gpipe and 1f1b against torch.distributed.pipelining.

    .venv/bin/python benchmarks/bench_pipeline.py                 # 2 engines, ~1-2 minutes
    .venv/bin/python benchmarks/bench_pipeline.py --microbatches 4 --rounds 5

Both run on the same engines (one rank each, gloo on CPU), on the same model split at the
same block boundaries (labkit's stage split), the same batch and micro-batches. torch's
ScheduleGPipe / Schedule1F1B drive PipelineStage objects built from those blocks, inside a
``lab.apply`` call. Each figure is the median step wall time (the slowest rank's, after a
barrier, first step of each run left out) over all rounds; runs are interleaved round by
round so drift in machine load hits all of them alike. labkit is measured as a notebook runs
it (timeline recorded, point-to-point header check on) and stripped (neither).
"""
from __future__ import annotations

import argparse
from statistics import median

import labkit

SCHEDULES = ("gpipe", "1f1b")


def torch_pipelining(schedule: str, model, batch: int, microbatches: int, steps: int, seed: int) -> list[float]:
    """On every engine: torch's own pipeline on labkit's split; per-step wall times."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from labkit.engine import session
    from labkit.parallel.pipeline.stages import stage_blocks
    from labkit.training import build_model, resolve_data

    s = session()
    pp, stage_index = s.groups.dims.pp, s.groups.coords[1]
    full = build_model(model, seed)
    blocks = stage_blocks(full, labkit.Strategy(pp=pp))[stage_index]
    submod = torch.nn.Sequential(*(full[i] for i in blocks)).to(s.device)
    data = resolve_data(None, full, batch, seed)
    stage = PipelineStage(submod, stage_index, pp, s.device, group=s.groups.pp)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipe = kind(stage, n_microbatches=microbatches, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(submod.parameters(), lr=0.1)
    times = []
    for step in range(steps):
        x, y = data(step)
        dist.barrier(group=s.groups.pp)
        t0 = time.perf_counter()
        if stage_index == 0:
            pipe.step(x.to(s.device))
        elif stage_index == pp - 1:
            pipe.step(target=y.to(s.device), losses=[])
        else:
            pipe.step()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def measure_labkit(lab, schedule: str, model, args, stripped: bool) -> list[float]:
    lab.apply(labkit.comm.set_p2p_check, not stripped)
    try:
        run = lab.run(labkit.Strategy(pp=lab.world_size, schedule=schedule, microbatches=args.microbatches),
                      model=model, batch=args.batch, steps=args.steps, record=not stripped)
    finally:
        lab.apply(labkit.comm.set_p2p_check, True)
    return run.step_times[1:]


def measure_torch(lab, schedule: str, model, args) -> list[float]:
    per_rank = lab.apply(torch_pipelining, schedule, model, args.batch, args.microbatches, args.steps, 0)
    return [max(ts) for ts in zip(*per_rank)][1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=2, help="pipeline stages (one engine each)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    model = labkit.models.mlp(width=args.width, depth=args.depth)
    variants = ("torch", "labkit", "labkit stripped")
    times = {(s, v): [] for s in SCHEDULES for v in variants}
    with labkit.Lab.start(engines=args.engines, timeout=120) as lab:
        lab.run(labkit.Strategy(pp=args.engines), model=model, batch=args.batch, steps=1)   # groups, warm
        for r in range(args.rounds):
            for schedule in SCHEDULES:
                times[schedule, "torch"] += measure_torch(lab, schedule, model, args)
                times[schedule, "labkit"] += measure_labkit(lab, schedule, model, args, stripped=False)
                times[schedule, "labkit stripped"] += measure_labkit(lab, schedule, model, args, stripped=True)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {k: median(v) * 1e3 for k, v in times.items()}
    print(f"\npp={args.engines} engines, mlp width {args.width} depth {args.depth}, batch {args.batch}, "
          f"{args.microbatches} micro-batches, {args.rounds}×{args.steps - 1} measured steps each")
    print(f"{'schedule':>9} {'torch ms':>9} {'labkit ms':>10} {'÷ torch':>8} {'stripped ms':>12} {'÷ torch':>8}")
    for s in SCHEDULES:
        t, lk, bare = med[s, "torch"], med[s, "labkit"], med[s, "labkit stripped"]
        print(f"{s:>9} {t:9.2f} {lk:10.2f} {lk / t:8.3f} {bare:12.2f} {bare / t:8.3f}")


if __name__ == "__main__":
    main()
