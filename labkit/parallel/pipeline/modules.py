"""Pipeline stages cut from a decoder that is not an ``nn.Sequential``: the model's own layer list.

A decoder's forward is, between the token ids and the logits, a chain of modules that each
map one tensor to the next: the embedding, each decoder layer, the final norm, the head
(Hugging Face writes the middle of it as ``base_model_pp_plan``; torchtitan's pipeline cuts
Llama the same way). That chain is the model's **units**, and the stage split
(:mod:`.stages`) cuts the unit list as it cuts an ``nn.Sequential``'s children.

Where the chain comes from, first match wins:

1. a Hugging Face causal LM: its config's ``base_model_pp_plan`` under the base model
   (``model.embed_tokens``, ``model.layers``, ``model.norm``), then ``lm_head``;
2. ``model.pp_plan``: the dotted names of the modules the forward calls in order, each on
   the previous one's output; a name of an ``nn.ModuleList`` stands for its items, one unit
   each (``["tok_emb", "layers", "norm", "head"]``);
3. a model whose children are one module (the embedding), its list of repeated blocks
   (:mod:`labkit.parallel.blocks`), then the modules after it, called in that order
   (labkit's llama: ``tok_emb``, ``layers``, ``norm``, ``head``).

What a layer needs besides the hidden state is recomputed on its stage from the sequence
length: llama's layers compute their own RoPE; a Hugging Face decoder layer is given the
rotary cos/sin of ``model.rotary_emb`` and the causal mask of ``create_causal_mask`` (no
parameters, so nothing to send). A mixture-of-experts layer's balance loss (a module with
``pop_aux_loss``) is added to the training loss where it is made: its gradient is injected
in backward on the stage that computed it, scaled as the micro-batch's loss is (Megatron's
``MoEAuxLossAutoScaler``, ``megatron/core/transformer/moe/moe_utils.py``). The parameters
equal one process's; the loss a pipeline reports is its last stage's, the cross-entropy
without the balance loss (whose value stays on the stages that made it).

``Strategy.split_at`` names unit indices; the interleaved schedule gives each stage an equal
share of the layers, the embedding with the first and the norm and head with the last.

A stage is a :class:`PipelineStage`: the model's own submodules under their own dotted
names (``layers.3.attn.q_proj.weight``; ``model.layers.3...`` for Hugging Face), so its
state_dict keys are the model's.

    >>> model = labkit.models.llama(n_layer=4)()
    >>> [u.path for u in pipeline_units(model)][:3]
    ['tok_emb', 'layers.0', 'layers.1']
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..blocks import blocks_path

PP_PLAN_FIX = ("give the model a pp_plan attribute, the dotted names of the modules its forward calls in order "
               "on one tensor, e.g. model.pp_plan = ['tok_emb', 'layers', 'norm', 'head'] (a ModuleList's name "
               "stands for its items), or write it as an nn.Sequential")


@dataclass(frozen=True)
class Unit:
    """One link of the chain: the module at ``path``, called on the previous unit's output.
    ``kind`` "hf_layer": a Hugging Face decoder layer, given its rotary cos/sin (from the
    module at ``rotary``) and causal mask."""

    path: str
    kind: str = "plain"
    rotary: str | None = None
    layer: bool = False       # an item of the model's layer list (interleaved splits those evenly)


def pipeline_units(model: nn.Module) -> list[Unit]:
    """The model's units in forward order (module docstring); ValueError naming the fix when
    there is no chain to cut, or when the chain leaves some of the model's parameters out."""
    units = _hf_units(model)      # before pp_plan: transformers' own model.pp_plan is a dict by name
    if units is None and getattr(model, "pp_plan", None) is not None:
        units = _planned(model, model.pp_plan)
    if units is None:
        path = blocks_path(model)
        children = [name for name, _ in model.named_children()]
        if not path or "." in path or children.index(path) != 1:
            raise ValueError(f"Strategy.pp > 1 cuts the model into stages along its chain of layers, and "
                             f"{type(model).__name__} has no chain labkit can read (one embedding, then its list "
                             f"of repeated blocks, then the modules after it); {PP_PLAN_FIX}")
        units = _planned(model, children)
    held = {id(p) for u in units for p in model.get_submodule(u.path).parameters()}
    left = [name for name, p in model.named_parameters() if id(p) not in held]
    if left:
        chain = ", ".join(u.path for u in units[:3])
        raise ValueError(f"Strategy.pp > 1: {type(model).__name__}'s chain of layers ({chain}…) leaves out "
                         f"parameters {left[:4]}, so no stage would hold them; move them into a "
                         f"submodule the chain calls (e.g. one embedding module that adds token and position "
                         f"embeddings), or write the model as an nn.Sequential")
    return units


def _planned(model: nn.Module, plan) -> list[Unit]:
    if isinstance(plan, str) or not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"{type(model).__name__}.pp_plan={plan!r} must be a non-empty list of dotted module "
                         f"names; {PP_PLAN_FIX}")
    units = []
    for name in plan:
        try:
            module = model.get_submodule(name) if isinstance(name, str) and name else None
        except AttributeError:
            module = None
        if module is None:
            raise ValueError(f"{type(model).__name__}.pp_plan names {name!r}, which is not a submodule of the "
                             f"model; its children are {[n for n, _ in model.named_children()]}")
        if isinstance(module, nn.ModuleList):
            units += [Unit(f"{name}.{i}", layer=True) for i, _ in module.named_children()]
        else:
            units.append(Unit(name))
    return units


def _hf_units(model: nn.Module) -> list[Unit] | None:
    """A transformers causal LM's chain (``base_model_pp_plan``, then ``lm_head``), or None."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", None)
    if not plan or not prefix or not hasattr(model, "lm_head") or not hasattr(model, prefix):
        return None
    base = getattr(model, prefix)
    rotary = f"{prefix}.rotary_emb" if hasattr(base, "rotary_emb") else None
    units = []
    for name in plan:
        module = base.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            units += [Unit(f"{prefix}.{name}.{i}", "hf_layer", rotary, layer=True) for i, _ in module.named_children()]
        else:
            units.append(Unit(f"{prefix}.{name}"))
    return units + [Unit("lm_head")]


def unit_weights(model: nn.Module) -> list[int]:
    """Each unit's parameter count (what the balanced split weighs)."""
    return [sum(p.numel() for p in model.get_submodule(u.path).parameters()) for u in pipeline_units(model)]


def layer_span(model: nn.Module) -> range:
    """The unit indices of the model's layers (a Sequential: all its children)."""
    if isinstance(model, nn.Sequential):
        return range(len(model))
    at = [i for i, u in enumerate(pipeline_units(model)) if u.layer]
    return range(at[0], at[-1] + 1) if at else range(0)


def unit_parameters(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """Each pipeline unit's parameters under the model's own names (a Sequential's children
    are its units); a weight tied between two units is listed in both."""
    if isinstance(model, nn.Sequential):
        return [[(f"{i}.{n}", p) for n, p in block.named_parameters(remove_duplicate=False)]
                for i, block in enumerate(model)]
    return [[(f"{u.path}.{n}", p) for n, p in model.get_submodule(u.path).named_parameters(remove_duplicate=False)]
            for u in pipeline_units(model)]


def unit_count(model: nn.Module) -> int:
    return len(model) if isinstance(model, nn.Sequential) else len(pipeline_units(model))


# -- a stage -------------------------------------------------------------------------------------
class _Holder(nn.Module):
    """A container on the way to a unit's module (``model`` in ``model.layers.3``); it is never
    called, it only gives the parameters their names."""


class _ListHolder(nn.ModuleList):
    """Some items of a model's ModuleList, under their own indices (``layers.3``, ``layers.4``),
    so the stage's blocks are found as the model's are (:func:`labkit.parallel.blocks.find_blocks`)."""


def _attach(root: nn.Module, model: nn.Module, path: str) -> None:
    """Put ``model``'s submodule at ``path`` into ``root`` under the same dotted name."""
    parts, node, at = path.split("."), root, model
    for part in parts[:-1]:
        at = getattr(at, part)
        if part not in node._modules:
            node._modules[part] = _ListHolder() if isinstance(at, nn.ModuleList) else _Holder()
        node = node._modules[part]
    node._modules[parts[-1]] = getattr(at, parts[-1])


class PipelineStage(nn.Module):
    """Consecutive units of a model: its own submodules under their own names, called in order.

    ``aux_scale``: the weight of a balance loss's gradient, 1/microbatches (the executor
    divides each micro-batch's loss by the micro-batch count).
    """

    def __init__(self, model: nn.Module, units: list[Unit], aux_scale: float = 1.0):
        super().__init__()
        self.units, self.aux_scale = list(units), aux_scale
        self.config = getattr(model, "config", None)         # a transformers model's (its mask needs it)
        for u in self.units:
            _attach(self, model, u.path)
            if u.rotary is not None and not _has(self, u.rotary):
                _attach(self, model, u.rotary)             # cos/sin are recomputed here: no parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in self.units:
            # looked up each call: a wrapper (activation checkpointing) may have replaced it
            module = self.get_submodule(u.path)
            x = _hf_layer(self, module, u, x) if u.kind == "hf_layer" else module(x)
            if isinstance(x, tuple):                         # layers that return (hidden, ...)
                x = x[0]
            x = _add_aux_losses(module, x, self.aux_scale)
        return x


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


def _hf_layer(stage: PipelineStage, layer: nn.Module, unit: Unit, x: torch.Tensor):
    """A transformers decoder layer on the hidden states, with what its model's forward would
    give it: the position ids of its tokens (0..T-1; under cp, the rank's slice), the rotary
    (cos, sin) and the causal mask, recomputed here."""
    from transformers.masking_utils import create_causal_mask

    from ..context import positions
    position_ids = positions(x.shape[1], x.device).unsqueeze(0)
    mask = create_causal_mask(config=stage.config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=position_ids)
    cos_sin = stage.get_submodule(unit.rotary)(x, position_ids=position_ids)
    return layer(x, attention_mask=mask, position_embeddings=cos_sin, position_ids=position_ids)


# -- balance losses made on this stage ---------------------------------------------------------
class _InjectAuxGrad(torch.autograd.Function):
    """Identity on the hidden states; in backward, the balance loss gets gradient ``scale``
    (as if it had been added to the micro-batch's loss), so its router learns on this stage."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


def _add_aux_losses(module: nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    for m in module.modules():
        pop = getattr(m, "pop_aux_loss", None)
        aux = pop() if callable(pop) else None
        if isinstance(aux, torch.Tensor) and aux.requires_grad:
            x = _InjectAuxGrad.apply(x, aux, scale)
    return x


def aux_losses(model: nn.Module) -> bool:
    """Whether some layer of ``model`` makes a weighted balance loss (``aux_loss_coef`` > 0)."""
    return any(callable(getattr(m, "pop_aux_loss", None)) and getattr(m, "aux_loss_coef", 0)
               for m in model.modules())


# -- a rank's stages as one module ---------------------------------------------------------------
def merge_stages(modules: list[nn.Module]) -> nn.Module:
    """The stages one rank holds as one module with the model's keys (interleaved: chunks 0
    and 1 both hold items of ``layers``), for its state_dict and tensor-parallel gathers."""
    root = nn.Module()
    for module in modules:
        _merge_into(root, module)
    return root


def _merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, child in src.named_children():
        if isinstance(child, (_Holder, _ListHolder)):
            if name not in dst._modules:
                dst._modules[name] = type(child)()          # a copy: the stage's own stays as it is
            _merge_into(dst._modules[name], child)
        else:
            dst._modules[name] = child
