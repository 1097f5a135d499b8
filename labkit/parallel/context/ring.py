"""Ring attention (Liu et al. 2023; Megatron-LM's context parallelism, picotron's ring): each
rank keeps its queries; the key/value blocks go round the cp ring, one hop per round.

Forward, round j = 0 … cp − 1: this rank holds the key/value block of cp rank (i − j) mod cp.
The hop that brings the next round's block (send to i + 1, receive from i − 1, both through
:func:`labkit.comm.isend` / :func:`labkit.comm.irecv`) is posted *before* the round's
attention, so it travels while the rank computes; partial results are merged by the online
softmax (:mod:`.blocks`). cp − 1 hops of one K/V block each.

Backward goes round the ring the same way, by hand (no autograd graph over the rounds):
the key/value blocks travel again (cp − 1 hops, posted before each round's compute), and
beside each block travels the gradient of its keys and values accumulated so far (float32);
each rank adds its own queries' share and passes it on, so after cp hops it is back home,
complete. A gradient hop can only be posted once the round's compute made it, so it travels
under the next round's compute instead.
What is kept for backward is this rank's q, k, v, output and log-sum-exp only: no other
rank's block is stored (the memory that makes long sequences fit).

Each round's compute is a span ("attention", "ring fwd j" / "ring bwd j") on the rank's
timeline, so the hops can be seen under it.
"""
from __future__ import annotations

import torch

from ... import comm
from .blocks import SKIP, block_backward, block_forward, merge, relation

KV_TAG, GRAD_TAG = 1, 2       # a block and its gradient both go i → i + 1: kept apart (cp group only)


def _pairs(cp, src: int, causal: bool, c: int):
    """(query slice, key slice, relation) of every pair this rank computes against ``src``'s block."""
    for qi, qa in enumerate(cp.chunks):
        for kj, kb in enumerate(cp.chunks_of(src)):
            how = relation(qa, kb, causal)
            if how != SKIP:
                yield slice(qi * c, (qi + 1) * c), slice(kj * c, (kj + 1) * c), how


def _hop(cp, send: torch.Tensor, recv: torch.Tensor, tag: int, name: str) -> list:
    """Post one hop round the ring: ``send`` to the next rank, ``recv`` from the previous."""
    # check=False: the header check posts the payload's receive only at wait(), which would
    # put the whole transfer after the round's compute instead of under it
    return [comm.isend(send, cp.next_rank, cp.group, name=name, tag=tag, check=False),
            comm.irecv(recv, cp.prev_rank, cp.group, name=name, tag=tag, check=False)]


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every cp rank's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, causal, cp, scale):
        q, kv = q.contiguous(), torch.stack([k, v]).contiguous()      # one message per hop
        c = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for j in range(cp.size):
            src = (cp.index - j) % cp.size
            last = j == cp.size - 1
            nxt = None if last else torch.empty_like(kv)
            pending = [] if last else _hop(cp, kv, nxt, KV_TAG, f"cp kv {j + 1}")
            with comm.span("attention", f"ring fwd {j}"):
                for qs, ks, how in _pairs(cp, src, causal, c):
                    o_b, lse_b = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], how, scale)
                    merge(out[:, :, qs], lse[:, :, qs], o_b, lse_b)
            for handle in pending:
                handle.wait()
            kv = kv if last else nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.cp, ctx.scale = causal, cp, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, c = ctx.cp, ctx.causal, q.shape[2] // 2
        dout = dout.float()
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_in, grad_hops, sent = None, [], None      # the gradient of this round's block, arriving
        for j in range(cp.size):
            src = (cp.index - j) % cp.size
            last = j == cp.size - 1
            nxt = None if last else torch.empty_like(kv)
            pending = [] if last else _hop(cp, kv, nxt, KV_TAG, f"cp kv bwd {j + 1}")
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            with comm.span("attention", f"ring bwd {j}"):
                for qs, ks, how in _pairs(cp, src, causal, c):
                    dq_b, dk_b, dv_b = block_backward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                                      out[:, :, qs], dout[:, :, qs], lse[:, :, qs], how,
                                                      ctx.scale)
                    dq[:, :, qs] += dq_b
                    dkv[0][:, :, ks] += dk_b
                    dkv[1][:, :, ks] += dv_b
            for handle in grad_hops:               # the block's gradient so far, from rank i − 1
                handle.wait()
            if grad_in is not None:
                dkv += grad_in
            # pass it on: rank i + 1 holds this block next round; after the last round it is home
            grad_in = torch.empty_like(dkv)
            grad_hops, sent = _hop(cp, dkv, grad_in, GRAD_TAG, f"cp dkv {j + 1}"), dkv   # alive until sent
            for handle in pending:
                handle.wait()
            kv = kv if last else nxt
        for handle in grad_hops:
            handle.wait()
        return dq.to(q.dtype), grad_in[0].to(k.dtype), grad_in[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, causal: bool, cp, scale: float | None = None) -> torch.Tensor:
    """Ring attention of ``q`` (B, H, T/cp, hd) over ``k``, ``v`` (B, Hkv, T/cp, hd) across ``cp``;
    ``scale`` multiplies the scores (None: 1/√hd)."""
    return RingAttention.apply(q, k, v, causal, cp, scale)
