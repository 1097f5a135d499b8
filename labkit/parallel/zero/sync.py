"""ZeRO-1/2/3 by hand, as gradient syncs the executor drives like the dp modes
(``wrap``, ``defer``, ``backward``, ``finish``, ``after_step``), plus an optimizer that steps
only this rank's shards (:class:`ShardedOptimizer`).

The three stages of Rajbhandari et al. 2020 (arXiv 1910.02054), Figure 1:

* :class:`Zero1Sync` (P_os): buckets of whole gradients are reduce-scattered after backward;
  the optimizer steps this rank's shard; ``after_step`` all-gathers the updated shards back
  into the parameters. Same traffic as plain DP: reduce-scatter + all-gather = all-reduce.
* :class:`Zero2Sync` (P_os+g): each bucket is reduce-scattered from autograd hooks the moment
  its gradients exist (like the ``overlap`` mode), and the full gradients are dropped, so a
  rank holds gradients for the buckets in flight and its own shard only.
* :class:`~.zero3.Zero3Sync` (P_os+g+p), in :mod:`.zero3`: one unit per block; parameters live as shards, each block
  gathered just before its forward and freed after, gathered again for its backward, and its
  gradient reduce-scattered when the block's backward is done. ``prefetch`` = k issues the
  gathers of the next k blocks before this block's forward (the previous k in backward), so
  they run under compute. Traffic: gather (fwd) + gather (bwd) + reduce-scatter = 1.5× DP.

Every collective goes through :mod:`labkit.comm` (timed, flight-logged, with the timeout).
"""
from __future__ import annotations

import collections
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from ..data.sync import GradSync, NoSync, make_buckets
from .shard import FlatUnit, Meter


def build_zero_sync(strategy, group, dp: int, recorder, blocks: str | None = None, replicas=None) -> GradSync:
    """The sync for ``strategy.zero`` / ``zero_mode`` over ``group``; dp = 1 (no parameters): NoSync.
    ``blocks``: the dotted name of the model's repeated blocks (``labkit.parallel.blocks``), the
    units ZeRO-3 and FSDP2 shard one by one ("" for an ``nn.Sequential``'s children).
    ``replicas`` (HSDP): ``(group, runs)``: the group holding this rank's shard in every replica
    of ``group``, and the runs of ranks that shard alike (one per replica, ``group``'s ranks
    among them); the shards' gradients are all-reduced over the replicas."""
    if dp == 1:
        return NoSync(group, dp, strategy.bucket_mb)
    if strategy.zero_mode == "fsdp2":
        from .fsdp2 import FSDP2Sync
        return FSDP2Sync(group, dp, strategy.bucket_mb, recorder, strategy.zero, strategy.prefetch, blocks,
                         replicas)
    from .zero3 import Zero3Sync
    kinds = {1: Zero1Sync, 2: Zero2Sync, 3: Zero3Sync}
    sync = kinds[strategy.zero](group, dp, strategy.bucket_mb, recorder, strategy.prefetch)
    sync.blocks_path, sync.replicas = blocks, replicas
    return sync


class Zero1Sync(GradSync):
    """ZeRO-1: whole gradients, sharded optimizer state, parameters all-gathered after the step."""

    # Reduce-scatters in flight at once: launching one more waits for the oldest, so a rank
    # holds the packed gradients of at most this many buckets (DeepSpeed bounds its ZeRO-2
    # buckets, FSDP2 its reduce-scatter buffers, for the same reason).
    MAX_IN_FLIGHT = 2
    replicas = None           # HSDP: (group, runs) of this shard's replicas (build_zero_sync)

    def __init__(self, group, dp: int, bucket_mb: float, recorder, prefetch: int = 0):
        super().__init__(group, dp, bucket_mb)
        self.recorder, self.prefetch = recorder, prefetch
        self.rank = dist.get_rank(group)
        self.grad_meter, self.param_meter = Meter(), Meter()
        self.in_flight = collections.deque()      # units, in the order their reduce-scatters started

    def wrap(self, model: nn.Module) -> nn.Module:
        super().wrap(model)
        self.units = self.build_units(model)
        if self.replicas is not None:
            group, runs = self.replicas
            for unit in self.units:
                unit.replicate(group, len(runs))
        return model

    def build_units(self, model: nn.Module) -> list[FlatUnit]:
        buckets = make_buckets(self.params, self.bucket_bytes)       # in the order gradients arrive
        return [FlatUnit(i, m, self.group, self.dp, self.rank, f"bucket {i}") for i, m in enumerate(buckets)]

    def finish(self) -> None:
        for unit in self.units:
            flat = unit.flat_grad()
            self.grad_meter.add(flat.numel() * flat.element_size())
            unit.reduce_scatter(flat)
            self.in_flight.append(unit)
            self._collect_beyond(self.MAX_IN_FLIGHT)
        self._collect_all()
        for unit in self.units:
            for _, p in unit.members:         # consumed; ZeRO-1 keeps the buffers (its memory cost)
                if p.grad is not None:
                    p.grad.zero_()

    def _collect_oldest(self) -> None:
        self.grad_meter.sub(self.in_flight.popleft().collect_oldest())

    def _collect_beyond(self, limit: int) -> None:
        while len(self.in_flight) > limit:
            self._collect_oldest()

    def _collect_all(self) -> None:
        while self.in_flight:
            self._collect_oldest()
        for unit in self.units:
            unit.average_grads()

    def after_step(self) -> None:
        """The updated shards back into every rank's parameters (all issued, then waited)."""
        for unit in self.units:
            unit.gathered = False
            unit.gather()
        for unit in self.units:
            unit.wait()

    def held_bytes(self, module: nn.Module) -> dict:
        params = sum(u.nbytes for u in self.units)
        grads = sum(p.grad.numel() * p.grad.element_size() for _, p in self.params if p.grad is not None)
        shard_grads = sum(u.shard_bytes() for u in self.units)
        held = {"params": params, "params_peak": params, "grads": grads + shard_grads,
                "grads_peak": grads + shard_grads + self.grad_meter.peak}    # + packed buckets in flight
        self.grad_meter.reset()
        return held


class Zero2Sync(Zero1Sync):
    """ZeRO-2: buckets reduce-scattered during backward; full gradients dropped once sent."""

    COLLECT_ON_SEND = True      # bound the buckets in flight as each is sent (ZeRO-3: between blocks)

    def wrap(self, model):
        super().wrap(model)
        for unit in self.units:
            for _, p in unit.members:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad(u, p))
        return model

    def _on_grad(self, unit: FlatUnit, p) -> None:
        self.grad_meter.add(p.grad.numel() * p.grad.element_size())
        unit.ready += 1
        if unit.ready == len(unit.members):
            self._send_grads(unit)

    def _send_grads(self, unit: FlatUnit) -> None:
        """Pack the unit's gradients, drop the full ones, reduce-scatter (async) the packed copy."""
        flat = unit.flat_grad()
        self.grad_meter.add(flat.numel() * flat.element_size())
        for _, p in unit.members:
            if p.grad is not None:
                self.grad_meter.sub(p.grad.numel() * p.grad.element_size())
                p.grad = None
        unit.ready = 0
        unit.reduce_scatter(flat)
        unit.sent = True
        self.in_flight.append(unit)
        if self.COLLECT_ON_SEND:
            self._collect_beyond(self.MAX_IN_FLIGHT)

    def finish(self) -> None:
        for unit in self.units:
            if unit.ready or not unit.sent:       # a parameter that got no gradient
                self._send_grads(unit)
        self._collect_all()
        for unit in self.units:
            unit.sent = False

    def held_bytes(self, module):
        shard_grads = sum(u.shard_bytes() for u in self.units)
        peak = self.grad_meter.peak                    # full gradients and packed buckets at once
        held = super().held_bytes(module)
        held["grads_peak"] = shard_grads + peak
        return held


class ShardedOptimizer:
    """torch's optimizer over this rank's shards only: 1/dp of the optimizer state.

    SGD and AdamW are elementwise, so stepping a flat slice is the same arithmetic as stepping
    the whole tensors; the zero padding has zero gradient and stays zero (decay of 0 is 0).
    The shard is stepped as its members' pieces (:meth:`FlatUnit.pieces`), so that a member no
    backward reached is skipped with its own state (AdamW's step count) untouched, as torch
    skips a parameter whose gradient is None (:meth:`skipping`).
    """

    def __init__(self, units: list[FlatUnit], inner, pieces: list | None = None):
        self.units, self.inner = units, inner
        self.pieces = pieces or []
        self.label = f"{type(inner).__name__} step (shards)"

    @contextmanager
    def skipping(self, members: list):
        """Inside, the pieces of ``members`` have no gradient: the step leaves them as they are."""
        ids = {id(m) for m in members}
        hidden = [(piece, piece.grad) for member, piece in self.pieces if id(member) in ids]
        for piece, _ in hidden:
            piece.grad = None
        try:
            yield
        finally:
            for piece, grad in hidden:
                piece.grad = grad

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        """The shards' groups: fp16's loss scaler unscales (and checks for inf) the shard grads."""
        return self.inner.param_groups

    def step(self) -> None:
        self.inner.step()

    def register_step_post_hook(self, hook):
        """``hook(self, args, kwargs)`` after each step, as torch's optimizers offer (labkit.drift's snapshots)."""
        return self.inner.register_step_post_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.inner.zero_grad(set_to_none=False)      # shard grads are accumulated into in place


def build_sharded_optimizer(syncs: list, spec, params: list):
    """Step 5's optimizer with zero: over the shards (by hand), or FSDP2's DTensor parameters."""
    from ...training import build_optimizer

    if spec.strategy.zero_mode == "fsdp2":
        return build_optimizer(params, spec.lr, spec.momentum, spec.optimizer)
    units = [u for sync in syncs for u in getattr(sync, "units", ())]
    pieces = [pair for u in units for pair in u.pieces()]
    inner = build_optimizer([piece for _, piece in pieces], spec.lr, spec.momentum, spec.optimizer)
    return ShardedOptimizer(units, inner, pieces)
