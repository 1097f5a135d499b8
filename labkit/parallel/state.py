"""Training state on disk, engine side: save a job's parameters and optimizer state with torch's
distributed checkpoint (DCP), and restore them into a job built under any other strategy.

What is written is layout-free: every tensor whole, under the model's own ``state_dict`` name
(``{"model": {name: tensor}, "optim": {name: {"exp_avg": …, "exp_avg_sq": …}}}``), so the
folder is torch's own (``dcp_to_torch_save`` gives a plain state dict) and any strategy can
read it. Each parameter's entries are written by one rank, its owner (the parameters dealt
out by size, :func:`labkit.parallel.saving.owners`), so every rank writes about 1/world of
the bytes into its own ``__{rank}_0.distcp``. Sharded saves (DTensor pieces resharded by
DCP's loader) would skip the gathers, but labkit's ZeRO shards are flat ranges across several
parameters, which no DTensor placement describes; whole tensors cost one reduce per owner
and state and give one rule for every layout.

The one rule is an index map. Number every element of the whole model's trainable
parameters (in ``named_parameters`` order, a tied weight once); each tensor a rank holds,
the model's own (a Megatron chunk, a DTensor's local shard) or an optimizer's (a ZeRO flat
shard, padded), is then a tensor of those numbers (−1 for padding), built by the same cuts
the strategy made. Saving scatters each local state into a vector of one owner's elements
and takes the element-wise maximum over ranks at that owner (replicas hold equal values,
absent elements −inf, so the result is exact); restoring reads the whole entries of the
parameters a rank holds part of (:meth:`Layout.restricted`: a pipeline stage its own blocks)
and ``vector[index]`` into each local tensor. Optimizer state
is elementwise and shaped like the tensor it steps (SGD's momentum, AdamW's moments), so
the same map serves parameters and state.

    >>> saving.save("ckpt/.step_000004.tmp", step=4, layout=layout)   # every rank (lab.apply)
    >>> restore("ckpt/step_000004", step=4, layout=layout)            # every rank, after setup_run
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def state_keys(optimizer: str, momentum: float) -> tuple:
    """The per-parameter optimizer tensors a run keeps: AdamW's two moments, SGD's momentum
    buffer (none for plain SGD)."""
    if optimizer == "sgd" and not momentum:
        return ()
    return STATE_KEYS[optimizer]


class Layout:
    """The whole model's parameters, numbered: ``names`` (a tied weight once),
    ``shapes``, ``dtypes``, ``offsets`` into one vector, and ``alias`` (a tied weight's other
    names → the first). ``dtype``: the vector's, float32 unless a parameter is float64 (it holds
    bf16, fp16 and float32 values exactly, so each entry is saved in its parameter's dtype)."""

    def __init__(self, names: list, shapes: list, alias: dict, dtypes: list | None = None):
        self.names, self.shapes, self.alias = list(names), [tuple(s) for s in shapes], dict(alias)
        self.dtypes = [_dtype(d) for d in dtypes] if dtypes else [torch.float32] * len(self.names)
        self.dtype = torch.float64 if torch.float64 in self.dtypes else torch.float32
        self.offsets, total = {}, 0
        for name, shape in zip(self.names, self.shapes):
            self.offsets[name] = total
            total += _numel(shape)
        self.total = total

    @classmethod
    def of(cls, model: nn.Module) -> "Layout":
        """From the whole model (built on ``meta`` is enough: only names and shapes are read)."""
        first, names, shapes, alias, dtypes = {}, [], [], {}, []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                alias[name] = first[id(p)]
                continue
            first[id(p)] = name
            names.append(name)
            shapes.append(tuple(p.shape))
            dtypes.append(p.dtype)
        return cls(names, shapes, alias, dtypes)

    def to_dict(self) -> dict:
        return {"names": self.names, "shapes": [list(s) for s in self.shapes], "alias": self.alias,
                "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes]}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(d["names"], d["shapes"], d["alias"], d.get("dtypes"))

    def dtype_of(self, name: str) -> torch.dtype:
        return self.dtypes[self.names.index(name)]

    def restricted(self, names) -> "Layout":
        """The same parameters numbered again, only ``names`` (in this layout's order): what
        one rank holds, so a resume reads no more than that."""
        keep = [i for i, n in enumerate(self.names) if n in names]
        return Layout([self.names[i] for i in keep], [self.shapes[i] for i in keep], {},
                      [self.dtypes[i] for i in keep])

    def renumber(self, ids: torch.Tensor, whole: "Layout") -> torch.Tensor:
        """``ids`` numbered in ``whole`` → numbered here (−1 stays −1); every id is of a name kept."""
        ends = torch.tensor([whole.offsets[n] + _numel(sh) for n, sh in zip(whole.names, whole.shapes)])
        shift = torch.tensor([self.offsets.get(n, 0) - whole.offsets[n] for n in whole.names], dtype=torch.long)
        out, kept = ids.clone(), ids >= 0
        out[kept] = ids[kept] + shift[torch.searchsorted(ends, ids[kept], right=True)]
        return out

    def ids(self, name: str) -> torch.Tensor | None:
        """The numbers of parameter ``name``'s elements, shaped like it (None: not a parameter)."""
        name = self.alias.get(name, name)
        if name not in self.offsets:
            return None
        start = self.offsets[name]
        shape = self.shapes[self.names.index(name)]
        return torch.arange(start, start + _numel(shape)).view(shape)

    def split(self, vector: torch.Tensor) -> dict:
        """A whole vector back into ``{name: tensor}``, each in its parameter's shape."""
        return {n: vector[self.offsets[n]:self.offsets[n] + _numel(s)].view(s).clone()
                for n, s in zip(self.names, self.shapes)}


def _dtype(d) -> torch.dtype:
    return d if isinstance(d, torch.dtype) else getattr(torch, d)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# -- the index map: what each local tensor is, in the whole model's numbering ---------------------
def parameter_ids(model: nn.Module, layout: Layout, tp_index: int, tp_size: int) -> dict:
    """``id(parameter)`` → (its numbers, shaped like the local tensor; its whole name) for every
    parameter of this rank's ``model``, cut as the strategy cut it: a Megatron layer's
    chunk along its ``shard_dims`` (labkit.parallel.tensor.layers), then a DTensor's local
    shard (DTensor tp, FSDP2) from its mesh and placements."""
    out = {}
    for prefix, module in model.named_modules():
        dims = getattr(module, "shard_dims", None) or {}
        experts = _expert_slice(module)
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            ids = layout.ids(key)
            if ids is None or id(p) in out:
                continue
            if name in dims:
                ids = ids.chunk(tp_size, dim=dims[name])[tp_index]
            if experts is not None:
                ids = ids.chunk(experts[1], dim=0)[experts[0]]
            ids = _dtensor_local(p, ids)
            out[id(p)] = (ids, layout.alias.get(key, key))
    return out


def _expert_slice(module) -> tuple | None:
    """(this rank's index in its ep group, ep) for a transformers sparse block's fused experts
    under expert parallelism (labkit.parallel.expert.dispatch: each parameter keeps its name
    and this rank's 1/ep of its rows); None for any other module. labkit's own MoE needs
    nothing: its experts keep their global names (``experts.5.…``), whole."""
    from .expert.dispatch import ExpertParallelExperts
    if not isinstance(module, ExpertParallelExperts):
        return None
    return dist.get_group_rank(module.ep_group, dist.get_rank()), module.ep


def _dtensor_local(p, ids: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece of ``ids`` (``ids`` shaped as the DTensor's global shape)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return ids
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return ids[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def optimizer_ids(job, layout: Layout) -> list:
    """(tensor the optimizer steps, its numbers as a flat vector with −1 for padding, the whole
    names it touches) for every tensor of this rank's optimizer: labkit's ZeRO flat shards
    (labkit.parallel.zero.shard: members end to end, padded, this rank's slice), or the
    parameters themselves."""
    s = job.spec.strategy
    pids = parameter_ids(job.model, layout, job.tp_index, s.tp)
    opt = job.optimizer
    if opt is None:
        return []
    units = getattr(opt, "units", None)
    if units is not None:
        out = []
        for unit in units:
            parts = [pids[id(p)] for _, p in unit.members]
            flat = torch.cat([ids.reshape(-1) for ids, _ in parts] +
                             [torch.full((unit.padded - unit.numel,), -1, dtype=torch.long)])
            lo = unit.rank * unit.shard_numel
            out += _shard_pieces(unit, flat[lo:lo + unit.shard_numel], getattr(opt, "pieces", None) or [], pids)
        return out
    return [(p, pids[id(p)][0].reshape(-1), [pids[id(p)][1]])
            for group in opt.param_groups for p in group["params"]]


def _shard_pieces(unit, ids: torch.Tensor, pieces: list, pids: dict) -> list:
    """The tensors the optimizer steps for one ZeRO shard: the pieces it is cut into where its
    members meet (labkit.parallel.zero.shard.FlatUnit.pieces: each steps one member's part, so
    a member with no gradient is skipped), each with its numbers; the padding's piece has none
    to save. The shard itself where the optimizer steps it whole."""
    storage = unit.shard.data.untyped_storage().data_ptr()
    base = unit.shard.data.storage_offset()
    mine = [(m, q) for m, q in pieces if q.data.untyped_storage().data_ptr() == storage]
    if not mine:
        names = sorted({pids[id(p)][1] for _, p in unit.members})
        return [(unit.shard, ids, names)]
    out = []
    for member, piece in mine:
        offset = piece.data.storage_offset() - base
        if member is not None:
            out.append((piece, ids[offset:offset + piece.numel()], [pids[id(member)][1]]))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (written in place on restore), else the tensor."""
    return getattr(t, "_local_tensor", t)


# -- save: what a rank holds (the gather and the writing are labkit.parallel.saving) ---------------
def _state_of(job, p, key: str):
    """``p``'s optimizer state ``key``; zeros (step 0) where it has none yet (no step taken, every
    step skipped, never reached): torch's optimizers start from exactly those."""
    state = job.optimizer.state.get(p, {}).get(key)
    if state is not None:
        return state
    return torch.tensor(0.0) if key == "step" else torch.zeros_like(_local(p))


def scaler_state(job) -> dict:
    """fp16's loss scaler, the same on every rank (they agree on each overflow): its scale and
    the clean steps since it last changed, so a resumed run scales, skips and grows as the run
    it continues would have. ``{}`` without one."""
    scaler = job.precision.scaler
    if scaler is None:
        return {}
    saved = scaler.state_dict()
    return {"scale": torch.tensor(float(saved["scale"])), "growth_tracker": torch.tensor(int(saved["_growth_tracker"]))}


def _restore_scaler(job, loaded: dict) -> None:
    scaler = job.precision.scaler
    if scaler is None or not loaded:
        return
    state = scaler.state_dict()
    state.update(scale=float(loaded["scale"]), _growth_tracker=int(loaded["growth_tracker"]))
    scaler.load_state_dict(state)


# -- restore ------------------------------------------------------------------------------------
def read(path: str, want: dict) -> dict:
    """``want`` (a nested dict of tensors to fill, by DCP key) read from ``path`` in this process
    alone (``no_dist``: no collective, each rank reads what it needs)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(want, checkpoint_id=path, no_dist=True)
    return want


def restore(path: str, step: int, layout: dict) -> dict:
    """Load the checkpoint at ``path`` into this rank's freshly built job, whatever strategy
    built it, and start its data at ``step`` (every rank calls it after ``setup_run``)."""
    from .. import engine

    s = engine.session()
    job, lay = s.job, Layout.from_dict(layout)
    t0 = time.perf_counter()
    keys = state_keys(job.spec.optimizer, job.spec.momentum)
    pairs = optimizer_ids(job, lay)
    touched = sorted({n for _, _, names in pairs for n in names})
    pids = parameter_ids(job.model, lay, job.tp_index, job.spec.strategy.tp)
    local = [p for p in {id(p): p for p in job.model.parameters()}.values()     # ZeRO-3 at rest: in its shards
             if id(p) in pids and _local(p).untyped_storage().size()]
    mine = lay.restricted(set(touched) | {pids[id(p)][1] for p in local})     # read no more than this rank holds
    pairs = [(p, mine.renumber(ids, lay), names) for p, ids, names in pairs]
    local = {id(p): (p, mine.renumber(pids[id(p)][0], lay)) for p in local}
    lay = mine
    saved = _saved_entries(path)
    want = {"model": {n: saved[f"model.{n}"]() for n in lay.names}}
    want["model"].update({k: saved[f"model.{k}"]() for k in _buffers(job.model)})
    if keys and touched:
        counted = [k for k in keys + ("step",) if f"optim.{touched[0]}.{k}" in saved]
        want["optim"] = {n: {k: saved[f"optim.{n}.{k}"]() for k in counted} for n in touched}
    if job.precision.scaler is not None and "scaler.scale" in saved:
        want["scaler"] = {k: saved[f"scaler.{k}"]() for k in ("scale", "growth_tracker")}
    loaded = read(path, want)
    with torch.no_grad():
        _restore_model(job, _vector(lay, {n: loaded["model"][n] for n in lay.names}), local, pairs,
                       loaded["model"])
        for k in keys if touched else ():
            _restore_state(job, k, _vector(lay, {n: d[k] for n, d in loaded["optim"].items()}), pairs)
        if job.spec.optimizer == "adamw":
            _restore_steps(job, pairs, loaded.get("optim", {}), step)
        _restore_scaler(job, loaded.get("scaler"))
    job.data = FromStep(job.data, step)
    read_bytes = sum(t.numel() * t.element_size() for t in _tensors(want))
    return {"rank": s.rank, "read_s": time.perf_counter() - t0, "read_bytes": read_bytes}


def _tensors(tree: dict):
    for v in tree.values():
        yield from _tensors(v) if isinstance(v, dict) else [v]


def _saved_entries(path: str) -> dict:
    """``{DCP key: a function making an empty tensor of its saved shape and dtype}``."""
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(path).read_metadata()
    return {k: (lambda m=m: torch.empty(tuple(m.size), dtype=m.properties.dtype))
            for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}


def _restore_steps(job, pairs: list, loaded: dict, step: int) -> None:
    """AdamW's step count per tensor, as saved (the most of the names a ZeRO shard steps
    together); ``step`` for a checkpoint that holds none."""
    from torch.optim.optimizer import _get_scalar_dtype
    for p, _, names in pairs:
        taken = max((float(loaded[n]["step"]) for n in names if "step" in loaded.get(n, {})), default=float(step))
        job.optimizer.state[p]["step"] = torch.tensor(taken, dtype=_get_scalar_dtype())


def _buffers(model: nn.Module) -> dict:
    """The buffers ``state_dict`` holds (persistent ones), by name."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if k not in params}


def _vector(layout: Layout, tensors: dict) -> torch.Tensor:
    """One whole vector in the layout's numbering from ``{name: tensor}`` (NaN where absent)."""
    vector = torch.full((layout.total,), float("nan"), dtype=layout.dtype)
    for name, t in tensors.items():
        start = layout.offsets[name]
        vector[start:start + t.numel()] = t.reshape(-1).to(layout.dtype)
    return vector


def _restore_model(job, params: torch.Tensor, local: dict, pairs: list, loaded: dict) -> None:
    """Each local parameter (``local``: id → (parameter, its numbers)) from the vector; ZeRO's
    shards too (a parameter whose flat buffer ZeRO-3 freed is left to the next gather, from
    those shards)."""
    for p, ids in local.values():
        _local(p).copy_(params[ids].view(_local(p).shape).to(_local(p).dtype))
    if getattr(job.optimizer, "units", None) is not None:
        for p, ids, _ in pairs:
            _fill(_local(p), params, ids)
    for name, b in job.model.named_buffers():
        if name in loaded:
            b.copy_(loaded[name])


def _fill(target: torch.Tensor, vector: torch.Tensor, ids: torch.Tensor) -> None:
    """``target`` ← ``vector[ids]``, zeros where ``ids`` is −1 (ZeRO's padding)."""
    flat = torch.zeros(ids.numel(), dtype=vector.dtype)
    kept = ids >= 0
    flat[kept] = vector[ids[kept]]
    target.copy_(flat.view(target.shape).to(target.dtype))


def _restore_state(job, key: str, vector: torch.Tensor, pairs: list) -> None:
    """torch's own per-tensor state, as its step makes it, filled from ``vector``: AdamW's
    moments, SGD's momentum buffer; a DTensor parameter's state is a DTensor on its mesh and
    placements (its step count is set by :func:`restore`)."""
    for p, ids, _ in pairs:
        local = torch.empty_like(_local(p))
        _fill(local, vector, ids)
        job.optimizer.state.setdefault(p, {})[key] = _as_like(p, local)


def _as_like(p, local: torch.Tensor):
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


class FromStep:
    """``data(first + step)``: a resumed run's step 0 reads the batch the run it continues
    would have read next (its other attributes are the data's own)."""

    def __init__(self, data, first: int):
        self.data, self.first = data, first

    def __call__(self, step: int):
        return self.data(self.first + step)

    def __getattr__(self, name):
        return getattr(self.__dict__["data"], name)


# -- where a whole tensor lives now (the course's picture of resharding) --------------------------
def pieces(name: str, layout: dict) -> dict:
    """Which elements of parameter ``name`` (numbered in the whole tensor, row-major) this rank's
    optimizer steps, i.e. what its part of a checkpoint's ``name`` comes from: ``count``, the
    ``rows`` and ``cols`` they fall in (a 2-D weight), and the ``first`` and ``last`` element."""
    from .. import engine

    s = engine.session()
    lay = Layout.from_dict(layout)
    name = lay.alias.get(name, name)
    if name not in lay.offsets:
        raise KeyError(f"{name!r} is not a parameter of this model; one of {lay.names[:4]}…")
    start, shape = lay.offsets[name], lay.shapes[lay.names.index(name)]
    held = torch.cat([ids[(ids >= start) & (ids < start + _numel(shape))] for _, ids, _ in optimizer_ids(s.job, lay)]
                     or [torch.empty(0, dtype=torch.long)]).unique() - start
    out = {"rank": s.rank, "count": int(held.numel()), "of": _numel(shape), "shape": list(shape)}
    if held.numel():
        out["first"], out["last"] = int(held.min()), int(held.max())
        if len(shape) == 2:
            rows, cols = (held // shape[1]).unique(), (held % shape[1]).unique()
            out["rows"] = [int(rows.min()), int(rows.max())]
            out["cols"] = [int(cols.min()), int(cols.max())]
    return out
