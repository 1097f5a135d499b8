"""Pipelines in the planner's programs: each rank's action list from
:func:`labkit.parallel.pipeline.schedules.build_schedule`, its stages cut by the executor's own
:func:`~labkit.parallel.pipeline.stages.split_blocks`, activations and their gradients sent
between neighbours, and with dp the dp modes per stage (their buckets issued after a stage's last
backward with overlap). :class:`PipelinePrograms` is a part of :class:`labkit.plan.local.physical.Builder`.
"""
from __future__ import annotations

from dataclasses import replace

from ....analysis.des import Compute, Wait


class PipelinePrograms:
    """The Builder's pp method (it uses its grid, compute and calls)."""

    def pipeline(self, d: int, p: int, t: int) -> list:
        from ....parallel.pipeline.schedules import build_schedule
        from ....parallel.pipeline.stages import split_blocks

        s, w = self.s, self.w
        stages = s.pp * s.chunks
        ranges = self.stages or split_blocks([sum(b.params) for b in w.blocks], stages, s.split_at,
                                             equal=s.schedule == "interleaved")
        actions = build_schedule(s.schedule, s.pp, s.microbatches, s.chunks)[p]
        last_b = {}
        for k, a in enumerate(actions):
            if a.op in ("B", "W") or (a.op == "I" and a.stage == 0):
                last_b[a.stage] = k
        syncs = {g: self.sync_items(g, ranges[g], g == 0, g == stages - 1, d, p, t, None) for g in {a.stage for a in actions}}
        act, out = Compute(self.m.action_s), []
        for k, a in enumerate(actions):
            g, mb = a.stage, a.microbatch
            blocks, first, last = ranges[g], g == 0, g == stages - 1
            if a.op == "F":
                out += [act] + self.forward(blocks, d, p, t, mb, first, last)
            elif a.op in ("B", "I", "W"):
                out += [act] + self.backward(blocks, d, p, t, mb, first, last, None if a.op == "B" else a.op)
                if k == last_b.get(g) and s.dp_mode in ("overlap", "ddp") and not s.zero:
                    out += [x for issued in syncs[g][0].values() for _, items in issued for x in items]
            else:
                out += self.message(a, ranges, d, p, t)
        held = sorted({a.stage for a in actions})
        for g in held:
            out += syncs[g][1]
        if (0 in held) != (stages - 1 in held):       # a tied weight's two copies summed, after dp (Megatron's embedding group)
            group = (self.rank(d, 0, t), self.rank(d, s.pp - 1, t))
            for k, j in self.tied(ranges[0], ranges[-1]):
                out += self.blocking(("tied", k, j, d, t), group, "all_reduce", 4 * self.local(k, j), "allreduce",
                                     f"embedding grad {(self.part(k).names or [''] * (j + 1))[j]}")
        mine = [i for g in held for i in ranges[g]]
        out.append(self.optimizer(mine, 0 in held, stages - 1 in held))
        if s.zero == 1:
            for g in held:
                out += self.gathers(g, ranges[g], g == 0, g == stages - 1, d, p, t)
        return out

    def message(self, a, ranges, d: int, p: int, t: int) -> list:
        """A SEND_F/SEND_B action posts its message; a RECV_F/RECV_B posts the receive and waits."""
        peer, me, direction, mb = self.rank(d, a.peer, t), self.rank(d, p, t), a.op[-1], a.microbatch
        if a.op.startswith("SEND"):
            nbytes = _act_bytes(self.w, ranges, a.stage, direction)
            return [self.call(("p2p", direction, a.stage, mb, d, t), (me, peer), "send", nbytes, "send",
                              f"{direction} {mb}", mb, peer)]
        src = a.stage - 1 if direction == "F" else a.stage + 1
        key = ("p2p", direction, src, mb, d, t)
        item = self.call(key, (peer, me), "send", _act_bytes(self.w, ranges, src, direction), "recv",
                         f"{direction} {mb}", mb, peer)
        return [replace(item, bytes=0), Wait(key)]


def _act_bytes(work, ranges, stage: int, direction: str) -> int:
    """Bytes of the activation (F) or its gradient (B) leaving ``stage``'s boundary: the output
    of the last block before it (the embedding's, of a block's shape, before the first)."""
    boundary = ranges[stage].stop - 1 if direction == "F" else ranges[stage].start - 1
    return 4 * work.blocks[max(0, boundary)].out_numel * work.size


def lab_stages(model, s) -> list[range] | None:
    """Each global stage's blocks as the executor cuts the model (:func:`stage_blocks` over its
    pipeline units: an embedding and a head weigh in the balance and may hold a stage alone),
    a stage's range empty when it holds only what comes before or after the blocks; None for an
    ``nn.Sequential`` (its children are the blocks). ValueError for a cut the programs cannot
    follow: the modules before (or after) the blocks spread over several stages."""
    from torch import nn

    from ....parallel.blocks import find_blocks
    from ....parallel.pipeline.modules import pipeline_units
    from ....parallel.pipeline.stages import stage_blocks
    from ....training import build_model

    built = build_model(model, 0)
    if isinstance(built, nn.Sequential):
        return None
    blocks = [name for name, _ in find_blocks(built)]
    paths = [u.path for u in pipeline_units(built)]
    at = [blocks.index(p) if p in blocks else None for p in paths]
    inner = [k for k, b in enumerate(at) if b is not None]
    if not inner or inner != list(range(inner[0], inner[-1] + 1)):
        raise ValueError(f"simulate: Strategy.pp={s.pp} cuts {type(built).__name__} into units {paths}, and the "
                         f"planner prices stages of whole blocks ({blocks}) with what comes before and after "
                         "them; lab.run runs it")
    piece = [b if b is not None else (-1 if k < inner[0] else len(blocks)) for k, b in enumerate(at)]
    cut, out = stage_blocks(built, s), []
    for g, units in enumerate(cut):
        pieces = [piece[u] for u in units]
        if (-1 in pieces and g != 0) or (len(blocks) in pieces and g != len(cut) - 1):
            raise ValueError(f"simulate: Strategy.pp={s.pp} puts {[paths[u] for u in units]} on stage {g}, which "
                             "splits the modules before or after the blocks over several stages; the planner "
                             "prices them on the first and the last; give the cut with Strategy(split_at=...)")
        held = [k for k in pieces if 0 <= k < len(blocks)]
        start = held[0] if held else (out[-1].stop if out else 0)
        out.append(range(start, start + len(held)))
    return out
