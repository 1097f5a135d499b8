"""Tensor parallelism (Megatron-LM's intra-layer split) by hand, and torch's DTensor as the comparator.

Two modes over the same plan (DTensor's convention, see :mod:`.plan`):

* ``"megatron"`` — each planned module is replaced by labkit's own
  :class:`~.layers.ColumnParallelLinear`, :class:`~.layers.RowParallelLinear` or
  :class:`~.layers.VocabParallelEmbedding`, built from the whole seeded module and split;
  their collectives are the f/g pair of :mod:`.mappings`, over :mod:`labkit.comm` (on the
  timeline); an embedding and a head that share one weight (tied), both split by vocabulary,
  share one shard, as Megatron-LM ties its vocab-parallel embedding and output layer;
* ``"dtensor"`` — ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a
  device mesh over the same tp group (gloo on CPU runs it); torch's own collectives, so they
  are not on labkit's timeline.

Sequence parallelism (megatron mode, ``sequence_parallel=True``; Korthikanti et al. 2022)
also cuts the LayerNorm regions along the sequence where the model's ``sp_plan`` says:
``"scatter_output"`` (the residual stream is cut after this module), ``"sequence"`` (this
module works on a slice; its parameters' gradients are summed over tp), ``"gather_input"``
(the sequence is whole again before this module). f and g become all-gather and
reduce-scatter along the sequence.

On an engine, with this rank's tp group (ranks laid out dp × pp × tp, tp innermost)::

    >>> model = build_model(labkit.models.gpt(vocab_size=96), seed)
    >>> model = build_tensor_parallel(model, "megatron", groups.tp, tp_rank, tp_size, plan=None)
    >>> ...train...
    >>> state = full_state_dict(model, groups.tp)      # every tp rank calls it: a collective
"""
from __future__ import annotations

import torch
from torch import nn

from ... import comm
from .layers import MEGATRON_LAYERS
from .mappings import all_reduce_grad, gather_from_sequence_parallel, scatter_to_sequence_parallel
from .plan import TP_MODES, check_tensor_parallel, match_plan, resolve_plan

__all__ = ["build_tensor_parallel", "check_tensor_parallel", "full_state_dict", "match_plan", "TP_MODES"]


def build_tensor_parallel(model: nn.Module, tp_mode: str, tp_group, tp_rank: int, tp_size: int,
                          plan: dict | None = None, sequence_parallel: bool = False,
                          sp_plan: dict | None = None) -> nn.Module:
    """``model`` with the modules ``plan`` names split over ``tp_group`` (in place; returned).

    ``plan`` defaults to ``model.tp_plan``; ``tp_group`` None means the world group. The
    model must already hold the seeded weights: every rank cuts its shard from the same
    whole tensors. ``sequence_parallel`` (megatron mode) also cuts the LayerNorm regions
    along the sequence where ``sp_plan`` (default ``model.sp_plan``) says. Call
    :func:`check_tensor_parallel` first (in the notebook).
    """
    if tp_size == 1:
        return model
    matched = match_plan(model, resolve_plan(model, plan))
    if tp_mode == "megatron":
        shards = {}               # id of a whole weight → its shard: a tied embedding and head share one
        for name, style in matched.items():
            parent, _, child = name.rpartition(".")
            module = model.get_submodule(name)
            kind = nn.Embedding if isinstance(module, nn.Embedding) else nn.Linear
            split = MEGATRON_LAYERS[kind, style](module, tp_group, tp_rank, tp_size, name, sequence_parallel)
            if id(module.weight) in shards:          # both cut rows [rank·V/tp, (rank+1)·V/tp) of one table
                split.weight = shards[id(module.weight)]
            shards[id(module.weight)] = split.weight
            setattr(model.get_submodule(parent), child, split)
        if sequence_parallel:
            _mark_sequence_region(model, sp_plan if sp_plan is not None else model.sp_plan, tp_group)
        return model
    if sequence_parallel:
        raise ValueError("Strategy.sequence_parallel is built for tp_mode='megatron' only; use that mode")
    if tp_mode == "dtensor":
        return _parallelize_dtensor(model, matched, tp_group)
    raise ValueError(f"Strategy.tp_mode={tp_mode!r} is unknown; use one of {', '.join(map(repr, TP_MODES))}")


def fresh_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions before a new mesh is used. The cache is keyed
    by mesh *equality* (the same ranks and device type), and what it returns carries the mesh
    of its first call: a later run over new groups on the same ranks (FSDP2's dp mesh after a
    dtensor tp mesh, or the reverse) gathered over the earlier run's group, which no longer
    resolves ("Could not resolve the process group registered under the name …")."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:             # the C++ dispatch fast path keeps its own copy
        clear_native()


def _parallelize_dtensor(model: nn.Module, matched: dict, tp_group) -> nn.Module:
    """torch's own: a 1-d device mesh over the tp group, then ``parallelize_module``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fresh_dtensor_caches()

    device = next(model.parameters()).device.type
    # from_group wraps the existing group: no new_group call, which every rank of the world
    # would have to make (in 3D each rank only belongs to its own tp group).
    mesh = DeviceMesh.from_group(tp_group if tp_group is not None else dist.group.WORLD, device)
    plan = {}
    for name, style in matched.items():
        if style == "colwise":
            plan[name] = ColwiseParallel()
        elif style == "colwise_gather_output":       # the whole output on every rank
            plan[name] = ColwiseParallel(output_layouts=Replicate())
        elif isinstance(model.get_submodule(name), nn.Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate())    # token ids are whole on every rank
        else:
            plan[name] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _mark_sequence_region(model: nn.Module, sp_plan: dict, tp_group) -> None:
    """Hooks at the edges of the sequence-parallel region (Korthikanti et al. 2022, Fig. 5):
    cut after ``scatter_output``, join before ``gather_input``; the parameters of
    ``sequence`` modules (LayerNorms) see 1/t of the tokens, so their gradients are summed."""
    for name, style in match_plan(model, sp_plan).items():
        module = model.get_submodule(name)
        if style == "scatter_output":
            module.register_forward_hook(
                lambda _m, _i, out, name=name: scatter_to_sequence_parallel(out, tp_group, name))
        elif style == "gather_input":      # its consumer is replicated: backward keeps a slice
            module.register_forward_pre_hook(
                lambda _m, args, name=name: (gather_from_sequence_parallel(args[0], tp_group, name, False),))
        else:
            for pname, p in module.named_parameters():
                p.register_hook(all_reduce_grad(tp_group, f"{name}.{pname}"))


def full_state_dict(model: nn.Module, tp_group=None, local: dict | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state dict, with the model's own keys, on CPU (a collective over tp).

    Megatron shards are gathered with :func:`labkit.comm.all_gather` (so the gather is on the
    timeline too); DTensor parameters with ``full_tensor()``. ``local``: this rank's tp shards
    by key, when the model's own parameters are not whole over dp (zero=3 frees them; its
    sync gathers them into such a dict first).
    """
    state = {}
    for prefix, module in model.named_modules():
        dims = getattr(module, "shard_dims", None)
        for name, tensor in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if local is not None and key in local:
                tensor = local[key]
            if dims is not None and name in dims:
                tensor = _gather(tensor.detach(), dims[name], tp_group, key)
            elif hasattr(tensor, "full_tensor"):
                tensor = tensor.detach().full_tensor()
            state[key] = tensor.detach().cpu().clone()
    for key, tensor in model.state_dict().items():      # buffers (never sharded)
        if key not in state:
            state[key] = tensor.detach().cpu().clone()
    return {key: state[key] for key in model.state_dict()}


def _gather(shard: torch.Tensor, dim: int, group, name: str) -> torch.Tensor:
    """Concatenate every tp rank's ``shard`` along ``dim`` (rank order)."""
    moved = shard.movedim(dim, 0).contiguous()
    size = torch.distributed.get_world_size(group)
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, moved, group=group, name=f"tp gather {name}")
    return out.movedim(0, dim)

