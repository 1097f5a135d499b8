"""The same run in one process: the yardstick every strategy is checked against.

>>> ref = labkit.reference(labkit.models.mlp(width=64, depth=4), batch=64, steps=5, lr=0.1, seed=0)
>>> run.max_diff(ref) < 1e-5
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import median

import torch

from ..models.training import build_model, build_optimizer, resolve_data, resolve_loss


@dataclass
class Reference:
    """Losses, per-step wall times and final parameters of a single-process run."""

    losses: list[float]
    step_times: list[float]
    model: torch.nn.Sequential = field(repr=False)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @property
    def step_time_s(self) -> float:
        """Median step time, first step (warm-up) left out when there are ≥ 3."""
        kept = self.step_times[1:] if len(self.step_times) >= 3 else self.step_times
        return median(kept)


def reference(model, batch: int = 64, steps: int = 5, lr: float = 0.1, seed: int = 0, data=None,
              loss="mse", momentum: float = 0.0, threads: int | None = None, optimizer: str = "sgd") -> Reference:
    """Train ``model`` on the whole global batch in this process (plain SGD, mean loss;
    ``optimizer="adamw"``: torch's AdamW with its defaults).

    ``threads`` pins torch's intra-op threads for the run (for a fair one-engine baseline).
    """
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        net = build_model(model, seed)
        data_fn = resolve_data(data, net, batch, seed)
        loss_fn = resolve_loss(loss)
        opt = build_optimizer(net.parameters(), lr, momentum, optimizer)
        losses, times = [], []
        for step in range(steps):
            x, y = data_fn(step)
            t0 = time.perf_counter()
            value = loss_fn(net(x), y)
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
            losses.append(value.item())
        return Reference(losses, times, net)
    finally:
        torch.set_num_threads(previous)
