"""Start-up memory per rank: the whole model built on every engine, against each engine
materialising only what its rank holds (``RunSpec.init="per_rank"``, labkit.parallel.materialize).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_meta.py      # ~2–3 minutes

Model: gpt, 6 layers of n_embd 1024 (16 heads), vocab 128, untied, block 64: 76 M parameters,
289 MiB in float32. Strategies on 2 engines: tp=2 (megatron), pp=2, dp=2 with zero=3. Each cell starts a
fresh lab (peak RSS is a high-water mark over the process's life), builds the run's job on
both engines (``engine.setup_run``: no step), then reads on each rank: the peak RSS growth
over the engine's RSS before the build (``ru_maxrss``, what the build cost), the RSS after,
and the bytes the replay counted (its peak, what the rank kept). RSS includes torch's
allocator slack and the process's other growth: read it as a shape, the counted bytes as
the exact figure. The engines run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc otherwise keeps
freed multi-MB buffers in its heap, and RSS stays at the high-water mark of everything ever
allocated), and the baseline is taken after one tiny recording (the dispatch-mode machinery's
imports, ~70 MiB once per process, are not the model's).
"""
from __future__ import annotations

import argparse
import os
import uuid

import labkit
from labkit import engine
from labkit.parallel.build import RunSpec

MB = 2 ** 20


def rss(warm: bool = False) -> dict:
    import resource

    import labkit.parallel.materialize as m
    if warm:       # the dispatch-mode machinery's first use imports modules (~70 MiB, once per process)
        m.record(labkit.models.mlp(width=8, depth=2))
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * resource.getpagesize()
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "now": now,
            "counted": dict(m.LAST)}


def cell(strategy: labkit.Strategy, init: str, make, data) -> list[dict]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)    # big buffers mmap'd: freed ones leave RSS
    lab = labkit.Lab.start(engines=2, timeout=120, progress=False)
    try:
        lab.ensure_groups(strategy.dp, strategy.pp, strategy.tp, strategy.cp)
        before = lab.apply(rss, True)
        spec = RunSpec(strategy, make, data=data, loss="cross_entropy", batch=8, steps=1, init=init)
        lab.apply(engine.setup_run, spec, uuid.uuid4().hex[:12])
        after = lab.apply(rss)
    finally:
        lab.close()
    return [{"growth": a["peak"] - b["now"], "after": a["now"] - b["now"], **a["counted"]}
            for b, a in zip(before, after)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=1024)
    args = parser.parse_args()
    data = labkit.data.text(batch=8, block_size=64)
    make = labkit.models.gpt(n_layer=args.layers, n_head=16, n_embd=args.embd, block_size=64,
                             vocab_size=max(128, data.vocab_size), tie=False)
    whole = make.num_parameters() * 4
    print(f"model: {make.num_parameters() / 1e6:.1f} M parameters, {whole / MB:.0f} MiB float32")
    print("| strategy | init | rank | peak RSS growth MiB | RSS after MiB | replay peak MiB | kept MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for strategy in (labkit.Strategy(tp=2), labkit.Strategy(pp=2), labkit.Strategy(dp=2, zero=3)):
        for init in ("whole", "per_rank"):
            for rank, r in enumerate(cell(strategy, init, make, data)):
                counted = (f"{r['peak_bytes'] / MB:.0f} | {r['kept_bytes'] / MB:.0f}" if "peak_bytes" in r
                           else "– | –")
                print(f"| {strategy.label()} | {init} | {rank} | {r['growth'] / MB:.0f} | {r['after'] / MB:.0f} | "
                      f"{counted} |", flush=True)


if __name__ == "__main__":
    main()
