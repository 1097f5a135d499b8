"""Expert parallelism in the planner's programs: a MoE layer's exchanges over the ep group
around this rank's experts (parallel/expert/dispatch.py), and the experts' own gradient sync.

Beside dp, per MoE layer: the sizes, dispatch and combine all-to-alls around the rank's own
compute (sorting, its experts on the rows that arrive, weighting back: ``ExpertParallelMoE``'s
own code, timed in sequence where the model's pieces are, else counted and priced), the rows
as the first step's tokens route; with ``ep_overlap="microbatch"``
two halves whose exchanges travel under each other's experts; the experts' gradients summed
over their replicas after the dense sync over dp. An all-to-all is priced as gloo runs it: every
pair's message posted at once, one latency and the busiest member's bytes, sent or received.
:class:`ExpertPrograms` is a part of :class:`labkit.plan.local.physical.Builder`.
"""
from __future__ import annotations

from .. import price
from ....analysis.des import Compute, Issue, Wait


class ExpertPrograms:
    """The Builder's ep methods (they use its grid, prices and calls)."""

    def ep_layer(self, layer, moe, fwd: bool, kind, name, mb, d) -> list:
        """One MoE layer on dp rank ``d`` as parallel/expert/dispatch.py runs it: the counts, then
        the tokens out (dispatch) and back (combine), blocking; ep_overlap="microbatch": two
        halves of the tokens, each's exchanges in flight under the other's experts. Backward
        mirrors forward (autograd runs the later half first)."""
        from ..expert_work import exchange, routed_ops, routed_seconds, shape
        (n, width), ep = shape(moe), self.s.ep
        first, me, row = d - d % ep, d % ep, 4 * width
        group = tuple(self.rank(first + k, 0, 0) for k in range(ep))
        halves = [None] if self.s.ep_overlap == "none" else [0, 1]
        ops, call = {}, {}
        for h in halves:
            chosen = [self.routes[first + k][mb][layer] for k in range(ep)]
            chosen = chosen if h is None else [x.tensor_split(2)[h] for x in chosen]
            rows, counts = exchange(chosen, n, ep)
            if (layer, d, mb, h) not in self.counted:          # forward and backward alike
                self.counted[layer, d, mb, h] = (
                    routed_seconds(moe, chosen[me], counts[me]) if self.timed else
                    {part: tuple(price.seconds(self.m, x.ops) for x in pair)
                     for part, pair in routed_ops(moe, chosen[me], counts[me]).items()})
            for part, pair in self.counted[layer, d, mb, h].items():
                ops[part, h] = Compute(pair[0 if fwd else 1], kind, name, mb,
                                       self.weights(moe, layer, pair, fwd) if part == "experts" else ())
            out = [sum(rows[s]) - rows[s][s] for s in range(ep)]                        # dispatch's rows
            back = [sum(rows[s][r] for s in range(ep)) - rows[r][r] for r in range(ep)]  # combine's
            for what, (sent, got) in (("dispatch", (out, back)), ("combine", (back, out))):
                sent, got = (sent, got) if fwd else (got, sent)      # bytes leaving, arriving per member
                label = f"{layer} {what}{'' if h is None else f' mb{h}'}{'' if fwd else ' backward'}"
                call[what, h] = self.a2a(("a2a", first, mb, layer, what, h, fwd), group, [row * x for x in sent],
                                         me, label, mb, received=[row * x for x in got])
        # the int64 sizes, both halves' in one exchange: (E,) per rank, or [destination, half, local expert]
        per = 8 * n * (ep - 1) // ep if halves == [None] else 16 * (n // ep) * (ep - 1)
        sizes = self.a2a(("a2a counts", first, mb, layer), group, [per] * ep, me, f"{layer} counts", mb)
        order = halves if fwd else halves[::-1]
        start, a, b, end = ("pre", "dispatch", "combine", "post") if fwd else ("post", "combine", "dispatch", "pre")
        items = [sizes, Wait(sizes.key)] if fwd else []
        for h in order:
            items += [ops[start, h], call[a, h]]
        for h in order:
            items += [Wait(call[a, h].key), ops["experts", h], call[b, h]]
        for h in order:
            items += [Wait(call[b, h].key), ops[end, h]]
        return items

    def weights(self, moe, layer, pair, fwd: bool) -> tuple:
        """What the rank's experts touch (:meth:`Builder.touches`' form): their weights, read
        forward and backward, their gradients added into backward, as bytes of their own, so the
        cache's loss since the rank last ran them (``refetch``) is paid as for any piece's
        bytes. Their timing (:func:`~labkit.plan.local.expert_work.routed_seconds`, forward then
        backward, again and again) paid what a forward and backward's age costs."""
        from ..expert_work import expert_bytes
        nbytes = expert_bytes(moe, self.s.ep)
        paid = price.refetch(self.m, sum(pair)) if self.timed else 0.0
        weights = (("experts", layer), nbytes, paid)
        return (weights,) if fwd else (weights, (("experts' gradients", layer), nbytes, paid))

    def a2a(self, key, group, sent: list, me: int, name, mb, received: list | None = None) -> Issue:
        """An all-to-all over ``group``, ``sent[i]`` bytes leaving its i-th member and
        ``received[i]`` arriving at it (default: as many as leave). gloo's alltoallv posts every
        member's n − 1 sends and receives at once, then waits for them all (gloo/alltoallv.cc):
        one message's latency, its busiest member's bytes. An emulated link prices it as a
        pairwise exchange (``labkit.Link.seconds``: (n − 1)·α and the busiest member's bytes,
        sent or received, since a link is shared on both sides); the call takes the longer."""
        n = len(group)
        busiest = max(max(sent), max(received or sent))
        own, link = price.comm_parts(self.m, "all_to_all", busiest * n / (n - 1), n,
                                  gloo=price.comm_parts(self.m, "send", busiest, 2)[0])
        return Issue(key, group, own, "all_to_all", name, int(sent[me]), None, mb, link=link)

    def expert_sync(self, d: int) -> list:
        """ExpertSync.finish without ZeRO: this rank's experts' gradients flattened, summed over
        their dp/ep replicas (blocking), divided and copied back."""
        s = self.s
        nbytes = 4 * sum(n for b in self.w.blocks for n, r in zip(b.params, b.routed) if r) // s.ep
        if s.ep == 1 or not nbytes:
            return []
        group = tuple(self.rank(k * s.ep + d % s.ep, 0, 0) for k in range(s.dp // s.ep))
        out = [self.copy(nbytes)]
        if len(group) > 1:
            out += self.blocking(("expert grads", d % s.ep), group, "all_reduce", nbytes, "allreduce", "expert grads")
        return out + [Compute(2 * nbytes / self.m.dram_Bps), self.copy(nbytes)]
