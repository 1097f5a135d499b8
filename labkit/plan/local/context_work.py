"""The compute of context parallelism's attention, counted as :mod:`.work` counts a model's:
a ring pair, an all-gathered attention, Ulysses' layouts and core (the calls themselves are
priced by :mod:`.physical`).
"""
from __future__ import annotations

import torch

from .work import Ops, _ops


def ring_pair(b: int, h: int, c: int, hd: int, hkv: int, how: str) -> tuple[Ops, Ops]:
    """One (query chunk, key chunk) pair of ring attention of ``c`` tokens each, as
    :mod:`labkit.parallel.context.ring` computes it: forward (``block_forward`` and ``merge``)
    and backward (``block_backward`` and its three sums), counted."""
    from ...parallel.context.blocks import block_backward, block_forward, merge
    q, dout = torch.randn(b, h, c, hd), torch.randn(b, h, c, hd)
    k, v = torch.randn(b, hkv, c, hd), torch.randn(b, hkv, c, hd)
    out, lse = torch.zeros(b, h, c, hd), torch.full((b, h, c), float("-inf"))
    fwd = _ops(lambda: merge(out, lse, *block_forward(q, k, v, how)))
    dq, dkv = torch.zeros(b, h, c, hd), torch.zeros(2, b, hkv, c, hd)

    def backward():
        dq_b, dk_b, dv_b = block_backward(q, k, v, out, dout, lse, how)
        dq.add_(dq_b), dkv[0].add_(dk_b), dkv[1].add_(dv_b)
    return Ops(fwd), Ops(_ops(backward))


def gathered_attention(b: int, h: int, t: int, hd: int, hkv: int, cp: int) -> tuple[Ops, Ops]:
    """All-gather attention (:mod:`labkit.parallel.context.allgather`) of ``t`` queries over the
    ``cp·t`` gathered keys and values, forward and backward, counted (the calls left out)."""
    from ...parallel.context.layout import token_index
    q, k, v = (torch.randn(b, n, t, hd, requires_grad=True) for n in (h, hkv, hkv))
    sink = {}

    def forward():
        kv = torch.stack([k, v])
        gathered = torch.cat([kv] * cp).view(cp, *kv.shape)          # what the all-gather returns
        k_all, v_all = (torch.cat(list(gathered[:, i].unbind(0)), dim=2) for i in range(2))
        if h > hkv:
            k_all, v_all = k_all.repeat_interleave(h // hkv, 1), v_all.repeat_interleave(h // hkv, 1)
        k_pos = torch.cat([token_index(r, cp, t * cp, True) for r in range(cp)])
        mask = token_index(0, cp, t * cp, True)[:, None] >= k_pos[None, :]
        sink["y"] = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
    fwd = _ops(forward)
    return Ops(fwd), Ops(_ops(lambda: sink["y"].backward(torch.ones_like(sink["y"]))))


def ulysses_attention(b: int, h: int, t: int, hd: int, hkv: int, cp: int) -> dict:
    """Ulysses attention's compute (:mod:`labkit.parallel.context.ulysses`) for a rank's ``t``
    tokens, the calls left out: per head count n (of q, of k and v), the layouts around a
    tensor's all-to-all, (to the head split, back to the sequence split); and "core", sdpa over
    the whole sequence on 1/cp of the heads in position order, (forward Ops, backward Ops)."""
    def layout(x, to_heads: bool):
        bb, hh, tt, d = x.shape
        parts = (x.view(bb, cp, hh // cp, tt, d).transpose(0, 1) if to_heads
                 else x.view(bb, hh, cp, tt // cp, d).permute(2, 0, 1, 3, 4)).contiguous()
        got = torch.empty_like(parts)                          # what the all-to-all fills
        return (got.permute(1, 2, 0, 3, 4).reshape(bb, hh // cp, cp * tt, d) if to_heads
                else got.transpose(0, 1).reshape(bb, cp * hh, tt // cp, d))
    q, k, v = (torch.randn(b, n // cp, t * cp, hd, requires_grad=True) for n in (h, hkv, hkv))
    order = torch.randperm(t * cp)
    got = {}

    def core():
        kk, vv = (z.repeat_interleave(h // hkv, dim=1) for z in (k, v)) if h > hkv else (k, v)
        qh, kh, vh = (z.index_select(2, order) for z in (q, kk, vv))
        got["y"] = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).index_select(2, order)
    fwd = _ops(core)
    out = {n: (Ops(_ops(lambda: layout(torch.randn(b, n, t, hd), True))),
               Ops(_ops(lambda: layout(torch.randn(b, n // cp, t * cp, hd), False)))) for n in {h, hkv}}
    return out | {"core": (Ops(fwd), Ops(_ops(lambda: got["y"].backward(torch.ones_like(got["y"])))))}
