"""Loss curves that show what gradient compression costs: the same training under several
settings, beside the fp32 single-process reference, with the bytes each sends per step.

>>> curves = labkit.bench.curves.loss_curves(lab, labkit.models.mlp(width=128, depth=4), steps=20)
>>> curves              # a table: final loss and validation loss, max |Δ| from the reference, KiB/step
>>> curves.plot()       # loss and validation loss, parameters' departure per step, bytes per step

Validation loss is measured in the notebook process on held-out batches, ``data(step)`` at
steps training never reaches (from ``VALIDATION_STEP`` on: for the synthetic data, fresh
samples of the same teacher), with each step's parameters taken from the run's snapshots —
so every setting is judged on the same batches, after the same steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..analysis.events import SEND_KINDS
from ..analysis.tables import CellTable
from ..config import Strategy
from ..training import build_model, resolve_data, resolve_loss

SETTINGS = {
    "fp32": dict(dp_mode="overlap"),
    "fp16": dict(dp_mode="overlap", compression="fp16"),
    "bf16": dict(dp_mode="overlap", compression="bf16"),
    "int8": dict(dp_mode="overlap", compression="int8"),
    "fp8_e4m3": dict(dp_mode="overlap", compression="fp8_e4m3"),
    "fp8_e5m2": dict(dp_mode="overlap", compression="fp8_e5m2"),
    "powersgd": dict(dp_mode="ddp", compression="powersgd"),     # torch's hook: ddp mode only
}
VALIDATION_STEP = 1_000_000


@dataclass
class Curve:
    """One setting: per-step training and validation loss, bytes sent per step (busiest rank)."""

    label: str
    strategy: Strategy
    losses: list[float]
    val_losses: list[float]
    bytes_per_step: list[int]
    step_time_s: float
    param_gaps: list[float]
    """Per step, the largest |parameter − reference| over every parameter and rank."""

    @property
    def max_diff(self) -> float:
        return self.param_gaps[-1]


@dataclass(repr=False)      # the table's __repr__ (CellTable)
class Curves(CellTable):
    """Several settings' curves and the reference's; a table in the notebook, ``plot()`` draws them."""

    reference_losses: list[float]
    reference_val_losses: list[float]
    curves: list[Curve] = field(default_factory=list)

    def _cells(self):
        heads = ["setting", "loss", "val loss", "|Δ val| vs ref", "max |Δ param|", "KiB sent/step", "step (ms)"]
        ref_val = self.reference_val_losses[-1]
        body = [["reference", f"{self.reference_losses[-1]:.5f}", f"{ref_val:.5f}", "", "", "", ""]]
        for c in self.curves:
            body.append([c.label, f"{c.losses[-1]:.5f}", f"{c.val_losses[-1]:.5f}",
                         f"{abs(c.val_losses[-1] - ref_val):.2e}", f"{c.max_diff:.2e}",
                         f"{c.bytes_per_step[-1] / 1024:,.1f}", f"{1e3 * c.step_time_s:.1f}"])
        return heads, body

    def plot(self):
        """Loss and validation loss beside the reference, the parameters' departure, bytes per
        step (:func:`labkit.view.curves.plot_curves`)."""
        from ..view.curves import plot_curves

        return plot_curves(self)


def _strategy(setting, dp: int, bucket_mb: float) -> Strategy:
    if isinstance(setting, Strategy):
        return setting
    if setting not in SETTINGS:
        raise ValueError(f"setting {setting!r} is unknown; use one of {', '.join(map(repr, SETTINGS))} "
                         "or a labkit.Strategy")
    return Strategy(dp=dp, bucket_mb=bucket_mb, **SETTINGS[setting])


def _bytes_per_step(run) -> list[int]:
    sent: dict[tuple[int, int], int] = {}
    for e in run.timeline.events:
        if e["kind"] in SEND_KINDS:
            sent[(e["step"], e["rank"])] = sent.get((e["step"], e["rank"]), 0) + int(e.get("bytes") or 0)
    return [max((b for (s, _), b in sent.items() if s == step), default=0) for step in range(len(run.losses))]


def _param_gaps(snapshots: list[dict], reference: list[dict]) -> list[float]:
    """Per step, the largest |parameter − reference| (what ``labkit.drift`` compares with tol)."""
    return [max(float((t - ref[0]["params"][name]).abs().max()) for snap in by_rank.values()
                for name, t in snap["params"].items())
            for by_rank, ref in zip(snapshots, reference)]


def _val_losses(snapshots: list[dict], net, batches, loss_fn) -> list[float]:
    """Mean loss on ``batches`` after each step, with the step's parameters loaded into ``net``."""
    out = []
    named = dict(net.named_parameters())
    for by_rank in snapshots:
        with torch.no_grad():
            for snap in by_rank.values():           # each rank's part (pipeline stages hold disjoint parts)
                for name, value in snap["params"].items():
                    named[name].copy_(value)
            out.append(sum(float(loss_fn(net(x), y)) for x, y in batches) / len(batches))
    return out


def loss_curves(lab, model, settings=tuple(SETTINGS), batch: int = 64, steps: int = 20, lr: float = 0.1,
                seed: int = 0, data=None, loss="mse", bucket_mb: float = 1.0, val_batches: int = 2) -> Curves:
    """Train ``model`` under each of ``settings`` (names of :data:`SETTINGS`, or Strategies) on ``lab``.

    Every setting uses dp = the lab's engines, the same seed, data and learning rate; the fp32
    single-process reference is trained once, here.
    """
    from ..run.reference import reference

    net = build_model(model, seed)
    data_fn, loss_fn = resolve_data(data, net, batch, seed), resolve_loss(loss)
    held_out = [data_fn(VALIDATION_STEP + i) for i in range(val_batches)]
    ref = reference(model, batch=batch, steps=steps, lr=lr, seed=seed, data=data_fn, loss=loss, snapshots=True)
    curves = Curves(ref.losses, _val_losses(ref.snapshots, net, held_out, loss_fn))
    for setting in settings:
        s = _strategy(setting, lab.world_size, bucket_mb)
        run = lab.run(s, model=model, data=data_fn, loss=loss, batch=batch, steps=steps, lr=lr, seed=seed,
                      snapshots=True)
        label = setting if isinstance(setting, str) else f"{s.dp_mode} {s.compression}"
        curves.curves.append(Curve(label, s, run.losses, _val_losses(run.snapshots, net, held_out, loss_fn),
                                   _bytes_per_step(run), run.metrics["step_time_s"],
                                   _param_gaps(run.snapshots, ref.snapshots)))
    return curves
