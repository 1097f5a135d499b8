"""The GPT step of the GPU check: the model (labkit's GPT when this tree has one, else a plain
torch decoder built here), seeded random tokens, the loss, the FLOP count, and the same step
in plain torch as the yardstick for the lab's harness.

    >>> factory, source = build_gpt(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)
    >>> seconds = plain_step_times(factory, RandomTokens(128, 4, 32), steps=3, device="cpu")

Every block runs under bf16 autocast on CUDA (fp32 master weights, as mixed precision
training keeps them), so the matmuls use the tensor cores whose bf16 peak MFU is quoted
against. On CPU the blocks run in fp32.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.data.text import RandomTokens  # noqa: F401  (seeded random token ids: data(step) -> (x, y))


def _bf16(x: torch.Tensor):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda)


class Embed(nn.Module):
    """Token plus learned position embeddings (GPT-2)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention (torch's fused SDPA), then a 4× MLP."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.fc, self.out = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        with _bf16(x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final norm and the vocabulary projection (untied from the embedding)."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__()
        self.ln, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x):
        with _bf16(x):
            return self.lm_head(self.ln(x))


@dataclass(frozen=True)
class PlainGPT:
    """A factory for a GPT-2-shaped ``nn.Sequential``: embed, ``n_layer`` blocks, head."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int

    def __call__(self) -> nn.Sequential:
        blocks = [Block(self.n_embd, self.n_head) for _ in range(self.n_layer)]
        return nn.Sequential(Embed(self.vocab_size, self.block_size, self.n_embd), *blocks,
                             Head(self.n_embd, self.vocab_size))


class Autocast(nn.Module):
    """Runs a block of a model that has no precision setting of its own under bf16 autocast."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        with _bf16(x):
            return self.block(x)


@dataclass(frozen=True)
class InAutocast:
    """Wraps each block of another factory's ``nn.Sequential`` in :class:`Autocast`."""

    factory: object

    def __call__(self) -> nn.Sequential:
        return nn.Sequential(*(Autocast(block) for block in self.factory()))


def build_gpt(n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int):
    """``(factory, source)``: ``labkit.models.gpt`` if this tree has it, else :class:`PlainGPT`."""
    import labkit.models as models

    if callable(getattr(models, "gpt", None)):
        dims = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
        try:
            factory = models.gpt(**dims, vocab_size=vocab_size)
        except TypeError:
            factory = None           # a gpt() without vocab_size: its vocabulary would not match the data
        if factory is not None:
            return InAutocast(factory), "labkit.models.gpt (each block under bf16 autocast)"
        note = "labkit.models.gpt takes no vocab_size; "
    else:
        note = "labkit.models.gpt is not in this tree; "
    return PlainGPT(n_layer, n_head, n_embd, block_size, vocab_size), note + "a plain torch GPT from scripts/gpu_model.py"


def matmul_params(model: nn.Module, vocab_size: int) -> int:
    """Parameters that take part in matmuls: every nn.Linear weight, plus a tied output head."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    n = sum(m.weight.numel() for m in linears)
    if not any(m.out_features == vocab_size for m in linears):      # head tied to the embedding
        n += max((m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    return n


def count_params(factory, vocab_size: int) -> tuple[int, int]:
    """(all parameters, matmul parameters), built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = factory()
    return sum(p.numel() for p in model.parameters()), matmul_params(model, vocab_size)


def token_loss(logits, targets):
    """Mean next-token cross-entropy over the batch (fp32 softmax)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def plain_step_times(factory, data, steps: int, device, lr: float = 0.01) -> list[float]:
    """The same step in plain torch (no lab, no hooks): seconds per step, CUDA events on GPU."""
    device = torch.device(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    times = []
    for step in range(steps):
        x, y = (t.to(device) for t in data(step))
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        token_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - t0)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times
