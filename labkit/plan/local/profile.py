"""The model's own pieces timed in sequence, where :mod:`labkit.plan.local.work` only counts them.

vTrain's and Echo's way: a step of the model runs again on this process, one thread, at the
micro-batch size, with cheap hooks marking where each piece begins (:func:`profile`); each
piece's time then becomes its ops' ``factor`` over their table prices (:func:`timed`), so a
piece costs what it took, and what it already paid for its bytes' age is noted (``Op.paid``),
so the simulator charges only the refetch beyond it (:mod:`labkit.plan.local.price`).

    >>> seconds = profile(labkit.models.mlp(width=512, depth=8), 16)
    >>> work = timed(count(model, 16), seconds, machine)
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ...training import build_model, resolve_data, resolve_loss
from .work import ModelWork, Ops, _Recording, _rows, in_step_order, routed_parts, with_pieces


class _Clock:
    """In a :class:`_Recording`'s place of its counter: each time the piece running changes
    (``sink`` is set), the seconds since the last change go to the piece that ran."""

    def __init__(self):
        self.linear, self.weights, self.grads, self.by_storage, self.by_shape = "", set(), {}, {}, {}
        self.seconds, self._sink, self._since = {}, None, 0.0

    @property
    def sink(self):
        return self._sink

    @sink.setter
    def sink(self, piece) -> None:
        now = time.perf_counter()
        if self._sink is not None:
            self.seconds[id(self._sink)] = self.seconds.get(id(self._sink), 0.0) + now - self._since
        self._sink, self._since = piece, now

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.sink = None


@contextmanager
def one_thread():
    """torch on one thread, as an engine runs (OMP_NUM_THREADS=1), the caller's threads after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def profile(model, batch: int, data=None, loss="mse", optimizer: str = "sgd", repeats: int = 7,
            cp: int = 1) -> dict:
    """Seconds of each piece of a step of ``model`` on a micro-batch of ``batch`` samples, timed
    in sequence on this process's one thread (forward, loss, backward and the optimizer, as the
    executor runs them; the median of ``repeats`` steps after two): {(block i, "pre", "post" or
    "opt", "fwd" or "bwd"): seconds}. What the model's own ops take one after another, where
    their table prices miss what runs between them (vTrain's profiling of a layer, Echo's).
    ``cp`` > 1: on a cp rank's 1/cp of every sequence (as :func:`count`), attending within it."""
    from statistics import median

    from ...parallel.blocks import find_blocks

    net = build_model(model, 0)
    found = find_blocks(net, None)
    x, y = resolve_data(data, net, batch, 0)(0)
    x, y = _rows(x, lambda v: v[:batch]), y[:batch]
    if cp > 1:
        x, y = _rows(x, lambda v: v[:, :v.shape[1] // cp]), y[:, :y.shape[1] // cp]
    clock = _Clock()
    rec = _Recording(net, found, marked=False, counter=clock)
    routed = _time_routed(net, found)
    runs = []
    with one_thread():
        for k in range(repeats + 2):
            clock.seconds = {}
            routed.clear()
            rec.step(x, y, resolve_loss(loss), optimizer, 1)
            if k >= 2:
                runs.append({key: clock.seconds.get(id(sink), 0.0) for key, sink in rec.pieces.items()} | routed)
    out = {key: median(r.get(key, 0.0) for r in runs) for key in runs[-1]}
    last = len(found) - 1
    for (piece, phase), t in list(out.items()):
        if isinstance(piece, tuple) and piece[0] == "after":   # between block i and the next, or the loss
            del out[piece, phase]
            into = (piece[1], "fwd") if piece[1] < last else ("post", "fwd")
            out[into] = out.get(into, 0.0) + t
    return out


def _time_routed(net, found) -> dict:
    """Each MoE layer's routed experts (``MoE._routed``, a transformers block's fused experts: the
    part expert parallelism moves off the block) timed inside its block's piece, forward and backward: {(("routed", i), phase):
    seconds}, filled as the step runs (the block's own piece still holds them)."""
    seconds, names = {}, [name for name, _ in found]

    def add(key, t):
        seconds[key] = seconds.get(key, 0.0) + t

    def timing(i, inner):
        def routed(x, *rest):
            t0 = time.perf_counter()
            out = inner(x, *rest)
            add((("routed", i), "fwd"), time.perf_counter() - t0)
            if out.requires_grad and x.requires_grad:     # its backward: the output's gradient to the input's
                began = []
                out.register_hook(lambda g: began.append(time.perf_counter()))
                x.register_hook(lambda g: add((("routed", i), "bwd"), time.perf_counter() - began[0]) if began else None)
            return out
        return routed

    for name, layer, attr in routed_parts(net):
        i = next((k for k, n in enumerate(names) if name == n or name.startswith(n + ".")), None)
        if i is not None:
            setattr(layer, attr, timing(i, getattr(type(layer), attr).__get__(layer)))
    return seconds


def timed(work: ModelWork, seconds: dict, machine, plain: ModelWork | None = None) -> ModelWork:
    """``work`` with each op's ``factor``: its piece's measured ``seconds`` (:func:`profile`)
    over the piece's price on ``machine``, so the piece costs what it measured and each op its
    price's share of it (a tensor-parallel shard scales its ops' prices, the factor stays).
    ``plain``: the same pieces counted unmarked (``count(..., marked=False)``), whose prices
    the timed pieces are set against, when ``work`` left cp's attention or ep's experts out."""
    from dataclasses import replace

    from . import price

    plain = dict(in_step_order(plain or work))

    def scaled(key, ops: Ops) -> Ops:
        if key not in seconds:
            return ops
        took, against = seconds[key], plain[key]
        if any(o.name == "experts" for o in ops.ops):     # ep: the routed experts, timed inside, left out
            took, against = took - seconds.get((("routed", key[0]), key[1]), 0.0), ops
        priced = price.seconds(machine, against.ops)
        if priced <= 0:
            return ops
        return Ops([replace(o, factor=took / priced) for o in ops.ops])
    return _paid(with_pieces(work, scaled), seconds, machine)


def _paid(work: ModelWork, seconds: dict, machine) -> ModelWork:
    """``work`` with each op's ``paid``: ρ of each operand's age where the profile timed it, the
    pieces one after another in a step's order, the second of two steps (each piece's operands
    taken at its start, as the simulator takes a span's)."""
    from dataclasses import replace

    from . import price

    now, last, paid = 0.0, {}, {}
    for second in (False, True):
        for piece, ops in in_step_order(work):
            seen = {}
            for op in ops.ops:
                for key, _ in op.operands:
                    if key not in seen:
                        seen[key] = price.refetch(machine, now - last[key]) if key in last else 0.0
            if second:
                paid[piece] = seen
            last.update(dict.fromkeys(seen, now))
            now += seconds.get(piece, 0.0)
    return with_pieces(work, lambda piece, ops: Ops([replace(o, paid=tuple(paid[piece][k] for k, _ in o.operands))
                                                     for o in ops.ops]))
