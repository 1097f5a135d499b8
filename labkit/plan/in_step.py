"""What the sweep does not see: collectives inside a real step, and the executor's own gaps.

The α-β sweep times each call back to back on idle ranks. Inside a step the same call pays
more: a watcher thread per async call, several calls queued on one group, the flight
recorder, other processes on the same cores. And the executor spends Python time between
actions (polling the pipeline link, hooks, bookkeeping) that no span covers: the metrics'
``lab_overhead_fraction``. Both are measured here by running the real executor once per kind
of call, on the lab's engines, and comparing its recorded spans with what the cost table
predicts for the same calls:

* ``dp`` naive — blocking all-reduces after backward, nothing beside them: all_reduce's factor,
  and its own α and β from the calls of each size (a weight and a bias: :func:`all_reduce_fit`);
  the same fit over the pipeline run's dp groups (``all_reduce_<n/2>_…``, from 4 engines);
* ``zero=1`` — reduce-scatters, then all-gathers, after backward: their factors (the window
  from the first issue to the last completion against the calls run one after another), and
  the untimed seconds before each call (``zero1_fit``);
* ``pp=2`` GPipe, 1F1B, interleaved (two chunks), zb-h1 (split backward) and zbv, dp naive
  (nothing beside the schedule's receives) — point-to-point: the receive spans against
  α + S/β, per kind of schedule (``sendrecv``, ``sendrecv_1f1b``, ``sendrecv_chunked``,
  ``sendrecv_split``, ``sendrecv_zbv``), and forward and backward against the blocks
  (``pipeline_compute``, ``1f1b_compute``, ``chunked_compute``, ``split_compute``,
  ``zbv_compute``: more actions for the same compute cost more);
* every pipeline run together (these, and from 4 engines the two below) — where their ranks
  start, the untimed seconds per action inside the schedule and per call after it, and per run
  how late a message reaches a receiver that waits for it (``pipeline_start_s``, ``gap_s``,
  ``tail_gap_s``, ``p2p_delay_<run>_s``: :func:`pipeline_fit`);
* ``dp`` overlap — buckets launched inside backward: how much longer that backward takes
  (and beside how many bytes a second: ``overlap_bwd_Bps``, the replay scales the stretch by
  a strategy's own), how much later than the typical rank the last one ends it (``overlap_sync_lag``: a bucket
  waits for its slowest peer, :func:`sync_lag`), and the busy factor that makes the replay's
  comm tail after backward the measured one (the busy-probe's factor, small matmuls polling
  a transfer, overstates a real backward's);
  the same fit for ``ddp`` (torch's reducer, and recorded, a Python hook per bucket);
* ``zero=3`` — where in a block's backward span its reduce-scatter is issued
  (``zero3_scatter_at``: :func:`scatter_at`), its backward beside reduce-scatters and gathers
  against the replay's, the untimed seconds before each of its calls (its per-block
  bookkeeping), and the busy factor that makes the replayed step the measured one
  (``zero3_fit``); and with ``prefetch=1`` its own backward stretch and, for its gathers beside
  compute, its own busy factor (``zero3_prefetch_fit``);
* the data-parallel runs together — how far apart their ranks end (``rank_ends_s``, seconds
  from the mean, smallest first: :func:`rank_spread`), and how late the typical rank makes its
  first span (``rank_start_s``: :func:`start_lag`); and the overlap and ddp runs each on their
  own (``overlap_ends_s``, ``overlap_start_s``, ``ddp_…``: on 4 engines their ranks started
  3.8–5.6 ms into the step where the pool's typical rank started at 2.8–3.5, and ddp's last rank
  ended 3.9–6.9 ms after the mean against the pool's 3.3–3.6); and the zero=3 runs, with and
  without prefetch, together (``zero3_start_s``, ``zero3_ends_s``: 0.7–1.0 ms, its gathers first);
* the pipeline runs together (pp × dp, from 4 engines) — how far apart their dp replicas reach
  the end of the schedule (``replica_pace``, a pace per replica, slowest last:
  :func:`replica_paces`);
* ``tp`` (when calibrated) — tensor parallelism's f and g against the same calls timed alone,
  and its shards' forward and backward against the blocks timed alone (``tp_compute``); from
  4 engines the same, and the receives, of a pipeline of tp pairs (pp2 × tp2, 1F1B:
  ``tp_in_pipeline``, ``sendrecv_pipeline_tp``, ``pipeline_tp_compute``);
* ``pp`` = the engines (from 4), 1F1B — one pipeline deeper than 2 stages, alone: its receives
  and compute (``sendrecv_deep``, ``deep_compute``), which price pipelines of more than 2 stages;
* the optimizer span of the naive run against the blocks' steps timed alone, and the forward
  and backward spans of the naive run and of the pipeline run against the calibrated costs
  (``dp_compute``, ``pipeline_compute``, each also per kind, ``_fwd`` and ``_bwd``: compute
  inside a step does not run at the speed of the blocks timed alone);

and the data-parallel run's gap per action (``gap_dp_s``): its untimed time (T − |C ∪ X|, less
its late start) over the actions and calls a rank made. Factors are medians over steps after
the first (warm-up).

    >>> in_step = time_in_step(lab, model, batch, costs)     # {"all_reduce": 1.6, ..., "gap_dp_s": 2e-4}
"""
from __future__ import annotations

from statistics import mean, median


def _steps(run) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in run.timeline.events:
        if e["step"] > 0:
            out.setdefault(e["step"], []).append(e)
    return out


def _ratio(values) -> float | None:
    values = [v for v in values if v and v > 0]
    return median(values) if values else None


def all_reduce_factor(run, costs, n: int) -> float | None:
    """Recorded all-reduce seconds over the α-β prediction for the same calls, per step."""
    per_step = []
    for events in _steps(run).values():
        calls = [e for e in events if e["kind"] == "allreduce" and e["rank"] == 0]
        predicted = sum(costs.all_reduce_s(e["bytes"] * n / (2 * (n - 1)), n, busy=False) for e in calls)
        per_step.append(sum(e["end"] - e["start"] for e in calls) / predicted if predicted else None)
    return _ratio(per_step)


def all_reduce_fit(run, n: int, key: str = "all_reduce") -> dict:
    """``<key>_alpha_s`` and ``<key>_beta_Bps``: α and β of the all-reduces over ``n`` ranks
    inside a step, a line through rank 0's recorded calls of each size (per step the mean per
    size, then the median over steps); {} with fewer than two sizes or a line that does not rise.

    One factor on the sweep's α + S/β (:func:`all_reduce_factor`) cannot price a bias and a
    bucket alike: inside a naive step a 2 KB bias paid about twice the sweep's α, and the
    factor fitted to naive's mix of biases and 1 MB weights priced bucketed's and overlap's
    1 MB buckets ×1.12–1.28 of what naive's prediction, in the same round, got right."""
    per_size: dict[int, list[float]] = {}
    for events in _steps(run).values():
        spans: dict[int, list[float]] = {}
        for e in events:
            if e["kind"] == "allreduce" and e["rank"] == 0 and e["bytes"]:
                spans.setdefault(int(round(e["bytes"] * n / (2 * (n - 1)))), []).append(e["end"] - e["start"])
        for size, values in spans.items():
            per_size.setdefault(size, []).append(mean(values))
    points = sorted((size, median(values)) for size, values in per_size.items())
    if len(points) < 2:
        return {}
    x0, y0 = mean(x for x, _ in points), mean(y for _, y in points)
    slope = sum((x - x0) * (y - y0) for x, y in points) / sum((x - x0) ** 2 for x, _ in points)
    alpha = y0 - slope * x0
    if slope <= 0 or alpha <= 0:
        return {}
    return {f"{key}_alpha_s": alpha, f"{key}_beta_Bps": 2 * (n - 1) / n / slope}


def window_factor(run, costs, kind: str, op: str, n: int) -> float | None:
    """From the first issue to the last completion of ``kind`` calls against their serial α-β sum."""
    per_step = []
    for events in _steps(run).values():
        calls = [e for e in events if e["kind"] == kind and e["rank"] == 0]
        if calls:
            window = max(e["end"] for e in calls) - min(e["start"] for e in calls)
            predicted = sum(costs.collective_s(op, e["bytes"] * n / (n - 1), n) for e in calls)
            per_step.append(window / predicted)
    return _ratio(per_step)


def p2p_factor(run, costs) -> float | None:
    per_step = []
    for events in _steps(run).values():
        sends = [e["bytes"] for e in events if e["kind"] == "send" and e["bytes"]]
        recvs = [e["end"] - e["start"] for e in events if e["kind"] == "recv"]
        if sends and recvs:     # sums, not medians: the slow receives are part of the step too
            per_step.append(sum(recvs) / (len(recvs) * costs.p2p_s(median(sends))))
    return _ratio(per_step)


def tp_factor(run, costs, tp: int, ranks=(0,)) -> float | None:
    """Recorded f/g seconds of ``ranks`` over the prediction from the calls timed alone
    (tensor_costs), per step."""
    per_step = []
    for events in _steps(run).values():
        calls = [e for e in events if e["kind"] == "allreduce" and e["rank"] in ranks and e["name"][:5] in ("tp f ", "tp g ")]
        predicted = sum(costs.tp_call_s(e["name"][3], e["bytes"] * tp / (2 * (tp - 1)), tp) for e in calls)
        per_step.append(sum(e["end"] - e["start"] for e in calls) / predicted if predicted else None)
    return _ratio(per_step)


def optimizer_factor(run, costs, share: float = 1.0) -> float | None:
    """The recorded optimizer span (the ranks' mean) over the blocks' calibrated steps (×
    ``share`` of them)."""
    predicted = share * sum(b["optimizer"] for b in costs.blocks)
    spans = [mean(sum(e["end"] - e["start"] for e in evs if e["kind"] == "optimizer" and e["rank"] == r)
                  for r in {e["rank"] for e in evs}) for evs in _steps(run).values()]
    return _ratio([s / predicted for s in spans]) if predicted > 0 else None


def _compute_seconds(run, costs, strategy, batch: int) -> tuple[dict, list[dict]]:
    """Calibrated forward and backward seconds of one step of ``strategy``, and the recorded
    ones per step, summed over one pipeline's ranks (one rank for pp = 1, one tp rank a stage)
    and averaged over its dp replicas."""
    from .simulation import build_program

    prog = build_program(strategy, costs, batch)
    bwd = sum(prog.bwd_input) + sum(prog.bwd_weight) if prog.bwd_input else sum(prog.bwd)   # split: I and W
    predicted = {"fwd": strategy.microbatches * sum(prog.fwd), "bwd": strategy.microbatches * bwd}
    kinds = {"fwd": ("fwd",), "bwd": ("bwd", "bwd_input", "bwd_weight")}
    # one tp rank a stage, averaged over the dp replicas recorded: in six naive dp=4 calibration
    # runs on 2 cores rank 0 computed ×0.62–1.27 of the ranks' mean (one rank, one sample)
    mine = lambda rank: rank % strategy.tp == 0
    measured = []
    for evs in _steps(run).values():
        replicas = len({e["rank"] // (strategy.pp * strategy.tp) for e in evs if mine(e["rank"])}) or 1
        measured.append({k: sum(e["end"] - e["start"] for e in evs if e["kind"] in kinds[k] and mine(e["rank"]))
                         / replicas for k in predicted})
    return predicted, measured


def _stretch(predicted: dict, measured: list[dict], kinds: tuple) -> float | None:
    expected = sum(predicted[k] for k in kinds)
    return _ratio([sum(m[k] for k in kinds) / expected for m in measured]) if expected > 0 else None


def compute_factor(run, costs, strategy, batch: int, kinds: tuple = ("fwd", "bwd")) -> float | None:
    """Recorded seconds of ``kinds`` (forward, backward or both) of a run over the calibrated ones.

    Compute inside a step runs beside the other ranks' processes and their transfers, on the
    same cores, under the recorder's hooks: a data-parallel step measured ×0.9–1.4 of the
    blocks timed alone on the 2-core machine. Forward and backward need not move together: a
    pipeline stage's forwards ran ×0.33–0.75 of their calibrated time, its backwards ×0.8–0.97
    (2 and 4 engines), so each gets its own factor (:func:`compute_factors`)."""
    return _stretch(*_compute_seconds(run, costs, strategy, batch), kinds)


def compute_factors(run, costs, strategy, batch: int, name: str) -> dict:
    """``name`` (forward and backward together, what the notebook prints) and ``name_fwd``,
    ``name_bwd`` (what the replay stretches by: :meth:`CostTable.compute_stretch`)."""
    predicted, measured = _compute_seconds(run, costs, strategy, batch)
    return {name: _stretch(predicted, measured, ("fwd", "bwd")),
            f"{name}_fwd": _stretch(predicted, measured, ("fwd",)),
            f"{name}_bwd": _stretch(predicted, measured, ("bwd",))}


GAP_GRID = [2e-5 * k for k in range(51)]
"""Untimed seconds per action or call the fits try: 0 … 1 ms."""
ZERO3_BUSY_GRID = [1.0 + 0.25 * k for k in range(8)] + [3.0 * 1.25 ** k for k in range(8)]
"""Busy factors zero=3's fits try: 1 … ~13 (from 1: a transfer beside compute is never faster
than alone)."""


def _nearest(grid, target: float, of) -> float:
    """The value of ``grid`` whose ``of(value)`` is nearest ``target``."""
    return min(grid, key=lambda x: abs(of(x) - target))


def _typical_step(steps: list[list[dict]]) -> float:
    """The typical rank's step (see :func:`rank_spread`), from its first span (the replay starts
    it late: :func:`start_lag`): the median over steps."""
    return median(mean(rank_ends(evs).values()) - mean(_first_spans(evs).values()) for evs in steps)


def _overlap_shape(events: list[dict], rank: int = 0) -> tuple[float, float] | None:
    """(backward seconds, comm seconds after backward ends) of one step on ``rank``."""
    bwd = [e for e in events if e["kind"] == "bwd" and e["rank"] == rank]
    comm = [e for e in events if e["kind"] == "allreduce" and e["rank"] == rank]
    if not bwd or not comm:
        return None
    end = max(e["end"] for e in bwd)
    return end - min(e["start"] for e in bwd), max(0.0, max(e["end"] for e in comm) - end)


def overlap_fit(run, costs, strategy, batch: int) -> dict:
    """``<mode>_bwd`` (mode: the run's dp_mode, overlap or ddp): the measured backward that
    launches buckets over the replay's; ``<mode>_sync_lag``: how late the slowest rank ends
    that backward (:func:`sync_lag`, replayed with it); then ``<mode>_busy``: the busy factor
    (on a grid) whose replayed comm tail after backward is nearest the measured one. The ranks' mean per step,
    then the median over steps; {} if the run recorded no overlap. (Rank 0 alone is not the
    typical rank here: its tail after backward was the longest of 2 engines more often than
    not, and fitting it put overlap's exposed comm at 0.59 against 0.46 measured.)"""
    from dataclasses import replace

    from .replay import replay
    from .simulation import bucket_density, build_program

    measured = []               # per step, the ranks' mean: the replay is the typical rank
    for evs in _steps(run).values():
        shapes = [shape for r in sorted({e["rank"] for e in evs}) if (shape := _overlap_shape(evs, r))]
        if shapes:
            measured.append((mean(b for b, _ in shapes), mean(t for _, t in shapes)))
    if not measured:
        return {}
    bwd, tail = median(b for b, _ in measured), median(t for _, t in measured)
    lag = sync_lag(run)

    base = replace(build_program(strategy, costs, batch), sync_lag=lag)    # shape() sets its stretch
    pack = sum(m.pack for m in base.grads[0])       # inside the backward span, not stretched

    def shape(**fields):
        return _overlap_shape(replay(replace(base, **fields), 1, strategy.dp, microbatches=1,
                                    dp_mode=strategy.dp_mode, replicas=1))

    span = shape(overlap_busy=1.0, overlap_stretch=1.0)[0]
    stretch = max(1.0, (bwd - pack) / (span - pack))
    grid = [1.0 + 0.25 * k for k in range(8)] + [3.0 * 1.25 ** k for k in range(12)]    # 1 … ~35
    busy = _nearest(grid, tail, lambda f: shape(overlap_busy=f, overlap_stretch=stretch)[1])
    return {f"{strategy.dp_mode}_bwd": stretch, f"{strategy.dp_mode}_busy": busy,
            f"{strategy.dp_mode}_sync_lag": lag, f"{strategy.dp_mode}_bwd_Bps": bucket_density(base)}


def sync_lag(run) -> float:
    """How much later than the ranks' mean the last rank ends its backward: the median over
    steps. A bucket's all-reduce starts once the last rank has issued it, and on shared cores
    the ranks drift apart: on 4 engines over 2 cores the last backward of a ddp step ended
    9–10 ms after the mean (overlap 7–8, naive 4–5; on 2 engines 1.3–2.3 ms). Without it the
    fitted busy factor could not reach ddp's measured tail after backward (42–44 ms at the
    grid's top against 44–48 measured in two of three calibrations on 4 engines)."""
    spreads = []
    for evs in _steps(run).values():
        ends = list(rank_ends([e for e in evs if e["kind"] == "bwd"]).values())
        if len(ends) > 1:
            spreads.append(max(ends) - mean(ends))
    return median(spreads) if spreads else 0.0


def zero3_fit(run, costs, strategy, batch: int) -> dict:
    """zero=3: ``zero3_bwd``, the measured backward spans over the replay's, then ``zero3_busy``,
    the busy factor (on a grid) whose replayed step is nearest the measured one (where the
    ranks end on average: the replay is the typical rank, :func:`rank_spread`). Medians over
    steps; {} if the run recorded no backward.

    Without prefetch, each block's backward computes beside the reduce-scatter of the block
    behind it and, on gloo's two lanes, the gather of the next: on the 2-core machine its spans
    measured ×2.0–2.6 of the replay's, where the contention probe (one call beside small
    matmuls) predicts ×1.4–1.5. And comm beside that slower compute gets more of the cores.
    First ``zero3_gather``: its forward's gathers (one at a time, nothing beside them) over the
    replay's; the sweep-and-zero=1 price of a gather was ×2 of theirs on 2 engines.
    ``zero3_gap_s``, fitted before the busy factor, is the time before each call that no span
    covers (the executor's bookkeeping per block: 0.08 of a 2-engine step measured in no
    span against the replay's 0.02); without it the busy fit made up the step with comm.
    ``zero3_scatter``, before the gap: its reduce-scatters (beside backward) as they ran, over
    the replay's at full speed; the sweep's and zero=1's price of them was ×1.2–2.9 of theirs
    on 2 engines, and with the busy factor at its floor of 1 the step came out ×1.1–1.45 of
    measured. (Their slowdown beside compute is in this factor, so the busy factor fitted after
    it is what the step needs beyond it: a busy factor shown to the fit is not recovered.)"""
    from dataclasses import replace

    from .sharded import replay_sharded
    from .simulation import build_sharded_program

    steps = list(_steps(run).values())
    bwd = _ratio([sum(e["end"] - e["start"] for e in evs if e["kind"] == "bwd" and e["rank"] == 0) for evs in steps])
    if bwd is None:
        return {}
    step = _typical_step(steps)
    at = {"zero3_scatter_at": scatter_at(steps)}

    def replayed(**fit):
        table = replace(costs, in_step={**costs.in_step, **at, **fit})
        events = replay_sharded(build_sharded_program(strategy, table, batch))
        return events, max(e["end"] for e in events)

    gather = _ratio([_forward_gathers(evs) for evs in steps])
    gather = gather / _forward_gathers(replayed(zero3_gather=1.0)[0]) if gather else 1.0
    spans = sum(e["end"] - e["start"] for e in replayed(zero3_gather=gather, zero3_bwd=1.0)[0] if e["kind"] == "bwd")
    stretch = bwd / spans
    scatters = lambda evs: sum(e["end"] - e["start"] for e in evs if e["kind"] == "reduce_scatter" and e["rank"] == 0)
    scatter = _ratio([scatters(evs) for evs in steps])
    alone = scatters(replayed(zero3_gather=gather, zero3_bwd=stretch, zero3_busy=1.0)[0])
    scatter = scatter / alone if scatter and alone else 1.0
    fixed = {"zero3_gather": gather, "zero3_bwd": stretch, "zero3_scatter": scatter}
    gap = _call_gap(steps, lambda g: replayed(**fixed, zero3_gap_s=g)[0])
    # from 1: a transfer beside compute is never faster than alone (below 1 the fit bought the
    # step back with comm that prefetch then hid: prefetch1 predicted ×0.77 of measured)
    busy = _nearest(ZERO3_BUSY_GRID, step, lambda f: replayed(**fixed, zero3_gap_s=gap, zero3_busy=f)[1])
    return {**at, **fixed, "zero3_gap_s": gap, "zero3_busy": busy}


def scatter_at(steps: list[list[dict]]) -> float:
    """Where in a block's backward span (0 its start, 1 its end) zero=3 issues the block's
    reduce-scatter: the median over the blocks whose call starts inside their span, every rank
    and step; 1.0 if none does.

    The executor's span closes on the hook of the block's input gradient, and the parameters'
    gradient hooks, which pack and issue the call, run before it: the call started 0.45–0.52 of
    the way into the span (7 of 8 blocks of the MLP, 2 and 4 engines, with and without
    prefetch), and the rest of the span ran beside it. Issued after the span, as the replay
    had it, 24–26 ms of a 2-engine step's reduce-scatters were exposed where 16–18 of 26–30
    measured were (19–21 issued inside), and dp2 zero=3's exposed comm came out 0.01–0.05 above
    measured (−0.01 to +0.03 inside; three calibrations re-fitted offline)."""
    fractions = []
    for evs in steps:
        spans = {(e["rank"], e["name"].split()[-1]): e for e in evs if e["kind"] == "bwd"}
        for e in evs:
            span = spans.get((e["rank"], e["name"].split()[-1])) if e["kind"] == "reduce_scatter" else None
            if span is not None and span["start"] <= e["start"] <= span["end"] > span["start"]:
                fractions.append((e["start"] - span["start"]) / (span["end"] - span["start"]))
    return median(fractions) if fractions else 1.0


def zero3_prefetch_fit(run, costs, strategy, batch: int) -> dict:
    """zero=3 with prefetch: ``zero3_prefetch_busy``, the busy factor (on the zero=3 grid) whose
    replayed step is nearest the measured one, the other zero=3 factors as :func:`zero3_fit`
    found them without prefetch; {} if the run recorded nothing.

    Without prefetch a block's gathers wait for nothing beside them in forward, and the busy
    factor fitted there sat at its floor of 1 in three calibrations on 2 engines (the backward's
    stretch, ×2.3–2.8, carries that run's contention). Prefetch issues the next block's gather
    beside this block's compute, and there the transfer is slower: priced at 1, dp2 zero=3
    prefetch=1 came out ×0.83–0.88 of measured, its forward 15–17 ms against 18.5–20 measured;
    at 1.5–2 it came out ×0.93–1.02.

    Its backward has its own stretch, ``zero3_prefetch_bwd`` (fitted first, as
    :func:`zero3_fit`'s): with the gathers issued a block ahead, its spans wait beside less. On 4
    engines, with the stretch of the run without prefetch, a rank's compute came out 27–34 ms a
    step against 22–26 measured, and the busy factor that made up the step left its gathers at
    78–84 ms against 101–105: exposed comm 0.04–0.09 below measured."""
    from dataclasses import replace

    from .sharded import replay_sharded
    from .simulation import build_sharded_program

    steps = list(_steps(run).values())
    if not steps:
        return {}

    def replayed(**fit):
        table = replace(costs, in_step={**costs.in_step, **fit})
        return replay_sharded(build_sharded_program(strategy, table, batch))

    spans = lambda evs: sum(e["end"] - e["start"] for e in evs if e["kind"] == "bwd" and e["rank"] == 0)
    bwd = _ratio([spans(evs) for evs in steps])
    stretch = {"zero3_prefetch_bwd": bwd / spans(replayed(zero3_prefetch_bwd=1.0))} if bwd else {}
    step = _typical_step(steps)
    busy = _nearest(ZERO3_BUSY_GRID, step, lambda f: max(e["end"] for e in replayed(**stretch, zero3_prefetch_busy=f)))
    return {**stretch, "zero3_prefetch_busy": busy}


def _forward_gathers(events: list[dict], rank: int = 0) -> float:
    """Seconds of rank's all-gathers before its first backward (one at a time, nothing beside)."""
    mine = [e for e in events if e["rank"] == rank]
    first = min((e["start"] for e in mine if e["kind"] == "bwd"), default=float("inf"))
    return sum(e["end"] - e["start"] for e in mine if e["kind"] == "allgather" and e["end"] <= first)


def _call_gap(steps: list[list[dict]], replayed) -> float:
    """The seconds before each call (on a grid, 0 … 1 ms) whose ``replayed(gap)`` step leaves as
    much of rank 0's step in no span as the measured ``steps`` did (median over steps)."""
    untimed = median(_untimed(evs) for evs in steps)
    return _nearest(GAP_GRID, untimed, lambda g: _untimed(replayed(g)))


def zero1_fit(run, costs, strategy, batch: int) -> dict:
    """zero=1: ``zero1_gap_s``, the untimed seconds before each of its calls (packing a bucket,
    the shard's bookkeeping) that make the replayed step leave as much in no span as the
    measured one: 0.07 of a 2-engine step against the replay's 0.02 without it. {} if the run
    recorded nothing."""
    from dataclasses import replace

    from .replay import replay
    from .simulation import build_program

    steps = list(_steps(run).values())
    if not steps:
        return {}

    def replayed(gap):
        prog = build_program(strategy, replace(costs, in_step={**costs.in_step, "zero1_gap_s": gap}), batch)
        return replay(prog, 1, strategy.dp, microbatches=strategy.microbatches, dp_mode=strategy.dp_mode, replicas=1)

    return {"zero1_gap_s": _call_gap(steps, replayed)}


def _untimed(events: list[dict], rank: int = 0) -> float:
    """Seconds of rank's step, from its first span to its last, in no span: neither compute
    nor comm (before its first span is the rank's late start: :func:`start_lag`)."""
    from ..analysis.metrics import is_comm, total

    mine = [e for e in events if e["rank"] == rank]
    busy = total((e["start"], e["end"]) for e in mine if e["stream"] == "compute" or is_comm(e))
    return max(e["end"] for e in mine) - min(e["start"] for e in mine) - busy


def _first_spans(events: list[dict]) -> dict[int, float]:
    """Each rank's first start in ``events`` (one step)."""
    firsts: dict[int, float] = {}
    for e in events:
        firsts[e["rank"]] = min(firsts.get(e["rank"], e["start"]), e["start"])
    return firsts


def start_lag(runs) -> float | None:
    """Where the typical rank's step starts: per step the ranks' mean time to their first span,
    the median over the steps of ``runs``; None without steps.

    Time zero is the first rank's exit from the step's barrier (labkit.analysis.clocks), and
    the others do not all start at once: on 4 engines over 2 cores, two ranks take the cores
    and the others leave the barrier when they get one. In three calibrations on 4 engines the
    ranks of the data-parallel runs made their first span (per run, the median over steps of
    each order statistic) 0.1–0.3, 0.1–1.4, 0.8–9 and 1.2–13 ms into the step: 2.1–3.6 ms on
    average (read on each rank's own clock, 0.1 ms); on 2 engines 0.17–0.30 ms. The replay
    starts its typical rank there (:func:`labkit.plan.simulation.simulate`, pp = 1), so the
    executor's gap per action (``gap_dp_s``) is fitted without it."""
    lags = [mean(_first_spans(evs).values()) for run in runs for evs in _steps(run).values()]
    return median(lags) if lags else None


def rank_ends(events: list[dict]) -> dict[int, float]:
    """Each rank's last end in ``events`` (one step)."""
    ends: dict[int, float] = {}
    for e in events:
        ends[e["rank"]] = max(ends.get(e["rank"], 0.0), e["end"])
    return ends


def rank_spread(runs) -> list[float] | None:
    """How far the ranks' steps end from where they end on average: seconds, smallest first
    (the median over steps of each order statistic, re-centred to mean 0); None with one rank.

    The ranks of a step are alike, but on shared cores they do not keep one pace: in a naive
    dp=4 step on the 2-core machine, rank 0 ended at 95.0 ms and the slowest at 108.6. The
    replay computes one typical rank (its factors come from rank 0's spans, and rank 0 is now
    fast, now slow); the measured step ends with the slowest, and the faster ranks idle till
    then. Over the data-parallel runs of one calibration (37–97 ms steps) the slowest rank
    ended 3–5 ms after the mean on 4 engines whatever the step's length, so the offsets are
    kept in seconds. :func:`labkit.plan.simulation.paced` applies them."""
    devs = []
    for run in runs:
        for evs in _steps(run).values():
            ends = list(rank_ends(evs).values())
            if len(ends) > 1:
                centre = mean(ends)
                devs.append(sorted(t - centre for t in ends))
    order = _order_statistics(devs)
    return None if order is None else [o - mean(order) for o in order]


def _order_statistics(samples: list[list[float]]) -> list[float] | None:
    """The median over ``samples`` (each sorted, one per step) of each order statistic, over
    the samples of the narrowest width; None below two."""
    width = min((len(d) for d in samples), default=0)
    if width < 2:
        return None
    return [median(d[k] for d in samples if len(d) == width) for k in range(width)]


def replica_paces(runs, pp: int) -> list[float] | None:
    """How far apart a pipeline's dp replicas reach the end of their schedule: per step, each
    replica's time to its last forward or backward (the mean over its ranks) over the replicas'
    mean; the median over steps of each order statistic (slowest last), re-centred to mean 1.
    None with one replica.

    The replay's replicas were one pipeline copied, so a gradient all-reduce started as soon as
    one rank issued it. Measured, the replicas drift apart within a step and each all-reduce
    waits for the slowest replica to issue it: on 4 engines (pp2 × dp2, interleaved, overlap)
    rank 0 issued its first bucket at 34.7 ms and its dp peer at 39.3 and 44.5; the bucket
    ended at 45.2, where the replay, one pipeline for both, had it end 3 ms after rank 0's
    issue. :func:`labkit.plan.replay.replay` runs each replica at its pace (``paces``)."""
    order = []
    for run in runs:
        for evs in _steps(run).values():
            ends: dict[int, float] = {}
            for e in evs:
                if e["kind"] in ("fwd", "bwd", "bwd_input", "bwd_weight"):
                    ends[e["rank"]] = max(ends.get(e["rank"], 0.0), e["end"])
            replicas: dict[int, list[float]] = {}
            for rank, t in ends.items():          # the calibration's pipelines: tp = 1, rank = d·pp + stage
                replicas.setdefault(rank // pp, []).append(t)
            times = [mean(v) for v in replicas.values()]
            if len(times) > 1:
                order.append(sorted(t / mean(times) for t in times))
    paces = _order_statistics(order)
    return None if paces is None else [p / mean(paces) for p in paces]


_COMPUTE = ("fwd", "bwd", "bwd_input", "bwd_weight")


def _pipeline_shape(events: list[dict]) -> tuple[float, float, float]:
    """(schedule, untimed in it, untimed after it) of one step, each the mean over its ranks:
    the schedule from the step's start to the rank's last forward or backward; untimed, the
    seconds from the rank's first span on that no span covers (before it, its late start).
    Sends do not count: recorded, they lie inside the sender's other spans (all of them, in
    every pipeline run of a calibration on 4 engines), and the replay draws them at the
    receive, beside whatever the sender does then."""
    from ..analysis.metrics import total

    rows = []
    for r in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == r and e["kind"] != "send"]
        first = min(e["start"] for e in mine)
        end = max((e["end"] for e in mine if e["kind"] in _COMPUTE), default=first)
        last = max(e["end"] for e in mine)
        inside = total((max(e["start"], first), min(e["end"], end)) for e in mine)
        after = total((max(e["start"], end), e["end"]) for e in mine)
        rows.append((end, end - first - inside, last - end - after))
    return tuple(mean(row[k] for row in rows) for k in range(3))


def pipeline_fit(runs: dict, costs, batch: int) -> dict:
    """A pipeline's ranks off the typical pace: ``pipeline_start_s``, ``gap_s``, ``tail_gap_s``
    and a ``p2p_delay_<run>_s`` per run (``p2p_delay_s`` for GPipe's), from the calibration's
    pipeline runs (``runs``: name → (run, strategy), GPipe's named "").

    The replay is one typical rank per stage; measured, the ranks of a pp2 × dp2 step on 4
    engines over 2 cores take turns at the cores, and each message waits for a sender that is
    as often behind as ahead. A receive's wait measured 7–11 ms a rank in an interleaved step
    where the replay, every sender on time, had 3–4; the executor's untimed seconds inside the
    schedule were fewer than its untimed seconds per action, pooled over the schedule and its
    naive tail, priced there (2–8 ms against 3–11), and after it more. The two errors cancelled
    in a naive step and not beside overlap's buckets, whose tail is hidden: pp2 × dp2 with
    overlap came out ×0.85–0.93 of measured. So, in order: the untimed seconds per action
    inside the schedule, on a grid so the replay leaves as much untimed as the runs did; where
    the ranks start (their late start, :func:`start_lag`, less that gap, which the replay's
    first action pays too); the untimed seconds per call after the schedule (dp naive, as
    the first); then, per run, the delay (on a grid) that makes the replayed schedule end where
    the measured one does, on average over the ranks."""
    from dataclasses import replace

    from .replay import replay
    from .simulation import build_program, paces_of

    measured = {name: [_pipeline_shape(evs) for evs in _steps(run).values()] for name, (run, _) in runs.items()}
    fit = {}

    def replayed(name, **keys):
        strategy = runs[name][1]
        table = replace(costs, in_step={**costs.in_step, **fit, **keys})
        events = replay(build_program(strategy, table, batch), strategy.pp, strategy.dp, strategy.schedule,
                        strategy.microbatches, strategy.chunks, strategy.dp_mode, paces=paces_of(strategy, table))
        end, inside, after = _pipeline_shape(events)
        return end + table.in_step.get("pipeline_start_s", 0.0), inside, after

    inside = sum(median(m[1] for m in steps) for steps in measured.values())
    fit["gap_s"] = _nearest(GAP_GRID, inside, lambda g: sum(replayed(name, gap_s=g)[1] for name in runs))
    fit["pipeline_start_s"] = max(0.0, (start_lag([run for run, _ in runs.values()]) or 0.0) - fit["gap_s"])
    tails = [name for name, (_, s) in runs.items() if s.dp > 1 and s.dp_mode == "naive"]
    if tails:
        after = sum(median(m[2] for m in measured[name]) for name in tails)
        fit["tail_gap_s"] = _nearest(GAP_GRID, after, lambda g: sum(replayed(name, tail_gap_s=g)[2] for name in tails))
    for name in runs:
        key = f"p2p_delay_{name}_s" if name else "p2p_delay_s"
        end = median(m[0] for m in measured[name])
        fit[key] = _nearest([5e-5 * k for k in range(61)], end, lambda d: replayed(name, **{key: d})[0])
    return fit


def gap_per_action(run, actions: int, lag: float = 0.0) -> float:
    """Untimed seconds per action: lab_overhead_fraction·T per rank, less its late start
    (``lag``, priced on its own), over its ``actions``."""
    m = run.metrics
    return max(0.0, (m["lab_overhead_fraction"] * m["step_time_s"] - lag) / max(1, actions))


def replace_in_step(costs, in_step: dict):
    """A copy of ``costs`` with ``in_step`` factors (None values dropped)."""
    from dataclasses import replace
    return replace(costs, in_step={k: v for k, v in in_step.items() if v is not None})


def time_in_step(lab, model, batch: int, costs, steps: int = 24, data=None, loss="mse", tp_plan=None) -> dict:
    """Run the executor once per kind of call; the cost table's ``in_step`` entry."""
    from dataclasses import replace

    from ..config import Strategy

    n = lab.world_size
    run = lambda s, plan=None: lab.run(s, model=model, data=data, loss=loss, batch=batch, steps=steps,
                                       record=True, tp_plan=plan)
    if batch % (2 * n):
        raise ValueError(f"calibrate(in_step=True) runs the executor with dp={n} and pp=2 × 4 micro-batches; "
                         f"batch={batch} must be a multiple of {2 * n}, or pass in_step=False")
    naive_s = Strategy(dp=n, dp_mode="naive")
    naive = run(naive_s)
    zero = run(Strategy(dp=n, zero=1))
    params = sum(len(b["params"]) for b in costs.blocks)
    piped = n % 2 == 0 and batch % (n // 2 * 4) == 0 and len(costs.blocks) >= 2
    # naive dp: the pipeline's receives and compute alone, the all-reduces after the schedule
    # (overlap's buckets beside backward have their own fit below, applied on top)
    gpipe = Strategy(pp=2, dp=n // 2, schedule="gpipe", microbatches=4, dp_mode="naive")
    pipe = run(gpipe) if piped else None
    # 1F1B's receives: on 4 engines they took ×0.6–0.8 of GPipe's (same degrees, same
    # micro-batches), where GPipe's fill runs every first stage's forwards back to back
    pipe_1f1b = run(replace(gpipe, schedule="1f1b")) if piped else None
    # the same compute in more actions and messages: two chunks a rank (interleaved), backward
    # split into I and W (zb-h1), and both in a V (zbv: its receives took ×1.5–2 of interleaved's)
    blocks = len(costs.blocks)
    chunked = replace(gpipe, schedule="interleaved", chunks=2, split_at=tuple(round(k * blocks / 4) for k in (1, 2, 3)))
    pipe_chunked = run(chunked) if piped and blocks >= 4 else None
    split = replace(gpipe, schedule="zb-h1")
    halves = costs.times_halves()
    pipe_split = run(split) if piped and halves else None
    v_shape = replace(chunked, schedule="zbv")
    pipe_v = run(v_shape) if piped and halves and blocks >= 4 else None
    out = {"all_reduce": all_reduce_factor(naive, costs, n), **all_reduce_fit(naive, n),
           "reduce_scatter": window_factor(zero, costs, "reduce_scatter", "reduce_scatter", n),
           "all_gather": window_factor(zero, costs, "allgather", "all_gather", n),
           **compute_factors(naive, costs, naive_s, batch, "dp_compute")}
    pipelines = {}          # name → (run, strategy): the pipeline runs, for pipeline_fit
    if pipe is not None:
        out["sendrecv"] = p2p_factor(pipe, costs)
        # 1F1B's compute, forwards and backwards alternating, ran ×1.05–1.2 of GPipe's (4 engines)
        for name, strategy, measured in (("1f1b", replace(gpipe, schedule="1f1b"), pipe_1f1b),
                                         ("chunked", chunked, pipe_chunked), ("split", split, pipe_split),
                                         ("zbv", v_shape, pipe_v)):
            if measured is not None:
                out[f"sendrecv_{name}"] = p2p_factor(measured, costs)
                out.update(compute_factors(measured, costs, strategy, batch, f"{name}_compute"))
                pipelines[name] = (measured, strategy)
        pipelines[""] = (pipe, gpipe)
        out.update(compute_factors(pipe, costs, gpipe, batch, "pipeline_compute"))
        if n > 2:   # its dp groups' all-reduces: a smaller group than naive's, two groups at once
            out.update(all_reduce_fit(pipe, n // 2, f"all_reduce_{n // 2}"))
            out["replica_pace"] = replica_paces([r for r in (pipe, pipe_1f1b, pipe_chunked, pipe_split, pipe_v)
                                                 if r is not None], 2)
    if piped and n > 2 and len(costs.blocks) >= n and batch % (2 * n) == 0:
        # one pipeline over every engine: deeper than the pp = 2 runs, and alone (on 4 engines a
        # pp4 receive took a mean of 0.8 ms where the pp2 × dp2 1F1B run's factor priced 1.1–1.25,
        # and pp4's exposed comm came out 0.05–0.11 above measured in seven benchmark runs)
        deep = Strategy(pp=n, schedule="1f1b", microbatches=2 * n)
        deep_run = run(deep)
        out["sendrecv_deep"] = p2p_factor(deep_run, costs)
        out.update(compute_factors(deep_run, costs, deep, batch, "deep_compute"))
        pipelines["deep"] = (deep_run, deep)
    out["optimizer"] = optimizer_factor(naive, costs)
    # F, B, one call per tensor, the step; less naive's own late start (rank_start_s, below)
    out["gap_dp_s"] = gap_per_action(naive, 2 + params + 1, start_lag([naive]) or 0.0)
    table = replace_in_step(costs, out)         # the fits below replay with the factors above
    out.update(zero1_fit(zero, table, Strategy(dp=n, zero=1), batch))
    # ddp: torch's reducer, its buckets timed through a Python hook
    overlapped, ddp, zero3 = Strategy(dp=n, dp_mode="overlap"), Strategy(dp=n, dp_mode="ddp"), Strategy(dp=n, zero=3)
    prefetched = replace(zero3, prefetch=1)
    overlap_run, ddp_run, zero3_run, prefetch_run = run(overlapped), run(ddp), run(zero3), run(prefetched)
    out.update(overlap_fit(overlap_run, table, overlapped, batch))
    out.update(overlap_fit(ddp_run, table, ddp, batch))
    out.update(zero3_fit(zero3_run, table, zero3, batch))
    out.update(zero3_prefetch_fit(prefetch_run, replace_in_step(costs, out), prefetched, batch))
    out["rank_ends_s"] = rank_spread([naive, zero, overlap_run, ddp_run, zero3_run])     # the data-parallel runs
    for key in sorted(costs.tensor, key=int):    # the smallest calibrated tp degree that divides the engines
        t = int(key)
        if n % t == 0:
            tp_s = Strategy(tp=t, dp=n // t, dp_mode="bucketed")
            tp_run = run(tp_s, tp_plan)
            out["tp"] = tp_factor(tp_run, costs, t)
            out.update(compute_factors(tp_run, costs, tp_s, batch, "tp_compute"))
            break
    if piped and "2" in costs.tensor and n % 4 == 0:
        # pp × tp: a pipeline of tp pairs, whose receives, f and g and shards' compute ran unlike
        # either run alone (4 calibrations on 4 engines: receives ×0.75–1.06 of α + S/β against
        # the pp × dp 1F1B run's ×1.13–1.98; pp2 × tp2 was predicted ×1.07–1.52 of measured
        # with the pipeline's and the tp run's factors, ×1.01–1.26 with its own)
        pipe_tp = Strategy(pp=2, tp=2, dp=n // 4, schedule="1f1b", microbatches=4, dp_mode="naive")
        pipe_tp_run = run(pipe_tp, tp_plan)
        out["sendrecv_pipeline_tp"] = p2p_factor(pipe_tp_run, costs)
        # both stages' calls: a last stage's f calls took 1.4–1.5 ms, a first stage's 2.4–2.8
        out["tp_in_pipeline"] = tp_factor(pipe_tp_run, costs, 2, ranks=range(0, pipe_tp.pp * pipe_tp.tp, pipe_tp.tp))
        out.update(compute_factors(pipe_tp_run, costs, pipe_tp, batch, "pipeline_tp_compute"))
        pipelines["pipeline_tp"] = (pipe_tp_run, pipe_tp)
    if pipelines:       # their late start, untimed seconds and messages' delay, on the factors above
        out.update(pipeline_fit(pipelines, replace_in_step(costs, out), batch))
    out["rank_start_s"] = start_lag([naive, zero, overlap_run, ddp_run, zero3_run])
    for mode, measured in (("overlap", [overlap_run]), ("ddp", [ddp_run]), ("zero3", [zero3_run, prefetch_run])):
        # buckets beside backward: their ranks start later and end further apart than the pool's;
        # zero=3's start earlier (4 engines: 0.7–1.0 ms into the step against the pool's 3.7)
        out[f"{mode}_start_s"], out[f"{mode}_ends_s"] = start_lag(measured), rank_spread(measured)
    return {k: v for k, v in out.items() if v is not None}
