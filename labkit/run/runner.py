"""The run driver, step by step: validate in the notebook, build on the engines, run each step
as its own call (so a run can be watched, interrupted at a step boundary and its failure
pinned to a step), gather events after every step, and turn them into metrics.

:func:`execute` is the one step loop: ``lab.run`` and the CLI call it directly, the dashboard's
:class:`labkit.run.live.LiveRunner` calls it on a worker thread.
"""
from __future__ import annotations

import os
import sys
import tempfile
import uuid
from typing import Callable

import torch
from torch import nn

from .. import engine
from ..analysis.drift import check_snapshots
from ..config import Strategy
from ..parallel.build import RunSpec
from ..analysis.metrics import combine_steps, step_entry
from .result import Run
from ..analysis.timeline import Timeline
from ..training import build_model, check_optimizer, resolve_data, resolve_loss
from ..parallel.blocks import check_blocks
from ..parallel.materialize import check_init
from .checks import (check_loss, check_model, check_number, check_profile, check_targets, has_dropout, split,
                     warn_dropout,
                     warn_ignored_targets, warn_random_forward, warn_router_loss)
from .relay import relay_warnings
from ..analysis.clocks import aligned
from ..analysis.waits import split_waits
from ..parallel.recompute import check_recompute
from ..parallel.axes import check_models as check_axes
from ..parallel.expert import tokens_per_ep_rank


def validate(spec: RunSpec, engines: int):
    """Everything that can be checked before an engine is called; ValueError names the fix.
    Returns the run's checkpointing (labkit.checkpoint.Plan), or None when it asks for none."""
    s = spec.strategy
    if not isinstance(s, Strategy):
        raise TypeError(f"strategy must be a labkit.Strategy, got {type(s).__name__}")
    s.check_engines(engines)
    s.check_batch(spec.batch)
    if isinstance(spec.steps, bool) or not isinstance(spec.steps, int) or spec.steps < 1:
        raise ValueError(f"steps={spec.steps!r} must be a whole number ≥ 1")
    check_number("lr", spec.lr, "> 0, e.g. lr=0.1", lambda v: v > 0)
    check_number("momentum", spec.momentum, "≥ 0 (0: plain SGD)", lambda v: v >= 0)
    if not isinstance(spec.seed, int) or not -2**63 <= spec.seed < 2**64:
        raise ValueError(f"seed={spec.seed!r} must be a whole number that fits in 64 bits")
    loss = resolve_loss(spec.loss)
    check_snapshots(spec.extra.get("snapshots", False))
    check_profile(spec.extra.get("profile", False))
    check_optimizer(spec.optimizer, spec.momentum)
    check_init(spec.init)
    if not (isinstance(spec.model, nn.Module) or callable(spec.model)):
        raise TypeError(f"model must be an nn.Module or a zero-argument callable returning one (model=Net or "
                        f"model=Net()), got {type(spec.model).__name__}")
    if spec.data is not None and not callable(spec.data):     # a generator cannot reach the engines
        raise TypeError(f"data must be a callable data(step) -> (x, y), got a {type(spec.data).__name__}; from a "
                        f"generator: batches = [next(gen) for _ in range(steps)]; data=lambda step: batches[step]")
    if spec.data is not None and hasattr(spec.model, "check_data"):
        spec.model.check_data(spec.data)              # a GPT: windows ≤ block_size, ids < vocab_size
    built = model_for_checks(spec.model, spec.seed)
    check_model(built, s)
    warn_dropout(built, s)
    check_blocks(built, s, spec.blocks)              # zero=3/fsdp2: repeated blocks; pp > 1: a chain
    data = FirstBatch(resolve_data(spec.data, built, spec.batch, spec.seed), spec.data)   # synthetic: a shape it infers
    check_targets(spec.loss, data)                   # token ids with the default "mse": refused
    if callable(spec.loss):
        check_loss(loss, built, data, spec.batch)    # a user's loss: a mean over the rows, or refused
        warn_ignored_targets(loss, data, s)          # padding (-100) averaged per shard
    warn_router_loss(built, s)                       # a transformers MoE's batch-wide router loss
    check_recompute(built, s.recompute, spec.blocks) # "selective" needs submodules named core
    check_axes(spec, built, data)                    # each axis's rules on the model (parallel/axes.py)
    check_first_batch(spec, built, data)
    from ..checkpoint import prepare
    return prepare(spec, built)                      # checkpoint=, resume=: the folder, model, optimizer


class FirstBatch:
    """``data`` for the checks: the first batch fetched once however many checks read it, and
    kept for the next validation of the same user data (``data(step)`` is the same batch every
    time: the data contract; a user's data may be slow, and the dashboard validates twice on
    every change); other steps and attributes are the data's own."""

    _last: tuple = (None, None)          # (the user's data object, its first batch)

    def __init__(self, data, given=None):
        self._data, self._given = data, given
        self._first = FirstBatch._last[1] if given is not None and FirstBatch._last[0] is given else None

    def __call__(self, step: int):
        if step != 0:
            return self._data(step)
        if self._first is None:
            self._first = self._data(0)
            if self._given is not None:
                FirstBatch._last = (self._given, self._first)
        return self._first

    def __getattr__(self, name):
        return getattr(self._data, name)


PROBE_PARAMETERS = 50_000_000
"""The largest model :func:`check_first_batch` builds for real in the notebook (200 MB in fp32)."""


def check_first_batch(spec: RunSpec, built: nn.Module, data) -> None:
    """What needs the model's values, on one row of the first batch, in this process: with
    pp > 1, the stages' chain of units computes what its forward does (refused otherwise,
    :func:`labkit.parallel.pipeline.modules.check_chain`); with a split run, a forward that
    draws random numbers is warned about (:func:`.checks.warn_random_forward`). The model is
    built for real under the run's seed, the caller's RNG kept; a model over
    ``PROBE_PARAMETERS`` is not built (its chain and forward are not probed)."""
    s = spec.strategy
    random_probe = split(s) and not has_dropout(built)      # dropout layers are warned about already
    if not (s.pp > 1 or random_probe) or sum(p.numel() for p in built.parameters()) > PROBE_PARAMETERS:
        return
    # the same model, data and seed probed before (a dashboard validates on every change, and a
    # user's data may be slow): what passed then holds now
    same = _PROBED.get("of") is not None and all(a is b for a, b in zip(_PROBED["of"], (spec.model, spec.data)))
    same = same and _PROBED.get("seed") == spec.seed
    chain, random = s.pp > 1 and not (same and _PROBED.get("chain")), random_probe and not (same and _PROBED.get("random"))
    if not (chain or random):
        return
    try:
        x = data(0)[0]
    except Exception:             # the run reports the data's own error
        return
    if not isinstance(x, torch.Tensor):
        return
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec.model, spec.seed)
    if not same:
        _PROBED.clear()
        _PROBED.update({"of": (spec.model, spec.data), "seed": spec.seed})
    if chain:
        from ..parallel.pipeline.modules import check_chain
        check_chain(model, x[:1])
        _PROBED["chain"] = True
    if random:
        warn_random_forward(model, x[:1], s)
        _PROBED["random"] = True


_PROBED: dict = {}
"""The last model and data :func:`check_first_batch` probed (held, so identity means the same
objects), its seed, and which probes passed."""


def model_for_checks(model, seed: int) -> nn.Module:
    """The model the notebook's checks read: its structure, shapes and tied weights, never its
    values. A factory is built on the ``meta`` device (no memory for the weights, as torchtitan
    builds before materialising per rank), so a model larger than this machine can be checked;
    one that cannot be built there (a factory that reads a weight's value) is built for real,
    as is an instance (read as it is, not copied)."""
    if isinstance(model, nn.Module):
        return model
    with torch.random.fork_rng(devices=[]):       # building seeds torch: not the caller's RNG
        try:
            with torch.device("meta"):
                built = model()
        except Exception:                          # built for real below: its own error, if any
            built = None
        if isinstance(built, nn.Module):
            return built
        return build_model(model, seed)


def measured_steps(steps: int) -> int:
    """The first step warms up (allocations, DDP's bucket set-up): skip it when there are ≥ 3."""
    return 1 if steps >= 3 else 0


def ship_by_value(*objects) -> None:
    """Send user code defined outside installed packages by value, not by module name.

    Functions from a notebook travel by value already (cloudpickle); functions from a
    user's own .py file next to the notebook would otherwise be looked up by module name on
    engines whose working directory or path may not contain it.
    """
    import cloudpickle

    installed = [p for p in sys.path if "site-packages" in p] + [sys.base_prefix]
    for obj in _with_referenced(objects):
        if obj is None or isinstance(obj, str):
            continue
        name = getattr(obj, "__module__", None) or type(obj).__module__
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or name == "__main__" or name.split(".")[0] in ("labkit", "torch") or path is None:
            continue
        if not any(os.path.abspath(path).startswith(os.path.abspath(p)) for p in installed):
            cloudpickle.register_pickle_by_value(module)


def _with_referenced(objects) -> list:
    """``objects``, each model's class, and what a notebook-defined factory names (``lambda:
    Net(8)`` travels by value, while the ``Net`` it calls would be looked up by module name)."""
    out = []
    for obj in objects:
        out.append(obj)
        if isinstance(obj, nn.Module):
            out += [type(m) for m in obj.modules()]
        code = getattr(obj, "__code__", None)
        if code is not None:
            scope = getattr(obj, "__globals__", {})
            out += [scope[n] for n in code.co_names if n in scope]
            out += [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())
                    if _filled(c)]
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def execute(lab, spec: RunSpec, on_step: Callable | None = None, stop: Callable[[], bool] | None = None,
            on_groups: Callable | None = None, what: str = "lab.run") -> Run:
    """The one step loop: ``lab.run``, the CLI and the dashboard's runner all come through here.

    Validate in the notebook; hold the lab (another thread's ``lab.run``/``lab.apply`` is
    refused meanwhile); groups for the degrees (a fresh store after a failure or a change of
    degrees, as every lab call does); build on the engines under a fresh run id; one call per
    step, tagged with that id; after each step, append its events (O(events of the step)) and
    refresh the metrics; ``on_step(run, step)``; stop at a step boundary when ``stop()`` says so.
    """
    plan = validate(spec, lab.world_size)
    ship_by_value(spec.model, spec.data, spec.loss, getattr(spec.loss, "total", None))   # a token loss's fn
    s = spec.strategy
    with lab.hold(what):
        rebuilt = lab.ensure_groups(s.grid())
        if on_groups is not None:
            on_groups(rebuilt)
        run_id = uuid.uuid4().hex[:12]
        warned: set = set()           # engine warnings, each relayed once per rank and run
        built = lab.apply(engine.setup_run, spec, run_id)
        relay_warnings(built, warned)
        restored = None
        if plan is not None and plan.resume is not None:      # the state, and the data from its step
            from ..parallel import state
            restored = lab.apply(state.restore, plan.resume, plan.first, plan.layout)
        link = getattr(lab, "link", None)          # the emulated link its calls obey (None: raw gloo)
        title = f"emulated link {link}" if link is not None else None     # shown on every timeline
        run = Run(s, [], Timeline([], lab.world_size, title=title, grid=s), {}, spec.batch, ranks=lab.ranks)
        run.link = link
        run.timeline.gpus_per_node = getattr(link, "gpus_per_node", None)      # lanes name each rank's node
        run.parameter_bytes = [b["parameter_bytes"] for b in built]
        run.first_step = plan.first if plan is not None else 0
        if restored is not None:
            run.checkpoint_io["load"] = restored
        peak = [0] * lab.world_size
        for step in range(spec.steps):
            results = lab.apply(engine.run_step, step, run_id)
            relay_warnings(results, warned)
            record_step(run, results, spec, peak, step)
            if on_step is not None:
                on_step(run, step)
            stopping = stop is not None and stop() and step < spec.steps - 1
            if plan is not None and plan.root is not None:     # checkpoint=: due saves, finished async ones
                from ..checkpoint import after_step
                saved, drawn = after_step(lab, spec, plan, step, stopping, run_id, run.checkpoint_io, run.timeline)
                run.checkpoints += saved
                add_events(run, drawn, spec, peak, step)
            if stopping:
                run.interrupted = True
                break
        if plan is not None and plan.pending is not None:     # the last asynchronous save, waited for
            from ..checkpoint import finish, spans
            saved, ranks = finish(lab, spec, plan, run.checkpoint_io)
            run.checkpoints.append(saved)
            add_events(run, spans(ranks, run.timeline), spec, peak, spec.steps - 1)
        if spec.extra.get("profile"):
            run.profile_paths = save_profiles(lab.apply(engine.finish_profile), spec.extra["profile"], run_id)
        run.params, run.holders, run.copies = gather_parameters(lab)
    return run


def save_profiles(traces: list[dict], where, run_id: str) -> list[str]:
    """Each rank's gzipped profiler trace as ``rank{N}.json.gz`` in ``where`` (True: a new
    temporary folder named after the run); the paths, in rank order."""
    folder = tempfile.mkdtemp(prefix=f"labkit-profile-{run_id}-") if where is True else str(where)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for t in sorted(traces, key=lambda t: t["rank"]):
        path = os.path.join(folder, f"rank{t['rank']}.json.gz")
        with open(path, "wb") as f:
            f.write(t["trace_gz"])
        paths.append(path)
    return paths


def record_step(run: Run, results: list[dict], spec: RunSpec, peak: list[int], step: int) -> None:
    """Fold one step's answers into ``run``: loss, wall time, events (appended), metrics."""
    run.losses.append(_global_loss(results))
    run.step_times.append(max(r["step_s"] for r in results))
    run.step_cpu_times.append(max(r["cpu_s"] for r in results))
    if "snapshot" in results[0]:
        run.snapshots.append({r["rank"]: r.pop("snapshot") for r in results})
    for r in results:
        peak[r["rank"]] = max(peak[r["rank"]], r.get("peak_activation_bytes", 0))
    step_events = split_waits(aligned(results))
    run.timeline.extend(step_events)
    for s in sorted({e["step"] for e in step_events}):
        # an event tagged with an earlier step (none today) refreshes that step from all of its events
        mine = [e for e in step_events if e["step"] == s] if s == step else \
            [e for e in run.timeline.events if e["step"] == s]
        run.step_entries[s] = step_entry(mine, len(peak))
    routed = (run.metrics or {}).get("tokens_per_expert", [])
    run.metrics = _metrics(run.step_entries, len(peak), spec, list(peak), step)
    _routing_metrics(run, results, routed, spec.strategy.ep)
    _precision_metrics(run, results)
    run.metrics["memory_bytes"] = _memory(results)      # per rank, after this step


def add_events(run: Run, events: list[dict], spec: RunSpec, peak: list[int], step: int) -> None:
    """Events that come after their step was recorded (a checkpoint's spans): appended, and
    the metrics of the steps they belong to computed again."""
    if not events:
        return
    run.timeline.extend(events)
    for s in sorted({e["step"] for e in events}):
        run.step_entries[s] = step_entry([e for e in run.timeline.events if e["step"] == s], len(peak))
    run.metrics.update(_metrics(run.step_entries, len(peak), spec, list(peak), step))


def _routing_metrics(run: Run, results: list[dict], before: list, ep: int) -> None:
    """MoE routing, one entry per step: ``tokens_per_expert`` {layer: tokens per expert, over
    the global batch} and ``tokens_per_ep_rank`` {layer: tokens each rank of an ep group
    receives, summed over the groups} (labkit.view.experts plots them)."""
    layers: dict = {}
    for r in results:
        for name, counts in r.get("tokens_per_expert", {}).items():
            layers[name] = [a + b for a, b in zip(layers[name], counts)] if name in layers else list(counts)
    if not layers:
        return
    run.metrics["tokens_per_expert"] = before + [layers]
    run.metrics["tokens_per_ep_rank"] = [{name: tokens_per_ep_rank(c, ep) for name, c in step.items()}
                                         for step in run.metrics["tokens_per_expert"]]


def _precision_metrics(run: Run, results: list[dict]) -> None:
    """fp16's loss scaler: the steps it skipped (gradients overflowed; every rank agrees, see
    labkit.parallel.precision) and the scale of the last step, in ``run.metrics``."""
    scaled = [r for r in results if "loss_scale" in r]
    if not scaled:
        return
    if scaled[0]["skipped"]:
        run.skipped_steps.append(len(run.losses) - 1)
    run.metrics["skipped_steps"] = len(run.skipped_steps)
    run.metrics["loss_scale"] = scaled[0]["loss_scale"]


def _global_loss(results: list[dict]) -> float:
    """Mean over the ranks that computed a loss (dp replicas of the last stage), weighted."""
    scored = [r for r in results if r.get("loss_weight", 0) > 0]
    return sum(r["loss"] * r["loss_weight"] for r in scored) / sum(r["loss_weight"] for r in scored)


def _metrics(entries: dict, world_size, spec, peak, step) -> dict:
    """The metrics of the steps so far (the warm-up left out once a measured step exists), from
    each step's part (analysis.metrics.step_entry): O(steps), not O(events of the run)."""
    skip = measured_steps(spec.steps) if step >= measured_steps(spec.steps) else 0
    kept = [entry for s, entry in sorted(entries.items()) if s >= skip]
    return combine_steps(kept, world_size, spec.batch, peak_activation_bytes=peak)


def _memory(results: list[dict]) -> list[dict]:
    """Per rank, model-state bytes held (labkit.parallel.zero.memory): rank order."""
    return [r.get("memory", {}) for r in sorted(results, key=lambda r: r["rank"])]


def gather_parameters(lab) -> tuple[dict, dict, dict]:
    """The full state_dict, each key from the rank that reports it (every rank's job reports
    the keys it owns, its full_state_dict, so nothing here assumes which ranks hold which
    parameters); which rank that is, per key; and every other rank's copy of a key where it is
    not bitwise the reported one ({rank: {key: tensor}}), for ``run.max_diff``.

    Every rank hashes its own copy (each dp replica, each stage; ZeRO shards and tp pieces
    gathered as for the report), so an agreeing replica costs a digest, not a copy; only when a
    digest differs are the copies fetched (a second gather)."""
    parts = sorted(lab.apply(engine.parameter_copy), key=lambda p: p["rank"])
    merged, holders, digests = {}, {}, {}
    for part in parts:
        if part["owner"]:
            for key, tensor in part["state"].items():
                merged[key], holders[key] = tensor, part["rank"]
                digests.setdefault(key, part["digests"][key])
    differ = {p["rank"] for p in parts for k, d in p["digests"].items() if digests.get(k, d) != d}
    copies: dict = {}
    if differ:
        for part in lab.apply(engine.parameter_copy, True):
            if part["rank"] in differ:
                copies[part["rank"]] = {k: part["state"][k] for k, d in part["digests"].items()
                                        if digests.get(k, d) != d}
    return merged, holders, copies
