"""What this rank holds of each parameter while a model is materialised per rank
(:mod:`.materialize`): its pipeline stages' parameters, a Megatron tp layer's chunk, a
hand-written ZeRO-3 unit's flat slice, or the whole tensor. The same splits the eager path
makes after building the whole model (``parallel/tensor/layers.py``, ``parallel/zero/shard.py``),
made before any whole model exists.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


def pieces_for_rank(meta: nn.Module, spec, groups) -> Callable:
    """``keep(name, whole)`` for this rank of ``spec``: None for a parameter of another
    pipeline stage's block; a Megatron tp layer's chunk (marked ``labkit_shard``); for
    hand-written ZeRO-3, an empty tensor of the parameter's (tp-local) shape carrying this
    rank's slice of its unit's flat shard (``labkit_piece``, read by ``FlatUnit``); otherwise
    the whole tensor. The same splits the eager path makes afterwards, made before any whole
    model exists (``parallel/tensor/layers.py``, ``parallel/zero/shard.py``)."""
    s = spec.strategy
    held = _held_names(meta, s, groups)
    tp = _tp_chunks(meta, s, groups, spec.tp_plan)
    shapes = {n: _chunk_shape(p.shape, *tp[n]) if n in tp else tuple(p.shape)
              for n, p in meta.named_parameters(remove_duplicate=False)}
    flat = _zero3_slices(meta, s, groups, held, shapes, spec.blocks)

    def keep(name: str, whole: torch.Tensor):
        if held is not None and name not in held:
            return None
        t = whole
        if name in tp:
            dim, rank, size = tp[name]
            t = t.chunk(size, dim=dim)[rank].clone()
            t.labkit_shard = tp[name]
        if name in flat:
            start, stop = flat[name]
            carrier = torch.empty(t.shape, dtype=t.dtype)
            carrier.untyped_storage().resize_(0)         # no values: FlatUnit's views take its place
            carrier.labkit_piece = t.reshape(-1)[start:stop].clone()
            if name in tp:
                carrier.labkit_shard = tp[name]
            t = carrier
        return t
    return keep


def _chunk_shape(shape, dim: int, rank: int, size: int) -> tuple:
    return tuple(torch.empty(shape, device="meta").chunk(size, dim=dim)[rank].shape)


def _held_names(meta: nn.Module, s, groups) -> set[str] | None:
    """The parameter and buffer names of this rank's pipeline stages (None: every name). A
    stage of an ``nn.Sequential`` is its children by index; any other model's stages are held
    whole here (correct values, no saving)."""
    if s.pp == 1 or not isinstance(meta, nn.Sequential):
        return None
    from .build import my_stages
    from .pipeline.stages import stage_blocks
    from .materialize import final_tensors
    blocks = stage_blocks(meta, s)
    mine = {str(i) for g in my_stages(s, groups.coords[1]) for i in blocks[g]}
    return {name for name, _ in final_tensors(meta) if name.split(".")[0] in mine}


def _tp_chunks(meta: nn.Module, s, groups, plan) -> dict[str, tuple[int, int, int]]:
    """name → (dim, tp rank, tp) for each parameter a Megatron tp layer keeps a chunk of."""
    if s.tp == 1 or s.tp_mode != "megatron":      # dtensor distributes from whole tensors
        return {}
    from .tensor.layers import MEGATRON_LAYERS
    from .tensor.plan import match_plan, resolve_plan
    out = {}
    for name, style in match_plan(meta, resolve_plan(meta, plan)).items():
        module = meta.get_submodule(name)
        kind = nn.Embedding if isinstance(module, nn.Embedding) else nn.Linear
        for pname, dim in MEGATRON_LAYERS[kind, style].shard_dims.items():
            if getattr(module, pname, None) is not None:
                out[f"{name}.{pname}"] = (dim, groups.coords[2], s.tp)
    return out


def _zero3_slices(meta: nn.Module, s, groups, held, shapes: dict, blocks_path) -> dict[str, tuple[int, int]]:
    """name → (start, stop) of the parameter's flattened (tp-local) values that fall in this
    dp rank's shard of its ZeRO-3 unit: the layout ``Zero3Sync.build_units`` makes, one unit
    per block with parameters, then the root's group, each padded to a multiple of dp."""
    if s.zero != 3 or s.zero_mode == "fsdp2" or s.dp == 1 or s.ep > 1 or (s.tp > 1 and s.tp_mode != "megatron"):
        return {}       # FSDP2, DTensor and the expert split read whole tensors, or change the units
    from .blocks import blocks_path as find_path, find_blocks, outside_blocks
    from .build import my_stages
    if s.pp == 1:
        stages = [(meta, find_path(meta, blocks_path))]
    else:
        from .pipeline.stages import stage_blocks
        blocks = stage_blocks(meta, s)
        stages = []
        for g in my_stages(s, groups.coords[1]):
            module = nn.Sequential()
            for i in blocks[g]:
                module.add_module(str(i), meta[i])
            stages.append((module, find_path(module, None)))
    out, rank = {}, groups.coords[0]
    for module, path in stages:
        if not any(p.requires_grad for p in module.parameters()):
            continue                                    # no sync at all: kept whole
        found = find_blocks(module, path)
        units = [[(f"{name}.{n}", p) for n, p in block.named_parameters() if p.requires_grad]
                 for name, block in found]
        units = [u for u in units if u] + [outside_blocks(module, found)]
        for members in units:
            numel = sum(math.prod(shapes[n]) for n, _ in members)
            shard = -(-numel // s.dp)
            lo, hi, offset = rank * shard, (rank + 1) * shard, 0
            for name, _ in members:
                n = math.prod(shapes[name])
                out[name] = (min(max(lo - offset, 0), n), max(min(hi - offset, n), 0))
                offset += n
    return out
