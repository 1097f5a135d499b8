"""Predict a step from a :class:`~labkit.plan.local.machine.Machine` and a model's counted operations.

``simulate(strategy, machine, model=, batch=)`` writes each rank's program as the executor runs
it, one piece per axis as parallel/ runs it (dp and ZeRO :mod:`.programs.data`, pipelines
:mod:`.programs.pipeline`, Megatron tp :mod:`.programs.tensor`, cp :mod:`.programs.context`, ep
:mod:`.programs.expert`), prices every piece by :mod:`labkit.plan.local.price` from the model's own
operations (:mod:`labkit.plan.local.work`) and runs the programs through :mod:`labkit.analysis.des`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...analysis.metrics import step_metrics
from ...analysis.timeline import Timeline
from ...grid import ParallelDims
from . import price
from .programs.context import ContextPrograms
from .programs.data import DataPrograms
from ...analysis.des import Compute, Issue, Wait
from .programs.expert import ExpertPrograms
from ..wire import bus_factor
from .machine import Machine
from .programs.pipeline import PipelinePrograms
from .programs.tensor import TensorPrograms


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
    if strategy.world_size > 1 and machine.engines < 2:
        raise ValueError(f"simulate: this Machine was measured on {machine.engines} engine, so it holds no timing of a "
                         f"collective and would price the {strategy.world_size} ranks' communication as free; measure "
                         "it on a lab of at least 2 engines (labkit.plan.measure(lab) with Lab.start(engines=2))")
    unmodelled = {k: v for k, v, plain in (("precision", strategy.precision, "fp32"),
                                            ("recompute", strategy.recompute, "none"),
                                            ("sync_batchnorm", strategy.sync_batchnorm, False)) if v != plain}
    if unmodelled:
        raise ValueError(f"simulate: {unmodelled} is not modelled (the machine's rates are float32's, every "
                         "activation kept, batch norm local); predict the strategy without it")
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
             tp_plan: dict | None = None, optimizer: str = "sgd", profile: bool = True, steps: int = 5,
             lr: float = 0.1, seed: int = 0, momentum: float = 0.0) -> Simulated:
    """Predict a step of ``strategy`` on ``machine`` for ``model`` (lab.run's arguments).
    ``profile``: each piece of the model's step (a block's forward, its backward, the loss, the
    optimizer) costs what it took timed in sequence on this process at the micro-batch size
    (:func:`labkit.plan.local.profile.profile`, kept per model and size), its ops sharing it by their
    prices; False: the ops' prices alone, their arithmetic and bytes with none of the host's
    dispatch between them (a lower bound, far short for a small model; ``bench_plan.py``'s
    ablation prints what it misses).
    ``steps``, ``lr``, ``seed``, ``momentum``: the run's, for what changes from step to step: with
    ep, where the tokens go as the router trains (:func:`labkit.plan.local.expert_work.routes`); each
    step the run's metrics count is priced, the metrics theirs (the median step, as a run's),
    the timeline the median step's. Every other step is the same step."""
    check(strategy, machine, model)
    strategy.check_batch(batch)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"simulate: steps={steps!r} must be a whole number ≥ 1 (the run's)")
    size = batch // (strategy.dp * strategy.microbatches)
    _validate(strategy, model, batch, data, loss, tp_plan, optimizer, steps, lr, seed, momentum)
    work = _count(model, size, data, loss, optimizer, strategy.cp, strategy.ep, machine.cache_bytes)
    if profile:              # cp's attention and ep's experts are priced apart: the pieces' own prices, unmarked
        from .profile import timed
        plain = (_count(model, size, data, loss, optimizer, strategy.cp, strategy.ep, machine.cache_bytes, marked=False)
                 if strategy.cp > 1 or strategy.ep > 1 else work)
        work = timed(work, _profile(model, size, data, loss, optimizer, strategy.cp), machine, plain)
    if strategy.tp > 1:
        plan = tp_plan if tp_plan is not None else getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError("simulate: tp > 1 needs the model's tensor plan; pass tp_plan= (as lab.run takes it)")
        _check_tp_plan(model, plan)
    else:
        plan = {}
    world = strategy.world_size
    by_step = {0: None}                  # every step the same step, but where an MoE's tokens go
    if strategy.ep > 1:
        from ...run.runner import measured_steps
        from .expert_work import routes
        measured = range(measured_steps(steps), steps)
        by_step = _kept(("routes", model, batch, data, strategy.dp, strategy.microbatches, measured, lr, seed,
                         momentum, loss, optimizer),
                        lambda: routes(model, batch, data, strategy.dp, strategy.microbatches, measured, lr=lr,
                                       seed=seed, momentum=momentum, loss=loss, optimizer=optimizer))
    stages = None
    if strategy.pp > 1:
        from .programs.pipeline import lab_stages
        stages = _kept(("stages", model, strategy), lambda: lab_stages(model, strategy))
    each = {k: price.step_events(Builder(strategy, machine, work, plan, r, profile, stages).programs(), machine)
            for k, r in by_step.items()}
    length = {k: max((e["end"] for e in events), default=0.0) for k, events in each.items()}
    middle = sorted(each, key=length.get)[(len(each) - 1) // 2]
    return Simulated(strategy, step_metrics([{**e, "step": k} for k, events in each.items() for e in events], world, batch),
                     Timeline(each[middle], world, title="predicted", grid=strategy), batch)


def _validate(strategy, model, batch, data, loss, tp_plan, optimizer, steps, lr, seed, momentum) -> None:
    """lab.run's own checks of the run (every axis's rules on the model, the first batch): what
    the lab refuses, simulate refuses with the lab's message; done once per run's arguments."""
    from ...parallel.build import RunSpec
    from ...run.runner import validate
    spec = RunSpec(strategy, model, data, loss, batch, steps, lr, momentum, seed, tp_plan=tp_plan, optimizer=optimizer)
    _kept(("validated", strategy, model, batch, data, loss, optimizer, steps, lr, seed, momentum,
           tuple(sorted((tp_plan or {}).items()))), lambda: validate(spec, strategy.world_size) or True)


def _check_tp_plan(model, plan: dict) -> None:
    """ValueError for a tensor plan the programs would price as unsharded: a module outside the
    blocks, one that is not a Linear (a vocabulary-parallel embedding), or a style other than
    colwise and rowwise (a head's colwise_gather_output)."""
    import torch

    from ...parallel.blocks import find_blocks
    from ...parallel.tensor import match_plan
    from ...training import build_model
    built = build_model(model, 0)
    blocks = [name for name, _ in find_blocks(built)]
    odd = {name: style for name, style in match_plan(built, plan).items()
           if not any(name == b or name.startswith(f"{b}.") for b in blocks) or style not in ("colwise", "rowwise")
           or not isinstance(built.get_submodule(name), torch.nn.Linear)}
    if odd:
        raise ValueError(f"simulate: the tensor plan splits {odd}, and the planner prices tp on the blocks' "
                         "Linear layers split colwise or rowwise only (Megatron's f and g); lab.run runs it, or "
                         "simulate with a plan of the blocks' Linears")


_CACHE: dict = {}


def _kept(key, make):
    """``make()``, kept under ``key`` when the key (its model among it) is hashable."""
    try:
        hash(key)
    except TypeError:
        return make()
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def forget_profiles() -> None:
    """Drop the kept profiles: :func:`simulate` times a model's pieces again on its next call (a
    shared host's own speed drifts over minutes; a benchmark times them beside the runs)."""
    for key in [k for k in _CACHE if k[0] == "profile"]:
        del _CACHE[key]


def _profile(model, size, data, loss, optimizer, cp=1) -> dict:
    """The model's pieces timed at ``size`` (:func:`labkit.plan.local.profile.profile`), kept per model."""
    from .profile import profile
    return _kept(("profile", model, size, data, loss, optimizer, cp),
                 lambda: profile(model, size, data, loss, optimizer, cp=cp))


def _count(model, size, data, loss, optimizer, cp=1, ep=1, cache_bytes=float("inf"), marked=True):
    """The model's counted work, its ops' bytes beyond the cache marked (kept per model)."""
    from .work import count, warm
    return _kept((model, size, data, loss, optimizer, cp, ep, cache_bytes, marked),
                 lambda: warm(count(model, size, data, loss, optimizer, cp=cp, ep=ep, marked=marked), cache_bytes))


class Builder(DataPrograms, PipelinePrograms, TensorPrograms, ContextPrograms, ExpertPrograms):
    """Each rank's program for one step (see the module docstring): the compute of a range of
    blocks with the calls inside it, here; each axis's pieces in its own part."""

    def __init__(self, s, machine: Machine, work, plan: dict, routes=None, timed: bool = False, stages=None):
        self.s, self.m, self.w, self.routes, self.counted = s, machine, work, routes, {}
        self.stages = stages          # each global stage's blocks as the executor cuts them (pipeline_programs.lab_stages)
        self.timed = timed          # the work's pieces timed (profile.timed): an ep rank's own parts timed too
        if s.zero == 3:
            from .work import unaccumulated
            self.w = unaccumulated(work)
        self.dpc = s.dp * s.cp           # the ranks that average gradients (and ZeRO's shards): dp × cp
        self.grid = ParallelDims(s.dp, s.pp, s.tp, s.cp, order=s.order)       # where each axis sits
        self.tp_split(plan)

    def programs(self) -> list[list]:
        """Every rank's program, at its place in labkit.grid's dp × pp × cp × tp layout."""
        s = self.s
        progs = [None] * s.world_size
        for d in range(s.dp):
            for p in range(s.pp):
                for t in range(s.tp):
                    for c in range(s.cp):
                        one = self.zero3(d, p, t, c) if s.zero == 3 else (self.pipeline(d, p, t) if s.pp > 1
                                                                          else self.single(d, t, c))
                        progs[self.rank(d, p, t, c)] = one
        return progs

    def rank(self, d: int, p: int, t: int, c: int = 0) -> int:
        return self.grid.rank_of(d, p, t, c)

    # -- prices ---------------------------------------------------------------------------------
    def touches(self, ops, scale=None, keep=None) -> tuple:
        """(key, bytes, ρ paid) of what ``ops`` read and write, each once (the first op's), its
        bytes scaled as the op's work (:meth:`scale`); ``keep``: only these keys."""
        scale, seen = scale or self.scale, {}
        for o in ops:
            k = scale(o)
            for j, (key, nbytes) in enumerate(o.operands):
                if key != -1 and key not in seen and (keep is None or key in keep):
                    seen[key] = (key, nbytes * k, o.paid[j] if o.paid else 0.0)
        return tuple(seen.values())

    def piece(self, ops, kind, name, mb) -> Compute:
        """One span of ``ops`` (a list), priced, with what it touches."""
        return Compute(price.seconds(self.m, ops, self.scale), kind, name, mb, self.touches(ops))

    def call(self, key, group, family, nbytes, kind, name, mb=None, peer=None) -> Issue:
        """A posted call of ``family`` moving ``nbytes`` over ``group``, priced (gloo's part, the link's)."""
        n = len(group)
        own, link = price.comm_parts(self.m, family, nbytes, n)
        if family == "send":
            return Issue(key, group, own, kind, name, int(nbytes), peer, mb, ordered=False, link=link)
        return Issue(key, group, own, kind, name, int(round(bus_factor(family, n) * nbytes)), peer, mb, link=link)

    def blocking(self, key, group, family, nbytes, kind, name, mb=None) -> list:
        return [self.call(key, group, family, nbytes, kind, name, mb), Wait(key)]

    def copy(self, nbytes: float) -> Compute:
        """Packing or unpacking a bucket: one op reading and writing ``nbytes``."""
        return Compute(2 * nbytes / self.m.dram_Bps)

    # -- compute of a range of blocks, with tp's calls -------------------------------------------
    def forward(self, blocks, d, p, t, mb, first: bool, last: bool, gather=None, c: int = 0) -> list:
        out, w = [], self.w
        if first:
            out.append(self.piece(w.pre.fwd.ops, "fwd", "pre", mb))
        for i in blocks:
            if gather:
                out += gather(i, "fwd")
            b = w.blocks[i]
            out += self.block(b, b.fwd, "fwd", mb, d, c) + self.tp_calls(b, True, d, p, mb)
        if last:
            out.append(self.piece(w.post.fwd.ops, "fwd", "loss", mb))
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
            out.append(self.piece(w.post.bwd.ops, kind, "loss", mb))
            out += [x for _, items in issue.get(len(w.blocks), ()) for x in items]
        for i in reversed(list(blocks)):
            if gather:
                out += gather(i, "bwd")
            b = w.blocks[i]
            out += self.block(b, b.bwd.where(keep), kind, mb, d, c, issue.get(i, ()))
            out += self.tp_calls(b, False, d, p, mb) if part != "W" else []
            out += after(i) if after else []
        if first:
            out.append(self.piece(w.pre.bwd.where(keep).ops, kind, "pre", mb))
            out += [x for _, items in issue.get(-1, ()) for x in items]
            out += after(-1) if after else []
        return out

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
            out.append(self.piece(list(piece), kind, name, mb))
            piece.clear()
        factor = next((o.factor for o in ops.ops), 1.0)       # the piece's, timed (profile.timed)
        for o in ops.ops:
            if o.name in cut:
                close()
                what = todo[o.name].pop(0)
                if o.name == "attention":            # its rounds' compute is the piece's too
                    out += [replace(x, seconds=x.seconds * factor) if isinstance(x, Compute) and x.kind else x
                            for x in self.cp_attention(what, (b.name, marks), fwd, kind, name, mb, d, c)]
                else:
                    out += self.ep_layer(*what, fwd, kind, name, mb, d)
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


def overlay(predicted, measured, step=None, figsize=None):
    """Measured spans filled, predicted spans as dashed outlines in the same lanes; the Figure.

    ``predicted``: a Simulated or Timeline; ``measured``: a Run or Timeline. step: the
    measured step to draw (default its last); the prediction is one step.
    """
    from ...view.timeline import _lane

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
