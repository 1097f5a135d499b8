"""The same run in one process: the yardstick every strategy is checked against.

>>> ref = labkit.reference(labkit.models.mlp(width=64, depth=4), batch=64, steps=5, lr=0.1, seed=0)
>>> run.max_diff(ref) < 1e-5
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import median

import torch

from ..analysis.drift import StepSnapshots, check_snapshots
from ..training import build_model, build_optimizer, resolve_data, resolve_loss


@dataclass
class Reference:
    """Losses, per-step wall times and final parameters of a single-process run."""

    losses: list[float]
    step_times: list[float]
    model: torch.nn.Sequential = field(repr=False)
    snapshots: list[dict] = field(default_factory=list, repr=False)
    """Per step, {0: parameters and gradient norms after the step}; with ``snapshots=True``."""

    def grad_norms(self):
        """The gradient check in one process: every parameter's gradient norm per step."""
        from ..analysis.drift import grad_norms
        return grad_norms(self.snapshots)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @property
    def step_time_s(self) -> float:
        """Median step time, first step (warm-up) left out when there are ≥ 3."""
        kept = self.step_times[1:] if len(self.step_times) >= 3 else self.step_times
        return median(kept)


def reference(model, batch: int = 64, steps: int = 5, lr: float = 0.1, seed: int = 0, data=None,
              loss="mse", momentum: float = 0.0, threads: int | None = None, snapshots: bool = False,
              optimizer: str = "sgd") -> Reference:
    """Train ``model`` on the whole global batch in this process (plain SGD, mean loss;
    ``optimizer="adamw"``: torch's AdamW with its defaults).

    ``threads`` pins torch's intra-op threads for the run (for a fair one-engine baseline).
    ``snapshots`` records parameters and gradient norms after every step, for ``labkit.drift``.
    """
    check_snapshots(snapshots)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    with torch.random.fork_rng(devices=[]):      # the run seeds torch; the caller's RNG stays as it was
        try:
            return _train(model, batch, steps, lr, seed, data, loss, momentum, snapshots, optimizer)
        finally:
            torch.set_num_threads(previous)


def _train(model, batch, steps, lr, seed, data, loss, momentum, snapshots, optimizer) -> Reference:
    """One process, the whole global batch per step: the yardstick's loop."""
    net = build_model(model, seed)
    data_fn = resolve_data(data, net, batch, seed)
    loss_fn = resolve_loss(loss)
    opt = build_optimizer(net.parameters(), lr, momentum, optimizer)
    recorder = StepSnapshots(net, opt) if snapshots else None
    losses, times, taken = [], [], []
    for step in range(steps):
        x, y = data_fn(step)
        t0 = time.perf_counter()
        value = loss_fn(net(x), y)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
        losses.append(value.item())
        if recorder is not None:
            taken.append({0: recorder.pop()})
    return Reference(losses, times, net, taken)
