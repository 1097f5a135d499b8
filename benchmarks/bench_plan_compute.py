"""One process, no communication: a model's measured forward, backward and optimizer step against
the planner's price of its counted operations — the compute half of the local planner, alone.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_plan_compute.py          # ~1 minute

The machine's compute fields (``labkit.plan.measure``'s one-engine probes: matmuls, memory,
the cache and what it loses by age) are measured
here in this process; each model then runs its training step as the executor does (gradients
accumulated into zeros, zeroed in place), and the step's three parts, each the median of five
timed runs, are printed beside ``Machine.seconds`` of the ops ``labkit.plan.local.work.count``
recorded, the table's prices alone (``simulate`` times the pieces instead). The tiny models
show what the table cannot price (their host cost: only the pieces' timing holds it; their
arithmetic is nil); the others the products, elementwise ops
and cache at the benchmark's micro-batch sizes.
"""
from __future__ import annotations

import importlib
import os
import time
from statistics import median

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit.training import build_model, build_optimizer, resolve_data, resolve_loss  # noqa: E402
from labkit.plan import Machine  # noqa: E402
from labkit.plan.local.work import count, warm  # noqa: E402


def models() -> list[tuple[str, dict, int]]:
    tiny = labkit.data.text(batch=1, block_size=4)
    text = labkit.data.text(batch=8, block_size=64)
    llama = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=text.vocab_size)
    return [
        ("tiny mlp 8x8", dict(model=labkit.models.mlp(width=8, depth=8)), 2),
        ("tiny llama 4x8", dict(model=labkit.models.llama(n_layer=4, n_head=2, n_embd=8, block_size=4,
                                                          vocab_size=tiny.vocab_size), data=tiny,
                                loss="cross_entropy"), 1),
        ("mlp512x8", dict(model=labkit.models.mlp(width=512, depth=8)), 32),
        ("mlp512x8", dict(model=labkit.models.mlp(width=512, depth=8)), 16),
        ("mlp1024x4", dict(model=labkit.models.mlp(width=1024, depth=4)), 32),
        ("mlp256x16", dict(model=labkit.models.mlp(width=256, depth=16)), 32),
        ("llama4x128", dict(model=labkit.models.llama(**llama), data=text, loss="cross_entropy"), 4),
        ("moe4x128e4", dict(model=labkit.models.llama(**llama, n_experts=4, top_k=2), data=text,
                            loss="cross_entropy"), 4),
    ]


def measured(spec: dict, rows: int, steps: int = 10, runs: int = 5) -> tuple[float, float, float]:
    """Seconds of forward (with the loss), backward and optimizer step: medians of ``runs`` runs."""
    net = build_model(spec["model"], 0)
    x, y = resolve_data(spec.get("data"), net, rows, 0)(0)
    x, y = x[:rows], y[:rows]
    loss = resolve_loss(spec.get("loss", "mse"))
    opt = build_optimizer(net.parameters(), lr=0.01, optimizer="sgd")
    parts = []
    for k in range(runs + 1):
        total = [0.0, 0.0, 0.0]
        for _ in range(steps):
            t0 = time.perf_counter()
            value = loss(net(x), y)
            t1 = time.perf_counter()
            value.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            t3 = time.perf_counter()
            total = [a + b for a, b in zip(total, (t1 - t0, t2 - t1, t3 - t2))]
        if k:                               # the first run warms up
            parts.append([t / steps for t in total])
    return tuple(median(p[i] for p in parts) for i in range(3))


def priced(machine: Machine, spec: dict, rows: int) -> tuple[float, float, float]:
    work = warm(count(spec["model"], rows, spec.get("data"), spec.get("loss", "mse")), machine.cache_bytes)
    pieces = [work.pre] + list(work.blocks) + [work.post]
    return (sum(machine.seconds(p.fwd.ops) for p in pieces), sum(machine.seconds(p.bwd.ops) for p in pieces),
            machine.seconds(work.optimizer.ops))


def main() -> None:
    torch.set_num_threads(1)
    measure = importlib.import_module("labkit.plan.local.measure")
    probes, _ = measure._alone(0.2, None)
    dram = measure._shared(0.2)                 # one process: its share is the whole bus
    machine = Machine.of(cores=1.0, **probes, dram_Bps=dram)
    print(f"cache {machine.cache_bytes / 2 ** 20:.0f} MiB")
    print(f"{'model':>16} {'rows':>4} | {'forward ms':>17} | {'backward ms':>17} | {'optimizer ms':>17}")
    print(f"{'':>16} {'':>4} | {'meas':>5} {'pred':>5} {'ratio':>5} | {'meas':>5} {'pred':>5} {'ratio':>5} | "
          f"{'meas':>5} {'pred':>5} {'ratio':>5}")
    for name, spec, rows in models():
        m, p = measured(spec, rows), priced(machine, spec, rows)
        cells = " | ".join(f"{1e3 * a:5.2f} {1e3 * b:5.2f} {b / a:5.2f}" for a, b in zip(m, p))
        print(f"{name:>16} {rows:>4} | {cells}", flush=True)


if __name__ == "__main__":
    main()
