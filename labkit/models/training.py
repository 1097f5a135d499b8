"""What a run needs on every rank and in the single-process reference, built one way.

The engines and :func:`labkit.reference` both call these, which is what makes "same seed,
same data" mean the same weights and the same batches.
"""
from __future__ import annotations

import copy
from functools import cached_property
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: (N, C) logits with (N,) targets, or a language
    model's (B, T, V) logits with (B, T) targets (torch's own would read T as the class dim)."""
    if logits.dim() == target.dim() + 1 and logits.dim() > 2:
        return F.cross_entropy(logits.flatten(0, -2), target.flatten())
    return F.cross_entropy(logits, target)


LOSSES = {"mse": F.mse_loss, "cross_entropy": cross_entropy}


def build_model(model, seed: int) -> nn.Sequential:
    """Build (or copy) the model under ``seed``; it must be an ``nn.Sequential``."""
    torch.manual_seed(seed)
    built = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    if not isinstance(built, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential or a zero-argument callable returning one, "
                        f"got {type(built).__name__}")
    return built


def resolve_loss(loss) -> Callable:
    """"mse" | "cross_entropy" | a callable ``loss(output, target)`` that means over the batch."""
    if callable(loss):
        return loss
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is unknown; use one of {sorted(LOSSES)} or a callable")
    return LOSSES[loss]


def _features(model: nn.Sequential) -> tuple[int, int]:
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    if not linears:
        raise ValueError("cannot infer the input/output sizes of this model for synthetic data; "
                         "pass data=callable(step) -> (x, y)")
    return linears[0].in_features, linears[-1].out_features


@dataclass(frozen=True)
class SyntheticRegression:
    """Seeded regression data: x ~ N(0, 1), y = tanh(x @ W) for a fixed random teacher W.

    ``data(step)`` returns the global batch of that step, identical on every engine.
    """

    in_features: int
    out_features: int
    batch: int
    seed: int = 0

    @cached_property
    def teacher(self) -> torch.Tensor:
        """The fixed map the model learns (made once per data object, seeded)."""
        g = torch.Generator().manual_seed(self.seed + 7919)
        return torch.randn(self.in_features, self.out_features, generator=g) / self.in_features ** 0.5

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.batch, self.in_features, generator=g)
        return x, torch.tanh(x @ self.teacher)


def resolve_data(data, model: nn.Sequential, batch: int, seed: int) -> Callable:
    """The user's ``data(step) -> (x, y)``, or seeded synthetic data shaped for ``model``."""
    if data is not None:
        if not callable(data):
            raise TypeError("data must be a callable data(step) -> (x, y)")
        return data
    d_in, d_out = _features(model)
    return SyntheticRegression(d_in, d_out, batch, seed)


OPTIMIZERS = ("sgd", "adamw")


def check_optimizer(optimizer: str, momentum: float = 0.0) -> None:
    """Raise ValueError naming the argument and the fix for an optimiser labkit cannot build."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {', '.join(map(repr, OPTIMIZERS))}")
    if optimizer == "adamw" and momentum:
        raise ValueError(f"momentum={momentum!r} is SGD's; AdamW has its own betas (torch's defaults): "
                         "use momentum=0 with optimizer='adamw'")


def build_optimizer(params, lr: float, momentum: float = 0.0, optimizer: str = "sgd") -> torch.optim.Optimizer:
    """torch's own optimiser with torch's defaults and the run's lr, as in the reference:
    "sgd" (no momentum unless asked) or "adamw" (betas 0.9/0.999, eps 1e-8, weight decay 0.01)."""
    check_optimizer(optimizer, momentum)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=momentum)
