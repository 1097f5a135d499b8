"""Predict a step from a :class:`~labkit.plan.machine.Machine` and a model's counted operations.

``simulate(strategy, machine, model=, batch=)`` writes each rank's program as the executor
runs it, prices every piece from the model's own operations (:mod:`labkit.plan.work`) with
the machine's numbers, and runs the programs through the one simulator
(:mod:`labkit.analysis.des`):

* data parallelism: forward and backward block by block per micro-batch; the gradients
  per tensor after backward (naive), in buckets after backward (bucketed), or each bucket
  issued at the block where its last gradient appears (overlap, ddp), the buckets those of
  :func:`labkit.parallel.data.fill_buckets`;
* ZeRO 1/2/3 (labkit's own calls): reduce-scatters of the buckets after backward (1) or as
  they fill (2), all-gathers after the optimizer step on 1/dp of the parameters; zero=3
  gathers each block before its forward and its backward (``prefetch``: the next one ahead)
  and reduce-scatters it after its backward;
* Megatron tensor parallelism: the sharded Linears' products at 1/tp, a blocking all-reduce
  after each row-parallel Linear (g, forward) and at each column-parallel one's input (f,
  backward);
* pipelines: the action lists of :func:`labkit.parallel.pipeline.schedules.build_schedule`,
  the stages cut by the executor's own :func:`~labkit.parallel.pipeline.stages.split_blocks`;
  with dp, the dp modes above per stage;
* context parallelism (beside dp and zero): every op counted on a rank's 1/cp of each
  sequence, each block cut at its attention (:func:`labkit.plan.work.count`'s markers); ring:
  cp rounds, each round's K/V hop posted before its pairs (the executor's own
  ``block_forward``/``block_backward``, counted per (query chunk, key chunk) pair the causal
  split leaves the rank) and waited after them, backward passing dK/dV on as well; allgather:
  a blocking all-gather of K/V before the attention, a reduce-scatter of their gradient after
  its backward; ulysses: blocking all-to-alls of q, k, v to a head split before it and of its
  output back after (their mirrors in backward); gradients averaged over dp × cp;
* expert parallelism (beside dp): per MoE layer the sizes, dispatch and combine all-to-alls
  around the rank's own compute (sorting, its experts on the rows that arrive, weighting back:
  ``ExpertParallelMoE``'s own code, counted), the rows as the first step's tokens route; with
  ``ep_overlap="microbatch"`` two halves whose exchanges travel under each other's experts;
  the experts' gradients summed over their replicas after the dense sync over dp. An
  all-to-all is priced as gloo runs it: every pair's message posted at once, one latency and
  the busiest member's bytes.

Every action pays the machine's host cost per action, every op its host cost per op, every
posted call its host cost per call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatch

from ..analysis.metrics import step_metrics
from ..analysis.timeline import Timeline
from ..grid import ParallelDims
from .context_programs import ContextPrograms
from ..analysis.des import Compute, Issue, Sim, Wait
from .expert_programs import ExpertPrograms
from .machine import Machine, bus_factor, ring_steps

MiB = 1024 * 1024


@dataclass
class Simulated:
    """A predicted step: ``.metrics`` and ``.timeline`` as in :class:`labkit.Run`."""

    strategy: object
    metrics: dict
    timeline: Timeline
    batch: int

    def __repr__(self) -> str:
        return f"Simulated({self.metrics['step_time_s'] * 1e3:.2f} ms per step, {self.timeline!r})"


def check(strategy, machine: Machine, model) -> None:
    """ValueError (naming the field and the fix) for what the model of the machine does not cover."""
    if not isinstance(machine, Machine):
        raise TypeError(f"machine must be a labkit.plan.Machine (labkit.plan.measure(lab)), got {type(machine).__name__}")
    if model is None:
        raise ValueError("simulate(strategy, machine, model=...): pass the model to predict (a factory or module)")
    if strategy.tp > 1 and (strategy.tp_mode != "megatron" or strategy.sequence_parallel):
        raise ValueError("simulate: only tp_mode='megatron' without sequence_parallel is modelled (labkit's own "
                         "f and g); use tp_mode='megatron', sequence_parallel=False")
    if strategy.zero and strategy.zero_mode != "labkit":
        raise ValueError("simulate: zero_mode='fsdp2' issues torch's own calls; simulate zero_mode='labkit'")
    if strategy.compression != "none":
        raise ValueError(f"simulate: compression={strategy.compression!r} is not modelled; use compression='none'")
    if strategy.cp > 1 and (strategy.pp > 1 or strategy.tp > 1):
        raise ValueError(f"simulate: Strategy.cp={strategy.cp} is modelled beside dp and zero only, not with "
                         f"pp={strategy.pp} tp={strategy.tp}; use pp=1 and tp=1 with cp, or cp=1")
    if strategy.ep > 1 and (strategy.pp > 1 or strategy.tp > 1 or strategy.cp > 1 or strategy.zero):
        raise ValueError(f"simulate: Strategy.ep={strategy.ep} is modelled beside dp only, not with pp={strategy.pp} "
                         f"tp={strategy.tp} cp={strategy.cp} zero={strategy.zero}; use pp=1, tp=1, cp=1 and zero=0 "
                         "with ep, or ep=1")


def simulate(strategy, machine: Machine, model=None, batch: int = 64, data=None, loss="mse",
             tp_plan: dict | None = None, optimizer: str = "sgd") -> Simulated:
    """Predict one step of ``strategy`` on ``machine`` for ``model`` (lab.run's arguments)."""
    check(strategy, machine, model)
    strategy.check_batch(batch)
    size = batch // (strategy.dp * strategy.microbatches)
    if strategy.cp > 1 or strategy.ep > 1:     # the lab's own model checks, its messages
        from ..training import build_model, resolve_data
        from ..parallel import context, expert
        built = build_model(model, 0)
        context.check_model(strategy, built, resolve_data(data, built, batch, 0))
        expert.check_model(strategy, built)
    work = _count(model, size, data, loss, optimizer, strategy.cp, strategy.ep, machine.cache_bytes)
    if strategy.tp > 1:
        plan = tp_plan if tp_plan is not None else getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError("simulate: tp > 1 needs the model's tensor plan; pass tp_plan= (as lab.run takes it)")
    else:
        plan = {}
    routes = None
    if strategy.ep > 1:                  # where each rank's tokens go, as the first step routes them
        from .expert_work import routes as route
        routes = route(model, batch, data, strategy.dp, strategy.microbatches)
    programs = [[y for x in prog for y in ((Compute(machine.call_s), x) if isinstance(x, Issue) else (x,))]
                for prog in Builder(strategy, machine, work, plan, routes).programs()]   # posting a call is host work
    events = Sim(programs, machine.cores, machine.comm_load, machine.wake_s, machine.cross_s,
                 links=bool(machine.link_alpha_beta)).run()
    world = strategy.world_size
    return Simulated(strategy, step_metrics(events, world, batch),
                     Timeline(events, world, title="predicted", grid=strategy), batch)


_CACHE: dict = {}


def _count(model, size, data, loss, optimizer, cp=1, ep=1, cache_bytes=float("inf")):
    """The model's counted work, its ops' bytes beyond the cache marked (kept per model)."""
    from .work import count, warm
    try:
        key = (model, size, data, loss, optimizer, cp, ep, cache_bytes)
        hash(key)
    except TypeError:
        return warm(count(model, size, data, loss, optimizer, cp=cp, ep=ep), cache_bytes)
    if key not in _CACHE:
        _CACHE[key] = warm(count(model, size, data, loss, optimizer, cp=cp, ep=ep), cache_bytes)
    return _CACHE[key]


class Builder(ContextPrograms, ExpertPrograms):
    """Each rank's program for one step (see the module docstring)."""

    def __init__(self, s, machine: Machine, work, plan: dict, routes=None):
        self.s, self.m, self.w, self.routes, self.counted = s, machine, work, routes, {}
        if s.zero == 3:
            from .work import unaccumulated
            self.w = unaccumulated(work)
        self.dpc = s.dp * s.cp           # the ranks that average gradients (and ZeRO's shards): dp × cp
        self.grid = ParallelDims(s.dp, s.pp, s.tp, s.cp)
        self.col = {q for b in work.blocks for q in b.linears if _matches(q, plan, "colwise")}
        self.row = {q for b in work.blocks for q in b.linears if _matches(q, plan, "rowwise")}

    # -- the grid: labkit.grid's ranks = arange(world).view(dp, pp, cp, tp), as the engines lay them out
    def rank(self, d: int, p: int, t: int, c: int = 0) -> int:
        return self.grid.rank_of(d, p, t, c)

    def dp_group(self, p: int, t: int) -> tuple:
        """The ranks that average stage ``p``'s gradients at tp index ``t``: dp × cp."""
        return tuple(self.grid.group("dc", pp=p, tp=t))

    def tp_group(self, d: int, p: int) -> tuple:
        return tuple(self.grid.group("t", dp=d, pp=p))

    # -- prices ---------------------------------------------------------------------------------
    def scale(self, op) -> float:
        return 1.0 / self.s.tp if op.linear in self.col or op.linear in self.row else 1.0

    def secs(self, ops) -> float:
        return self.m.seconds(ops.ops, self.scale)

    def call(self, key, group, family, nbytes, kind, name, mb=None, peer=None) -> Issue:
        n = len(group)
        own, link = self.m.comm_parts(family, nbytes, n)
        if family == "send":
            return Issue(key, group, own, kind, name, int(nbytes), peer, mb, ordered=False, link=link)
        return Issue(key, group, own, kind, name, int(round(bus_factor(family, n) * nbytes)), peer, mb,
                     steps=ring_steps(family, n), link=link)

    def blocking(self, key, group, family, nbytes, kind, name, mb=None) -> list:
        return [self.call(key, group, family, nbytes, kind, name, mb), Wait(key)]

    def copy(self, nbytes: float) -> Compute:
        """Packing or unpacking a bucket: one op reading and writing ``nbytes``."""
        return Compute(self.m.op_s + 2 * nbytes / self.m.memory_Bps)

    # -- compute of a range of blocks, with tp's calls -------------------------------------------
    def forward(self, blocks, d, p, t, mb, first: bool, last: bool, gather=None, c: int = 0) -> list:
        out, w = [], self.w
        if first:
            out.append(Compute(self.secs(w.pre.fwd), "fwd", "pre", mb))
        for i in blocks:
            if gather:
                out += gather(i, "fwd")
            b = w.blocks[i]
            out += self.block(b, b.fwd, "fwd", mb, d, c)
            for q in sorted(self.row & set(b.linears)):
                out += self.blocking(("g", q, d, p, mb), self.tp_group(d, p), "all_reduce",
                                     4 * b.out_numel * w.size, "allreduce", f"tp g {q}", mb)
        if last:
            out.append(Compute(self.secs(w.post.fwd), "fwd", "loss", mb))
        return out

    def backward(self, blocks, d, p, t, mb, first: bool, last: bool, part=None, after=None, gather=None,
                 c: int = 0, issue=None) -> list:
        """Backward over ``blocks`` (last to first); ``part``: "I" or "W" of a split backward;
        ``after(i)``: items to issue once block i's backward is done; ``issue``: block → [(its
        parameters, items)], each issued inside the block once those gradients are added."""
        issue = issue or {}
        kind = {"I": "bwd_input", "W": "bwd_weight"}.get(part, "bwd")
        keep = {None: lambda o: True, "I": lambda o: not o.weight_grad, "W": lambda o: o.weight_grad}[part]
        out, w = [], self.w
        if last and part != "W":
            out.append(Compute(self.secs(w.post.bwd), kind, "loss", mb))
        for i in reversed(list(blocks)):
            if gather:
                out += gather(i, "bwd")
            b = w.blocks[i]
            out += self.block(b, b.bwd.where(keep), kind, mb, d, c, issue.get(i, ()))
            if part != "W":
                for q in sorted(self.col & set(b.linears)):
                    out += self.blocking(("f", q, d, p, mb), self.tp_group(d, p), "all_reduce",
                                         4 * b.out_numel * w.size, "allreduce", f"tp f {q}", mb)
            if after:
                out += after(i)
        if first:
            out.append(Compute(self.secs(w.pre.bwd.where(keep)), kind, "pre", mb))
            out += [x for _, items in issue.get(-1, ()) for x in items]
            if after:
                out += after(-1)
        return out

    # -- context parallelism: a block's compute cut at its attention ----------------------------
    def block(self, b, ops, kind, mb, d, c, issue=()) -> list:
        """A block's compute; under cp and ep, cut where its attention and its routed experts ran
        (work.count's markers): each attention across the cp group as ``cp_mode`` runs it, each
        MoE layer's experts behind its exchanges over the ep group. ``issue``: [(parameters,
        items)], each cut in once the block has added into those parameters' gradients."""
        name, fwd = f"block {b.name}", kind == "fwd"
        cut = ({"attention"} if self.s.cp > 1 else set()) | ({"experts"} if self.s.ep > 1 else set())
        todo = {"attention": b.attention[::1 if fwd else -1], "experts": b.moe[::1 if fwd else -1]}
        pending, added = list(issue), set()
        out, piece, marks = [], [], 0

        def close():
            out.append(Compute(self.m.seconds(piece, self.scale), kind, name, mb))
            piece.clear()
        for o in ops.ops:
            if o.name in cut:
                close()
                what = todo[o.name].pop(0)
                out += (self.cp_attention(what, (b.name, marks), fwd, kind, name, mb, d, c) if o.name == "attention"
                        else self.ep_layer(*what, fwd, kind, name, mb, d))
                marks += 1
                continue
            piece.append(o)
            if o.param >= 0 and pending:
                added.add(o.param)
                ready = [x for x in pending if x[0] <= added]
                if ready:
                    close()
                    out += [item for _, items in ready for item in items]
                    pending = [x for x in pending if not x[0] <= added]
        close()
        return out + [item for _, items in pending for item in items]

    # -- gradients -----------------------------------------------------------------------------
    def buckets(self, blocks, first: bool) -> list[tuple[int, int, frozenset]]:
        """(bytes, the block whose backward completes it, its parameters in that block: their
        indices among the block's) per bucket, in gradient order."""
        from ..parallel.data import fill_buckets

        params = ([(4 * n, -1, j) for j, n in enumerate(self.w.pre.params)] if first else [])
        params += [(4 * n, i, j) for i in blocks for j, (n, r) in enumerate(zip(self.w.blocks[i].params, self.routed(i)))
                   if not (r and self.s.ep > 1)]     # ep: the experts sync on their own (expert_sync)
        if not self.s.dp_mode == "naive" or self.s.zero:
            groups = fill_buckets(params, lambda x: x[0], self.s.bucket_mb * MiB)
        else:
            groups = [[x] for x in reversed(params)]
        out = []
        for g in groups:
            i = min(x[1] for x in g)
            out.append((sum(x[0] for x in g) // self.s.tp, i, frozenset(x[2] for x in g if x[1] == i)))
        return out

    def sync_items(self, stage, blocks, first, d, p, t, overlap_mb: int | None):
        """(issued during backward: block → [(its parameters, items)], after backward: items) of
        dp's gradient sync; a bucket goes out once the block's backward has added into the
        gradients of its parameters there (the executor's post-accumulate hooks)."""
        s = self.s
        if self.dpc == 1:
            return {}, []
        group = self.dp_group(p, t)
        during, after = {}, []
        zero = s.zero
        family = "reduce_scatter" if zero else "all_reduce"
        kind = "reduce_scatter" if zero else "allreduce"
        units = self.buckets(blocks, first)
        if zero == 3:
            return {}, []                    # its reduce-scatters are per block (zero3_program)
        asynchronous = zero == 2 or (not zero and s.dp_mode in ("overlap", "ddp"))
        keys = []
        for k, (nbytes, i, members) in enumerate(units):
            key = ("grad", stage, p, t, k, overlap_mb)
            if asynchronous:
                during.setdefault(i, []).append((members, [self.copy(nbytes), self.call(key, group, family, nbytes,
                                                                                      kind, f"bucket {k}")]))
                keys.append((key, nbytes))
            else:
                after += ([self.copy(nbytes)] if s.dp_mode != "naive" or zero else [Compute(self.m.op_s)])
                after += self.blocking(key, group, family, nbytes, kind, f"bucket {k}")
                after.append(self.copy(nbytes / (self.dpc if zero else 1)))
        for key, nbytes in keys:
            after += [Wait(key), self.copy(nbytes / (self.dpc if zero else 1))]
        return during, after

    def gathers(self, stage, blocks, first, d, p, t) -> list:
        """ZeRO 1/2: the updated shards all-gathered after the optimizer step."""
        out = []
        for k, (nbytes, _, _) in enumerate(self.buckets(blocks, first)):
            out += self.blocking(("gather", stage, p, t, k), self.dp_group(p, t), "all_gather", nbytes,
                                 "allgather", f"bucket {k}")
        return out

    def optimizer(self, share: float) -> Compute:
        return Compute(self.m.seconds(self.w.optimizer.ops) * share, "optimizer", "optimizer")

    # -- programs -----------------------------------------------------------------------------
    def programs(self) -> list[list]:
        s = self.s
        progs = [None] * s.world_size
        for d in range(s.dp):
            for p in range(s.pp):
                for t in range(s.tp):
                    for c in range(s.cp):
                        one = self.zero3(d, p, t, c) if s.zero == 3 else (self.pipeline(d, p, t) if s.pp > 1
                                                                          else self.single(d, t, c))
                        progs[self.rank(d, p, t, c)] = [Compute(self.m.step_s)] + one
        return progs

    def routed(self, i: int) -> list:
        return self.w.blocks[i].routed or [False] * len(self.w.blocks[i].params)

    def share(self, blocks, first: bool) -> float:
        """The part of the optimizer's work this rank does: its blocks, its tp shard, its ZeRO
        shard, its 1/ep of the routed experts."""
        total = sum(sum(b.params) for b in self.w.blocks) + sum(self.w.pre.params)
        mine = sum(n / (self.s.ep if r else 1) for i in blocks for n, r in zip(self.w.blocks[i].params, self.routed(i)))
        mine += sum(self.w.pre.params) if first else 0
        return mine / max(1, total) / self.s.tp / (self.dpc if self.s.zero else 1)

    def single(self, d: int, t: int, c: int = 0) -> list:
        s, n = self.s, len(self.w.blocks)
        blocks, act = range(n), Compute(self.m.action_s)
        out = []
        for mb in range(s.microbatches):
            last_mb = mb == s.microbatches - 1
            sync = s.zero == 2 or last_mb
            during, after = self.sync_items(0, blocks, True, d, 0, t, mb if s.zero == 2 else None) if sync else ({}, [])
            out += [act] + self.forward(blocks, d, 0, t, mb, True, True, c=c)
            out += [act] + self.backward(blocks, d, 0, t, mb, True, True, issue=during, c=c)
            if s.zero == 2 and not last_mb:
                out += after
        out += after + self.expert_sync(d)
        out.append(self.optimizer(self.share(blocks, True)))
        if s.zero in (1, 2):
            out += self.gathers(0, blocks, True, d, 0, t)
        return out

    def zero3(self, d: int, p: int, t: int, c: int = 0) -> list:
        """zero=3 (pp = 1): each block gathered before its forward and its backward, reduce-scattered after."""
        s, n = self.s, len(self.w.blocks)
        group, act = self.dp_group(0, t), Compute(self.m.action_s)
        sizes = [4 * -(-sum(b.params) // s.tp // self.dpc) * self.dpc for b in self.w.blocks]
        pre = 4 * -(-sum(self.w.pre.params) // self.dpc) * self.dpc
        out, pending = [], []
        for mb in range(s.microbatches):
            issued = set()

            def gather(i, phase, mb=mb, issued=issued):
                items = []
                ahead = [j for j in (range(i, min(n, i + 1 + s.prefetch)) if phase == "fwd"
                                     else range(i, max(-1, i - 1 - s.prefetch), -1))]
                for j in ahead:
                    if sizes[j] and (j, phase) not in issued:
                        issued.add((j, phase))
                        items.append(self.call(("g3", j, phase, mb, t), group, "all_gather", sizes[j], "allgather",
                                               f"gather block {j}", mb))
                if sizes[i]:
                    items.append(Wait(("g3", i, "fwd" if phase == "fwd" else "bwd", mb, t)))
                return items

            def scatter(i, mb=mb):
                nbytes = pre if i < 0 else sizes[i]
                if not nbytes:
                    return []
                key = ("rs3", i, mb, t)
                pending.append((key, nbytes))
                return [self.call(key, group, "reduce_scatter", nbytes, "reduce_scatter", f"scatter block {i}", mb)]

            out += [act] + self.forward(range(n), d, 0, t, mb, True, True, gather=gather, c=c)
            out += [act] + self.backward(range(n), d, 0, t, mb, True, True, after=scatter, gather=gather, c=c)
        for key, nbytes in pending:
            out += [Wait(key), self.copy(nbytes / self.dpc)]
        out.append(self.optimizer(self.share(range(n), True)))
        return out

    def pipeline(self, d: int, p: int, t: int) -> list:
        from ..parallel.pipeline import SPLIT_BACKWARD
        from ..parallel.pipeline.schedules import build_schedule
        from ..parallel.pipeline.stages import split_blocks

        s, w = self.s, self.w
        stages = s.pp * s.chunks
        ranges = split_blocks([sum(b.params) for b in w.blocks], stages, s.split_at,
                              equal=s.schedule == "interleaved")
        actions = build_schedule(s.schedule, s.pp, s.microbatches, s.chunks)[p]
        last_b = {}
        for k, a in enumerate(actions):
            if a.op in ("B", "W") or (a.op == "I" and a.stage == 0):
                last_b[a.stage] = k
        syncs = {g: self.sync_items(g, ranges[g], g == 0, d, p, t, None) for g in {a.stage for a in actions}}
        act, out, size = Compute(self.m.action_s), [], w.size
        split = s.schedule in SPLIT_BACKWARD
        for k, a in enumerate(actions):
            g, mb = a.stage, a.microbatch
            blocks, first, last = ranges[g], g == 0, g == stages - 1
            if a.op == "F":
                out += [act] + self.forward(blocks, d, p, t, mb, first, last)
            elif a.op in ("B", "I", "W"):
                part = None if a.op == "B" else a.op
                if split and first and a.op == "I":
                    part = "I"
                out += [act] + self.backward(blocks, d, p, t, mb, first, last, part)
                if k == last_b.get(g) and s.dp_mode in ("overlap", "ddp") and not s.zero:
                    out += [x for issued in syncs[g][0].values() for _, items in issued for x in items]
            elif a.op.startswith("SEND"):
                peer = self.rank(d, a.peer, t)
                direction = a.op[-1]
                key = ("p2p", direction, g, mb, d, t)
                out.append(self.call(key, (self.rank(d, p, t), peer), "send", _act_bytes(w, ranges, g, direction, size),
                                     "send", f"{direction} {mb}", mb, peer))
            else:                                               # RECV_F / RECV_B
                peer = self.rank(d, a.peer, t)
                direction = a.op[-1]
                src = g - 1 if direction == "F" else g + 1
                key = ("p2p", direction, src, mb, d, t)
                item = self.call(key, (peer, self.rank(d, p, t)), "send", _act_bytes(w, ranges, src, direction, size),
                                 "recv", f"{direction} {mb}", mb, peer)
                out += [replace(item, bytes=0), Wait(key)]
        held = sorted({a.stage for a in actions})
        for g in held:
            out += syncs[g][1]
        mine = [i for g in held for i in ranges[g]]
        out.append(self.optimizer(self.share(mine, 0 in held)))
        if s.zero == 1:
            for g in held:
                out += self.gathers(g, ranges[g], g == 0, d, p, t)
        return out


def _act_bytes(work, ranges, stage: int, direction: str, size: int) -> int:
    """Bytes of the activation (F) or its gradient (B) leaving ``stage``'s boundary."""
    boundary = ranges[stage][-1] if direction == "F" else ranges[stage][0] - 1
    return 4 * work.blocks[max(0, boundary)].out_numel * size


def _matches(qualified: str, plan: dict, style: str) -> bool:
    return any(v == style and (fnmatch(qualified, k) or qualified == k) for k, v in plan.items())


def overlay(predicted, measured, step=None, figsize=None):
    """Measured spans filled, predicted spans as dashed outlines in the same lanes; the Figure.

    ``predicted``: a Simulated or Timeline; ``measured``: a Run or Timeline. step: the
    measured step to draw (default its last); the prediction is one step.
    """
    from ..view.timeline import _lane

    pred = getattr(predicted, "timeline", predicted)
    meas = getattr(measured, "timeline", measured)
    fig = meas.plot(step=step, figsize=figsize, labels=False)
    ax = fig.axes[0]
    for e in pred.events:
        if e["rank"] not in meas.ranks:
            continue
        y = _lane(meas.ranks, e["rank"], e["stream"])
        ax.broken_barh([(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)], (y - 0.45, 0.9),
                       facecolors="none", edgecolors="black", linestyles="--", linewidth=0.8)
    right = max([ax.get_xlim()[1]] + [e["end"] * 1e3 for e in pred.events])
    ax.set_xlim(0, right)
    t_pred = max((e["end"] for e in pred.events), default=0.0)
    ax.set_title(f"{ax.get_title()} — predicted (dashed) {t_pred * 1e3:.2f} ms")
    return fig
