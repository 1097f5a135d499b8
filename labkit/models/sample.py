"""Text from a trained language model: the sample a notebook prints to show it learned.

Works for any model whose forward maps token ids (B, T) to logits (B, T, V), or to an output
with ``.logits`` (labkit's llama with a balance loss, a Hugging Face model).

>>> model = make(); model.load_state_dict(run.parameters())
>>> print(data.decode(generate(model, data.encode("def "), 80)))
"""
from __future__ import annotations

import torch
from torch import nn


def logits_of(output) -> torch.Tensor:
    """The logits of a forward's output: the tensor itself, or its ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the model takes: ``block_size`` on the model (llama) or on its
    first block (gpt), or a Hugging Face config's ``max_position_embeddings``; else None."""
    first = model[0] if isinstance(model, nn.Sequential) else model
    config = getattr(model, "config", None)
    return getattr(first, "block_size", None) or getattr(config, "max_position_embeddings", None)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.8,
             seed: int = 0, block_size: int | None = None) -> torch.Tensor:
    """``prompt`` (1-d token ids) followed by ``new_tokens`` drawn one at a time (nanoGPT's
    ``generate``: crop to the context, softmax of the last logits at ``temperature``, sample),
    seeded so two models compared on the same prompt draw from the same random stream."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    block_size = block_size or context_length(model) or prompt.numel() + new_tokens
    g = torch.Generator().manual_seed(seed)
    idx = prompt.reshape(1, -1).long()
    was_training = model.training
    model.eval()
    for _ in range(new_tokens):
        logits = logits_of(model(idx[:, -block_size:]))[0, -1] / temperature
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return idx[0]


@torch.no_grad()
def validation_loss(model: nn.Module, data, batches: int = 4) -> float:
    """Mean cross-entropy over ``batches`` of the data's held-out split (``data.val(i)``);
    a balance loss the model adds in training is left out."""
    from ..training import cross_entropy

    losses = [float(cross_entropy(logits_of(model(x)), y)) for x, y in (data.val(i) for i in range(batches))]
    return sum(losses) / len(losses)
