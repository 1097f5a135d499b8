"""Measure what a step is made of on the lab's engines: a reloadable cost table.

``calibrate(lab, model=, batch=)`` times, on every engine at once (so the engines contend for
the cores as they do in a run), each top-level block's forward and backward per micro-batch
size, the loss, and each block's optimizer step (:mod:`.block_timing`); then the α-β of
all-reduce, all-gather, reduce-scatter (ZeRO's calls) and point-to-point with
:func:`labkit.bench.comm_sweep` and its fit, and what a step adds to them (:mod:`.comm_timing`,
:mod:`.in_step`: the real executor run once per kind of call). With ``tp=(2,)`` it also times
the blocks as the model's tensor plan cuts them, at one rank's shard width, and labkit's f/g
calls (:mod:`.tensor_costs`). The table is plain JSON and knows the model it was measured on
(block types and parameter shapes): simulating or loading it for another model is refused.

    >>> costs = labkit.plan.calibrate(lab, model=labkit.models.mlp(width=256, depth=8), batch=64)
    >>> costs.save("costs.json"); costs = labkit.plan.CostTable.load("costs.json", model=make_model)
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from statistics import median

GLOO_THREADS = 2
"""Worker threads of a gloo process group (``ProcessGroupGloo._Options()._threads``, torch 2.13):
a group's async calls run two at a time (labkit.plan.sharded.Link). NCCL runs one stream."""

FORMAT = 2
"""2: all-gather and reduce-scatter α-β, and ``tensor`` (tp-sharded block costs). A format-1
table still loads (it simulates what it measured: no zero, no tp)."""


def model_signature(net) -> list:
    """What identifies a model for its costs: each block's type and parameter shapes."""
    return [[type(b).__name__, [list(p.shape) for p in b.parameters()]] for b in net]


def fingerprint(signature: list) -> str:
    return hashlib.sha1(json.dumps(signature).encode()).hexdigest()[:16]


@dataclass
class CostTable:
    """Seconds per block and micro-batch size, α-β per collective; JSON-ready."""

    model: str                    # fingerprint of the model's signature
    signature: list
    sizes: list[int]              # micro-batch sizes measured
    blocks: list[dict]            # name, params (numel per tensor), out_numel (per sample), fwd, bwd, optimizer
    loss: dict                    # {"fwd": [...], "bwd": [...]} per size
    comm: dict                    # {"all_reduce": {"alpha_s", "beta_Bps", "n"}, "sendrecv": {...}, ...}
    world_size: int = 1
    format: int = FORMAT
    tensor: dict = field(default_factory=dict)
    """str(tp) → {"plan", "blocks" (fwd, bwd, optimizer, out_numel, calls), "loss", "calls" (α-β of g and f)}."""
    in_step: dict = field(default_factory=dict)
    """How much slower each collective runs inside a real step than in the sweep, and the
    executor's untimed seconds per action (``gap_s``): :mod:`labkit.plan.in_step`."""

    # -- lookups ----------------------------------------------------------------------------
    def at(self, values: list[float], size: int) -> float:
        """A per-size measurement at ``size``: linear between the measured sizes, beyond them
        along the line through the last two (compute time grows about linearly in rows)."""
        xs = self.sizes
        if len(xs) == 1:
            return values[0] * size / xs[0]
        i = next((k for k in range(1, len(xs) - 1) if size <= xs[k]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(0.0, y0 + (y1 - y0) * (size - x0) / (x1 - x0))

    def alpha_beta(self, op: str) -> tuple[float, float]:
        if op not in self.comm:
            if self.world_size > 1:
                raise ValueError(f"the cost table has no {op!r} costs (format {self.format}, before they were "
                                 "measured); calibrate again with labkit.plan.calibrate(lab, model=...)")
            raise ValueError(f"the cost table has no {op!r} costs (calibrated on {self.world_size} engine(s)); "
                             "calibrate on at least 2 engines for dp > 1 or pp > 1")
        c = self.comm[op]
        return c["alpha_s"], c["beta_Bps"]

    def collective_s(self, op: str, nbytes: float, n: int, busy: bool = False) -> float:
        """α + (n−1)/n·S/β of an all-gather or reduce-scatter of a whole buffer of ``nbytes``
        (nccl-tests' bus factor; β the measured bus bandwidth); ``busy`` as for all-reduce."""
        alpha, beta = self.alpha_beta(op)
        return (alpha + (n - 1) / n * nbytes / beta) * (self.busy_factor if busy else 1.0) * self.slowdown(op)

    def sharded(self, tp: int) -> dict:
        """The blocks as ``tp`` ranks hold them (ValueError naming the fix if not measured)."""
        entry = self.tensor.get(str(tp))
        if entry is None:
            have = sorted(int(k) for k in self.tensor) or "none"
            raise ValueError(f"the cost table has no blocks timed at tp={tp} (measured: {have}); calibrate "
                             f"with labkit.plan.calibrate(lab, model=..., tp=({tp},))")
        return entry

    def tp_call_s(self, direction: str, nbytes: float, n: int, pp: int = 1) -> float:
        """Seconds of one f ("f": backward) or g ("g": forward) all-reduce of ``nbytes`` over ``n``
        tp ranks, as measured through labkit's own f and g, × how much slower they ran inside the
        calibration's tp run (``tp``), or inside its pipeline of tp pairs for pp > 1
        (``tp_in_pipeline``, where measured)."""
        calls = next(iter(self.tensor.values()))["calls"]
        c = calls[direction]
        factor = self.in_step.get("tp_in_pipeline", self.slowdown("tp")) if pp > 1 else self.slowdown("tp")
        return (c["alpha_s"] + 2 * (n - 1) / n * nbytes / c["beta_Bps"]) * factor

    def all_reduce_s(self, nbytes: float, n: int, busy: bool = False) -> float:
        """α + 2(n−1)/n·S/β, with the bus bandwidth β measured (ring scaling to other n);
        ``busy``: while the rank computes (× the measured ``busy_factor``). α and β are those
        fitted to the calls inside a step where measured (``in_step``: over groups of ``n``
        where those were measured, else over all the engines), else the sweep's × the in-step
        factor. (α is not the same in groups of 2 and 4: a ring's latency grows with its hops.)"""
        for key in (f"all_reduce_{n}", "all_reduce"):
            if f"{key}_alpha_s" in self.in_step and f"{key}_beta_Bps" in self.in_step:
                alpha, beta, slow = self.in_step[f"{key}_alpha_s"], self.in_step[f"{key}_beta_Bps"], 1.0
                break
        else:
            (alpha, beta), slow = self.alpha_beta("all_reduce"), self.slowdown("all_reduce")
        return (alpha + 2 * (n - 1) / n * nbytes / beta) * (self.busy_factor if busy else 1.0) * slow

    def slowdown(self, op: str) -> float:
        """How much slower ``op`` ran inside the measured step than the sweep predicts (1 if not measured)."""
        return self.in_step.get(op, 1.0)

    def compute_stretch(self, kind: str, pp: int = 1, tp: int = 1, schedule: str = "gpipe") -> float:
        """How much longer a forward (``kind`` "fwd") or backward ("bwd") ran inside a measured
        step than its blocks timed alone (:mod:`labkit.plan.in_step`): for pp > 1 the pipeline
        run of ``schedule``'s kind (:func:`pipeline_runs`: two chunks and a split backward run
        more actions for the same compute, each with its own fixed cost), for tp > 1 the
        tensor-parallel run's where measured (shards beside their f and g: on 2 engines
        ×1.2–1.4, against the data-parallel run's ×0.8–1.1), the data-parallel run's otherwise;
        per kind where measured, else both together (tables calibrated before the split), else 1.
        pp × tp takes the calibration's pipeline of tp pairs (``pipeline_tp_compute``), and a
        pipeline deeper than 2 stages its one pipeline over every engine (``deep_compute``),
        where measured (from 4 engines)."""
        tp_run = tp > 1 and f"tp_compute_{kind}" in self.in_step
        base = "pipeline_compute" if pp > 1 else "tp_compute" if tp_run else "dp_compute"
        if pp > 1:
            base = next((f"{run}_compute" for run in self.pipeline_runs(schedule, pp, tp)
                         if f"{run}_compute_{kind}" in self.in_step), base)
        return self.in_step.get(f"{base}_{kind}", self.in_step.get(base, 1.0))

    def times_halves(self, tp: int = 1) -> bool:
        """Whether backward was timed as its input and weight halves (the zero-bubble schedules
        need them), for the blocks as ``tp`` ranks hold them."""
        rows = self.sharded(tp)["blocks"] if tp > 1 else self.blocks
        return all("bwd_input" in b and "bwd_weight" in b for b in rows)

    def gap_s(self, pp: int) -> float:
        """The executor's untimed seconds per action (pipeline runs and data-parallel ones differ)."""
        return self.in_step.get("gap_s" if pp > 1 else "gap_dp_s", 0.0)

    def pipeline_runs(self, schedule: str, pp: int = 2, tp: int = 1) -> tuple[str, ...]:
        """The calibration's pipeline runs that price a pipeline, nearest first: for tp > 1 its
        pipeline of tp pairs ("pipeline_tp"), for pp > 2 its one pipeline over every engine
        ("deep"), then the run of ``schedule``'s kind (:func:`pipeline_runs`)."""
        return ("pipeline_tp",) * (tp > 1) + ("deep",) * (pp > 2) + pipeline_runs(schedule)

    def p2p_s(self, nbytes: float, busy: bool = False, schedule: str = "gpipe", tp: int = 1, pp: int = 2) -> float:
        """α + S/β of one message (``busy``: × ``busy_factor``, as if its rank computed throughout),
        × how much longer a receive took inside the calibration's pipeline run nearest this one
        (:meth:`pipeline_runs`), else the GPipe run's (tables calibrated before those runs)."""
        alpha, beta = self.alpha_beta("sendrecv")
        factor = next((self.in_step[f"sendrecv_{run}"] for run in self.pipeline_runs(schedule, pp, tp)
                       if f"sendrecv_{run}" in self.in_step), None)
        return ((alpha + nbytes / beta) * (self.busy_factor if busy else 1.0)
                * (factor or self.slowdown("sendrecv")))

    def p2p_delay_s(self, schedule: str = "gpipe", tp: int = 1, pp: int = 2) -> float:
        """How much later than its sender posts it a message reaches a waiting receiver, in the
        calibration's pipeline run nearest this one (:meth:`pipeline_runs`), else GPipe's; 0 in
        tables calibrated before it was measured (:func:`labkit.plan.in_step.pipeline_fit`)."""
        return next((self.in_step[f"p2p_delay_{run}_s"] for run in self.pipeline_runs(schedule, pp, tp)
                     if f"p2p_delay_{run}_s" in self.in_step), self.in_step.get("p2p_delay_s", 0.0))

    def copy_s(self, nbytes: float, what: str) -> float:
        """Compute-thread seconds to "pack", "unpack" or "div" ``nbytes`` of gradients (0 if not measured)."""
        rate = self.comm.get("copy", {}).get(f"{what}_Bps")
        return nbytes / rate if rate else 0.0

    @property
    def compute_factor(self) -> float:
        """How much longer compute takes while a transfer of its rank is in flight (1 when not measured)."""
        return self.comm.get("contention", {}).get("compute_factor", 1.0)

    @property
    def lanes(self) -> int:
        """How many async calls of one group run at once (gloo: its worker threads; 1 when not measured)."""
        return int(self.comm.get("contention", {}).get("lanes", 1))

    @property
    def busy_factor(self) -> float:
        """How much longer a transfer takes while its rank computes (1 when not measured)."""
        return self.comm.get("all_reduce", {}).get("busy_factor", 1.0)

    def check(self, model) -> None:
        """Raise ValueError unless ``model`` (a factory or module) is the one measured."""
        from ..models.training import build_model

        mine = fingerprint(model_signature(build_model(model, 0)))
        if mine != self.model:
            raise ValueError(f"this cost table was measured on another model (fingerprint {self.model}, "
                             f"this one {mine}); calibrate again with labkit.plan.calibrate(lab, model=...)")

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        if d.get("format") not in (1, FORMAT):
            raise ValueError(f"cost table format {d.get('format')!r} is neither 1 nor {FORMAT}; calibrate again")
        return cls(**d)

    @classmethod
    def load(cls, path, model=None) -> "CostTable":
        """Read a saved table; with ``model``, refuse it unless it was measured on that model."""
        with open(path) as f:
            table = cls.from_dict(json.load(f))
        if model is not None:
            table.check(model)
        return table


PIPELINE_RUNS = {"1f1b": ("1f1b",), "interleaved": ("chunked",), "zb-h1": ("split",), "zbv": ("zbv", "chunked")}


def pipeline_runs(schedule: str) -> tuple[str, ...]:
    """Which of the calibration's pipeline runs price ``schedule``'s receives and compute, the
    first measured one taken (:func:`labkit.plan.in_step.time_in_step`); none: GPipe's run.
    "1f1b" (1F1B's receives: GPipe's fill runs a first stage's forwards back to back, and its
    receivers wait for a core), "chunked" (interleaved: two chunks a rank, twice the actions
    and messages), "split" (zb-h1: backward as I and W), "zbv" (both, in a V; a table
    calibrated before its run takes interleaved's). 1F1B's compute is its own run's (in a table
    calibrated before it was, GPipe's run's)."""
    return PIPELINE_RUNS.get(schedule, ())


# -- in the notebook --------------------------------------------------------------------------
def default_sizes(batch: int) -> list[int]:
    """Micro-batch sizes worth measuring for ``batch``: batch, batch/2, … down to 1."""
    sizes, s = [], batch
    while s >= 1:
        sizes.append(s)
        s //= 2
    return sorted(set(sizes))


def _mean_over_ranks(per_rank: list[dict]) -> tuple[list[dict], dict]:
    blocks = []
    for i, b in enumerate(per_rank[0]["blocks"]):
        rows = [r["blocks"][i] for r in per_rank]
        blocks.append(dict(b, **{k: [sum(r[k][j] for r in rows) / len(rows) for j in range(len(b[k]))]
                                 for k in ("fwd", "bwd", "bwd_input", "bwd_weight") if k in b},
                           optimizer=sum(r["optimizer"] for r in rows) / len(rows)))
    loss = {k: [sum(r["loss"][k][j] for r in per_rank) / len(per_rank) for j in range(len(per_rank[0]["loss"][k]))]
            for k in ("fwd", "bwd")}
    return blocks, loss


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")


def calibrate(lab, model, batch: int = 64, sizes=None, repeats: int = 5, data=None, loss="mse", seed: int = 0,
              comm: bool = True, seconds_per_point: float = 0.03, tp=(), tp_plan: dict | None = None,
              in_step: bool = True, steps: int = 24) -> CostTable:
    """Measure ``model``'s per-block costs and the lab's α-β into a :class:`CostTable`.

    ``in_step``: also run the executor once per kind of call (``steps`` steps each) to measure
    how much slower collectives run inside a step and its gaps between actions (:mod:`.in_step`).
    Its fits take medians over steps, and on shared cores one step of a run can take 1.7× the
    next: at 8 steps a run the predicted step of zero=3 on 2 engines ranged ×0.9–1.2 of the
    same measured run over four calibrations, and 10 of 16 cases on 4 engines came within 10 %
    of measured; at 24, 14 of 16 (``benchmarks/bench_plan.py``; in-step part 9 → 16 s on 2
    engines, 22 → 42 s on 4).
    ``tp``: tensor-parallel degrees to time the blocks at as well (e.g. ``(2,)``), cut by
    ``tp_plan`` (default: the model's own); the f/g calls are timed on the lab's engines.
    """
    from .. import bench
    from .block_timing import time_blocks
    from .comm_timing import time_busy_all_reduce, time_calls, time_copies

    sizes = sorted(set(sizes)) if sizes else default_sizes(batch)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes={sizes!r} must be whole numbers ≥ 1 (rows per micro-batch)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a whole number ≥ 1")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} must be a whole number ≥ 2 (executor steps per in-step run)")
    tp = (tp,) if isinstance(tp, int) else tuple(tp)
    if any(not isinstance(t, int) or t < 2 for t in tp):
        raise ValueError(f"tp={tp!r} must list tensor-parallel degrees ≥ 2, e.g. tp=(2,)")
    if tp and lab.world_size < 2:
        raise ValueError("tp: the f/g calls are timed between engines; calibrate on at least 2 engines")
    per_rank = lab.apply(time_blocks, model, seed, sizes, repeats, data, loss)
    blocks, loss_costs = _mean_over_ranks(per_rank)
    signature = per_rank[0]["signature"]
    tensor = {str(t): time_sharded(lab, t, model, seed, sizes, repeats, data, loss, tp_plan) for t in tp}
    fits = {}
    if comm and lab.world_size > 1:
        param_bytes = sum(4 * n for b in blocks for n in b["params"])
        act_bytes = max(4 * b["out_numel"] * max(sizes) for b in blocks)
        top = max(param_bytes, act_bytes)
        grid = [4 ** k for k in range(1, 14) if 4 ** (k - 1) <= top]
        sweep = bench.comm_sweep(lab, sizes=grid, collectives=COLLECTIVES, algorithms=(),
                                 seconds_per_point=seconds_per_point)
        calls = lab.apply(time_calls)
        contention = lab.apply(time_busy_all_reduce, min(param_bytes, 1 << 20))
        copies = lab.apply(time_copies, min(param_bytes, 1 << 20))
        fits["copy"] = {k: min(r[k] for r in copies) for k in copies[0]}
        busy_factor = max(1.0, max(r["busy_s"] for r in contention) / max(r["idle_s"] for r in contention))
        fits["contention"] = {"compute_factor": max(1.0, median(r["compute_factor"] for r in contention)),
                              "lanes": GLOO_THREADS if lab.ranks[0]["backend"] == "gloo" else 1}
        for (collective, _), (alpha, beta) in sweep.fits.items():
            # α as a step sees it: the slowest rank's recorded small call, if above the fit's
            seen = max(r[collective] for r in calls)
            fits[collective] = {"alpha_s": max(alpha, seen), "alpha_fit_s": alpha,
                                "beta_Bps": beta if math.isfinite(beta) else 1e30, "n": lab.world_size,
                                "busy_factor": busy_factor}
    table = CostTable(model=fingerprint(signature), signature=signature, sizes=sizes, blocks=blocks,
                      loss=loss_costs, comm=fits, world_size=lab.world_size, tensor=tensor)
    if in_step and fits:
        from .in_step import time_in_step
        table.in_step = time_in_step(lab, model, batch, table, steps=steps, data=data, loss=loss,
                                     tp_plan=tp_plan)
    return table


def time_sharded(lab, tp: int, model, seed, sizes, repeats, data, loss, tp_plan) -> dict:
    """The blocks at one tp rank's shard shape, and the α-β of f and g through labkit's own."""
    from .block_timing import time_blocks
    from .tensor_costs import fit_tp_calls, time_tp_calls

    per_rank = lab.apply(time_blocks, model, seed, sizes, repeats, data, loss, tp, tp_plan)
    blocks, loss_costs = _mean_over_ranks(per_rank)
    nbytes = sorted({4 * numel * s for b in blocks for _, numel in b["calls"] for s in sizes}) or [4]
    calls = fit_tp_calls(lab.apply(time_tp_calls, nbytes), lab.world_size)
    return {"plan": per_rank[0]["plan"], "blocks": blocks, "loss": loss_costs, "calls": calls}
