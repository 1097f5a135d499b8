"""Loss curves drawn: the settings of :func:`labkit.bench.curves.loss_curves` beside the
fp32 reference, their departure from it per step, and the bytes each sends.

>>> labkit.view.curves.plot_curves(curves)        # what curves.plot() draws
"""
from __future__ import annotations


def plot_curves(curves):
    """Loss (solid) and validation loss (dashed) against the reference, the parameters'
    departure from the reference per step, and bytes per step. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap, ax_bytes) = plt.subplots(1, 3, figsize=(14, 3.8))
    steps = range(len(curves.reference_losses))
    ax_loss.plot(steps, curves.reference_losses, "k-", lw=2, label="reference")
    ax_loss.plot(steps, curves.reference_val_losses, "k--", lw=2)
    for c in curves.curves:
        line, = ax_loss.plot(steps, c.losses, lw=1, label=c.label)
        ax_loss.plot(steps, c.val_losses, "--", lw=1, color=line.get_color())
        ax_gap.semilogy(steps, [max(g, 1e-10) for g in c.param_gaps], color=line.get_color(), label=c.label)
    ax_bytes.bar([c.label for c in curves.curves], [c.bytes_per_step[-1] / 1024 for c in curves.curves],
                 color=[line.get_color() for line in ax_gap.get_lines()])
    ax_loss.set(xlabel="step", ylabel="loss (dashed: validation)", title="loss")
    ax_gap.set(xlabel="step", ylabel="max |parameter − reference|", title="departure from fp32")
    ax_bytes.set(ylabel="KiB sent per step (busiest rank)", title="bytes on the wire")
    ax_bytes.tick_params(axis="x", rotation=45)
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    return fig
