"""Mixture-of-experts routing over a run: tokens per expert (or per expert-parallel rank) each
step, one panel per MoE layer, and how uneven it is (max / mean: 1 is balanced); and the
time each rank spends in (or waits on) the experts' all-to-alls.

>>> run = lab.run(Strategy(dp=4, ep=2), model=labkit.models.llama(n_experts=4, router_skew=0.5), ...)
>>> labkit.view.experts.plot_routing(run)                 # the rank holding expert 0 gets the most
>>> labkit.view.experts.plot_routing(run, by="ep_rank")
>>> labkit.view.experts.all_to_all_ms(run, "mlp combine")   # per rank: ms per step in the combines
>>> labkit.view.experts.all_to_all_ms(run, exposed=True)    # per rank: ms the compute lane waited on them
"""
from __future__ import annotations

from ..parallel.expert import imbalance

BY = {"expert": ("tokens_per_expert", "expert"), "ep_rank": ("tokens_per_ep_rank", "ep rank")}


def routing_table(run, by: str = "expert") -> list[dict]:
    """One row per (step, layer): the tokens each expert (``by="expert"``) or each rank of an ep
    group (``by="ep_rank"``, summed over the groups) received, and their max / mean."""
    if by not in BY:
        raise ValueError(f"routing_table: by={by!r} is unknown; use one of {', '.join(map(repr, BY))}")
    key = BY[by][0]
    steps = run.metrics.get(key)
    if not steps:
        raise ValueError(f"this run has no {key} metric: its model has no mixture-of-experts layer "
                         "(labkit.models.llama(n_experts=...))")
    return [{"step": step, "layer": layer, "tokens": counts, "imbalance": imbalance(counts)}
            for step, layers in enumerate(steps) for layer, counts in layers.items()]


def plot_routing(run, by: str = "expert", layers: list[str] | None = None, axes=None):
    """Grouped bars, one panel per MoE layer: for each step, the tokens of each expert (or ep
    rank) side by side; the panel's title gives the last step's max / mean."""
    import matplotlib.pyplot as plt

    rows = routing_table(run, by)
    names = layers or list(dict.fromkeys(r["layer"] for r in rows))
    if axes is None:
        _, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.0), layout="constrained", squeeze=False)
        axes = axes[0]
    for ax, name in zip(axes, names):
        mine = [r for r in rows if r["layer"] == name]
        n = len(mine[0]["tokens"])
        width = 0.8 / n
        for i in range(n):
            ax.bar([r["step"] + (i - (n - 1) / 2) * width for r in mine], [r["tokens"][i] for r in mine],
                   width=width, label=f"{BY[by][1]} {i}")
        ax.set_title(f"{name}: max/mean {mine[-1]['imbalance']:.2f}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("tokens")
    axes[0].legend(fontsize=7)
    return axes


def all_to_all_ms(run, suffix: str = "", exposed: bool = False) -> list[float]:
    """Per rank, milliseconds per step spent in all-to-alls whose name ends with ``suffix``
    (every one when empty), median over steps 1.. (step 0 warms up). ``exposed``: only the
    part no compute span of the rank covers, the time its compute lane waited on them."""
    from statistics import median

    from ..analysis.metrics import difference_length, total

    per: dict = {}
    for e in run.timeline.events:
        if e["step"] < 1:
            continue
        a2a, compute = per.setdefault((e["rank"], e["step"]), ([], []))
        if e["kind"] == "all_to_all" and e["name"].endswith(suffix):
            a2a.append((e["start"], e["end"]))
        elif e["stream"] == "compute":
            compute.append((e["start"], e["end"]))
    ranks = sorted({r for r, _ in per})
    measure = (lambda a, c: difference_length(a, c)) if exposed else (lambda a, c: total(a))
    return [1e3 * median(measure(*per[r, s]) for rr, s in per if rr == r) for r in ranks]
