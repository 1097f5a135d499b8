"""Model-state memory per rank, stage by stage: measured bytes as stacked bars, the ZeRO paper's
formula (fp32: (4 + 4 + K)·Ψ, divided by N_d term by term, Figure 1) as a tick beside each bar.

>>> runs = {z: lab.run(Strategy(dp=2, zero=z), model=m, optimizer="adamw") for z in range(4)}
>>> labkit.view.memory.plot_memory(runs, optimizer="adamw")
"""
from __future__ import annotations

from ..parallel.zero import model_state_bytes, optimizer_state_factor

PARTS = (("params", "parameters", "#0072B2"), ("grads", "gradients", "#E69F00"),
         ("optimizer", "optimizer state", "#009E73"), ("activations_peak", "activations (peak)", "#BBBBBB"))


def memory_table(runs: dict, optimizer: str = "sgd", momentum: float = 0.0, peak: bool = False) -> list[dict]:
    """One row per (stage, rank): measured bytes of each part and the formula's total.

    ``runs`` maps a ZeRO stage to its Run; ``peak`` takes each part at its most during a step
    instead of at rest (after the step).
    """
    rows = []
    k = optimizer_state_factor(optimizer, momentum)
    for stage, run in sorted(runs.items()):
        psi = sum(v.numel() for v in run.parameters().values())
        formula = model_state_bytes(psi, run.strategy.dp, stage, k)
        for rank, held in enumerate(run.metrics["memory_bytes"]):
            row = {"stage": stage, "rank": rank}
            for key, _, _ in PARTS:
                row[key] = held.get(f"{key}_peak" if peak and key != "activations_peak" else key, 0)
            row["formula"] = formula["total"]
            row["measured"] = row["params"] + row["grads"] + row["optimizer"]
            rows.append(row)
    return rows


def plot_memory(runs: dict, optimizer: str = "sgd", momentum: float = 0.0, peak: bool = False, ax=None):
    """A stacked bar per rank for each stage (bytes), the formula's model state as a black tick."""
    import matplotlib.pyplot as plt

    rows = memory_table(runs, optimizer, momentum, peak)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.8 + 0.5 * len(rows), 3.2), layout="constrained")
    labels = [f"z{r['stage']}\nr{r['rank']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, name, color in PARTS:
        values = [r[key] / 1024 for r in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(labels, [r["formula"] / 1024 for r in rows], marker="_", s=600, color="black",
               label="ZeRO formula (model state)", zorder=3)
    ax.set_ylabel("KiB per rank" + (" (peak)" if peak else " (at rest)"))
    ax.set_title("model state per rank, stage by stage")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
