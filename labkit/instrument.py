"""Compute spans for a model's blocks, taken with module hooks.

Timing ``loss.backward()`` as one span would be wrong for data parallelism: DDP (and any
strategy that waits for its buckets inside backward) returns only after communication
finished, so that span would swallow the comm wait and claim perfect overlap. Each block's
backward is timed on its own instead: from its backward pre-hook to the moment its input
gradient *and* its parameters' gradients exist.

>>> handles = instrument_backward(model, recorder)   # once; ``remove_hooks(handles)`` undoes it
"""
from __future__ import annotations

from torch import nn


class _BlockSpan:
    """The backward span of one block: opened by the pre-hook, closed when all its grads exist."""

    def __init__(self, recorder, name: str, n_params: int):
        self.recorder, self.name, self.n_params = recorder, name, n_params
        self.start = None
        self.pending = 0
        self.inputs_done = False

    def open(self, *_):
        self.start = self.recorder.mark()
        self.pending = self.n_params
        self.inputs_done = False

    def inputs_ready(self, *_):
        self.inputs_done = True
        self._maybe_close()

    def param_ready(self, *_):
        self.pending -= 1
        self._maybe_close()

    def _maybe_close(self):
        if self.start is not None and self.inputs_done and self.pending <= 0:
            rec = self.recorder
            rec.add("bwd", self.name, self.start, rec.mark(), microbatch=getattr(rec, "microbatch", None))
            self.start = None


def _disable_inplace(module: nn.Module) -> None:
    # Full backward hooks wrap a block's output; an in-place op after it (ReLU(inplace=True))
    # would then modify a hooked view. The result is the same without in-place.
    for sub in module.modules():
        if getattr(sub, "inplace", False) is True:
            sub.inplace = False


def instrument_backward(model: nn.Sequential, recorder, names: list[str] | None = None) -> list:
    """Record a ``bwd`` span per top-level block of ``model``; returns the hook handles."""
    handles = []
    if not recorder.enabled:
        return handles
    for i, block in enumerate(model):
        _disable_inplace(block)
        params = [p for p in block.parameters() if p.requires_grad]
        span = _BlockSpan(recorder, names[i] if names else f"{type(block).__name__} {i}", len(params))
        handles.append(block.register_full_backward_pre_hook(span.open))
        handles.append(block.register_full_backward_hook(span.inputs_ready))
        handles += [p.register_post_accumulate_grad_hook(span.param_ready) for p in params]
    return handles


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
