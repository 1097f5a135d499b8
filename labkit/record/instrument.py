"""Compute spans for a model's blocks, taken with autograd hooks.

Timing ``loss.backward()`` as one span would be wrong for data parallelism: DDP (and any
strategy that waits for its buckets inside backward) returns only after communication
finished, so that span would swallow the comm wait and claim perfect overlap. Each block's
backward is timed on its own instead: from the moment the gradient of its output arrives to
the moment its input gradient *and* its parameters' gradients exist.

Plain tensor hooks do this (registered on each block's output and input during forward),
rather than ``register_full_backward_hook``: full hooks wrap every block's inputs and outputs
in extra autograd nodes, which cost several percent of a step on CPU.

>>> handles = instrument_backward(model, recorder)   # once; ``remove_hooks(handles)`` undoes it
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class BackwardSpan:
    """The backward span of one block: opened when its output's gradient arrives, closed
    when its input's gradient and all its parameters' gradients exist."""

    def __init__(self, recorder, name: str, n_params: int):
        self.recorder, self.name, self.n_params = recorder, name, n_params
        self.start = None
        self.pending = 0
        self.inputs_done = False
        self.expects_input_grad = False

    def forward_done(self, _module, inputs, output) -> None:
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        self.expects_input_grad = first is not None and first.requires_grad
        on_grad(output, self.open)
        if self.expects_input_grad:
            on_grad(first, self.inputs_ready, before_others=True)

    def open(self, _grad):
        self.start = self.recorder.mark()
        self.pending = self.n_params
        self.inputs_done = not self.expects_input_grad

    def inputs_ready(self, _grad):
        self.inputs_done = True
        self._maybe_close()

    def param_ready(self, *_):
        self.pending -= 1
        self._maybe_close()

    def _maybe_close(self):
        if self.start is not None and self.inputs_done and self.pending <= 0:
            self.finish()

    def finish(self):
        """Close the span now if it is still open (e.g. a parameter got no gradient)."""
        if self.start is not None:
            rec = self.recorder
            rec.add("bwd", self.name, self.start, rec.mark(), microbatch=getattr(rec, "microbatch", None))
            self.start = None


def on_grad(t: torch.Tensor, fn, before_others: bool = False) -> None:
    """Call ``fn(grad)`` when ``t``'s gradient is computed, with one autograd hook per tensor
    however many spans watch it: a block's output is the next block's input, so its one hook
    closes the later block's span and then opens the earlier one's (a hook registered per span
    per forward costs a handle and a C++ → Python call each, which a small step notices)."""
    watchers = t.__dict__.get("_labkit_on_grad")
    if watchers is None:
        watchers = t._labkit_on_grad = []
        t.register_hook(_call_each(watchers))
    if before_others:
        watchers.insert(0, fn)
    else:
        watchers.append(fn)


def _call_each(watchers: list):
    def hook(grad):
        for fn in watchers:
            fn(grad)
    return hook          # None: the gradient passes on unchanged


def instrument_backward(model: nn.Module, recorder, units: list[tuple[str, nn.Module]] | None = None) -> list:
    """Record a ``bwd`` span per unit of ``model``; returns the hook handles.

    ``units``: (name, module) pairs, e.g. ``labkit.parallel.blocks.units`` (each repeated block
    and the modules around them); default: the model's children (an ``nn.Sequential``'s blocks).
    A unit whose output is not one tensor gets no span."""
    handles = []
    if not recorder.enabled:
        return handles
    for name, block in (units if units is not None else model.named_children()):
        params = [p for p in block.parameters() if p.requires_grad]
        span = BackwardSpan(recorder, f"{type(block).__name__} {name}", len(params))
        handles.append(block.register_forward_hook(span.forward_done))
        handles += [p.register_post_accumulate_grad_hook(span.param_ready) for p in params]
    return handles


def instrument_forward(units: list[tuple[str, nn.Module]], recorder) -> list:
    """Record a ``fwd`` span per unit (``F name``); for the modules around the blocks (the
    embedding, the norm, the head) when a sharded sync times the blocks' forwards itself."""
    handles = []
    if not recorder.enabled:
        return handles
    for name, module in units:
        start = {}

        def opened(_m, _args, start=start) -> None:
            start["t"] = recorder.mark()

        def closed(_m, _args, _out, name=name, start=start) -> None:      # None: the output stays
            recorder.add("fwd", f"F {name}", start["t"], recorder.mark(),
                         microbatch=getattr(recorder, "microbatch", None))
        handles += [module.register_forward_pre_hook(opened), module.register_forward_hook(closed)]
    return handles


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


# -- memory: what each micro-batch keeps for its backward --------------------------------------
class ActivationMeter:
    """Bytes held for backward at once: autograd's saved tensors, stage inputs and outputs.

    Measured with ``saved_tensors_hooks`` (parameters and autocast's copies of them excluded,
    shared storage counted once),
    added when a micro-batch's forward ends, dropped when its backward ends.

    Measured on a job's first step only: a step's shapes repeat (the batch is fixed and
    pipeline stages must keep their output shapes), so later steps hold the same bytes, and
    the hooks, which cost ~8 % of a small step on CPU (FACTS.md), would only slow them down.
    """

    def __init__(self, params):
        self.params = list(params)      # (parameters are told apart by _is_parameter)
        self.param_ids = {id(p) for p in self.params}   # by identity: zero=3 regathers their memory
        self.live: dict[tuple, int] = {}
        self.peak = 0
        self.measured = False

    def start_step(self) -> None:
        """Call at the start of every step; measures until the first step has ended."""
        if self.live or self.peak:
            self.measured = True
        self.live = {}

    @contextmanager
    def forward(self, key, inputs):
        if self.measured:
            yield []
            return
        seen: dict[int, int] = {}

        def pack(t):
            if not _is_parameter(t) and not _is_param_cast(t, self.param_ids):
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kept = []
            yield kept                   # the body appends the tensors it keeps (the output)
        for t in [inputs, *kept]:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        self.live[key] = sum(seen.values())
        self.peak = max(self.peak, sum(self.live.values()))

    def release(self, key) -> None:
        self.live.pop(key, None)


def _is_parameter(t: torch.Tensor) -> bool:
    """A weight, or a view of one (Linear saves ``w.t()``): a leaf that requires grad.

    Asked of the tensor, not looked up by address: a sharded model (zero=3, FSDP2) gathers its
    weights into fresh memory every forward. Stage inputs that require grad are leaves too;
    the meter adds those (and the outputs) explicitly after the forward.
    """
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _is_param_cast(t: torch.Tensor, param_ids: set) -> bool:
    """A parameter's low-precision copy that autocast made for this forward (bf16/fp16 mixed
    precision): weights, not activations, so not counted. autocast's copy is a ``_to_copy`` of
    the parameter itself: its grad_fn leads straight to an AccumulateGrad (saved as such, or as
    a view of it: a Linear saves ``weight.t()``), whose variable is one of ``param_ids`` (by
    identity, not address: zero=3 gathers its weights into fresh memory every forward)."""
    fn = (t._base if t._base is not None else t).grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions[0][0] if fn.next_functions else None
    variable = getattr(nxt, "variable", None)
    return variable is not None and id(variable) in param_ids
