"""Pipeline parallelism: a model cut into stages across ranks (an nn.Sequential's children, or
any other decoder's chain of layers, :mod:`.modules`).

Two parts, top to bottom:

* the **stage split** — top-level blocks (or units) into p·v contiguous stages, balanced by parameter
  count (interleaved: equal block counts, as Megatron does), or at ``Strategy.split_at``;
* the **channel** — activations and gradients between neighbour stages with labkit.comm's
  isend/irecv, so every transfer is on the comm lane. Each channel's first activation is
  preceded by a shape header (the receiver allocates from it); a shape that changes later is
  a clear error from the sender, never a gloo abort (see :class:`PipeChannel`).

The schedule (:mod:`.schedules`) says what each rank does in which order; one executor for
every strategy runs it (:mod:`labkit.parallel.executor`, built by :mod:`labkit.parallel.build`).

    >>> run = lab.run(labkit.Strategy(pp=2, schedule="1f1b", microbatches=4),
    ...               model=labkit.models.mlp(width=64, depth=4), batch=32)
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from ... import comm
from ...errors import CommFailure
from .modules import PipelineStage, layer_span, pipeline_units, unit_weights


# -- the stage split ---------------------------------------------------------------------------
def stage_module(model: nn.Module, blocks: range, microbatches: int) -> nn.Module:
    """One stage's blocks: a Sequential of the model's children keeping their indices, or a
    :class:`.modules.PipelineStage` of its units; either way the model's state_dict keys."""
    if not isinstance(model, nn.Sequential):
        units = pipeline_units(model)
        return PipelineStage(model, [units[i] for i in blocks], aux_scale=1 / microbatches)
    module = nn.Sequential()
    for i in blocks:               # keep the full model's indices: same state_dict keys
        module.add_module(str(i), model[i])
    return module


def check_split(strategy, blocks: int, layers: int | None = None) -> None:
    """Raise ValueError (naming the fix) unless ``blocks`` split into the strategy's stages
    (``layers``: how many of them the interleaved split shares out evenly; default all)."""
    stages = strategy.pp * strategy.chunks
    layers = blocks if layers is None else layers
    if blocks < stages:
        raise ValueError(f"the model has {blocks} top-level blocks but pp*chunks = {stages} stages need "
                         f"at least one each; use pp*chunks ≤ {blocks} or a model with more blocks")
    if strategy.split_at:
        if strategy.split_at[-1] >= blocks:
            raise ValueError(f"Strategy.split_at={strategy.split_at} names block {strategy.split_at[-1]} "
                             f"but the model has blocks 0..{blocks - 1}; every boundary must be < {blocks}")
    elif strategy.schedule == "interleaved" and layers % stages:
        raise ValueError(f"interleaved splits the model's {layers} blocks into pp*chunks = {stages} equal "
                         f"stages; use a model whose block count is a multiple of {stages}, other "
                         f"pp/chunks, or give the boundaries with Strategy(split_at=...)")


def split_blocks(weights: list[int], stages: int, split_at=(), equal: bool = False) -> list[range]:
    """Block indices of each stage: at ``split_at``, in equal counts, or balanced by ``weights``.

    Balanced means the heaviest stage is as light as possible (a linear partition by dynamic
    programming); among equally heavy splits the one with the fewest blocks in its largest
    stage wins, so parameter-free blocks (activations) spread out too.

    >>> split_blocks([4, 0, 4, 0, 8], 2)
    [range(0, 3), range(3, 5)]
    """
    n = len(weights)
    if split_at:
        bounds = [0, *split_at, n]
    elif equal:
        bounds = [k * n // stages for k in range(stages + 1)]
    else:
        bounds = _balanced_bounds([w * (n + 1) + 1 for w in weights], stages)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced_bounds(weights: list[int], stages: int) -> list[int]:
    n = len(weights)
    prefix = list(itertools.accumulate(weights, initial=0))
    inf = float("inf")
    # cost[k][j]: lightest possible heaviest stage when blocks 0..j-1 form k stages
    cost = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    cost[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                c = max(cost[k - 1][i], prefix[j] - prefix[i])
                if c < cost[k][j]:
                    cost[k][j], cut[k][j] = c, i
    bounds, j = [n], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]


def stage_blocks(model: nn.Module, strategy) -> list[range]:
    """Every global stage's block indices for ``strategy`` (stage g lives on rank g mod pp): an
    ``nn.Sequential``'s children, or any other model's units (:mod:`.modules`)."""
    stages = strategy.pp * strategy.chunks
    if isinstance(model, nn.Sequential):
        weights = [sum(p.numel() for p in block.parameters()) for block in model]
    else:
        weights = unit_weights(model)
        if strategy.schedule == "interleaved" and not strategy.split_at:
            # Megatron's interleaving: equal decoder layers per stage, the embedding joining the
            # first stage and the final norm and head the last
            span = layer_span(model)
            bounds = [0, *(span.start + k * len(span) // stages for k in range(1, stages)), len(weights)]
            return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    return split_blocks(weights, stages, strategy.split_at, equal=strategy.schedule == "interleaved")


# -- the channel between neighbour stages ------------------------------------------------------
FAILED = -1   # a header of these: the sending stage failed and sends nothing more


class ShapeChanged(ValueError):
    """A stage's output changed shape or dtype after its first micro-batch."""


class PipeChannel:
    """Activations forward and gradients backward, each transfer a labkit.comm call.

    A channel is the pair of neighbour stages. Its first activation is preceded by
    labkit.comm's message header (the one point-to-point header format), so the receiver can
    allocate; every later one must keep that shape and goes without a header (a header per
    message cost ~10% of a pipeline step on gloo). A change of shape is caught here, on the sender
    (ShapeChanged), and the changed tensor is never sent, so gloo cannot abort the receiver:
    the lab reports the sender's error and frees the waiting receiver. Gradients need no
    check: the receiving stage knows its own output's shape, and autograd keeps it.
    """

    def __init__(self, pp_ranks: list[int], group, device, tag: int):
        self.pp_ranks, self.group, self.device, self.tag = pp_ranks, group, device, tag
        self.shapes: dict[int, tuple] = {}     # sender's stage → (shape, dtype) of its activations
        self.pending: list[comm.Handle] = []

    def _send(self, tensor, a, name=None, check=None):
        self.pending.append(comm.isend(tensor, self.pp_ranks[a.peer], self.group, name or str(a),
                                       microbatch=a.microbatch, tag=self.tag, check=check))

    def _recv(self, tensor, a, name=None, check=None):
        comm.irecv(tensor, self.pp_ranks[a.peer], self.group, name or str(a),
                   microbatch=a.microbatch, tag=self.tag, check=check).wait()
        return tensor

    def send_activation(self, a, out: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            if a.stage not in self.shapes:          # the receiver waits for a header: tell it, so it
                self._send(torch.full((comm.HEADER_LEN,), FAILED, dtype=torch.int64, device=self.device), a,
                           f"{a} shape", check=False)      # fails now instead of at the timeout
                self.drain()
            raise TypeError(f"pipeline stage {a.stage} returned a {type(out).__name__}, but a stage must return "
                            "one tensor (the next stage's input); split the model where blocks pass a single "
                            "tensor, e.g. Strategy(split_at=...), or wrap the blocks that pass a tuple in one module")
        meta, out = (tuple(out.shape), out.dtype), out.detach().contiguous()
        if a.stage not in self.shapes:
            if not comm.describable(out):
                raise ValueError(f"stage {a.stage} output {out.dtype} with {out.dim()} dims cannot be sent; "
                                 f"stage outputs must be a tensor of ≤ {comm.MAX_DIMS} dims, dtype in {comm.DTYPES}")
            self.shapes[a.stage] = meta
            self._send(comm.header(out), a, f"{a} shape", check=False)
            self._send(out, a, check=False)     # the header already says what it is
            return
        if meta == self.shapes[a.stage]:
            self._send(out, a, check=False)
            return
        shape, dtype = self.shapes[a.stage]
        raise ShapeChanged(f"stage {a.stage} made {meta[0]} {meta[1]} for micro-batch {a.microbatch} "
                           f"but {shape} {dtype} before; pipeline stages must keep one output shape and "
                           "dtype (same batch size every step, no data-dependent shapes)")

    def recv_activation(self, a) -> torch.Tensor:
        sender = a.stage - 1
        if sender not in self.shapes:
            values = self._recv(torch.empty(comm.HEADER_LEN, dtype=torch.int64, device=self.device), a,
                                f"{a} shape", check=False)
            if values[0].item() == FAILED:
                raise CommFailure(f"stage {sender} (rank {self.pp_ranks[a.peer]}) failed before sending its "
                                  f"first activation; its own error says why")
            self.shapes[sender] = comm.read_header(values)
        shape, dtype = self.shapes[sender]
        buf = self._recv(torch.empty(shape, dtype=dtype, device=self.device), a, check=False)
        return buf.requires_grad_(dtype.is_floating_point)

    def send_grad(self, a, grad: torch.Tensor) -> None:
        self._send(grad.detach().contiguous(), a, check=False)

    def recv_grad(self, a, like: torch.Tensor) -> torch.Tensor:
        return self._recv(torch.empty_like(like, memory_format=torch.contiguous_format), a, check=False)

    def poll(self) -> None:
        """Close the sends that completed (so their spans end about when they did)."""
        still = []
        for handle in self.pending:
            if handle.work is None or handle.work.is_completed():
                handle.wait()
            else:
                still.append(handle)
        self.pending = still

    def drain(self) -> None:
        for handle in self.pending:
            handle.wait()
        self.pending = []
