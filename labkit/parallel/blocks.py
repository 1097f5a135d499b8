"""A model's repeated blocks, found the way torchtitan and FSDP users find them, and the units
a whole-model strategy wraps around them.

An ``nn.Sequential``'s blocks are its children (labkit's own models). Any other module keeps
its transformer layers in an ``nn.ModuleList`` (``self.layers``, Hugging Face's
``model.layers``): the blocks are the items of the largest ModuleList of one class that sits
inside no other such list (a mixture-of-experts layer's ``experts`` list lives inside a
layer, and is not the model's blocks), or of the list ``blocks="layers"`` names.

Whatever lies outside the blocks (embeddings, a position table on the root, the final norm,
the head) is the root's own group, as FSDP's root ``fully_shard`` holds it.

>>> blocks = find_blocks(model)                  # [("layers.0", Block), ("layers.1", Block)]
>>> blocks = find_blocks(model, "model.layers")  # a dotted path to a ModuleList
"""
from __future__ import annotations

from torch import nn

BLOCKS_FIX = "pass lab.run(..., blocks='layers'), the dotted name of the nn.ModuleList that holds them"


def find_blocks(model: nn.Module, path: str | None = None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each repeated block, in order; ``[]`` when there are none."""
    path = blocks_path(model, path)
    if path is None:
        return []
    if path == "":
        return list(model.named_children())
    return [(f"{path}.{i}", block) for i, block in model.get_submodule(path).named_children()]


def blocks_path(model: nn.Module, path: str | None = None) -> str | None:
    """The dotted name of the blocks' container ("" for an ``nn.Sequential``'s own children),
    or None. ``path`` given: checked (ValueError naming the fix when it is not a ModuleList)."""
    if path is not None:
        if not isinstance(path, str):
            raise TypeError(f"blocks={path!r} must be the dotted name of an nn.ModuleList, e.g. blocks='layers'")
        try:
            container = model.get_submodule(path) if path else model
        except AttributeError:
            container = None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not len(container):
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
            raise ValueError(f"blocks={path!r} names no non-empty nn.ModuleList of {type(model).__name__}; "
                             f"its ModuleLists are {lists[:6] or 'none'}")
        return path
    if isinstance(model, nn.Sequential):
        return ""
    candidates = {name: m for name, m in model.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1}
    # a list inside another list's item (a layer's experts) is not the model's blocks
    outer = [n for n in candidates if not any(n.startswith(o + ".") for o in candidates if o != n)]
    if not outer:
        return None
    return max(outer, key=lambda n: len(candidates[n]))      # the first of the largest (model order)


def outside_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters no block holds (the root's own group), with their names."""
    inside = {id(p) for _, b in blocks for p in b.parameters()}
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]


def units(model: nn.Module, path: str | None) -> list[tuple[str, nn.Module]]:
    """The modules a per-block span or checkpoint is taken around, in model order: each block,
    and every other child on the way down to the blocks (the embedding, the norm, the head)."""
    if path is None:
        return list(model.named_children())
    if path == "":
        return list(model.named_children())
    out = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if full == path:
                out.extend((f"{full}.{i}", b) for i, b in child.named_children())
            elif path.startswith(full + "."):
                walk(child, full + ".")
            else:
                out.append((full, child))
    walk(model, "")
    return out


def check_blocks(model: nn.Module, strategy, path: str | None = None) -> None:
    """The sharded strategies need blocks (ValueError naming the fix); pipelines need an
    ``nn.Sequential`` or a chain of layers to cut (:mod:`.pipeline.modules`)."""
    if strategy.pp > 1 and not isinstance(model, nn.Sequential):
        from .pipeline.modules import aux_losses, pipeline_units
        pipeline_units(model)
        if strategy.precision == "fp16" and aux_losses(model):
            raise ValueError("Strategy.precision='fp16' with pp > 1: a balance loss's gradient is injected on the "
                             "stage that made it, outside fp16's loss scale; use precision='bf16' or 'fp32', "
                             "or aux_loss_coef=0")
    if path is not None:
        blocks_path(model, path)
    sharded = strategy.zero == 3 or (strategy.zero and strategy.zero_mode == "fsdp2")
    if sharded and not any(any(p.requires_grad for p in b.parameters()) for _, b in find_blocks(model, path)):
        how = "zero_mode='fsdp2'" if strategy.zero_mode == "fsdp2" else "zero=3"
        raise ValueError(f"Strategy.zero={strategy.zero} ({how}) shards the model block by block, and "
                         f"{type(model).__name__} has no repeated blocks with parameters (an nn.ModuleList of "
                         f"one class); {BLOCKS_FIX}, or use zero=1 or 2 with zero_mode='labkit'")
