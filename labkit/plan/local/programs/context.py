"""Context parallelism in the planner's programs: one attention of a cp rank as ``cp_mode``
runs it (parallel/context/: the ring's hops under each round's compute, the K/V all-gather,
Ulysses' all-to-alls), priced from the counted ops of :mod:`..context_work`.

Beside dp and zero, every op is counted on a rank's 1/cp of each sequence, each block cut at
its attention (:func:`labkit.plan.local.work.count`'s markers). ring: cp rounds, each round's K/V hop
posted before its pairs (the executor's own ``block_forward``/``block_backward``, counted per
(query chunk, key chunk) pair the causal split leaves the rank) and waited after them, backward
passing dK/dV on as well; allgather: a blocking all-gather of K/V before the attention, a
reduce-scatter of their gradient after its backward; ulysses: blocking all-to-alls of q, k, v
to a head split before it and of its output back after (their mirrors in backward). Gradients
are averaged over dp × cp.
:class:`ContextPrograms` is a part of :class:`labkit.plan.local.physical.Builder`.
"""
from __future__ import annotations

from dataclasses import replace

from .. import price
from ....analysis.des import Compute, Wait

_COUNTED: dict = {}


def _attention_ops(how: str, *shape) -> tuple:
    """A cp mode's attention ops at ``shape``, counted once: :func:`~labkit.plan.local.context_work.ring_pair`
    (how: its pair's relation), ``gathered_attention`` or ``ulysses_attention``."""
    from ..context_work import gathered_attention, ring_pair, ulysses_attention
    key = ("attention", how, shape)
    if key not in _COUNTED:
        _COUNTED[key] = {"gathered": gathered_attention, "ulysses": ulysses_attention}.get(
            how, lambda *a: ring_pair(*a, how))(*shape)
    return _COUNTED[key]


class ContextPrograms:
    """The Builder's cp methods (they use its grid, prices and calls)."""

    def cp_attention(self, shape, layer, fwd: bool, kind, name, mb, d, c) -> list:
        """One attention of cp rank ``c``: ring (parallel/context/ring.py), ulysses, or allgather
        (blocking, no overlap inside the layer: K/V gathered before, their gradient scattered after)."""
        s, (b, h, t, hd, hkv) = self.s, shape
        nbytes = 4 * 2 * b * hkv * t * hd                 # k and v stacked (float32): one hop, one rank's share
        group = tuple(self.grid.group("c", dp=d))
        if s.cp_mode == "ring":
            return self.ring((b, h, t // 2, hd, hkv), nbytes, layer, fwd, mb, d, c)
        if s.cp_mode == "ulysses":
            return self.ulysses(shape, group, layer, fwd, kind, name, mb, d, c)
        ops = _attention_ops("gathered", *shape, s.cp)[0 if fwd else 1].ops
        work = Compute(price.seconds(self.m, ops), kind, name, mb)
        if fwd:
            return self.blocking(("cp ag", d, mb, layer), group, "all_gather", s.cp * nbytes, "allgather",
                                 "cp allgather kv", mb) + [work]
        return [work] + self.blocking(("cp rs", d, mb, layer), group, "reduce_scatter", s.cp * nbytes,
                                      "reduce_scatter", "cp reduce-scatter dkv", mb)

    def ulysses(self, shape, group, layer, fwd: bool, kind, name, mb, d, c) -> list:
        """Ulysses: q, k, v turned to a head split by blocking all-to-alls, attention over the whole
        sequence on 1/cp of the heads, its output turned back; backward the same calls mirrored."""
        s, (b, h, t, hd, hkv) = self.s, shape
        ops = _attention_ops("ulysses", *shape, s.cp)

        def turn(what, n):
            sent = 4 * b * n * t * hd * (s.cp - 1) // s.cp          # all but this rank's own slice
            call = self.a2a(("cp a2a", d, mb, layer, what, fwd), group, [sent] * s.cp, c,
                            f"cp a2a {'' if fwd else 'grad '}{what}", mb)
            return [call, Wait(call.key)]

        def work(items):
            return Compute(sum(price.seconds(self.m, x.ops) for x in items), kind, name, mb)
        if fwd:
            return ([work([ops[h][0], ops[hkv][0], ops[hkv][0]])] + turn("q", h) + turn("k", hkv) + turn("v", hkv)
                    + [work([ops["core"][0], ops[h][1]])] + turn("out", h))
        return ([work([ops[h][0]])] + turn("out", h) + [work([ops["core"][1], ops[h][1], ops[hkv][1], ops[hkv][1]])]
                + turn("v", hkv) + turn("k", hkv) + turn("q", h))

    def ring(self, pair, nbytes, layer, fwd: bool, mb, d, c) -> list:
        """Ring attention: per round, the next K/V hop posted before the round's pairs and waited
        after them; backward also passes each block's dK/dV on, posted once its round made it."""
        from ....parallel.context.blocks import SKIP, relation
        from ....parallel.context.layout import rank_chunks
        s, n = self.s, self.s.cp
        nxt, prv, me = self.rank(d, 0, 0, (c + 1) % n), self.rank(d, 0, 0, (c - 1) % n), self.rank(d, 0, 0, c)
        def hop(what, j, label):
            send = self.call((what, d, mb, layer, j, c), (me, nxt), "send", nbytes, "send", label, mb, nxt)
            recv = self.call((what, d, mb, layer, j, (c - 1) % n), (prv, me), "send", nbytes, "recv", label, mb, prv)
            return [send, replace(recv, bytes=0)], [Wait(send.key), Wait(recv.key)]

        def round_s(src):      # its pairs, and its buffers: the next block's (fwd), dK/dV's zeroed and summed (bwd)
            hows = [relation(qa, kb, True) for qa in rank_chunks(c, n, s.cp_balance)
                    for kb in rank_chunks(src, n, s.cp_balance)]
            own = 0.0 if fwd else 4 * nbytes / self.m.dram_Bps
            return own + sum(price.seconds(self.m, _attention_ops(how, *pair)[0 if fwd else 1].ops)
                             for how in hows if how != SKIP)

        out, grads = [], []
        for j in range(n):
            label = f"cp kv {'' if fwd else 'bwd '}{j + 1}"
            posts, waits = hop("kv" if fwd else "kv bwd", j, label) if j < n - 1 else ([], [])
            out += posts + [Compute(round_s((c - j) % n), "attention", f"ring {'fwd' if fwd else 'bwd'} {j}", mb)]
            if not fwd:                                   # the block's gradient so far in, passed on
                posts_g, next_grads = hop("dkv", j, f"cp dkv {j + 1}")
                out += grads + posts_g
                grads = next_grads
            out += waits
        return out + grads
