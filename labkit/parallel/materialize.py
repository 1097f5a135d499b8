"""Build a model on the ``meta`` device, then materialise only what this rank holds, with the
very values the whole model would have had under the run's seed.

Why replay, not a per-parameter seed: a model's random initialisation draws from one RNG
stream in the order its construction calls the random ops (``nn.Linear``'s Kaiming draw,
then a factory's ``model.apply(init)`` drawing again over it). A rank that drew only its own
parameters would see another stream, and "equals one process" would stop being exact. So
the factory runs once under a dispatch mode that sends every tensor it creates to ``meta``
(no memory) and records every aten call it makes (:class:`Trace`); the record is then
replayed on real CPU tensors in the same order (:class:`Replay`), which consumes the
generator exactly as the eager build did (the tests compare every value and the generator's
state after, for labkit's models and Hugging Face ones). Every
random op is replayed, even one whose result is overwritten later (its draws move the
stream); everything else is replayed only if its result is used.

What keeps memory at "this rank's shard plus one whole parameter": each tensor storage is
allocated when its value starts to matter and freed as soon as nothing later reads it
(liveness over the record: an op that overwrites a whole storage, like ``normal_`` or
``fill_``, does not read it). A parameter's storage therefore lives from its final
initialisation to its last write, which for every ``nn.init`` function is one op; then
``keep`` takes this rank's piece (a tp chunk, a ZeRO-3 flat slice, the whole tensor, or
nothing for another pipeline stage's block) and the whole is dropped. Measured in bytes:
:attr:`Replay.peak_bytes` (what the replay held at once) and :attr:`Replay.kept_bytes`.

torchtitan builds on ``meta`` too, then calls ``model.init_weights()`` per rank after
``to_empty`` (torchtitan/train.py); its values differ from an eager build's, which is fine
there but not here, where every rank must equal :func:`labkit.reference`.

A factory that cannot be recorded (it reads a tensor's value while building, seeds or draws
from torch's generator on a real tensor, or calls an op the record cannot replay) raises
:class:`NotReplayable`; the caller builds the whole model instead.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .rank_pieces import pieces_for_rank

aten = torch.ops.aten

# Ops whose result does not depend on what the written tensor held before (so, when they cover
# the whole storage, the storage's earlier value is dead). Random fills are also "seeded".
OVERWRITES = {aten.normal_.default, aten.uniform_.default, aten.fill_.Scalar, aten.fill_.Tensor,
              aten.zero_.default, aten.copy_.default, aten.random_.default, getattr(aten.random_, "from"),
              aten.random_.to, aten.exponential_.default, aten.cauchy_.default, aten.log_normal_.default,
              aten.geometric_.default, aten.bernoulli_.float}


class NotReplayable(Exception):
    """The factory's build cannot be recorded on ``meta`` and replayed exactly."""


def key(t: torch.Tensor) -> int:
    """A storage's identity (the record keeps every tensor alive, so no identity is reused)."""
    return StorageWeakRef(t.untyped_storage()).cdata


@dataclass
class AtenCall:
    """One aten call recorded while building on ``meta``: what to replay and which storages it touches."""

    func: object
    args: tuple
    kwargs: dict
    out: object
    reads: set = field(default_factory=set)      # storages whose earlier value the op uses
    writes: set = field(default_factory=set)     # storages it writes or creates
    always: bool = False        # draws from the RNG (or writes a real tensor): always replayed


class Trace(TorchDispatchMode):
    """Every aten call made while building on ``meta``, with the storages each reads and writes."""

    def __init__(self):
        super().__init__()
        self.events: list[AtenCall] = []
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if any(a.name == "device" for a in func._schema.arguments):   # a factory (or .to): made on meta
            kwargs["device"] = torch.device("meta")
        out = func(*args, **kwargs)
        self.events.append(self._event(func, args, kwargs, out))
        return out

    def _event(self, func, args, kwargs, out) -> AtenCall:
        e = AtenCall(func, args, kwargs, out, always=torch.Tag.nondeterministic_seeded in func.tags)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = [t for t in tensors if t.device.type == "meta"]     # a real one (a constant) is used as is
        written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        mutated = [args[i] for i, a in enumerate(func._schema.arguments) if a in written and i < len(args)]
        mutated += [kwargs[a.name] for a in written if a.name in kwargs]
        e.reads = {key(t) for t in inputs}
        for t in mutated:
            if not isinstance(t, torch.Tensor):
                raise NotReplayable(f"{func} writes a list of tensors")
            if t.device.type != "meta":
                e.always = True
                continue
            e.writes.add(key(t))
            if func in OVERWRITES and _covers(t) and not any(x is not t and key(x) == key(t) for x in inputs):
                e.reads.discard(key(t))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta" and key(t) not in self.seen \
                    and key(t) not in e.reads:
                e.writes.add(key(t))                                   # a new storage
        self.seen |= e.reads | e.writes
        return e


def _nbytes(piece: torch.Tensor) -> int:
    """Bytes a kept piece holds: its storage, or a ZeRO-3 carrier's slice."""
    inner = getattr(piece, "labkit_piece", None)
    return piece.untyped_storage().nbytes() + (0 if inner is None else inner.untyped_storage().nbytes())


def _covers(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == \
        t.untyped_storage().nbytes()


def record(factory: Callable[[], nn.Module]) -> tuple[nn.Module, list[AtenCall]]:
    """``factory()`` built on ``meta`` (the caller's RNG untouched), with its record."""
    with torch.random.fork_rng(devices=[]):
        try:
            # factories are sent to meta by the mode, not by torch.device("meta"): code that asks
            # for the default device (transformers' init_weights skips every init under a meta
            # one) then builds as it does eagerly
            start = torch.get_rng_state()
            with Trace() as trace:
                model = factory()
            if not torch.equal(torch.get_rng_state(), start):    # meta ops never draw
                raise NotReplayable("the factory seeds torch's generator or draws from it on a real tensor")
        except NotReplayable:
            raise
        except Exception as err:                    # it read a value, or needs a real device
            raise NotReplayable(f"{type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise NotReplayable("the factory did not return an nn.Module")
    for name, t in final_tensors(model):
        if t.device.type != "meta":
            raise NotReplayable(f"{name} was not built on meta")
    return model, trace.events


def final_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers (tied ones under each name), and any other tensor
    attribute a module holds: what the replay must leave whole or hand to ``keep``."""
    out = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out.append((f"{prefix}.{attr}" if prefix else attr, value))
    return out


class Replay:
    """Run a record on CPU; ``keep(name, whole) -> piece | None`` is called once per final
    tensor name, after its storage's last use, with the whole value (a view, valid during the
    call; returning it keeps the whole tensor)."""

    def __init__(self, events: list[AtenCall], finals: list[tuple[str, torch.Tensor]], keep: Callable):
        self.events, self.keep = events, keep
        self.finals: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, t in finals:
            self.finals.setdefault(key(t), []).append((name, t))
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.owned: set[int] = set()        # storages a kept piece holds whole: the model's now
        self.now = self.peak_bytes = self.kept_bytes = 0
        self.kept: dict[str, torch.Tensor | None] = {}

    def plan(self) -> tuple[list[bool], dict[int, list[int]], dict[int, list[int]]]:
        """Backwards over the record (liveness): which events run (every seeded one, and any
        whose result is used), after which event a storage's value is dead (freed), and after
        which a final storage is last used (handed to ``keep``)."""
        needed = set(self.finals)             # storages whose current value something later reads
        run = [False] * len(self.events)
        dead_after: dict[int, list[int]] = {}
        final_after: dict[int, list[int]] = {}
        handed: set[int] = set()
        for i in range(len(self.events) - 1, -1, -1):
            e = self.events[i]
            run[i] = e.always or any(s in needed for s in e.writes)
            if not run[i]:
                continue
            for s in e.writes | e.reads:
                if s in self.finals and s not in handed:      # its last use: the final value
                    handed.add(s)
                    final_after.setdefault(i, []).append(s)
                elif s not in needed:
                    dead_after.setdefault(i, []).append(s)
            needed -= e.writes - e.reads
            needed |= e.reads
        return run, dead_after, final_after

    def run(self) -> "Replay":
        run, dead_after, final_after = self.plan()
        for i, e in enumerate(self.events):
            if not run[i]:
                continue
            self._execute(e)
            for s in final_after.get(i, ()):
                self._hand_over(s)
                self._drop(s)
            for s in dead_after.get(i, ()):
                self._drop(s)
        return self

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU tensor ``t`` stands for: its storage (allocated on first use), its view."""
        if t.device.type != "meta":
            return t
        s = key(t)
        if s not in self.storages:
            self.storages[s] = torch.UntypedStorage(t.untyped_storage().nbytes())
            self._count(self.storages[s].nbytes())
        return torch.empty(0, dtype=t.dtype).set_(self.storages[s], t.storage_offset(), t.shape, t.stride())

    def _execute(self, e: AtenCall) -> None:
        fresh = e.writes - e.reads - {key(t) for t in tree_flatten((e.args, e.kwargs))[0]
                                      if isinstance(t, torch.Tensor) and t.device.type == "meta"}

        def real(x):
            if isinstance(x, torch.Tensor):
                return self._real(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x
        out = e.func(*tree_map(real, e.args), **tree_map(real, e.kwargs))
        for meta, got in zip(tree_flatten(e.out)[0], tree_flatten(out)[0]):
            if isinstance(meta, torch.Tensor) and key(meta) in fresh and key(meta) not in self.storages:
                if got.stride() != meta.stride() or got.storage_offset() != meta.storage_offset():
                    raise NotReplayable(f"{e.func} laid out its result differently on CPU than on meta")
                self.storages[key(meta)] = got.untyped_storage()
                self._count(got.untyped_storage().nbytes())

    def _hand_over(self, s: int) -> None:
        whole = self.storages[s]
        for name, t in self.finals[s]:
            piece = self.keep(name, self._real(t))
            self.kept[name] = piece
            if piece is None:
                continue
            if piece.untyped_storage().data_ptr() == whole.data_ptr():
                if s not in self.owned:
                    self.owned.add(s)
                    self.kept_bytes += whole.nbytes()
            else:
                nbytes = _nbytes(piece)
                self.kept_bytes += nbytes
                self._count(nbytes)

    def _drop(self, s: int) -> None:
        storage = self.storages.pop(s, None)
        if storage is not None and s not in self.owned:
            self.now -= storage.nbytes()

    def _count(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak_bytes = max(self.peak_bytes, self.now)


def install(model: nn.Module, kept: dict[str, torch.Tensor | None], device=None) -> nn.Module:
    """Put each kept piece in the meta model, in place, on ``device``: a Parameter stays a
    Parameter (the names of a tied one share it, kept if any name is), a buffer a buffer;
    what no name keeps stays on ``meta`` (another stage's block)."""
    slots, by_tensor = [], {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        attrs = list(module._parameters) + list(module._buffers) + [
            a for a, v in vars(module).items() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]
        for attr in attrs:
            old = module._parameters.get(attr, module._buffers.get(attr, getattr(module, attr, None)))
            if old is None:
                continue
            slots.append((module, attr, old))
            piece = kept.get(f"{prefix}.{attr}" if prefix else attr)
            if piece is not None and id(old) not in by_tensor:
                value = _moved(piece, device)
                if isinstance(old, nn.Parameter):
                    value = _tagged(nn.Parameter(value, requires_grad=old.requires_grad), piece)
                by_tensor[id(old)] = value
    for module, attr, old in slots:
        value = by_tensor.get(id(old))
        if value is None:
            continue
        if attr in module._parameters:
            module._parameters[attr] = value
        elif attr in module._buffers:
            module._buffers[attr] = value
        else:
            setattr(module, attr, value)
    return model


def _moved(piece: torch.Tensor, device) -> torch.Tensor:
    """``piece`` on ``device``; a ZeRO-3 carrier (no values of its own) as a new empty one."""
    if device is None:
        return piece
    if hasattr(piece, "labkit_piece"):
        carrier = torch.empty(piece.shape, dtype=piece.dtype, device=device)
        carrier.untyped_storage().resize_(0)
        carrier.labkit_piece = piece.labkit_piece.to(device)
        return _tagged(carrier, piece)
    return _tagged(piece.to(device), piece)


def _tagged(value: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    for tag in ("labkit_shard", "labkit_piece"):
        if hasattr(piece, tag) and not hasattr(value, tag):
            setattr(value, tag, getattr(piece, tag))
    return value


def _on_meta(factory) -> nn.Module:
    """The factory's model on ``meta`` without recording (cheap), or an empty module."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                built = factory()
        except Exception:
            return nn.Module()
    return built if isinstance(built, nn.Module) else nn.Module()


def whole_bytes(model: nn.Module) -> int:
    """Bytes of a (meta) model's parameters and buffers, a tied weight once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for _, t in final_tensors(model)}.values())


INITS = ("auto", "whole", "per_rank")
AUTO_FRACTION = 0.25
"""``init="auto"`` materialises per rank when the whole model would take more than this
fraction of the memory available on the engine's machine (and the strategy splits it)."""

LAST: dict = {}
"""The last build on this engine: {"path": "whole" | "per_rank", "peak_bytes", "kept_bytes",
"whole_bytes"} (what ``labkit.parallel.materialize`` counted; the tests read it)."""


def check_init(init) -> None:
    if init not in INITS:
        raise ValueError(f"init={init!r} is unknown; use one of {', '.join(map(repr, INITS))} ('per_rank': each "
                         "engine materialises only the parameters it holds)")


def splits(s) -> bool:
    """Whether the strategy leaves a rank less than the whole model in a way per-rank builds
    (pipeline stages, Megatron tp chunks, hand-written ZeRO-3 shards; FSDP2, DTensor and the
    expert split take whole tensors and keep them whole here)."""
    return s.pp > 1 or (s.tp > 1 and s.tp_mode == "megatron") or (s.zero == 3 and s.zero_mode != "fsdp2"
                                                                    and s.dp > 1)


def available_bytes() -> int:
    """Memory this machine has free now (Linux's MemAvailable; sysconf elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_rank_model(spec, groups, device) -> nn.Module:
    """Step 1 of ``build_job``: the model under the run's seed, whole (``init="whole"``, an
    instance, or a strategy that holds it all anyway), or with only this rank's pieces
    (``init="per_rank"``; ``"auto"``: when the whole model would exceed
    :data:`AUTO_FRACTION` of the free memory). Either way the values are the eager build's."""
    from ..training import build_model

    init = getattr(spec, "init", "auto")
    check_init(init)
    LAST.clear()
    if init == "whole" or isinstance(spec.model, nn.Module) or not callable(spec.model) or \
            not splits(spec.strategy):
        LAST["path"] = "whole"
        return build_model(spec.model, spec.seed)
    if init == "auto" and whole_bytes(_on_meta(spec.model)) <= AUTO_FRACTION * available_bytes():
        LAST["path"] = "whole"           # small enough (or not buildable on meta): as it always was
        return build_model(spec.model, spec.seed)
    try:
        meta, events = record(spec.model)
        keep = pieces_for_rank(meta, spec, groups)
        torch.manual_seed(spec.seed)                # the stream the eager build draws from
        replay = Replay(events, final_tensors(meta), keep).run()
    except NotReplayable as err:
        warnings.warn(f"init={init!r}: the model's build could not be replayed per rank ({err}); building it whole")
        LAST["path"] = "whole"
        return build_model(spec.model, spec.seed)
    size = whole_bytes(meta)
    install(meta, replay.kept, device)
    LAST.update(path="per_rank", peak_bytes=replay.peak_bytes, kept_bytes=replay.kept_bytes, whole_bytes=size)
    return meta
