"""One executor for every strategy: it runs this rank's schedule actions on its stages.

A rank holds one or more stages (pp = 1: one stage, the whole model; interleaved: several
chunks). Each stage carries its gradient sync (the four dp modes, or none for dp = 1). The
executor walks the rank's action list from :mod:`labkit.parallel.pipeline.schedules` and
dispatches each action through :data:`Executor.HANDLERS`, a table keyed by the action's
op, so a schedule with split backward (input-grad ``I``, weight-grad ``W``, as in
torch.distributed.pipelining and the zero-bubble schedules) is new rows, not new control flow.

After the list: drain pending sends, let every stage's sync finish (gradients averaged over
dp), step the optimizer. Built by :func:`labkit.parallel.build.build_job`.

    >>> job = build_job(spec, groups, recorder, device)     # on an engine
    >>> job.step(0, job.batch(0))["loss"]
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..training import TokenLoss
from .buffers import warn_written_buffers, written_buffers
from .pipeline.modules import merge_stages
from .pipeline.split_backward import backward_input, backward_weight
from .precision import Precision
from .zero.memory import measure_memory


def global_batch(data, step: int, batch: int) -> tuple:
    """The step's global batch from ``data(step)``, which must give exactly ``batch`` rows:
    fewer would silently train on a truncated shard (or none: NaN), more on a different batch.
    The inputs may be a tensor or a dict of tensors (keyword inputs, as Hugging Face models
    take), each with the batch's rows first."""
    out = data(step)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"step {step}: data(step) gave {type(out).__name__}, not (x, y); return the inputs "
                         f"and targets of the step's global batch, e.g. (torch.randn({batch}, 16), y)")
    x, y = out
    rows = [batch_rows(x), batch_rows(y) if isinstance(y, torch.Tensor) else None]
    if rows != [batch, batch]:
        raise ValueError(f"step {step}: data gave {rows[0]} inputs and {rows[1]} targets but batch={batch}; "
                         f"the data must give the whole global batch (batch={batch} rows) every step, as "
                         "tensors (the inputs may be a dict of tensors), rows first")
    return x, y


def batch_rows(x) -> int | None:
    """The rows of a tensor, or of every tensor of a dict (None if they differ or it is neither)."""
    if isinstance(x, dict):
        counts = {batch_rows(v) for v in x.values()}
        return counts.pop() if len(counts) == 1 else None
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None


def map_rows(x, fn):
    """``fn`` on a tensor, or on each tensor of a dict of inputs."""
    return {k: fn(v) for k, v in x.items()} if isinstance(x, dict) else fn(x)


def chunk_rows(x, n: int) -> list:
    """``x`` in ``n`` micro-batches along its rows (a dict: each of its tensors alike)."""
    if isinstance(x, dict):
        parts = {k: v.chunk(n) for k, v in x.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(len(next(iter(parts.values()))))]
    return list(x.chunk(n))


class LossContractError(ValueError):
    """A loss that returns something labkit cannot average into one process's loss."""


@dataclass
class Stage:
    """One global (virtual) stage held by this rank."""

    index: int              # global stage: chunk c on pipeline rank r is stage c·pp + r
    chunk: int              # its position among this rank's stages
    module: nn.Module       # the whole model (pp = 1), or its blocks keeping their indices
    run: nn.Module          # what forward calls: the module, or its DDP wrapper
    sync: object            # labkit.parallel.data.sync.GradSync
    span: object = None     # a BackwardSpan per micro-batch; None: per-block spans (one stage)


class Executor:
    """This rank's stages, run by its action list, then dp-reduced and stepped."""

    HANDLERS = {"F": "_forward", "B": "_backward", "I": "_backward_input", "W": "_backward_weight",
                "SEND_F": "_send_activation", "RECV_F": "_recv_activation",
                "SEND_B": "_send_grad", "RECV_B": "_recv_grad"}

    def __init__(self, spec, stages: list[Stage], last_stage: int, actions, channel, data, loss_fn,
                 optimizer, meter, recorder, device, dp_index: int, owns_parameters: bool,
                 precision: Precision | None = None, tied=None, tp_group=None, tp_index: int = 0):
        self.spec, self.stages, self.last_stage, self.actions = spec, stages, last_stage, actions
        self.channel, self.data, self.loss_fn, self.optimizer = channel, data, loss_fn, optimizer
        self.meter, self.recorder, self.device, self.dp_index = meter, recorder, device, dp_index
        self.owns_parameters = owns_parameters
        self.precision = precision or Precision("fp32", device)   # autocast and fp16's loss scale
        self.tied = tied                   # the embedding group's sync (tied weights across stages)
        self.tp_group, self.tp_index = tp_group, tp_index     # tp_group None: no tensor split
        # Same keys as the full model's state_dict: one stage is the model itself (its root's own
        # parameters included); pipeline stages' blocks keep their names ("6.weight", "layers.3.…").
        self.model = stages[0].module if len(stages) == 1 and last_stage == 0 else \
            merge_stages([st.module for st in stages])
        # The reduction is armed for each stage's last gradient accumulation: its last B, or
        # its last W when the schedule splits backward (parameter gradients appear in W).
        self.last_backward = {a.chunk: a.microbatch for a in actions if a.op in ("B", "W")}
        self.chunk_of = {st.index: st.chunk for st in stages}     # stages this rank holds
        unknown = sorted({a.op for a in actions} - self.HANDLERS.keys())
        if unknown:
            raise ValueError(f"schedule {spec.strategy.schedule!r} uses action(s) {unknown} that the executor "
                             f"cannot run yet; add them to Executor.HANDLERS")

    def close(self) -> None:
        """Let go of this job. A parameter's autograd hooks are held from C++, where Python's
        collector cannot see them, and so is the state of DDP's comm hook; a hook whose closure
        reaches its parameter (a gradient sync holding its buckets) made a cycle nothing could
        collect. Every replaced job stayed alive, with its model, optimizer and process groups,
        and each change of degrees left a world's gloo threads and sockets behind: +4 threads per
        engine for each round of dp, tp and pp runs, without end. A long session slowed with it:
        over 15 rounds of benchmarks/bench_plan.py, zero=1's step went from 52 to 114 ms (flat at
        35–41 ms once jobs were closed)."""
        for sync in [st.sync for st in self.stages] + [self.tied]:
            if sync is not None:        # DDP's reducer (C++) keeps its comm hook's state: the sync
                vars(sync).clear()
        for p in self.model.parameters():
            for hooks in (getattr(p, "_post_accumulate_grad_hooks", None), getattr(p, "_backward_hooks", None)):
                if hooks:
                    hooks.clear()
        self.inputs, self.outputs, self.grads, self.kept, self.input_grads = {}, {}, {}, {}, {}

    # -- one step ------------------------------------------------------------------------------
    def batch(self, step: int):
        """This rank's 1/dp of the step's global batch, on its device (every strategy alike)."""
        s, batch = self.spec.strategy, self.spec.batch
        x, y = global_batch(self.data, step, batch)
        if isinstance(self.loss_fn, TokenLoss):
            # Counted tokens of the whole global batch: every rank holds it, so the count that
            # normalises the step's token loss needs no communication (Megatron all-reduces it).
            # Under cp the data hands this rank its slice of each sequence: count the whole.
            whole = getattr(self.data, "whole_target", None)
            self.counted = self.loss_fn.count(y if whole is None else whole)
        size = batch // s.dp
        rows = slice(self.dp_index * size, (self.dp_index + 1) * size)
        return map_rows(x, lambda t: t[rows].to(self.device)), y[rows].to(self.device)

    def step(self, step: int, batch) -> dict:
        s = self.spec.strategy
        x, y = batch
        self.step_index = step
        self.xs, self.ys = chunk_rows(x, s.microbatches), y.chunk(s.microbatches)
        self.inputs, self.outputs, self.grads, self.loss = {}, {}, {}, 0.0
        self.input_grads, self.kept = {}, {}       # for SEND_B / a local turn; I's state for W
        self.meter.start_step()
        before = None if getattr(self, "buffers_checked", False) else written_buffers(self.model)
        for action in self.actions:
            self.channel.poll()
            getattr(self, self.HANDLERS[action.op])(action)
        if before is not None:              # the first step: did a forward write a buffer?
            self.buffers_checked = True
            warn_written_buffers(written_buffers(self.model, before), s)
        self.channel.drain()
        self.recorder.microbatch = None
        for stage in self.stages:
            stage.sync.finish()
        if self.tied is not None:          # after the dp reduction, as Megatron does
            self.tied.finish()
        stepped = {}
        if self.optimizer is not None:
            label = getattr(self.optimizer, "label", f"{type(self.optimizer).__name__} step")
            with self.recorder.span("optimizer", label):
                stepped = self.precision.step(self.optimizer)     # fp16: unscale, maybe skip
                self.optimizer.zero_grad(set_to_none=False)
        for stage in self.stages:
            stage.sync.after_step()          # ZeRO-1/2: updated shards gathered back
        last = any(st.index == self.last_stage for st in self.stages)
        return {"loss": float(self.loss) if last else 0.0, "loss_weight": 1.0 if last else 0.0,
                "peak_activation_bytes": self.meter.peak, **stepped}

    def memory(self) -> dict:
        """This rank's model-state bytes after the last step (labkit.parallel.zero.memory);
        asked for once the step's clock has stopped: counting them is not the step's work."""
        return measure_memory(self.stages, self.optimizer, self.meter.peak)

    def full_state_dict(self) -> dict:
        """The parameters this rank reports for ``run.parameters()``: each key from exactly one
        rank (here: dp index 0 reports its stages; with tp, its tp index 0 after gathering the
        shards, a collective every tp rank of dp index 0 joins), so the notebook just merges.
        Every rank asks its syncs first: a sharded one (zero) gathers, which takes the whole dp group."""
        state = {}
        for stage in self.stages:
            state.update(stage.sync.full_state_dict(stage.module))
        if not self.owns_parameters:
            return {}
        if self.tp_group is not None:
            from .tensor import full_state_dict
            whole = full_state_dict(self.model, self.tp_group, state)
            # with ep, the experts other ep ranks hold: gathered by the sync, absent from this model
            whole.update({k: v.detach().cpu().clone() for k, v in state.items() if k not in whole})
            return whole if self.tp_index == 0 else {}
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def _label(self, op: str, a) -> str:
        return f"{op}{a.microbatch}" + (f" c{a.chunk}" if len(self.stages) > 1 else "")

    # -- the actions -----------------------------------------------------------------------------
    def _recv_activation(self, a):
        self.inputs[a.chunk, a.microbatch] = self.channel.recv_activation(a)

    def _forward(self, a):
        key, rec, stage = (a.chunk, a.microbatch), self.recorder, self.stages[a.chunk]
        if a.stage == 0:
            inp = self.xs[a.microbatch]
        elif key in self.inputs:
            inp = self.inputs[key]
        else:           # the V's turn: the previous stage is this rank's too, no message
            prev = self.outputs[self.chunk_of[a.stage - 1], a.microbatch]
            inp = self.inputs[key] = prev.detach().requires_grad_(prev.is_floating_point())
        rec.microbatch = a.microbatch
        span = nullcontext() if stage.sync.times_forward else rec.span("fwd", self._label("F", a),
                                                                        microbatch=a.microbatch)
        with span, self.meter.forward(key, inp) as kept, stage.sync.defer():
            with self.precision.autocast():
                out = stage.run(inp)
                if a.stage == self.last_stage:
                    out = self._loss(out, self.ys[a.microbatch])
            if a.stage == self.last_stage:
                self.loss = self.loss + out.detach()      # read once per step, not per micro-batch
                out = self.precision.scale(out)           # fp16: backward starts from loss × S
            kept.append(out)
        self.outputs[key] = out

    def _loss(self, out, target) -> torch.Tensor:
        """This micro-batch's share of the step's loss, scaled so that averaging the gradients
        over dp replicas (every sync divides by dp) gives one process's gradient.

        A mean loss: ÷ microbatches. A token loss: its sum ÷ the global batch's counted tokens,
        × dp·cp to undo the replicas' average (cp ranks average with dp) (Megatron and torchtitan divide by the global token
        count, not by a mean of means); an all-padding micro-batch adds 0, not 0/0."""
        s = self.spec.strategy
        if isinstance(self.loss_fn, TokenLoss):
            total, aux = self.loss_fn.parts(out, target)
            value = total * (s.dp * s.cp / max(self.counted, 1))     # the sync averages over dp×cp
            return value if aux is None else value + aux / s.microbatches
        value = self.loss_fn(out, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                f"a {type(value).__name__}"
            raise LossContractError(
                f"step {self.step_index}: the loss returned {what}, not a scalar tensor; return the mean over "
                "the rows as a tensor (e.g. ((o - y) ** 2).mean(), not .item() or float(...), and reduce "
                "a per-row loss with .mean())")
        return value / s.microbatches

    def _send_activation(self, a):
        self.channel.send_activation(a, self.outputs[a.chunk, a.microbatch])

    def _recv_grad(self, a):
        self.grads[a.chunk, a.microbatch] = self.channel.recv_grad(a, self.outputs[a.chunk, a.microbatch])

    def _backward(self, a):
        key, rec, stage = (a.chunk, a.microbatch), self.recorder, self.stages[a.chunk]
        rec.microbatch = a.microbatch
        out, grad = self.outputs.pop(key), self._output_grad(a)
        inp, span = self.inputs.get(key), stage.span
        if span is not None:
            span.name, span.expects_input_grad = self._label("B", a), inp is not None and inp.requires_grad
            if rec.enabled:
                span.open(None)
                if span.expects_input_grad:
                    inp.register_hook(span.inputs_ready)
        with stage.sync.backward(last=self.last_backward[a.chunk] == a.microbatch):
            if out.requires_grad:        # a stage with no parameters and a plain input has no graph
                torch.autograd.backward(out, grad)
        if span is not None:
            span.finish()
        self._input_grad_ready(a, inp.grad if inp is not None else None, inp)
        self.meter.release(key)

    def _backward_input(self, a):
        """I: the gradient w.r.t. the stage input only, now (it goes upstream); W comes later."""
        key, rec, stage = (a.chunk, a.microbatch), self.recorder, self.stages[a.chunk]
        rec.microbatch = a.microbatch
        out, grad, inp = self.outputs.pop(key), self._output_grad(a), self.inputs.get(key)
        with rec.span("bwd_input", self._label("I", a), microbatch=a.microbatch):
            g, self.kept[key] = backward_input(out, grad, inp, stage.module)
        self._input_grad_ready(a, g, inp)

    def _backward_weight(self, a):
        """W: the stage's weight gradients from what its I kept; the reduction hooks fire here."""
        key, rec, stage = (a.chunk, a.microbatch), self.recorder, self.stages[a.chunk]
        rec.microbatch = a.microbatch
        with rec.span("bwd_weight", self._label("W", a), microbatch=a.microbatch), \
                stage.sync.backward(last=self.last_backward[a.chunk] == a.microbatch):
            backward_weight(self.kept.pop(key))
        self.meter.release(key)

    def _output_grad(self, a):
        """The gradient of this stage's output: none for the loss, else received or handed over."""
        return None if a.stage == self.last_stage else self.grads.pop((a.chunk, a.microbatch), None)

    def _input_grad_ready(self, a, grad, inp) -> None:
        """Hand the input gradient to the previous stage: locally (the V's turn) or by SEND_B."""
        self.inputs.pop((a.chunk, a.microbatch), None)
        if a.stage == 0:
            return                         # the data needs no gradient
        if grad is None:                   # the output did not depend on the input
            grad = torch.zeros_like(inp)
        prev = self.chunk_of.get(a.stage - 1)
        if prev is not None:
            self.grads[prev, a.microbatch] = grad
        else:
            self.input_grads[a.chunk, a.microbatch] = grad

    def _send_grad(self, a):
        self.channel.send_grad(a, self.input_grads.pop((a.chunk, a.microbatch)))
