"""Predicted runs: a Strategy replayed with measured costs, and a step at cluster scale.

``simulate(strategy, costs, batch=)`` builds each stage's per-micro-batch costs from a
:class:`~labkit.plan.costs.CostTable` exactly as the executor cuts the model (the same
stage split, the same buckets in the same order), replays one step
(:mod:`labkit.plan.replay`) and returns an object shaped like a run: ``.metrics`` (the
DESIGN.md keys, from :func:`labkit.metrics.step_metrics`) and ``.timeline`` (a
:class:`labkit.Timeline`, so plot, trace export and metrics work unchanged).

A bucket launched during backward progresses at 1/``busy_factor`` of its speed while the
rank still computes (on CPU the comm and compute threads share the cores), at full speed
after; and that backward takes longer beside its buckets. Both come from one overlapped step
of the calibration (``in_step["overlap_busy"]``, ``["overlap_bwd"]``), fitted so the replay's
comm tail after backward is the measured one. With one stage the typical rank stands for its
dp group, and a bucket starts only when the slowest peer issues it, beside that peer's backward
(``["overlap_sync_lag"]``: how late the last rank ends its backward); and its backward's
stretch goes with the bytes its buckets put on the wire per second of it, against the calibrated
run's (``["overlap_bwd_Bps"]``: dp × tp's shards send a third of dp's beside a backward as long,
and took the calibrated stretch ×1.1–1.2 too slow). In a pipeline the schedule
goes on beside the buckets (the other chunk's actions, the receives), at 1/``overlap_bwd`` of its
speed while they fly (:func:`labkit.plan.replay.replay`).

Tensor parallelism (``tp_mode="megatron"``): the blocks cost what they measured at one rank's
shard width (:mod:`labkit.plan.tensor_costs`: the plan's modules replaced by plain modules of
the shard's shape, not cost/tp, since LayerNorms, biases and Python do not shrink), and each
row-parallel module's g (forward) and column-parallel module's f (backward) is a blocking
all-reduce of the activation on the compute path, drawn as ``allreduce`` "tp g 2"/"tp f 4" with
the compute span cut around it, as the recorder cuts it. dp×tp and pp×tp replicate the replay
over the tp ranks (tp innermost); dp all-reduces the shards' gradients.

ZeRO (``zero_mode="labkit"``): the units and calls of :mod:`labkit.parallel.zero`, replayed
by :mod:`labkit.plan.sharded` (zero=1 also with pp > 1): reduce-scatters of the executor's
buckets after backward (1) or from its hooks in every micro-batch (2), at most two in flight;
all-gathers after the step (1, 2) or of each block before its forward and its backward, with
``prefetch`` (3); the optimizer on 1/dp of the parameters.

Calibrated against a real step (:mod:`labkit.plan.in_step`): how much slower each collective,
the optimizer and a pipeline's compute run inside the executor than alone, and the executor's
untimed seconds per action.

The ranks' spread: the replay computes one typical rank, but on shared cores the ranks do not
keep one pace and a measured step ends with the slowest. The calibration measures how far
apart the ranks of its data-parallel runs end (``in_step["rank_ends_s"]``); :func:`paced` lets
each rank run at its own pace by those offsets, and the metrics average over the ways of
assigning them. Nor do they all start when the first one does (4 engines on 2 cores: two take
the cores, the others leave the step's barrier when they get one): a replay of one stage
(pp = 1) starts its typical rank where the calibration's data-parallel ranks made their first
span, on average (``in_step["rank_start_s"]``); overlap and ddp (pp = tp = 1, no ZeRO: the runs
they were measured in) take their own run's start and spread (``["overlap_start_s"]``,
``["overlap_ends_s"]``, ``ddp_…``), later and wider than the pool's, and zero=3 its own runs'
(``zero3_…``: its gathers come first, and it starts earlier). A pipeline's dp replicas (pp > 1, dp > 1)
drift apart within a step, and each gradient all-reduce waits for the slowest replica to issue
it: there the replay runs every replica at its own measured pace (``in_step["replica_pace"]``,
from the calibration's pipeline runs) and syncs the all-reduces across them; the offsets then
spread where each rank ends after that sync. (The two differ: the paces are how far apart the pipelines reach their sync,
the offsets how far apart ranks end after the last one.) Within a pipeline the stages are not
on one pace either: a rank that waits for a message waits, on average, for a sender behind the
typical one; the replay delivers each message that much later to a receiver that waits for it,
as measured in the calibration's pipeline run of the same kind, and starts a pipeline's ranks
where those runs' ranks started (``in_step["p2p_delay_<run>_s"]``, ``["pipeline_start_s"]``:
:func:`labkit.plan.in_step.pipeline_fit`).

Not modelled: gradient compression (its encode/decode cost is not in the table), sequence
parallelism, tp_mode="dtensor" and zero_mode="fsdp2" (torch's own calls, not labkit's: refused
with a message), DDP's small first bucket, the busy slowdown of pipeline messages other than beside overlap's
buckets, the compute slowdown beside in-flight transfers other than overlap's buckets and ZeRO's
calls, and the cores one rank takes from another other than through the measured delays and
spreads above (on 2 cores, a rank spinning in a receive's wait leaves its peers one core
between them).

    >>> pred = simulate(labkit.Strategy(pp=2, schedule="1f1b", microbatches=4), costs, batch=64)
    >>> overlay(pred, run)                   # predicted outlines over the measured spans
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..analysis.metrics import step_metrics
from ..parallel.pipeline import SPLIT_BACKWARD
from ..analysis.timeline import Timeline
from .costs import CostTable
from .replay import Message, StageProgram, replay
from .sharded import Block, Call, ShardedProgram, Unit, replay_sharded
from .physical import overlay  # noqa: F401 (drawn the same for both planners)

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


def build_buckets(params: list[tuple[str, int, int]], bucket_bytes: float) -> list[list[tuple[str, int, int]]]:
    """(name, bytes, block) in registration order → buckets in gradient order, as
    :func:`labkit.parallel.data.sync.make_buckets` fills them (one rule: ``fill_buckets``)."""
    from ..parallel.data import fill_buckets
    return fill_buckets(params, lambda item: item[1], bucket_bytes)


def _stage_ranges(costs: CostTable, strategy) -> list[range]:
    from ..parallel.pipeline.stages import split_blocks   # the executor's own split, so stages match

    weights = [sum(b["params"]) for b in costs.blocks]
    return split_blocks(weights, strategy.pp * strategy.chunks, strategy.split_at,
                        equal=strategy.schedule == "interleaved")


def _held_blocks(costs: CostTable, strategy) -> tuple[list[dict], dict]:
    """Per-block costs as one rank holds the blocks: whole, or at the tp shard's width (measured)."""
    if strategy.tp > 1:
        entry = costs.sharded(strategy.tp)
        return entry["blocks"], entry["loss"]
    return costs.blocks, costs.loss


def _tp_calls(costs: CostTable, strategy, row: dict, size: int, direction: str, at: float) -> list[Call]:
    """Block ``row``'s f ("f", backward) or g ("g", forward) all-reduces at ``size`` rows, made
    ``at`` seconds into the action (at the block's end: exact for one Linear per block)."""
    n = strategy.tp
    out = []
    for which, numel in row.get("calls", []) if n > 1 else []:
        if which == direction:
            nbytes = 4 * numel * size
            out.append(Call(f"tp {which} {row['name'].split()[-1]}", int(round(2 * (n - 1) / n * nbytes)),
                            costs.tp_call_s(which, nbytes, n, strategy.pp), at))
    return out


def _grad_messages(costs: CostTable, strategy, blocks: range, rows: list[dict], bwd_of, loss_bwd: float) -> list[Message]:
    """The all-reduces of one stage's gradients, with when (into its backward) each is ready."""
    done, t = {}, loss_bwd
    for i in reversed(blocks):          # backward visits the blocks last to first
        t += bwd_of(i)
        done[i] = t
    params = [(f"{i}.{k}", 4 * n, i) for i in blocks for k, n in enumerate(rows[i]["params"])]
    n = strategy.dp
    wire = lambda nbytes: int(round(2 * (n - 1) / n * nbytes))      # ring all-reduce, per rank
    if strategy.dp_mode == "naive":
        return [Message(name, wire(b), costs.all_reduce_s(b, n), done[i], unpack=costs.copy_s(b, "div"))
                for name, b, i in params]
    out = []
    for k, bucket in enumerate(build_buckets(params, strategy.bucket_mb * MiB)):
        nbytes = sum(b for _, b, _ in bucket)
        name = f"ddp bucket {k}" if strategy.dp_mode == "ddp" else f"bucket {k} ({len(bucket)} tensors)"
        out.append(Message(name, wire(nbytes), costs.all_reduce_s(nbytes, n), max(done[i] for _, _, i in bucket),
                           pack=costs.copy_s(nbytes, "pack"), unpack=costs.copy_s(nbytes, "unpack")))
    return out


def build_units(costs: CostTable, strategy, blocks: range, rows: list[dict]) -> list[Unit]:
    """ZeRO's flat units over ``blocks``: the executor's buckets (zero=1/2) or one per block with
    parameters (zero=3), each padded to a multiple of dp (parallel/zero/shard.py)."""
    n = strategy.dp
    params = [(f"{i}.{k}", 4 * numel, i) for i in blocks for k, numel in enumerate(rows[i]["params"])]
    if strategy.zero == 3:
        groups = [[p for p in params if p[2] == i] for i in blocks]
        groups, names = [g for g in groups if g], [f"block {g[0][2]}" for g in groups if g]
    else:
        groups = build_buckets(params, strategy.bucket_mb * MiB)
        names = [f"bucket {k}" for k in range(len(groups))]
    units = []
    for name, group in zip(names, groups):
        nbytes = 4 * n * -(-sum(b for _, b, _ in group) // 4 // n)          # padded: every shard alike
        units.append(Unit(name, nbytes, costs.collective_s("all_gather", nbytes, n),
                          costs.collective_s("reduce_scatter", nbytes, n), min(i for _, _, i in group),
                          pack=costs.copy_s(nbytes, "pack"), unpack=costs.copy_s(nbytes / n, "div"),
                          wire=int(round((n - 1) / n * nbytes))))
    return units


def build_program(strategy, costs: CostTable, batch: int) -> StageProgram:
    """Per-stage costs of ``strategy`` on ``batch`` from the measured table."""
    strategy.check_batch(batch)
    size = batch // (strategy.dp * strategy.microbatches)
    ranges = _stage_ranges(costs, strategy) if strategy.pp > 1 else [range(len(costs.blocks))]
    rows, loss = _held_blocks(costs, strategy)
    last = len(ranges) - 1
    fit = "ddp" if strategy.dp_mode == "ddp" and "ddp_bwd" in costs.in_step else "overlap"    # labkit.plan.in_step
    prog = StageProgram([], [], [], [], [], [], busy_factor=costs.busy_factor, zero=strategy.zero, tp=strategy.tp,
                        gap=costs.gap_s(strategy.pp), overlap_busy=costs.in_step.get(f"{fit}_busy"),
                        overlap_stretch=costs.slowdown(f"{fit}_bwd"), lanes=costs.lanes,
                        sync_lag=costs.in_step.get(f"{fit}_sync_lag", 0.0) if strategy.pp == 1 else 0.0,
                        call_gap=costs.in_step.get("zero1_gap_s", 0.0) if strategy.zero == 1 else 0.0)
    if strategy.pp > 1:     # labkit.plan.in_step.pipeline_fit
        prog.tail_gap = costs.in_step.get("tail_gap_s")
        prog.p2p_delay = costs.p2p_delay_s(strategy.schedule, strategy.tp, strategy.pp)
    f_stretch, b_stretch = (costs.compute_stretch("fwd", strategy.pp, strategy.tp, strategy.schedule),
                            costs.compute_stretch("bwd", strategy.pp, strategy.tp, strategy.schedule))
    fwd_of = lambda i: costs.at(rows[i]["fwd"], size) * f_stretch
    bwd_of = lambda i: costs.at(rows[i]["bwd"], size) * b_stretch
    split = strategy.pp > 1 and strategy.schedule in SPLIT_BACKWARD       # zero-bubble: I and W
    in_of = lambda i: costs.at(rows[i]["bwd_input"], size) * b_stretch
    w_of = lambda i: costs.at(rows[i]["bwd_weight"], size) * b_stretch
    for g, blocks in enumerate(ranges):
        loss_f = costs.at(loss["fwd"], size) * f_stretch if g == last else 0.0
        loss_b = costs.at(loss["bwd"], size) * b_stretch if g == last else 0.0
        fwd_calls, at = [], 0.0
        for i in blocks:
            at += fwd_of(i)
            fwd_calls += _tp_calls(costs, strategy, rows[i], size, "g", at)
        # Split, a stage's f calls lie on I's path, and its gradients appear in W; the first
        # stage's input needs no gradient, so its W is its whole backward (split_backward.py).
        halves = split and g > 0
        bwd_calls, at, wall = [], loss_b, {}
        for i in reversed(blocks):
            at += in_of(i) if halves else bwd_of(i)
            calls = _tp_calls(costs, strategy, rows[i], size, "f", at)
            bwd_calls += calls
            wall[i] = w_of(i) if halves else bwd_of(i) + sum(c.cost for c in calls)   # what the gradients wait for
        prog.fwd.append(sum(fwd_of(i) for i in blocks) + loss_f)
        prog.bwd.append(sum(bwd_of(i) for i in blocks) + loss_b)
        if split:
            prog.bwd_input.append(sum(in_of(i) for i in blocks) + loss_b if halves else 0.0)
            prog.bwd_weight.append(sum(w_of(i) for i in blocks) if halves else prog.bwd[-1])
        prog.fwd_calls.append(fwd_calls)
        prog.bwd_calls.append(bwd_calls)
        out_bytes = 4 * rows[blocks[-1]]["out_numel"] * size
        prog.p2p_bytes.append(out_bytes)
        prog.p2p.append(costs.p2p_s(out_bytes, schedule=strategy.schedule, tp=strategy.tp, pp=strategy.pp)
                        if strategy.pp > 1 and g < last else 0.0)
        sync = strategy.dp > 1 and not strategy.zero
        prog.grads.append(_grad_messages(costs, strategy, blocks, rows, wall.__getitem__, 0.0 if halves else loss_b)
                          if sync else [])
        prog.units.append(build_units(costs, strategy, blocks, rows) if strategy.zero else [])
        step = sum(rows[i]["optimizer"] for i in blocks) * costs.slowdown("optimizer")
        prog.optimizer.append(step / strategy.dp if strategy.zero else step)
    calibrated, density = costs.in_step.get(f"{fit}_bwd_Bps"), bucket_density(prog)
    if calibrated and strategy.pp == 1 and prog.overlap_stretch > 1 and density:
        # one stage: the cores its buckets take from backward go with their bytes (in_step.overlap_fit)
        prog.overlap_stretch = 1 + (prog.overlap_stretch - 1) * density / calibrated
    return prog


def bucket_density(prog: StageProgram) -> float:
    """Bytes a rank puts on the wire for its gradients per second of its backward (the stages'
    sums): how much transfer runs beside a backward that launches buckets."""
    seconds = sum(prog.bwd)
    return sum(m.bytes for msgs in prog.grads for m in msgs) / seconds if seconds > 0 else 0.0


def build_sharded_program(strategy, costs: CostTable, batch: int) -> ShardedProgram:
    """zero=2/3 (pp = 1): the whole model block by block, with its units and tp calls."""
    strategy.check_batch(batch)
    size = batch // (strategy.dp * strategy.microbatches)
    rows, loss = _held_blocks(costs, strategy)
    f_stretch, b_stretch = costs.compute_stretch("fwd"), costs.compute_stretch("bwd")
    busy, call_gap = costs.busy_factor, 0.0
    if strategy.zero == 3:          # fitted to a measured zero=3 step (labkit.plan.in_step.zero3_fit)
        busy = costs.in_step.get("zero3_busy", busy)
        if strategy.prefetch and "zero3_prefetch_bwd" in costs.in_step:     # its own fit (in_step.zero3_prefetch_fit)
            b_stretch *= costs.slowdown("zero3_prefetch_bwd")
        else:
            b_stretch *= costs.slowdown("zero3_bwd")
        if strategy.prefetch:       # gathers beside compute: their own busy factor
            busy = costs.in_step.get("zero3_prefetch_busy", busy)
        call_gap = costs.in_step.get("zero3_gap_s", 0.0)
    scatter_at = costs.in_step.get("zero3_scatter_at", 1.0) if strategy.zero == 3 else 1.0
    blocks = []
    for row in rows:
        fwd, bwd = costs.at(row["fwd"], size) * f_stretch, costs.at(row["bwd"], size) * b_stretch
        blocks.append(Block(row["name"], fwd, bwd, _tp_calls(costs, strategy, row, size, "g", fwd),
                            _tp_calls(costs, strategy, row, size, "f", bwd)))
    units = build_units(costs, strategy, range(len(rows)), rows)
    if strategy.zero == 3:          # its gathers one at a time, as measured in its forward; its reduce-scatters
        units = [replace(u, gather=u.gather * costs.slowdown("zero3_gather"),
                         scatter=u.scatter * costs.slowdown("zero3_scatter")) for u in units]
    return ShardedProgram(blocks, units, strategy.zero, strategy.microbatches, strategy.prefetch,
                          sum(r["optimizer"] for r in rows) * costs.slowdown("optimizer") / strategy.dp,
                          costs.at(loss["fwd"], size) * f_stretch,
                          costs.at(loss["bwd"], size) * b_stretch, busy, costs.gap_s(1), costs.compute_factor,
                          costs.lanes, call_gap, scatter_at)


def check_simulable(strategy, costs: CostTable) -> None:
    """ValueError (naming the field and the fix) for what the replay does not model."""
    if strategy.tp > 1:
        if strategy.tp_mode != "megatron":
            raise ValueError(f"simulate: tp_mode={strategy.tp_mode!r} runs torch's DTensor collectives, which "
                             "labkit does not time; simulate tp_mode='megatron' (labkit's own f and g)")
        if strategy.sequence_parallel:
            raise ValueError("simulate: sequence_parallel=True is not modelled (its all-gathers and "
                             "reduce-scatters are not in the cost table); use sequence_parallel=False")
        costs.sharded(strategy.tp)
    if strategy.zero and strategy.zero_mode != "labkit":
        raise ValueError(f"simulate: zero_mode={strategy.zero_mode!r} is torch's FSDP2, whose calls and "
                         "prefetching happen inside torch; simulate zero_mode='labkit' (the same stages by hand)")
    if strategy.zero:
        costs.alpha_beta("all_gather"), costs.alpha_beta("reduce_scatter")
    if strategy.compression != "none":
        raise ValueError(f"simulate: compression={strategy.compression!r} is not modelled (its encode and "
                         "decode costs are not in the cost table); use compression='none'")
    if strategy.pp > 1 and strategy.schedule in SPLIT_BACKWARD:
        if not costs.times_halves(strategy.tp):
            raise ValueError(f"simulate: schedule={strategy.schedule!r} splits backward into its input and "
                             "weight halves, and this cost table did not time them apart (calibrated before "
                             "they were); calibrate again with labkit.plan.calibrate(lab, model=...), or "
                             "simulate schedule='1f1b' (the same stages, backward whole)")
    if strategy.pp * strategy.chunks > len(costs.blocks):
        raise ValueError(f"pp*chunks = {strategy.pp * strategy.chunks} stages but the model has "
                         f"{len(costs.blocks)} blocks; use fewer stages")


def paces_of(strategy, costs: CostTable) -> list[float] | None:
    """One pace per dp replica of a pipeline (pp > 1, dp > 1; naive, bucketed or overlap dp,
    no zero): the calibration's measured ``replica_pace`` (slowest last), spread over ``dp``
    replicas by linear interpolation between its order statistics where dp differs, re-centred
    to mean 1; None otherwise (the replicas are one pipeline, copied)."""
    measured = costs.in_step.get("replica_pace")
    if not measured or strategy.pp < 2 or strategy.dp < 2 or strategy.zero or strategy.dp_mode == "ddp":
        return None
    import numpy as np

    paces = np.interp(np.linspace(0, len(measured) - 1, strategy.dp), range(len(measured)), measured)
    return [float(p / paces.mean()) for p in paces]


def paced(events: list[dict], offsets: list[float], world: int) -> list[list[dict]]:
    """The replayed step once per assignment of the ranks' measured spread, rank r ending
    ``offsets[(r + k) % n]`` seconds from where the replay has it (k = 0 … world−1).

    The replay computes one typical rank and copies it; on shared cores the ranks keep their
    own pace, and a measured step ends with the slowest (``rank_ends_s``,
    :func:`labkit.plan.in_step.rank_spread`). Each rank's times are scaled by
    1 + offset / its end: it runs at its own pace throughout, its fractions kept, its end moved
    by the offset. The assignments are the steps of one prediction, so the metrics take the
    median step and average the fractions over them, as over a run's steps. ``world`` ranks
    other than the calibrated ones take ``world`` consecutive offsets, re-centred."""
    from .in_step import rank_ends

    n, ends = len(offsets), rank_ends(events)
    out = []
    for k in range(world):
        window = [offsets[(r + k) % n] for r in range(world)]
        centre = sum(window) / world
        pace = {r: max(0.1, 1.0 + (window[r] - centre) / ends[r]) if ends.get(r) else 1.0 for r in range(world)}
        out.append([dict(e, start=e["start"] * pace[e["rank"]], end=e["end"] * pace[e["rank"]]) for e in events])
    return out


def simulate(strategy, costs: CostTable, batch: int = 64, model=None) -> Simulated:
    """Predict one step of ``strategy`` (a labkit.Strategy) from measured ``costs``.

    ``model``, if given, must be the one the costs were measured on (else ValueError).
    """
    if not isinstance(costs, CostTable):
        raise TypeError(f"costs must be a labkit.plan.CostTable (from labkit.plan.calibrate), got {type(costs).__name__}")
    if model is not None:
        costs.check(model)
    check_simulable(strategy, costs)
    world = strategy.world_size
    if strategy.zero >= 2:
        one = replay_sharded(build_sharded_program(strategy, costs, batch))
        events = [dict(e, rank=r) for r in range(world) for e in one]       # every rank alike (pp = 1)
    else:
        prog = build_program(strategy, costs, batch)
        # pp × dp: the replicas drift apart before their gradient sync (replica_pace); the
        # offsets below then spread where each rank ends after it, as in data parallelism
        events = replay(prog, strategy.pp, strategy.dp, strategy.schedule, strategy.microbatches,
                        strategy.chunks, strategy.dp_mode, paces=paces_of(strategy, costs))
    # one stage whose buckets fly beside backward: its own run's start and spread where calibrated
    own = strategy.pp == strategy.tp == 1 and strategy.zero in (0, 3) and strategy.dp > 1
    mode = "zero3" if strategy.zero == 3 else strategy.dp_mode      # zero=3: its gathers come first
    start, ends = (f"{mode}_start_s", f"{mode}_ends_s") if own else ("rank_start_s", "rank_ends_s")
    lag = (costs.in_step.get(start, costs.in_step.get("rank_start_s", 0.0)) if strategy.pp == 1
           else costs.in_step.get("pipeline_start_s", 0.0))
    if lag:             # the typical rank's late start (in_step.start_lag); a pipeline's: in_step.pipeline_fit
        events = [dict(e, start=e["start"] + lag, end=e["end"] + lag) for e in events]
    offsets = costs.in_step.get(ends) or costs.in_step.get("rank_ends_s")
    if not offsets or world < 2:
        return Simulated(strategy, step_metrics(events, world, batch), Timeline(events, world, title="predicted"), batch)
    steps = paced(events, offsets, world)
    metrics = step_metrics([dict(e, step=k) for k, evs in enumerate(steps) for e in evs], world, batch)
    drawn = min(steps, key=lambda evs: abs(max(e["end"] for e in evs) - metrics["step_time_s"]))
    return Simulated(strategy, metrics, Timeline(drawn, world, title="predicted"), batch)


def simulate_scale(prediction, max_microbatches: int | None = None) -> Timeline:
    """The timeline of one predicted step at scale: one pipeline (its pp ranks; dp replicas are
    alike), per-stage costs from FLOPs and α-β, the dp all-reduce as one message."""
    from .step import stage_costs

    s, m = prediction.strategy, prediction.strategy.microbatches(prediction.global_batch)
    if max_microbatches is not None and m > max_microbatches:
        raise ValueError(f"{m} micro-batches would draw {m * s.pp * 4} spans; pass max_microbatches={m} "
                         "to draw them all")
    c = stage_costs(prediction.model, prediction.cluster, s)
    stages = s.pp * s.chunks
    act = 2 * s.microbatch_size * prediction.model.seq * prediction.model.hidden
    split = s.schedule in SPLIT_BACKWARD            # the gradients appear in W
    ready = c.bwd_weight if split else c.bwd
    grads = [[Message("gradients", 0, c.dp_sync, ready[g])] if s.dp > 1 else [] for g in range(stages)]
    prog = StageProgram(c.fwd, c.bwd, [c.p2p] * stages, [act // s.tp] * stages, grads,
                        [c.optimizer / s.chunks] * stages)
    if split:
        prog.bwd_input, prog.bwd_weight = c.bwd_input, c.bwd_weight
    events = replay(prog, s.pp, s.dp, s.schedule, m, s.chunks, "overlap" if s.dp_overlap else "bucketed",
                    replicas=1)
    if s.dp > 1:        # one replica drawn, but its collectives span dp of them
        events = [dict(e, name=f"{e['name']} (dp={s.dp})") if e["kind"] == "allreduce" else e for e in events]
    return Timeline(events, s.pp, title=f"{prediction.model.layers}-layer GPT, {s.label()}")
