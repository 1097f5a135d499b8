"""The same run in one process: the yardstick every strategy is checked against.

>>> ref = labkit.reference(labkit.models.mlp(width=64, depth=4), batch=64, steps=5, lr=0.1, seed=0)
>>> run.max_diff(ref) <= ref.tolerance          # 1e-5, unless float32 itself is noisier here

A strategy sums the same numbers in another order, so it differs from one process by float32
rounding: ~1e-7 relative, under 1e-5 after a few SGD steps. AdamW divides each gradient by the
root of its second moment plus eps = 1e-8, so a parameter whose gradient is near or below eps
(a cancellation of larger terms) moves by up to lr·δg/eps for a rounding δg of its gradient:
lr-sized noise from 1e-7 rounding. ``ref.tolerance`` measures that noise instead of guessing it:
the same run in float64, and twice this reference's distance from it (a run and the reference
are two float32 evaluations of the same arithmetic, each about that far from the exact one).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median

import torch

from ..analysis.drift import StepSnapshots, check_snapshots
from ..training import build_model, build_optimizer, call_model, resolve_data, resolve_loss


@dataclass
class Reference:
    """Losses, per-step wall times and final parameters of a single-process run."""

    losses: list[float]
    step_times: list[float]
    model: torch.nn.Sequential = field(repr=False)
    snapshots: list[dict] = field(default_factory=list, repr=False)
    """Per step, {0: parameters and gradient norms after the step}; with ``snapshots=True``."""
    setup: dict = field(default_factory=dict, repr=False)
    """The arguments of the run, to repeat it in float64 (:meth:`float_noise`)."""
    _noise: float | None = field(default=None, repr=False)

    FLOOR = 1e-5
    """The float32 tolerance of a few steps: what summation order moves where nothing amplifies it."""

    def float_noise(self) -> float:
        """Largest |Δ| between this float32 run and the same run in float64 (the same initial
        weights and batches, cast): what float32 rounding alone moves here. Run once, on demand."""
        if self._noise is None:
            exact = _twin_in_float64(self.setup)
            self._noise = max((v.double() - exact[k]).abs().max().item() if v.numel() else 0.0
                              for k, v in self.parameters().items() if v.is_floating_point())
        return self._noise

    @property
    def tolerance(self) -> float:
        """How far a run that equals one process may read from this reference: 1e-5, or twice
        :meth:`float_noise` where the arithmetic amplifies rounding beyond that (AdamW on a
        gradient below its eps; see the module docstring)."""
        return max(self.FLOOR, 2 * self.float_noise())

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
    setup = dict(model=model, batch=batch, steps=steps, lr=lr, seed=seed, data=data, loss=loss,
                 momentum=momentum, optimizer=optimizer)
    with torch.random.fork_rng(devices=[]):      # the run seeds torch; the caller's RNG stays as it was
        try:
            ref = _train(snapshots=snapshots, **setup)
        finally:
            torch.set_num_threads(previous)
    ref.setup = setup
    return ref


def _twin_in_float64(setup: dict) -> dict[str, torch.Tensor]:
    """The final parameters of ``setup``'s run in float64: the same initial weights and batches
    (drawn in float32, as the run's, then cast: exact), the arithmetic in float64."""
    with torch.random.fork_rng(devices=[]):
        net = _train(snapshots=False, dtype=torch.float64, **setup).model
    return {k: v.detach().double() for k, v in net.state_dict().items()}


@contextmanager
def _default_dtype(dtype):
    """Tensors a forward makes itself (a mask, positions) in ``dtype`` too; None: as they are."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast(x, dtype):
    if dtype is None:
        return x
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _train(model, batch, steps, lr, seed, data, loss, momentum, snapshots, optimizer, dtype=None,
           watch=None) -> Reference:
    """One process, the whole global batch per step: the yardstick's loop (``dtype``: its float64
    twin; ``watch(net)``: called once the model is built, to hook it before it trains)."""
    net = build_model(model, seed)
    if watch is not None:
        watch(net)
    data_fn = resolve_data(data, net, batch, seed)
    if dtype is not None:
        net.to(dtype)
    loss_fn = resolve_loss(loss)
    opt = build_optimizer(net.parameters(), lr, momentum, optimizer)
    recorder = StepSnapshots(net, opt) if snapshots else None
    losses, times, taken = [], [], []
    for step in range(steps):
        x, y = data_fn(step)
        t0 = time.perf_counter()
        with _default_dtype(dtype):
            value = loss_fn(call_model(net, _cast(x, dtype)), _cast(y, dtype))
            value.backward()
            opt.step()
        opt.zero_grad()            # torch's default: a parameter backward never reaches has no gradient
        times.append(time.perf_counter() - t0)
        losses.append(value.item())
        if recorder is not None:
            taken.append({0: recorder.pop()})
    return Reference(losses, times, net, taken)
