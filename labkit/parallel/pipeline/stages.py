"""Pipeline parallelism: an nn.Sequential cut into stages across ranks, run by a schedule.

Three parts, top to bottom:

* the **stage split** — top-level blocks into p·v contiguous stages, balanced by parameter
  count (interleaved: equal block counts, as Megatron does), or at ``Strategy.split_at``;
* the **link** — activations and gradients between neighbour stages with labkit.comm's
  isend/irecv, so every transfer is on the comm lane. Each channel's first activation is
  preceded by a shape header (the receiver allocates from it); a shape that changes later is
  a clear error from the sender, never a gloo abort (see :class:`_Link`);
* the **executor** — :class:`PipelineJob` runs one rank's action list from
  :mod:`labkit.schedules` (gpipe, 1f1b, interleaved), then reduces each stage's gradients
  over its dp group with the foundation's gradient sync, then steps the optimizer.

    >>> run = lab.run(labkit.Strategy(pp=2, schedule="1f1b", microbatches=4),
    ...               model=labkit.models.mlp(width=64, depth=4), batch=32)
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext

import torch
from torch import nn

from ... import comm
from ...record.instrument import ActivationMeter, BackwardSpan
from .schedules import build_schedule
from ...models.training import build_model, build_optimizer, resolve_data, resolve_loss
from ..data.sync import DDPSync, build_grad_sync

_serial = itertools.count()   # one p2p tag per job: a failed run's stray messages match nothing later


# -- the stage split ---------------------------------------------------------------------------
def check_split(strategy, blocks: int) -> None:
    """Raise ValueError (naming the fix) unless ``blocks`` split into the strategy's stages."""
    stages = strategy.pp * strategy.chunks
    if blocks < stages:
        raise ValueError(f"the model has {blocks} top-level blocks but pp*chunks = {stages} stages need "
                         f"at least one each; use pp*chunks ≤ {blocks} or a model with more blocks")
    if strategy.split_at:
        if strategy.split_at[-1] >= blocks:
            raise ValueError(f"Strategy.split_at={strategy.split_at} names block {strategy.split_at[-1]} "
                             f"but the model has blocks 0..{blocks - 1}; every boundary must be < {blocks}")
    elif strategy.schedule == "interleaved" and blocks % stages:
        raise ValueError(f"interleaved splits the model's {blocks} blocks into pp*chunks = {stages} equal "
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


def stage_blocks(model: nn.Sequential, strategy) -> list[range]:
    """Every global stage's block indices for ``strategy`` (stage g lives on rank g mod pp)."""
    weights = [sum(p.numel() for p in block.parameters()) for block in model]
    return split_blocks(weights, strategy.pp * strategy.chunks, strategy.split_at,
                        equal=strategy.schedule == "interleaved")


# -- the link between neighbour stages ---------------------------------------------------------
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
HEADER = 10   # dtype code, ndim, up to 8 sizes


class ShapeChanged(ValueError):
    """A stage's output changed shape or dtype after its first micro-batch."""


class _Link:
    """Activations forward and gradients backward, each transfer a labkit.comm call.

    A channel is the pair of neighbour stages. Its first activation is preceded by a shape
    header, so the receiver can allocate, and goes with labkit.comm's per-message check; every
    later one must keep that shape, and skips the per-message check (its extra round trip
    cost ~10% of a pipeline step on gloo). A change of shape is caught here, on the sender
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
        meta, out = (tuple(out.shape), out.dtype), out.detach().contiguous()
        if a.stage not in self.shapes:
            if out.dtype not in DTYPES or out.dim() > HEADER - 2:
                raise ValueError(f"stage {a.stage} output {out.dtype} with {out.dim()} dims cannot be sent; "
                                 f"stage outputs must be a tensor of ≤ {HEADER - 2} dims, dtype in {DTYPES}")
            self.shapes[a.stage] = meta
            header = torch.zeros(HEADER, dtype=torch.int64, device=self.device)
            header[:2 + out.dim()] = torch.tensor([DTYPES.index(out.dtype), out.dim(), *out.shape])
            self._send(header, a, f"{a} shape")
            self._send(out, a)                  # the first one: checked by labkit.comm too
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
        first = sender not in self.shapes
        if first:
            header = self._recv(torch.empty(HEADER, dtype=torch.int64, device=self.device), a, f"{a} shape")
            code, ndim, *sizes = header.tolist()
            self.shapes[sender] = (tuple(sizes[:ndim]), DTYPES[code])
        shape, dtype = self.shapes[sender]
        buf = self._recv(torch.empty(shape, dtype=dtype, device=self.device), a, check=None if first else False)
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


# -- the executor -------------------------------------------------------------------------------
class PipelineJob:
    """This rank's stages of the model, run by the strategy's schedule, then dp-reduced."""

    def __init__(self, spec, groups, recorder, device):
        tag = next(_serial)
        self.spec, self.recorder, self.device = spec, recorder, device
        s = spec.strategy
        self.dp_index, self.pp_index, _ = groups.coords
        full = build_model(spec.model, spec.seed)     # under the seed: the reference's weights
        self.data = resolve_data(spec.data, full, spec.batch, spec.seed)
        self.loss_fn = resolve_loss(spec.loss)
        self.stages = stage_blocks(full, s)
        self.last_stage = len(self.stages) - 1
        mine = [g for g in range(len(self.stages)) if g % s.pp == self.pp_index]   # chunk c = stage c*pp + r
        self.chunks = [nn.Sequential(*(full[i] for i in self.stages[g])).to(device) for g in mine]
        # Same keys as the full model's state_dict ("6.weight"): the blocks keep their indices.
        self.model = nn.ModuleDict({str(i): full[i] for g in mine for i in self.stages[g]})
        self.actions = build_schedule(s.schedule, s.pp, s.microbatches, s.chunks)[self.pp_index]
        self.last_backward = {a.chunk: a.microbatch for a in self.actions if a.op == "B"}
        self.link = _Link(groups.pp_ranks, groups.pp, device, tag)
        self.syncs = [self._build_sync(s, groups, c) for c in self.chunks]
        self.run_chunks = [sync.wrap(c) if sync else c for sync, c in zip(self.syncs, self.chunks)]
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, spec.lr, spec.momentum) if params else None
        self.meter = ActivationMeter(params)
        self.bwd_spans = [self._backward_span(c) for c in self.chunks]

    def _backward_span(self, chunk) -> BackwardSpan:
        """A chunk's backward ends when its input gradient and all its parameter gradients
        exist, not when ``backward()`` returns: DDP waits for its all-reduces inside
        ``backward()``, and that wait is comm, not compute."""
        params = [p for p in chunk.parameters() if p.requires_grad]
        span = BackwardSpan(self.recorder, "B", len(params))
        if self.recorder.enabled:
            for p in params:
                p.register_post_accumulate_grad_hook(span.param_ready)
        return span

    @staticmethod
    def _build_sync(s, groups, chunk):
        if s.dp == 1 or not any(p.requires_grad for p in chunk.parameters()):
            return None
        return build_grad_sync(s.dp_mode, groups.dp, s.dp, s.bucket_mb, s.compression, s.error_feedback)

    # -- one step ------------------------------------------------------------------------------
    def step(self, step: int, batch) -> dict:
        s = self.spec.strategy
        x, y = batch
        self.xs, self.ys = x.chunk(s.microbatches), y.chunk(s.microbatches)
        self.inputs, self.outputs, self.grads, self.loss = {}, {}, {}, 0.0
        self.meter.start_step()
        for action in self.actions:
            self.link.poll()
            getattr(self, "_" + action.op.lower())(action)
        self.link.drain()
        self.recorder.microbatch = None
        for sync in self.syncs:
            if sync is not None:
                sync.finish()
        if self.optimizer is not None:
            with self.recorder.span("optimizer", "SGD step"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
        last = self.last_stage % s.pp == self.pp_index
        return {"loss": float(self.loss) if last else 0.0, "loss_weight": 1.0 if last else 0.0,
                "peak_activation_bytes": self.meter.peak}

    def batch(self, step: int):
        """This rank's 1/dp of the step's global batch, on its device."""
        s, batch = self.spec.strategy, self.spec.batch
        x, y = self.data(step)
        if x.shape[0] != batch or y.shape[0] != batch:
            raise ValueError(f"step {step}: data gave {x.shape[0]} inputs and {y.shape[0]} targets but "
                             f"batch={batch}; the data must give the whole global batch every step")
        size = batch // s.dp
        rows = slice(self.dp_index * size, (self.dp_index + 1) * size)
        return x[rows].to(self.device), y[rows].to(self.device)

    def _label(self, op: str, a) -> str:
        return f"{op}{a.microbatch}" + (f" c{a.chunk}" if self.spec.strategy.chunks > 1 else "")

    # -- the six actions -----------------------------------------------------------------------
    def _recv_f(self, a):
        self.inputs[a.chunk, a.microbatch] = self.link.recv_activation(a)

    def _f(self, a):
        key, rec = (a.chunk, a.microbatch), self.recorder
        inp = self.xs[a.microbatch] if a.stage == 0 else self.inputs[key]
        sync = self.syncs[a.chunk]
        quiet = sync.ddp.no_sync() if isinstance(sync, DDPSync) else nullcontext()
        rec.microbatch = a.microbatch
        with rec.span("fwd", self._label("F", a), microbatch=a.microbatch), \
                self.meter.forward(key, inp) as kept, quiet:
            out = self.run_chunks[a.chunk](inp)
            if a.stage == self.last_stage:
                out = self.loss_fn(out, self.ys[a.microbatch]) / self.spec.strategy.microbatches
                self.loss = self.loss + out.detach()      # read once per step, not per micro-batch
            kept.append(out)
        self.outputs[key] = out

    def _send_f(self, a):
        self.link.send_activation(a, self.outputs[a.chunk, a.microbatch])

    def _recv_b(self, a):
        self.grads[a.chunk, a.microbatch] = self.link.recv_grad(a, self.outputs[a.chunk, a.microbatch])

    def _b(self, a):
        key, rec = (a.chunk, a.microbatch), self.recorder
        sync = self.syncs[a.chunk]
        last = self.last_backward[a.chunk] == a.microbatch
        if last and isinstance(sync, DDPSync):
            # Forwards ran under no_sync; arm DDP's reducer for this chunk's final backward
            # (torch.distributed.pipelining's PipelineStage does the same).
            sync.ddp.reducer.prepare_for_backward([])
        rec.microbatch = a.microbatch
        out, grad = self.outputs.pop(key), self.grads.pop(key, None)
        span, inp = self.bwd_spans[a.chunk], self.inputs.get(key)
        span.name, span.expects_input_grad = self._label("B", a), inp is not None and inp.requires_grad
        if rec.enabled:
            span.open(None)
            if span.expects_input_grad:
                inp.register_hook(span.inputs_ready)
        with sync.microbatch(last=last) if sync else nullcontext():
            if out.requires_grad:        # a stage with no parameters and a plain input has no graph
                torch.autograd.backward(out, grad)
        span.finish()
        self.meter.release(key)

    def _send_b(self, a):
        inp = self.inputs.pop((a.chunk, a.microbatch))
        self.link.send_grad(a, inp.grad if inp.grad is not None else torch.zeros_like(inp))

    def parameters(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
