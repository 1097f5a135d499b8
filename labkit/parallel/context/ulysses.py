"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the
sequence-split q, k, v (every head, T/cp tokens) into head-split ones (H/cp heads, all T
tokens), each rank computes ordinary attention for its heads, and a second all-to-all turns
the output back. Both query and key/value heads must divide by cp.

Per layer and direction each rank sends (cp − 1)/cp of q, k, v and of the output; the volume
does not grow with cp, but the degree is capped by the heads. No overlap inside the layer:
the all-to-alls sit on the critical path.
"""
from __future__ import annotations

import torch

from ... import comm
from .layout import token_index


def _a2a(x: torch.Tensor, cp, name: str) -> torch.Tensor:
    x = x.contiguous()             # before empty_like, which would copy a view's strides
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=cp.group, name=name)
    return out


def _seq_to_heads(x: torch.Tensor, cp, name: str) -> torch.Tensor:
    """(B, H, T/cp, hd) → (B, H/cp, T, hd): head group g to cp rank g, tokens in rank order."""
    b, h, t, d = x.shape
    parts = x.view(b, cp.size, h // cp.size, t, d).transpose(0, 1)         # (cp, B, H/cp, t, hd)
    got = _a2a(parts, cp, name)                                               # from each rank: its tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * t, d)


def _heads_to_seq(x: torch.Tensor, cp, name: str) -> torch.Tensor:
    """(B, H/cp, T, hd) → (B, H, T/cp, hd): the inverse of :func:`_seq_to_heads`."""
    b, h, t, d = x.shape
    parts = x.view(b, h, cp.size, t // cp.size, d).permute(2, 0, 1, 3, 4)  # (cp, B, H/cp, t, hd)
    got = _a2a(parts, cp, name)                                               # from each rank: its heads
    return got.transpose(0, 1).reshape(b, cp.size * h, t // cp.size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, name):
        ctx.cp, ctx.name = cp, name
        return _seq_to_heads(x, cp, f"cp a2a {name}")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.cp, f"cp a2a grad {ctx.name}"), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, name):
        ctx.cp, ctx.name = cp, name
        return _heads_to_seq(x, cp, f"cp a2a {name}")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.cp, f"cp a2a grad {ctx.name}"), None, None


def ulysses_attention(q, k, v, causal: bool, cp, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens through head-split all-to-alls over ``cp`` (``scale``: the
    scores' factor, None for 1/√hd)."""
    import torch.nn.functional as F
    t = q.shape[2]
    if q.shape[1] % cp.size or k.shape[1] % cp.size:
        raise ValueError(f"cp_mode='ulysses' splits heads over cp={cp.size} ranks but this rank holds "
                         f"{q.shape[1]} query and {k.shape[1]} key/value heads; use heads divisible by cp")
    qh, kh, vh = (_SeqToHeads.apply(z, cp, n) for z, n in ((q, "q"), (k, "k"), (v, "v")))
    group = qh.shape[1] // kh.shape[1]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    if not causal:
        return _HeadsToSeq.apply(F.scaled_dot_product_attention(qh, kh, vh, scale=scale), cp, "out")
    # Tokens arrive in rank order, not position order. Sorted into position order, the causal
    # mask is sdpa's own (is_causal): an explicit (T, T) mask would be kept for the backward as
    # T² floats, the memory that context parallelism exists to avoid.
    pos = torch.cat([token_index(r, cp.size, t * cp.size, cp.balance) for r in range(cp.size)]).to(q.device)
    order = pos.argsort()
    qh, kh, vh = (x.index_select(2, order) for x in (qh, kh, vh))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale).index_select(2, pos)   # back to rank order
    return _HeadsToSeq.apply(y, cp, "out")
