"""Attention on one (query chunk, key chunk) pair, forward and backward, with the log-sum-exp
that lets partial results be merged (the online softmax of Milakov & Gimelshein 2018, used by
FlashAttention, Dao et al. 2022, and by ring attention, Liu et al. 2023).

For a query row, attention over keys K₁ ∪ K₂ is a weighted sum of the attention over each::

    lse = log(e^lse₁ + e^lse₂)        out = out₁·e^(lse₁ − lse) + out₂·e^(lse₂ − lse)

so a rank can take the key/value blocks one at a time, in any order, and end with the exact
softmax (up to the order of the sums). Backward recomputes each pair's probabilities from the
final lse: P = exp(QKᵀ·s − lse), dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − rowsum(dO ⊙ O)),
dQ = dS·K·s, dK = dSᵀ·Q·s (FlashAttention-2, Algorithm 2).
"""
from __future__ import annotations

import torch

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def relation(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How query chunk ``q_chunk`` sees key chunk ``k_chunk`` (global chunk ids)."""
    if not causal or q_chunk > k_chunk:
        return FULL
    return DIAGONAL if q_chunk == k_chunk else SKIP


def _repeat(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _scores(q, k, scale, how):
    s = (q @ k.transpose(-2, -1)) * scale
    if how == DIAGONAL:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_forward(q, k, v, how: str, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``q`` (B, H, c, hd) over ``k``, ``v`` (B, Hkv, c, hd): out in float32.
    ``scale`` multiplies the scores (None: 1/√hd, as torch's sdpa)."""
    group = q.shape[1] // k.shape[1]
    s = _scores(q, _repeat(k, group), q.shape[-1] ** -0.5 if scale is None else scale, how).float()
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ _repeat(v, group).float()
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a partial (out_b, lse_b) into the running (out, lse), in place."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q, k, v, out, dout, lse, how: str, scale: float | None = None):
    """(dq, dk, dv) of one pair, float32, dk and dv summed back onto the Hkv key/value heads."""
    group, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5 if scale is None else scale
    kr, vr = _repeat(k, group).float(), _repeat(v, group).float()
    p = torch.exp(_scores(q.float(), kr, scale, how) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ vr.transpose(-2, -1) - delta)
    dq = ds @ kr * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    if group > 1:
        b, h, c, d = dk.shape
        dk, dv = (g.view(b, h // group, group, c, d).sum(2) for g in (dk, dv))
    return dq, dk, dv
