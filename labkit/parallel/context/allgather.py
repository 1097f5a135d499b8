"""All-gather context parallelism (the form Llama 3 used, Dubey et al. 2024 §3.3.2): every
rank gathers the whole sequence's keys and values once, then computes its queries' attention
locally under the causal mask of the tokens' global positions.

Simpler than the ring and with no overlap inside the layer: one all-gather of (cp − 1)/cp of
K/V per layer forward, one reduce-scatter of their gradients backward; the gathered keys and
values (the whole sequence's, but only Hkv heads: cheap under grouped-query attention) are
held until backward.
"""
from __future__ import annotations

import torch

from ... import comm
from .layout import token_index


class _GatherKV(torch.autograd.Function):
    """All-gather K/V along the cp group (rank order); backward, reduce-scatter their gradient."""

    @staticmethod
    def forward(ctx, kv, cp):
        ctx.cp = cp
        kv = kv.contiguous()
        out = torch.empty((cp.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        comm.all_gather(out, kv, group=cp.group, name="cp allgather kv")     # gloo: flat along dim 0
        return out.view(cp.size, *kv.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().flatten(0, 1)
        out = torch.empty((grad.shape[0] // ctx.cp.size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter(out, grad, group=ctx.cp.group, name="cp reduce-scatter dkv")
        return out, None


def allgather_attention(q, k, v, causal: bool, cp, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's ``q`` over the gathered ``k``, ``v`` of every cp rank (``scale``:
    the scores' factor, None for 1/√hd)."""
    import torch.nn.functional as F
    t = q.shape[2]
    gathered = _GatherKV.apply(torch.stack([k, v]), cp)             # (cp, 2, B, Hkv, t, hd)
    k_all, v_all = (torch.cat(list(gathered[:, i].unbind(0)), dim=2) for i in range(2))   # rank order
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)
    mask = None
    if causal:
        q_pos = cp.positions(t, q.device)
        k_pos = torch.cat([token_index(r, cp.size, t * cp.size, cp.balance) for r in range(cp.size)]).to(q.device)
        mask = q_pos[:, None] >= k_pos[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
