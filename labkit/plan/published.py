"""A published table to check the planner against, row by row.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: weak scaling of GPT models
from 1.7B to 1T parameters on DGX A100 (80 GB) nodes, 8 GPUs per node with NVLink,
8×200 Gb/s HDR InfiniBand per node; sequence 2048, vocabulary 51,200; mixed precision,
activation recomputation on every layer. "Achieved TFLOP/s per GPU" counts FLOPs with the
paper's eq. 3 (recomputation included), which :func:`labkit.plan.step.hardware_flops` follows.

    >>> rows = compare()          # one dict per row: published and predicted TFLOP/s, error
    >>> print(table(rows))
"""
from __future__ import annotations

from .hardware import GPT, Cluster

# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU)
MEGATRON_SC21_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def rows() -> list[dict]:
    """The table as dicts: model, cluster, degrees, batch and the published TFLOP/s."""
    out = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_SC21_TABLE1:
        out.append({"billions": billions, "model": GPT(layers=layers, hidden=hidden, heads=heads),
                    "cluster": Cluster.of(gpus, "a100"), "tp": tp, "pp": pp, "dp": gpus // (tp * pp),
                    "batch": batch, "published_tflops": tflops})
    return out


def compare(microbatch_sizes=(1, 2, 4, 8)) -> list[dict]:
    """Predict each row at its published degrees: the best micro-batch size and schedule
    that fit (the published runs were tuned the same way) among the schedules Megatron-LM had
    then (1F1B and interleaved: zb-h1 came in 2023), full recomputation, gradients reduced
    after backward as Megatron-LM did then."""
    from .search import best_at

    result = []
    for row in rows():
        p = best_at(row["model"], row["cluster"], row["batch"], dp=row["dp"], pp=row["pp"], tp=row["tp"],
                    recompute=("full",), microbatch_sizes=microbatch_sizes, dp_overlap=False,
                    schedules=("1f1b", "interleaved"))
        err = (p.tflops_per_gpu - row["published_tflops"]) / row["published_tflops"] if p else float("nan")
        result.append({**row, "prediction": p, "predicted_tflops": p.tflops_per_gpu if p else float("nan"),
                       "error": err})
    return result


def table(result: list[dict]) -> str:
    lines = [f"{'params':>8} {'tp':>3} {'pp':>3} {'dp':>4} {'batch':>5} {'strategy':>34} "
             f"{'published':>9} {'predicted':>9} {'error':>7}"]
    for r in result:
        label = r["prediction"].strategy.label() if r["prediction"] else "does not fit"
        lines.append(f"{r['billions']:>7.1f}B {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['batch']:>5} {label:>34} "
                     f"{r['published_tflops']:>9.0f} {r['predicted_tflops']:>9.1f} {100 * r['error']:>6.1f}%")
    worst = max(abs(r["error"]) for r in result)
    lines.append(f"worst |error| {100 * worst:.1f}%, mean |error| "
                 f"{100 * sum(abs(r['error']) for r in result) / len(result):.1f}%  (TFLOP/s per GPU, A100)")
    return "\n".join(lines)
