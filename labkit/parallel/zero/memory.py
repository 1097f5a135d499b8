"""Model-state memory each rank holds, measured (not predicted): the bytes of the tensors
themselves, so the numbers sit beside the ZeRO paper's formula
(:func:`labkit.parallel.zero.model_state_bytes`) without allocator noise.

* parameters and gradients: asked of each stage's sync (``held_bytes``), at rest (after the
  step) and at their most during the step (ZeRO-3: shards plus the blocks gathered at once;
  ZeRO-2: shards plus the gradient buckets in flight);
* optimizer state: every tensor in the optimizer's ``state`` (AdamW: two moments and a step
  counter per tensor; SGD without momentum: none), which persists, so peak = at rest;
* activations: the executor's meter (``peak_activation_bytes``).

Padding is counted where it is held (a flat shard of a unit padded to a multiple of dp), which
is one of the two reasons the measured bytes sit a little above the formula.
"""
from __future__ import annotations

import torch


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor the optimizer keeps between steps."""
    if optimizer is None:
        return 0
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def measure_memory(stages, optimizer, activation_peak: int) -> dict:
    """This rank's model-state bytes after a step: {params, params_peak, grads, grads_peak,
    optimizer, activations_peak}."""
    held = {"params": 0, "params_peak": 0, "grads": 0, "grads_peak": 0}
    for stage in stages:
        for key, value in stage.sync.held_bytes(stage.module).items():
            held[key] += value
    state = optimizer_state_bytes(optimizer)
    held.update(optimizer=state, optimizer_peak=state, activations_peak=activation_peak)
    return held
