"""Checkpoints in torch's format, notebook side: where a run saves, what a folder holds, and
every check a resume needs before an engine trains.

A run with ``checkpoint="ckpt/", checkpoint_every=K`` writes ``ckpt/step_000004/`` (and so on,
every K steps and at the end), each a folder of torch's distributed checkpoint: ``.metadata``,
one ``__{rank}_0.distcp`` per rank, and ``labkit.json`` (the step, the strategy it was saved
under, the optimizer). Each save is written under a temporary name (``.step_000004.tmp-…``)
and renamed once every rank has written and the metadata is complete, so a save that fails
leaves the checkpoints before it untouched, and a folder under its final name is always
whole. ``checkpoint_async=True`` writes behind the next steps and completes the save at a
later step boundary; either way each rank's timeline gets the save's ``checkpoint`` spans
(:func:`spans`). A run under ``Strategy(precision=...)`` saves its fp32 master weights, and
fp16's loss scaler beside them (``scaler.scale``, ``scaler.growth_tracker``). The engines'
side is :mod:`labkit.parallel.state` (what each rank holds, how any strategy reads it back)
and :mod:`labkit.parallel.saving` (the gather to each entry's owner, and the writing).

    >>> run = lab.run(labkit.Strategy(dp=4, zero=1), model, steps=3, checkpoint="ckpt/", checkpoint_every=3)
    >>> run2 = lab.run(labkit.Strategy(dp=2, pp=2), model, steps=3, resume="ckpt/")   # steps 3..5
    >>> labkit.checkpoint.describe("ckpt/")        # the last complete one: step 6, tensors, shards
    >>> state = labkit.checkpoint.load("ckpt/")    # a plain state dict, the model's own names

The files need no labkit: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir,
"out.pt")`` gives ``{"model": state_dict, "optim": {...}}``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

import torch

from .parallel import saving as engine_saving, state as engine_state

FORMAT = "labkit-checkpoint/1"
INFO = "labkit.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def complete(root: str) -> list[str]:
    """The complete checkpoints under ``root`` (folders ``step_N`` with their metadata), by step;
    a temporary folder a failed save left is not one."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and _is_checkpoint(path):
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, INFO))


def find(path) -> str:
    """The checkpoint ``path`` names: the folder itself, or the last complete ``step_N`` in it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint is a folder path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist; give the folder a run saved into "
                                "(lab.run(..., checkpoint=DIR)) or one of its step_N folders")
    if _is_checkpoint(path):
        return path
    found = complete(path)
    if not found:
        left = sorted(n for n in os.listdir(path) if n.startswith(".step_")) if os.path.isdir(path) else []
        why = f" (only unfinished saves: {', '.join(left)})" if left else ""
        raise ValueError(f"{path!r} is not a checkpoint: it holds no .metadata and {INFO}, nor a complete "
                         f"step_N folder{why}; give the folder lab.run(..., checkpoint=DIR) saved into")
    return found[-1]


def info(path) -> dict:
    """``labkit.json`` of the checkpoint ``path`` names: step, strategy, optimizer, layout."""
    folder = find(path)
    with open(os.path.join(folder, INFO)) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{folder!r}: {INFO} says format {data.get('format')!r}, not {FORMAT!r}; it was not "
                         "written by this labkit")
    return data


def metadata(folder: str):
    """DCP's ``.metadata`` of a checkpoint folder (which tensor, which file, which bytes)."""
    import torch.distributed.checkpoint as dcp
    return dcp.FileSystemReader(folder).read_metadata()


def check_files(folder: str) -> None:
    """Every shard file the metadata names exists and is long enough: a file cut short (a disk
    that filled, a copy that stopped) is named before anything reads it."""
    need: dict = {}
    for item in metadata(folder).storage_data.values():
        need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(need.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {folder!r}: shard file {path!r} is missing; the checkpoint is incomplete, "
                             f"resume from an earlier one ({_others(folder)})")
        have = os.path.getsize(path)
        if have < size:
            raise ValueError(f"checkpoint {folder!r}: shard file {path!r} is truncated ({have} bytes, the metadata "
                             f"needs {size}); resume from an earlier checkpoint ({_others(folder)})")


def _others(folder: str) -> str:
    root = os.path.dirname(os.path.abspath(folder))
    others = [os.path.basename(p) for p in complete(root) if os.path.abspath(p) != os.path.abspath(folder)]
    return "others in the folder: " + ", ".join(others) if others else "there is no other in its folder"


def model_entries(folder: str) -> dict:
    """``{name: shape}`` of the model entries a checkpoint holds (parameters and buffers)."""
    out = {}
    for key, meta in metadata(folder).state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            out[key[len("model."):]] = tuple(meta.size)
    return out


def check_model(folder: str, built: torch.nn.Module) -> None:
    """The model to resume is the one saved: the same state_dict names and shapes."""
    saved, have = model_entries(folder), {k: tuple(v.shape) for k, v in built.state_dict().items()}
    fix = "resume with the model the checkpoint was saved from, or start without resume="
    missing = [k for k in have if k not in saved]
    if missing:
        raise ValueError(f"checkpoint {folder!r} has no parameter {missing[0]!r} of this model"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: it was saved from "
                         f"another model; {fix}")
    extra = [k for k in saved if k not in have]
    if extra:
        raise ValueError(f"checkpoint {folder!r} holds parameter {extra[0]!r}, which this model lacks"
                         f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: it was saved from "
                         f"another model; {fix}")
    for k, shape in have.items():
        if saved[k] != shape:
            raise ValueError(f"checkpoint {folder!r}: parameter {k!r} has shape {list(saved[k])} there and "
                             f"{list(shape)} in this model (another width?); {fix}")


def check_optimizer(folder: str, saved: dict, optimizer: str, momentum: float) -> None:
    """The optimizer resumed is the one whose state was saved (its kind and SGD's momentum)."""
    if saved["optimizer"] != optimizer or bool(saved["momentum"]) != bool(momentum):
        was = f"optimizer={saved['optimizer']!r}" + (f", momentum={saved['momentum']}" if saved["momentum"] else "")
        now = f"optimizer={optimizer!r}" + (f", momentum={momentum}" if momentum else "")
        raise ValueError(f"checkpoint {folder!r} holds the state of {was}, and this run asks for {now}; resume "
                         f"with {was} (its state is what the checkpoint holds), or start without resume=")


# -- what a run asks for, checked in the notebook (labkit.run.runner.validate) -------------------
@dataclass
class Plan:
    """A run's checkpointing: where it saves, how often, and where it resumes from."""

    layout: dict
    root: str | None = None
    every: int | None = None
    resume: str | None = None           # the complete checkpoint folder it starts from
    first: int = 0                      # its step: the resumed run's step 0 is this global step
    asynchronous: bool = False          # written behind the next steps (DCP's async_save)
    pending: tuple | None = None        # the asynchronous save in flight: (folder, step, ranks' costs)

    def due(self, step: int, steps: int, stopping: bool = False) -> bool:
        """Save after run step ``step``? Every ``every`` global steps, and at the end."""
        if self.root is None:
            return False
        return (self.first + step + 1) % self.every == 0 or step == steps - 1 or stopping


def prepare(spec, built) -> Plan | None:
    """Check ``checkpoint=``, ``checkpoint_every=`` and ``resume=`` against the run and the
    model (built for the checks, on ``meta``); the plan, or None when the run asks for none."""
    extra = spec.extra
    root, every, resume = extra.get("checkpoint"), extra.get("checkpoint_every"), extra.get("resume")
    asynchronous = extra.get("checkpoint_async", False)
    if not isinstance(asynchronous, bool):
        raise TypeError(f"checkpoint_async={asynchronous!r} must be True or False")
    if asynchronous and root is None:
        raise ValueError("checkpoint_async=True without checkpoint=; name the folder, e.g. checkpoint='ckpt/'")
    if root is None and resume is None:
        if every is not None:
            raise ValueError(f"checkpoint_every={every!r} without checkpoint=; name the folder, e.g. "
                             "checkpoint='ckpt/'")
        return None
    _check_supported(spec, built)
    plan = Plan(engine_state.Layout.of(built).to_dict())
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"checkpoint={root!r} must be a folder path, e.g. checkpoint='ckpt/'")
        root = os.fspath(root)
        if os.path.exists(root) and not os.path.isdir(root):
            raise ValueError(f"checkpoint={root!r} is a file; name a folder (it is created if missing)")
        if every is None:
            every = spec.steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every={every!r} must be a whole number of steps ≥ 1")
        plan.root, plan.every, plan.asynchronous = root, every, asynchronous
    if resume is not None:
        folder = find(resume)
        saved = info(folder)
        check_files(folder)
        check_model(folder, built)
        check_optimizer(folder, saved, spec.optimizer, spec.momentum)
        plan.resume, plan.first = folder, int(saved["step"])
    return plan


def _check_supported(spec, built) -> None:
    """What a checkpoint does not carry, refused by name: a parameter that is not real floating
    point (the index map gathers values in a float32 or float64 vector). Every floating dtype is
    saved as it is, not refused and not converted: bf16 and fp16 values are held exactly in the
    float32 vector, float64 in a float64 one, so a model kept in bf16 resumes bit for bit, its
    file half the bytes, and a loader gets the dtype the model trained in."""
    odd = next(((n, p.dtype) for n, p in built.named_parameters()
                if not p.is_floating_point() or p.is_complex()), None)
    if odd is not None:
        raise ValueError(f"checkpoint/resume: parameter {odd[0]!r} is {odd[1]}, and a checkpoint gathers real "
                         "floating point values; keep it as a buffer (register_buffer) instead of a "
                         "parameter, or train without checkpoint= and resume=")


# -- a save, driven from the notebook -------------------------------------------------------------
def after_step(lab, spec, plan: Plan, step: int, stopping: bool, run_id: str, io: dict, timeline) -> tuple:
    """After run step ``step``: complete an asynchronous save that has finished, save when one is
    due (waiting first for one still being written); the checkpoints completed, by path, and
    the ``checkpoint`` spans to add to ``timeline`` (:func:`spans`)."""
    done, drawn = [], []
    if plan.pending is not None and (plan.due(step, spec.steps, stopping) or
                                     all(lab.apply(engine_saving.save_done, plan.pending[0]))):
        path, ranks = finish(lab, spec, plan, io)
        done.append(path)
        drawn += spans(ranks, timeline)
    if plan.due(step, spec.steps, stopping):
        path, ranks = save(lab, spec, plan, plan.first + step + 1, run_id, io)
        done += [path] if path is not None else []
        drawn += spans(ranks, timeline)
    return done, drawn


def spans(ranks: list[dict], timeline) -> list[dict]:
    """Each rank's ``checkpoint`` spans (labkit.parallel.saving) as timeline events, on its host's
    clock as the step's own (labkit.analysis.clocks); the writing thread's cut to the steps it
    ran under (what they hid), the rest after their step's spans."""
    from .analysis.clocks import offsets
    from .analysis.events import make_event
    work = timeline.table.select(timeline.table["kind"] != "checkpoint")    # the steps' own spans
    length = type(timeline)(work, timeline.world_size).step_durations()
    clocks: dict = {}
    for r in ranks:
        for span in r.get("spans", []):
            clocks.setdefault(span["step"], {})[r["rank"]] = span["clock"]
    shift = {step: offsets(c) for step, c in clocks.items()}
    out = []
    for r in ranks:
        for span in r.pop("spans", []):
            d = shift[span["step"]][r["rank"]]
            start, end = span["start"] + d, span["end"] + d
            if span["name"] == "checkpoint writing":
                start, end = max(start, 0.0), min(end, length.get(span["step"], 0.0))
            if end > start:
                out.append(make_event(r["rank"], "checkpoint", span["name"], span["step"], start, end))
    return out


def finish(lab, spec, plan: Plan, io: dict) -> tuple:
    """Wait for the asynchronous save in flight on every rank, then complete it: its path, and
    each rank's answer (spans included)."""
    tmp, step, ranks = plan.pending
    plan.pending = None
    written = lab.apply(engine_saving.finish_save, tmp)
    merged = [{**a, **b, "spans": a.get("spans", []) + b.get("spans", [])} for a, b in zip(ranks, written)]
    io.setdefault("save", {})[step] = [{k: v for k, v in r.items() if k != "spans"} for r in merged]
    return complete_save(spec, plan, tmp, step, io["save"][step]), merged


def save(lab, spec, plan: Plan, step: int, run_id: str, io: dict | None = None) -> tuple:
    """Every rank writes the state after global ``step`` into a temporary folder; the metadata
    and ``labkit.json`` complete it; the rename makes it a checkpoint (an older one of the same
    step is replaced only then). Each rank's costs go to ``io["save"][step]``. Returns the path
    and each rank's answer (its spans). Asynchronous (``plan.asynchronous``): the files are
    written behind the next steps and the save is completed by :func:`finish` (path None
    here; the staging's spans now, the writing's then)."""
    os.makedirs(plan.root, exist_ok=True)
    tmp = os.path.join(plan.root, f".step_{step:06d}.tmp-{run_id}")
    ranks = lab.apply(engine_saving.save, tmp, step, plan.layout, plan.asynchronous)
    if plan.asynchronous:
        plan.pending = (tmp, step, [{k: v for k, v in r.items() if k != "spans"} for r in ranks])
        return None, ranks
    plain = [{k: v for k, v in r.items() if k != "spans"} for r in ranks]
    if io is not None:
        io.setdefault("save", {})[step] = plain
    return complete_save(spec, plan, tmp, step, plain), ranks


def complete_save(spec, plan: Plan, tmp: str, step: int, ranks: list) -> str:
    """``labkit.json`` into the written folder, then the rename that makes it a checkpoint."""
    final = step_dir(plan.root, step)
    s = spec.strategy
    data = {"format": FORMAT, "step": step, "strategy": s.label(), "strategy_fields": _fields(s),
            "optimizer": spec.optimizer, "momentum": spec.momentum, "lr": spec.lr, "batch": spec.batch,
            "seed": spec.seed, "world_size": len(ranks), "ranks": ranks, "layout": plan.layout,
            "torch": torch.__version__}
    with open(os.path.join(tmp, INFO), "w") as f:
        json.dump(data, f, indent=1)
    if os.path.exists(final):
        old = f"{tmp}.replaced"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return final


def _fields(s) -> dict:
    import dataclasses
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
            if isinstance(getattr(s, f.name), (int, float, str, bool, type(None)))}


# -- reading a checkpoint in one process --------------------------------------------------------
def load(path, optimizer: bool = False) -> dict:
    """The model's state dict (its own names, whole tensors) from a checkpoint, in this process;
    ``optimizer=True``: ``{"model": …, "optim": {name: {state: tensor}}, "step": N}`` (and
    ``"scaler"``: fp16's loss scale and clean steps, when the run had one)."""
    folder = find(path)
    check_files(folder)
    want: dict = {}
    for key, meta in metadata(folder).state_dict_metadata.items():
        if not hasattr(meta, "size"):
            continue
        if key.startswith("optim.") and not optimizer:
            continue
        want[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    engine_state.read(folder, want)
    model = {k[len("model."):]: v for k, v in want.items() if k.startswith("model.")}
    if not optimizer:
        return model
    scaler = {k[len("scaler."):]: v for k, v in want.items() if k.startswith("scaler.")}
    optim: dict = {}
    for key, v in want.items():
        if key.startswith("optim."):
            name, _, state = key[len("optim."):].rpartition(".")
            optim.setdefault(name, {})[state] = v
    out = {"model": model, "optim": optim, "step": info(folder)["step"]}
    return {**out, "scaler": scaler} if scaler else out


@dataclass
class Description:
    """What a checkpoint holds (``print`` it): step, strategy, tensors, bytes, each rank's file."""

    path: str
    step: int
    strategy: str
    optimizer: str
    tensors: int
    tensor_bytes: int
    files: dict            # {file name: bytes}
    entries_per_file: dict  # {file name: entries written there}

    def __repr__(self) -> str:
        lines = [f"checkpoint {self.path}", f"  step {self.step}, saved under {self.strategy}, "
                 f"optimizer {self.optimizer}",
                 f"  {self.tensors} tensors, {self.tensor_bytes:,} bytes of tensor data"]
        for name, size in sorted(self.files.items()):
            lines.append(f"  {name}: {size:,} bytes, {self.entries_per_file.get(name, 0)} entries")
        return "\n".join(lines)


def describe(path) -> Description:
    """Step, strategy saved under, tensors, bytes, and what each rank's file holds."""
    folder = find(path)
    saved = info(folder)
    md = metadata(folder)
    tensors = {k: m for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}
    nbytes = sum(int(torch.Size(m.size).numel()) * torch.empty(0, dtype=m.properties.dtype).element_size()
                 for m in tensors.values())
    entries: dict = {}
    for item in md.storage_data.values():
        entries[item.relative_path] = entries.get(item.relative_path, 0) + 1
    files = {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
             if n.endswith(".distcp")}
    return Description(folder, saved["step"], saved["strategy"], saved["optimizer"], len(tensors), nbytes,
                       files, entries)


def pieces(lab, model, name: str, seed: int = 0) -> list[dict]:
    """Per rank, which elements of the whole parameter ``name`` the lab's current run holds in
    the tensors its optimizer steps (a ZeRO flat shard's range, a Megatron chunk's rows or
    columns, a pipeline stage's whole tensor, nothing): the pieces a save gathers and a resume
    cuts again. Rank order; ``count`` 0 where a rank holds none of it."""
    from .run.runner import model_for_checks
    layout = engine_state.Layout.of(model_for_checks(model, seed)).to_dict()
    return lab.apply(engine_state.pieces, name, layout)


def show_pieces(found: list[dict]) -> str:
    """One line per rank for :func:`pieces`: how much of the weight, and where in it."""
    lines = []
    for p in found:
        where = "none of it"
        if p["count"]:
            where = f"elements {p['first']}–{p['last']}"
            if "rows" in p:
                where += f" ({_span('row', p['rows'])}, {_span('col', p['cols'])})"
        lines.append(f"rank {p['rank']}: {p['count']:>4} of {p['of']}  {where}")
    return "\n".join(lines)


def _span(what: str, bounds: list) -> str:
    return f"{what} {bounds[0]}" if bounds[0] == bounds[1] else f"{what}s {bounds[0]}–{bounds[1]}"
