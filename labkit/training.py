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


def model_output(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the prediction, the auxiliary loss or None) of whatever a model's forward returned: a
    tensor; a tuple or list (its first element); an object with ``.logits`` (Hugging Face's
    outputs). An ``aux_loss`` attribute that is a tensor (a mixture-of-experts router's
    load-balancing loss) comes back beside it."""
    aux = getattr(output, "aux_loss", None)
    if hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model's forward returned {type(output).__name__}; the built-in losses read a tensor, "
                        "a tuple/list (its first element) or an object with .logits; return one of those, "
                        "or pass loss=callable(output, target)")
    return output, aux if isinstance(aux, torch.Tensor) else None


def with_aux(loss: Callable) -> Callable:
    """``loss`` on the model's prediction, plus its ``aux_loss`` as it is."""
    def built_in(output, target: torch.Tensor) -> torch.Tensor:
        prediction, aux = model_output(output)
        value = loss(prediction, target)
        return value if aux is None else value + aux
    built_in.__name__ = built_in.__qualname__ = loss.__name__
    built_in.__doc__ = loss.__doc__
    return built_in


def _mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction, target)


_mse.__name__ = "mse_loss"
mse_loss = with_aux(_mse)
mse_loss.__doc__ = """Mean squared error; the model's output read as :func:`cross_entropy` reads it (a tuple's
    first element, ``.logits``), its ``aux_loss`` tensor added as it is."""


class TokenLoss:
    """A loss over tokens, some of them not counted (padding: target ``ignore_index``).

    ``total(prediction, target)`` returns the loss SUMMED over the counted tokens. Called, it
    is the mean over them (what one process computes). Under data parallelism and
    micro-batches the executor instead divides each part's sum by the count of the whole
    global batch of the step (:meth:`count`; every rank holds that batch, so counting needs no
    communication), as Megatron and torchtitan do: a mean of per-replica means would weigh a
    replica's tokens by how much padding it got, and an all-padding micro-batch would be 0/0.
    """

    def __init__(self, total: Callable, ignore_index: int = -100, name: str | None = None):
        if not callable(total):
            raise TypeError(f"token_loss: {type(total).__name__} is not callable; pass fn(prediction, target) "
                            "returning the loss summed over the counted tokens")
        self.total, self.ignore_index = total, ignore_index
        self.__name__ = name or getattr(total, "__name__", "token_loss")

    def count(self, target: torch.Tensor) -> int:
        """The counted tokens of ``target``: those ≠ ignore_index (soft targets: every row)."""
        if target.is_floating_point():
            return target.shape[:-1].numel()
        return int((target != self.ignore_index).sum())

    def parts(self, output, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the summed token loss, the model's aux_loss or None) of one (micro-)batch."""
        prediction, aux = model_output(output)
        return self.total(prediction, target), aux

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        total, aux = self.parts(output, target)
        value = total / self.count(target)         # 0/0 = NaN when nothing counts, as torch's mean
        return value if aux is None else value + aux

    def __repr__(self) -> str:
        return f"token_loss({self.__name__}, ignore_index={self.ignore_index})"


def token_loss(fn: Callable | None = None, *, ignore_index: int = -100):
    """Mark ``fn(prediction, target) -> loss summed over the counted tokens`` as a token loss:
    labkit divides the sums once by the global batch's count of targets ≠ ``ignore_index``.

    >>> loss = labkit.losses.token_loss(lambda p, y: F.cross_entropy(p.flatten(0, 1), y.flatten(),
    ...                                                              reduction="sum"))
    >>> lab.run(s, model=m, data=d, loss=loss)

    Usable as a decorator (``@token_loss`` or ``@token_loss(ignore_index=0)``).
    """
    if fn is None:
        return lambda f: TokenLoss(f, ignore_index)
    return TokenLoss(fn, ignore_index)


def _cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if logits.dim() == target.dim() + 1 and logits.dim() > 2:
        logits, target = logits.flatten(0, -2), target.flatten()
    return F.cross_entropy(logits, target, reduction="sum")      # ignore_index -100: torch's default


cross_entropy = TokenLoss(_cross_entropy_sum, -100, "cross_entropy")
cross_entropy.__doc__ = """Cross-entropy over every counted position: (N, C) logits with (N,) targets, or a language
    model's (B, T, V) logits with (B, T) targets (torch's own would read T as the class dim);
    targets -100 (torch's ignore_index, how language models pad) are not counted. A token loss:
    normalised once by the global batch's count of counted targets (:class:`TokenLoss`).

    The model's output may be a tensor, a tuple/list (its first element) or an object with
    ``.logits`` (Hugging Face's). If that object has an ``aux_loss`` tensor (a mixture-of-experts
    router's load-balancing loss, already weighted by the model's coefficient), it is added as
    it is: it is a mean over the sequences of the (micro-)batch, so it is averaged over replicas
    and micro-batches like a mean loss."""

LOSSES = {"mse": mse_loss, "cross_entropy": cross_entropy}


def build_model(model, seed: int) -> nn.Module:
    """Build (or copy) the model under ``seed``: an ``nn.Module``, or a zero-argument callable
    (a class such as ``Net``, a factory) returning one."""
    torch.manual_seed(seed)
    if isinstance(model, nn.Module):
        return copy.deepcopy(model)
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a zero-argument callable returning one (model=Net or "
                        f"model=Net()), got {type(model).__name__}")
    built = model()
    if not isinstance(built, nn.Module):
        what = "a factory" if callable(built) else f"a {type(built).__name__}"
        raise TypeError(f"model: the factory returned {what}, not an nn.Module; pass a zero-argument callable "
                        f"that returns the model (model=Net, or model=lambda: Net(...)), or the model itself")
    return built


def resolve_loss(loss) -> Callable:
    """"mse" | "cross_entropy" | a callable ``loss(output, target)`` returning the MEAN over the
    rows (or tokens) it is given (labkit averages it over replicas and micro-batches, which is
    one process's loss only for a mean; checked by :func:`labkit.run.checks.check_loss`), or a
    :class:`TokenLoss` (:func:`token_loss`), normalised by the global token count."""
    if callable(loss):
        return loss
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is unknown; use one of {sorted(LOSSES)} or a callable")
    return LOSSES[loss]


def _features(model: nn.Module) -> tuple[int, int]:
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    embeds = any(isinstance(m, nn.Embedding) for m in model.modules())
    if not linears or (embeds and not isinstance(model, nn.Sequential)):
        # a Sequential's first and last Linear are its input and output; any other module's
        # forward decides what it reads (token ids for an embedding), which labkit cannot guess
        raise ValueError(f"data: cannot infer the inputs of {type(model).__name__} for synthetic data; pass "
                         "data=callable(step) -> (x, y), e.g. data=labkit.data.text(batch=8, block_size=64) "
                         "for a language model")
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


def resolve_data(data, model: nn.Module, batch: int, seed: int) -> Callable:
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
