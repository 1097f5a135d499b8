"""Models the course uses, as zero-argument factories.

``lab.run`` builds the model on every engine under the run's seed, so a factory (not an
already-built module) is what travels: every rank and the single-process reference then
start from the same weights.

>>> make = mlp(width=64, depth=4)
>>> len(make())          # Linear, GELU, ..., Linear: 2*depth - 1 blocks
7
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .gpt import GPT, gpt  # noqa: F401  (the transformer the course trains on text)
from .hf import HFModel, from_hf  # noqa: F401  (Hugging Face causal LMs from a config; needs the hf extra)
from .llama import Llama, llama  # noqa: F401  (a Llama-family decoder, dense or mixture-of-experts)
from .sample import generate, validation_loss  # noqa: F401  (a trained model's text and held-out loss)

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


@dataclass(frozen=True)
class MLP:
    """A factory for a plain MLP as a flat ``nn.Sequential`` (pipelines split it by block)."""

    width: int = 256
    depth: int = 8
    in_features: int | None = None
    out_features: int | None = None
    activation: str = "gelu"

    def __post_init__(self):
        if self.depth < 1 or self.width < 1:
            raise ValueError("mlp: width and depth must be ≥ 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"mlp: activation={self.activation!r}; use one of {sorted(ACTIVATIONS)}")

    def __call__(self) -> nn.Sequential:
        d_in = self.in_features or self.width
        d_out = self.out_features or self.width
        sizes = [d_in] + [self.width] * (self.depth - 1) + [d_out]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < self.depth - 1:
                layers.append(ACTIVATIONS[self.activation]())
        return nn.Sequential(*layers)


def mlp(width: int = 256, depth: int = 8, in_features: int | None = None,
        out_features: int | None = None, activation: str = "gelu") -> MLP:
    """An MLP factory: ``depth`` Linear layers of ``width`` with an activation between them."""
    return MLP(width, depth, in_features, out_features, activation)
