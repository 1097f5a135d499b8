"""Gradient compression, accuracy against bytes: the same small training under each
compression, its loss curves and the bytes each rank put on the wire.

    >>> rows = labkit.bench.compression_tradeoff(lab, steps=30, lr=0.3)
    >>> labkit.bench.plot_tradeoff(rows)
"""
from __future__ import annotations

DEFAULT_TRADEOFF = (("none", True), ("fp16", True), ("bf16", True), ("int8", True), ("int8", False))


def compression_tradeoff(lab, model=None, configs=DEFAULT_TRADEOFF, steps: int = 30, batch: int = 32,
                         lr: float = 0.1, seed: int = 0, dp_mode: str = "bucketed", bucket_mb: float = 1.0,
                         data=None) -> list[dict]:
    """Train the same model under each (compression, error_feedback) in ``configs``.

    Returns one row per config: label, losses, final loss, bytes each rank sent per step,
    step time. Same seed, data and initial weights for every row, so the curves differ only
    by what compression did to the gradients.
    """
    from ..config import Strategy
    from ..models import mlp

    model = model or mlp(width=32, depth=2, in_features=16, out_features=4)
    rows, baseline = [], None
    for compression, error_feedback in configs:
        strategy = Strategy(dp=lab.world_size, dp_mode=dp_mode, bucket_mb=bucket_mb, compression=compression,
                            error_feedback=error_feedback)
        run = lab.run(strategy, model=model, data=data, batch=batch, steps=steps, lr=lr, seed=seed)
        if compression == "none" and baseline is None:
            baseline = run
        label = compression if compression == "none" else f"{compression}{'' if error_feedback else ', no EF'}"
        rows.append({"label": label, "compression": compression, "error_feedback": error_feedback,
                     "losses": run.losses, "final_loss": run.losses[-1], "run": run,
                     "bytes_per_step": run.metrics["bytes_sent"][0], "step_time_s": run.metrics["step_time_s"]})
    for row in rows:           # how far compression moved training from the uncompressed run
        if baseline is not None:
            row["loss_gap"] = [abs(a - b) for a, b in zip(row["losses"], baseline.losses)]
            row["param_diff"] = row["run"].max_diff(baseline)
    return rows


def plot_tradeoff(rows: list[dict]):
    """Loss curves (left), their distance from the uncompressed run (middle), and bytes per
    step against how far the weights drifted from the uncompressed run (right)."""
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_g, ax_b) = plt.subplots(1, 3, figsize=(14, 4))
    for i, r in enumerate(rows):
        style = "--" if not r["error_feedback"] else "-"
        ax_l.semilogy(range(len(r["losses"])), r["losses"], style, color=f"C{i}", label=r["label"])
        if r["compression"] == "none":      # the baseline: no gap, no drift; its bytes as a line
            ax_b.axvline(r["bytes_per_step"], color=f"C{i}", ls=":", label=f"{r['label']} (no drift)")
            continue
        if r.get("loss_gap"):               # exact zeros (step 0) have no place on a log axis
            gap = [g if g > 0 else float("nan") for g in r["loss_gap"]]
            ax_g.semilogy(range(len(gap)), gap, style, color=f"C{i}", label=r["label"])
        if r.get("param_diff", 0) > 0:
            ax_b.scatter(r["bytes_per_step"], r["param_diff"], color=f"C{i}", label=r["label"])
    ax_l.set(xlabel="step", ylabel="loss", title="training loss")
    ax_g.set(xlabel="step", ylabel="|loss − loss without compression|", title="what compression cost")
    ax_b.set(xscale="log", yscale="log", xlabel="bytes sent per rank per step",
             ylabel="max |w − w without compression|", title="bytes vs drift at the end")
    ax_l.legend(fontsize="small")
    ax_b.legend(fontsize="small")
    fig.tight_layout()
    return fig
