"""Writing a checkpoint, engine side: the state gathered (:mod:`.state`), written with torch's
distributed checkpoint now or by DCP's ``async_save`` thread behind the next steps, and the
spans of it each rank's timeline draws.

A save is work the training loop pays for, or hides. Three ``checkpoint`` spans say which, on
the rank's own step clock (labkit.analysis.events, stream ``io``: neither compute nor comm):

* ``checkpoint save`` / ``checkpoint staging``: after step k, the gathers and the write (or,
  asynchronous, the gathers and the hand-off, which stages a copy of the state for the
  thread); on step k's clock after its last span, so the step's length includes it;
* ``checkpoint writing``: the thread's span, once per later step it overlapped, on that
  step's clock (the notebook clips it to the step: what the step hid);
* ``checkpoint wait``: the time the loop waited for the thread at the step boundary where
  the save completes (what the steps did not hide), after that step's last span.

    >>> save("ckpt/.step_000004.tmp", step=4, layout=layout, asynchronous=True)   # every rank
    >>> save_done("ckpt/.step_000004.tmp"); finish_save("ckpt/.step_000004.tmp")
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist

import torch

from .state import Layout, _buffers, _local, _state_of, optimizer_ids, parameter_ids, scaler_state, state_keys


def save(path: str, step: int, layout: dict, asynchronous: bool = False) -> dict:
    """Write this run's state at ``step`` into ``path`` (every rank calls it: collectives).

    Parameters and buffers come from the job's ``full_state_dict`` (the gathers every strategy
    already has for ``run.parameters()``); each optimizer state is scattered into a whole
    vector and maximised over the world (:mod:`.state`). Returns this rank's seconds, the
    bytes of what it offered, the bytes of the file it wrote and its ``spans``.

    ``asynchronous``: the gathers stay in the step loop (they are collectives on the training
    groups), the writing goes to DCP's ``async_save`` thread, whose own collectives use a
    group of their own (:func:`_writer_group`), so they never interleave with a step's;
    :func:`finish_save` waits for it."""
    from .. import engine
    import torch.distributed.checkpoint as dcp

    s = engine.session()
    job, lay, clock = s.job, Layout.from_dict(layout), s.recorder
    t0 = time.perf_counter()
    model_state, optim_state = gather_owned(job, lay, s.rank, dist.get_world_size())
    t1 = time.perf_counter()
    state = {"model": model_state, "optim": optim_state}
    scaler = scaler_state(job)
    if scaler:
        state["scaler"] = scaler
    offered = sum(t.numel() * t.element_size() for t in model_state.values()) + \
        sum(t.numel() * t.element_size() for d in optim_state.values() for t in d.values())
    out = {"rank": s.rank, "gather_s": t1 - t0, "offered_bytes": offered}
    if asynchronous:
        future = dcp.async_save(state, checkpoint_id=path, process_group=_writer_group())
        ended: list = []
        future.add_done_callback(lambda _f: ended.append(time.perf_counter()))
        t2 = time.perf_counter()
        _PENDING[path] = {"future": future, "started": t2, "ended": ended, "steps": {}}
        return {**out, "handed_off_s": t2 - t1, "spans": [_span(clock, "checkpoint staging", t0, t2)]}
    dcp.save(state, checkpoint_id=path)
    t2 = time.perf_counter()
    return {**out, "write_s": t2 - t1, "file_bytes": _file_bytes(path, s.rank),
            "spans": [_span(clock, "checkpoint save", t0, t2)]}


# -- the gather: each entry to the one rank that writes it ------------------------------------------
def owners(layout: Layout, world: int) -> list[list[str]]:
    """Per rank, the parameters whose entries it writes: the largest first, each to the rank
    owning the fewest elements so far, so every rank writes about 1/world of the bytes (the
    same on every rank: it reads only the layout)."""
    load, out = [0] * world, [[] for _ in range(world)]
    for name, shape in sorted(zip(layout.names, layout.shapes), key=lambda ns: -_numel(ns[1])):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += _numel(shape)
    return [sorted(names, key=layout.names.index) for names in out]


def gather_owned(job, layout: Layout, rank: int, world: int) -> tuple[dict, dict]:
    """``({name: parameter}, {name: {key: state}})`` for the parameters this rank writes
    (:func:`owners`), whole, each in its parameter's dtype, AdamW's ``step`` beside its
    moments; buffers from every rank that holds them (DCP writes each once). Every rank
    scatters what it holds of each owner's parameters into a vector of that owner's elements
    (−inf elsewhere) and joins a reduce (max) to the owner: the replicas agree, so the result
    is exact, and no rank holds more than its own share and one owner's vector at a time."""
    pairs = optimizer_ids(job, layout)
    held = [(p, ids) for p, ids, _ in pairs]           # what the optimizer steps (ZeRO: its shards)
    pids = parameter_ids(job.model, layout, job.tp_index, job.spec.strategy.tp)
    stepped_here = {id(p) for p, _ in held}
    held += [(p, pids[id(p)][0]) for p in job.model.parameters()      # and the model's own, frozen ones too
             if id(p) in pids and id(p) not in stepped_here and _local(p).untyped_storage().size()]
    mine = owners(layout, world)
    sizes, routes = _routes(layout, mine, [ids for _, ids in held])
    model = _reduce_to_owners(layout, mine, sizes, rank, [(_local(p), r) for (p, _), r in zip(held, routes)],
                              job.device)
    stepped = _stepped(job, layout, pairs)
    optim: dict = {n: {} for n in mine[rank] if n in stepped}
    for key in state_keys(job.spec.optimizer, job.spec.momentum):
        values = [(_local(_state_of(job, p, key)), r) for (p, _, _), r in zip(pairs, routes)]    # pairs come first
        whole = _reduce_to_owners(layout, mine, sizes, rank, values, job.device)
        for name in optim:
            optim[name][key] = whole[name]
    if job.spec.optimizer == "adamw":
        for name in optim:
            optim[name]["step"] = torch.tensor(stepped[name])
    model.update({alias: model[first] for alias, first in layout.alias.items() if first in model})  # tied: both names
    model.update({k: b.detach().cpu().clone() for k, b in _buffers(job.model).items()})
    return model, optim


def _routes(layout: Layout, mine: list, held: list) -> tuple[list, list]:
    """Each owner's vector size, and per local tensor (its numbers ``ids``), per owner: which of
    its elements go there (``src``) and where in the owner's vector (``dst``). Worked out once a
    save, for the parameters and every optimizer state alike."""
    index = {n: i for i, n in enumerate(layout.names)}
    ends = torch.tensor([layout.offsets[n] + _numel(sh) for n, sh in zip(layout.names, layout.shapes)])
    owner_of = torch.zeros(len(layout.names), dtype=torch.long)
    shift = torch.zeros(len(layout.names), dtype=torch.long)      # whole-model number → place in its owner's vector
    sizes = []
    for owner, names in enumerate(mine):
        at = 0
        for n in names:
            owner_of[index[n]], shift[index[n]] = owner, at - layout.offsets[n]
            at += _numel(layout.shapes[index[n]])
        sizes.append(at)
    routes = []
    for ids in held:
        flat = ids.reshape(-1)
        src = (flat >= 0).nonzero().squeeze(1)
        name_of = torch.searchsorted(ends, flat[src], right=True)
        owner = owner_of[name_of]
        order = owner.argsort(stable=True)
        src, dst = src[order], (flat[src] + shift[name_of])[order]
        cut = torch.bincount(owner, minlength=len(mine)).tolist()
        routes.append(list(zip(src.split(cut), dst.split(cut))))
    return sizes, routes


def _reduce_to_owners(layout: Layout, mine: list, sizes: list, rank: int, values: list, device) -> dict:
    """``{name: whole tensor}`` of this rank's names: per owner, every rank puts its values where
    :func:`_routes` says in a vector of −inf and joins a reduce (max) to the owner, on the job's
    device (NCCL reduces only what is on a GPU)."""
    out = {}
    for owner, names in enumerate(mine):
        if not names:
            continue
        vector = torch.full((sizes[owner],), float("-inf"), dtype=layout.dtype)
        for t, route in values:
            src, dst = route[owner]
            vector[dst] = t.detach().reshape(-1)[src.to(t.device)].cpu().to(layout.dtype)
        vector = vector.to(device)
        dist.reduce(vector, dst=owner, op=dist.ReduceOp.MAX)
        vector = vector.cpu()
        if owner == rank:
            at = 0
            for n in names:
                shape = layout.shapes[layout.names.index(n)]
                whole = vector[at:at + _numel(shape)]
                at += _numel(shape)
                if torch.isinf(whole).any():
                    raise RuntimeError(f"checkpoint: no rank holds all of parameter {n!r} (or its optimizer state)")
                out[n] = whole.view(shape).to(layout.dtype_of(n)).clone()
    return out


def _stepped(job, layout: Layout, pairs: list) -> dict:
    """``{name: AdamW's step count (0 for SGD)}`` of the parameters some rank's optimizer steps:
    one all-reduce (max) of a number per parameter."""
    steps = torch.full((len(layout.names),), float("-inf"), dtype=torch.float64)
    for p, _, names in pairs:
        taken = float(_state_of(job, p, "step")) if job.spec.optimizer == "adamw" else 0.0
        for name in names:
            steps[layout.names.index(name)] = taken
    steps = steps.to(job.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    steps = steps.cpu()
    return {n: float(v) for n, v in zip(layout.names, steps.tolist()) if v != float("-inf")}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _span(clock, name: str, start: float, end: float, step: int | None = None, origin: float | None = None) -> dict:
    """A span between two host times on a step's clock (the recorder's current step unless given)."""
    from .. import engine
    origin = clock.origin if origin is None else origin
    return {"step": clock.step if step is None else step, "name": name, "start": start - origin, "end": end - origin,
            "clock": {"host": engine.session().host, "origin_s": origin}}


_PENDING: dict = {}          # path → the async save: its future, hand-off, [end], {later step: its origin}
_WRITER: list = []           # [(the default group it was made in, the writer's group)]


def _writer_group():
    """A gloo group over the world for the async writer's collectives, made once per world group
    (every rank makes it in the same call, as ``new_group`` needs)."""
    world = dist.distributed_c10d._get_default_group()
    if not _WRITER or _WRITER[0][0] is not world:
        _WRITER[:] = [(world, dist.new_group(backend="gloo"))]
    return _WRITER[0][1]


def _file_bytes(path: str, rank: int) -> int:
    mine = os.path.join(path, f"__{rank}_0.distcp")
    return os.path.getsize(mine) if os.path.exists(mine) else 0


def _seen_step(entry: dict) -> None:
    """Note the step just run (its clock) while the thread writes: it draws there."""
    from .. import engine
    clock = engine.session().recorder
    entry["steps"].setdefault(clock.step, clock.origin)


def save_done(path: str) -> bool:
    """Has this rank's asynchronous save into ``path`` finished (no wait)? Called after each
    step while it is in flight."""
    entry = _PENDING.get(path)
    if entry is None:
        return True
    _seen_step(entry)
    return entry["future"].done()


def finish_save(path: str) -> dict:
    """Wait for this rank's asynchronous save into ``path``; its seconds in the background
    (``write_s``, from hand-off to the end), how long this call waited for it (``waited_s``:
    what the steps in between did not hide) and the ``spans`` of both."""
    from .. import engine

    s = engine.session()
    entry = _PENDING.pop(path)
    _seen_step(entry)
    t0 = time.perf_counter()
    entry["future"].result()
    t1 = time.perf_counter()
    end = entry["ended"][0] if entry["ended"] else t1
    started = entry["started"]
    spans = [_span(s.recorder, "checkpoint writing", started, end, step, origin)
             for step, origin in entry["steps"].items() if end > origin]
    if t1 - t0 > 0:
        spans.append(_span(s.recorder, "checkpoint wait", t0, t1))
    return {"rank": s.rank, "write_s": end - started, "waited_s": t1 - t0, "file_bytes": _file_bytes(path, s.rank),
            "spans": spans}
