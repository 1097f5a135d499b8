"""Data parallelism and ZeRO in the planner's programs, as parallel/data/ and parallel/zero/ run them.

The gradients go out per tensor after backward (naive), in buckets after backward (bucketed),
or each bucket issued once the block that completes it has added into its gradients (overlap,
ddp), the buckets those of :func:`labkit.parallel.data.fill_buckets`. ZeRO 1/2 reduce-scatter
the buckets after backward (1) or as they fill (2) and all-gather the updated shards after the
optimizer step on 1/dp of the parameters; ZeRO 3 gathers each block before its forward and its
backward (``prefetch``: the next ones ahead) and reduce-scatters it after its backward, and
what no block holds (the root: embeddings, final norm, head) once per micro-batch, kept from
the model's forward until its gradients go. The
ranks that average are dp × cp. :class:`DataPrograms` is a part of :class:`labkit.plan.local.physical.Builder`.
"""
from __future__ import annotations

from functools import partial

from .. import price
from ....analysis.des import Compute, Wait

MiB = 1024 * 1024


class DataPrograms:
    """The Builder's dp and ZeRO methods, and the program of a rank without pp."""

    def dp_group(self, p: int, t: int) -> tuple:
        """The ranks that average stage ``p``'s gradients at tp index ``t``: dp × cp."""
        return tuple(self.grid.group("dc", pp=p, tp=t))

    def part(self, k: int):
        """The piece of work ``k`` (as ``ModelWork.order``): -1 the pre, len(blocks) the post, else a block."""
        return self.w.pre if k < 0 else self.w.post if k == len(self.w.blocks) else self.w.blocks[k]

    def held(self, blocks, first: bool, last: bool) -> set:
        """The pieces whose parameters a stage holds: its blocks, the pre on the first, the post on the last."""
        return set(blocks) | ({-1} if first else set()) | ({len(self.w.blocks)} if last else set())

    def places(self, held=None) -> list[tuple[int, int]]:
        """Each parameter once, in the model's order: its first place among the ``held`` pieces
        (None: all), the piece whose backward completes its gradient (a tied weight's, the earlier block)."""
        return [min(at for at in places if held is None or at[0] in held) for places in self.w.order
                if held is None or any(k in held for k, _ in places)]

    def tied(self, first_blocks, last_blocks) -> list[tuple[int, int]]:
        """The parameters the first and the last pipeline stage both hold (a tied embedding and head)."""
        a, b = set(first_blocks) | {-1}, set(last_blocks) | {len(self.w.blocks)}
        return [min(places) for places in self.w.order if any(k in a for k, _ in places) and any(k in b for k, _ in places)]

    def local(self, k: int, j: int) -> float:
        """Elements of parameter ``j`` of piece ``k`` on one rank: 1/tp of a weight of a Linear the
        tensor plan shards (and of a column-parallel one's bias), 1/ep of a routed expert's."""
        b = self.part(k)
        owner, _, leaf = (b.names[j] if b.names else "").rpartition(".")
        n = b.params[j] / (self.s.tp if owner in self.col or (owner in self.row and leaf == "weight") else 1)
        return n / (self.s.ep if b.routed and b.routed[j] else 1)

    def buckets(self, blocks, first: bool, last: bool) -> list[tuple[int, int, frozenset]]:
        """(bytes on this rank, the piece whose backward completes it, its parameters in that
        piece: their indices among the piece's) per bucket, in gradient order; the parameters
        in the model's own order, as the executor fills its buckets."""
        from ....parallel.data import fill_buckets

        params = [(4 * int(self.local(k, j)), k, j) for k, j in self.places(self.held(blocks, first, last))
                  if not (self.routed(k)[j] and self.s.ep > 1)]    # ep: the experts sync apart (expert_sync)
        if not self.s.dp_mode == "naive" or self.s.zero:
            groups = fill_buckets(params, lambda x: x[0], self.s.bucket_mb * MiB)
        else:
            groups = [[x] for x in reversed(params)]
        out = []
        for g in groups:
            i = min(x[1] for x in g)
            out.append((sum(x[0] for x in g), i, frozenset(x[2] for x in g if x[1] == i)))
        return out

    def sync_items(self, stage, blocks, first, last, d, p, t, overlap_mb: int | None):
        """(issued during backward: block → [(its parameters, items)], after backward: items) of
        dp's gradient sync; a bucket goes out once the block's backward has added into the
        gradients of its parameters there (the executor's post-accumulate hooks)."""
        s, zero = self.s, self.s.zero
        if self.dpc == 1 or zero == 3:          # zero=3 reduce-scatters per block (zero3)
            return {}, []
        group, during, after, keys = self.dp_group(p, t), {}, [], []
        family, kind = ("reduce_scatter", "reduce_scatter") if zero else ("all_reduce", "allreduce")
        asynchronous = zero == 2 or (not zero and s.dp_mode in ("overlap", "ddp"))
        for k, (nbytes, i, members) in enumerate(self.buckets(blocks, first, last)):
            key = ("grad", stage, p, t, k, overlap_mb)
            if asynchronous:
                during.setdefault(i, []).append((members, [self.copy(nbytes), self.call(key, group, family, nbytes,
                                                                                      kind, f"bucket {k}")]))
                keys.append((key, nbytes))
            else:
                after += [self.copy(nbytes)] if s.dp_mode != "naive" or zero else []
                after += self.blocking(key, group, family, nbytes, kind, f"bucket {k}")
                after.append(self.copy(nbytes / (self.dpc if zero else 1)))
        for key, nbytes in keys:
            after += [Wait(key), self.copy(nbytes / (self.dpc if zero else 1))]
        return during, after

    def gathers(self, stage, blocks, first, last, d, p, t) -> list:
        """ZeRO 1/2: the updated shards all-gathered after the optimizer step."""
        out = []
        for k, (nbytes, _, _) in enumerate(self.buckets(blocks, first, last)):
            out += self.blocking(("gather", stage, p, t, k), self.dp_group(p, t), "all_gather", nbytes,
                                 "allgather", f"bucket {k}")
        return out

    def optimizer(self, blocks, first: bool, last: bool) -> Compute:
        """The optimizer step on this rank's part of the parameters (:meth:`share`); of what it
        touches, what its pieces touched too, its share of it."""
        held = self.held(blocks, first, last)
        mine = {key for k in held for ops in (self.part(k).fwd, self.part(k).bwd) for o in ops.ops for key, _ in o.operands}
        whole = sum(self.part(k).params[j] for k, j in self.places(held))
        share = self.share(held)
        kept = share * sum(self.part(k).params[j] for k, j in self.places()) / max(1, whole)   # of what it touches
        return Compute(price.seconds(self.m, self.w.optimizer.ops) * share, "optimizer",
                       "optimizer", touches=self.touches(self.w.optimizer.ops, lambda o: kept, mine))

    def routed(self, k: int) -> list:
        b = self.part(k)
        return b.routed or [False] * len(b.params)

    def share(self, held: set) -> float:
        """The part of the optimizer's work this rank does: the parameters of the pieces it
        holds, as :meth:`local` counts them on one rank, its ZeRO shard of those."""
        total = sum(self.part(k).params[j] for k, j in self.places())
        mine = sum(self.local(k, j) for k, j in self.places(held))
        return mine / max(1, total) / (self.dpc if self.s.zero else 1)

    def single(self, d: int, t: int, c: int = 0) -> list:
        """A rank without pp: forward and backward per micro-batch, the sync, the optimizer step."""
        s, blocks, act = self.s, range(len(self.w.blocks)), Compute(self.m.action_s)
        out = []
        for mb in range(s.microbatches):
            last_mb = mb == s.microbatches - 1
            sync = s.zero == 2 or last_mb
            during, after = self.sync_items(0, blocks, True, True, d, 0, t, mb if s.zero == 2 else None) if sync else ({}, [])
            out += [act] + self.forward(blocks, d, 0, t, mb, True, True, c=c)
            out += [act] + self.backward(blocks, d, 0, t, mb, True, True, issue=during, c=c)
            if s.zero == 2 and not last_mb:
                out += after
        out += after + self.expert_sync(d)
        out.append(self.optimizer(blocks, True, True))
        if s.zero in (1, 2):
            out += self.gathers(0, blocks, True, True, d, 0, t)
        return out

    def zero3(self, d: int, p: int, t: int, c: int = 0) -> list:
        """zero=3 (pp = 1): each block gathered before its forward and its backward, reduce-scattered after."""
        n, act = len(self.w.blocks), Compute(self.m.action_s)
        out, pending = [], []
        for mb in range(self.s.microbatches):
            gather = partial(self.zero3_gather, mb=mb, t=t, issued=set())
            scatter = partial(self.zero3_scatter, mb=mb, t=t, pending=pending)
            root = self.zero3_bytes(-1)     # the root (what no block holds), gathered as the model's forward begins
            out += [act] + (self.blocking(("g3", -1, mb, t), self.dp_group(0, t), "all_gather", root, "allgather",
                                          "gather root") if root else [])
            out += self.forward(range(n), d, 0, t, mb, True, True, gather=gather, c=c)
            out += [act] + self.backward(range(n), d, 0, t, mb, True, True, after=scatter, gather=gather, c=c)
        for key, nbytes in pending:
            out += [Wait(key), self.copy(nbytes / self.dpc)]
        out.append(self.optimizer(range(n), True, True))
        return out

    def zero3_bytes(self, i: int) -> int:
        """Bytes of block ``i``'s parameters (-1: those outside the blocks) as ZeRO-3 pads them to dp × cp shards."""
        numel, tp = (sum(self.w.pre.params) + sum(self.w.post.params), 1) if i < 0 else (sum(self.w.blocks[i].params), self.s.tp)
        return 4 * -(-numel // tp // self.dpc) * self.dpc

    def zero3_gather(self, i: int, phase: str, mb, t: int, issued: set) -> list:
        """Before block ``i``'s ``phase``: its all-gather and the ``prefetch`` next ones (each
        issued once per micro-batch and phase), then the wait for its own."""
        n, ahead = len(self.w.blocks), self.s.prefetch
        nxt = range(i, min(n, i + 1 + ahead)) if phase == "fwd" else range(i, max(-1, i - 1 - ahead), -1)
        items = []
        for j in nxt:
            if self.zero3_bytes(j) and (j, phase) not in issued:
                issued.add((j, phase))
                items.append(self.call(("g3", j, phase, mb, t), self.dp_group(0, t), "all_gather", self.zero3_bytes(j),
                                       "allgather", f"gather block {j}", mb))
        return items + ([Wait(("g3", i, phase, mb, t))] if self.zero3_bytes(i) else [])

    def zero3_scatter(self, i: int, mb, t: int, pending: list) -> list:
        """After block ``i``'s backward (-1: the part before the blocks): its gradients' reduce-scatter."""
        nbytes = self.zero3_bytes(i)
        if not nbytes:
            return []
        key = ("rs3", i, mb, t)
        pending.append((key, nbytes))
        return [self.call(key, self.dp_group(0, t), "reduce_scatter", nbytes, "reduce_scatter",
                          f"scatter block {i}", mb)]
