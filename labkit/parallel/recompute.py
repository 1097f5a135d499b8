"""Activation recomputation: trade a second forward for the activations a backward would keep.

``apply_recompute(model, mode)`` on a built model, before training:

* ``"none"``: autograd keeps every tensor the backward needs (and undoes an earlier mode);
* ``"full"``: every top-level block runs under ``torch.utils.checkpoint`` (non-reentrant):
  only its input is kept, and its forward runs again inside the backward. Megatron's
  "full" recompute, one checkpoint per layer; torchtitan applies it per block the same way.
  A block that is a single op (a Linear, a GELU) saves nothing this way: it keeps its input
  either way, so recompute pays off for blocks of several ops (a transformer block);
* ``"selective"``: only submodules named ``core`` are checkpointed. Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, §5)
  recompute just attention's softmax and dropout region: its activations grow with the
  sequence length squared (5·a·s²·b bytes per layer of their eq. 1) while recomputing it
  costs a few percent of the FLOPs. labkit's GPT puts that region, with no parameters, in
  ``block.attn.core``.

The recomputed forward gives the same values (dropout's RNG state is replayed), so the
gradients are bitwise those without recompute. Parameter names and ``state_dict`` keys do
not change: the module's own ``forward`` is replaced on the instance, not wrapped in a new
module.

    >>> from labkit.models import mlp
    >>> model = apply_recompute(mlp(width=64, depth=4)(), "full")   # each block checkpointed
    >>> list(model.state_dict())[:2]
    ['0.weight', '0.bias']
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import RECOMPUTE_MODES as MODES

CORE = "core"     # the name of the submodule "selective" checkpoints


def apply_recompute(model: nn.Module, mode: str, blocks: str | None = None) -> nn.Module:
    """Set `model`'s recompute `mode` ("none" | "full" | "selective") in place; returns it.
    ``blocks``: the dotted name of the ModuleList whose items "full" checkpoints (default:
    found, :mod:`labkit.parallel.blocks`)."""
    targets = check_recompute(model, mode, blocks)
    for module in model.modules():
        module.__dict__.pop("forward", None)        # undo an earlier mode
    for module in targets:
        module.forward = types.MethodType(_recomputed_forward, module)
    return model


def check_recompute(model: nn.Module, mode: str, blocks: str | None = None) -> list[nn.Module]:
    """The modules `mode` would checkpoint; ValueError naming the fix for an unknown mode or a
    model that "selective" finds nothing in (``lab.run`` checks this before engines are called)."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r} is unknown; choose one of {', '.join(MODES)}")
    targets = recompute_targets(model, mode, blocks)
    if mode != "none" and not targets:
        raise ValueError(f"recompute='selective' checkpoints submodules named {CORE!r} (attention's "
                         f"softmax/dropout region) but {type(model).__name__} has none; put that region "
                         f"in a parameter-free submodule named {CORE!r} (as labkit.models.gpt does), "
                         "or use recompute='full'")
    return targets


def recompute_targets(model: nn.Module, mode: str, blocks: str | None = None) -> list[nn.Module]:
    """The modules `mode` checkpoints: top-level blocks (full) or those named ``core``.

    For "full", an ``nn.Sequential``'s blocks are its children; any other module's are its
    repeated blocks (the items of the ModuleList ``blocks`` names, or of the one
    :func:`labkit.parallel.blocks.find_blocks` finds, as torchtitan checkpoints each of
    ``model.layers``); a module with none falls back to its children, a ModuleList's /
    ModuleDict's items taken one by one.
    """
    if mode == "full" and not isinstance(model, nn.Sequential):
        from .blocks import find_blocks
        found = [b for _, b in find_blocks(model, blocks)]
        if found:
            return found
    if mode == "full":
        blocks = []
        for child in model.children():
            containers = (nn.ModuleList, nn.ModuleDict)
            blocks += list(child.children()) if isinstance(child, containers) else [child]
        return blocks or [model]
    if mode == "selective":
        return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == CORE]
    return []


def _recomputed_forward(self: nn.Module, *args, **kwargs):
    # The class's forward, not the instance's: this function *is* the instance's forward.
    # Bound with types.MethodType, so a deepcopy of the model rebinds it to the copy.
    forward = type(self).forward
    if not torch.is_grad_enabled():               # no graph, nothing kept: just run it
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def held_activation_bytes(model: nn.Module, *inputs) -> int:
    """Bytes a forward of `model` leaves allocated for its backward, on CPU.

    Counted by torch's profiler as the forward's net allocations, so it sees everything that
    stays alive (autograd's saved tensors, the inputs a checkpoint keeps, the output), with no
    hook of labkit's in the way.
    """
    import gc

    from torch.profiler import ProfilerActivity, profile

    # Garbage from before (a cycle holding tensors) freed by a collection inside the window
    # would count as a negative allocation: collect first, and none during the forward.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model(*inputs)
    finally:
        if was_enabled:
            gc.enable()
    held = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    del out
    return held
