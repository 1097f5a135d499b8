"""Tensor-parallel plans in DTensor's convention, and the checks a plan must pass.

A plan maps glob keys over module names to a style: ``{"*.attn.qkv": "colwise", ...}`` for an
``nn.Sequential`` of blocks, ``{"layers.*.attn.wq": "colwise", ...}`` for a module that keeps
them in ``self.layers`` (an attention's forward must then read its heads from the tensor,
``view(b, t, -1, head_dim)``, as torchtitan's and Hugging Face's do: a rank holds 1/tp). As
in ``torch.distributed.tensor.parallel.parallelize_module``, a key is split at dots and each
part is matched (``fnmatch``) against one level of the module tree, so ``*`` matches one
name: ``"*.mlp.fc"`` matches ``"3.mlp.fc"`` but not ``"mlp.fc"``.

A transformers model's plan is its own ``model.tp_plan`` (its config's ``base_model_tp_plan``
with the head's and the embedding's) in labkit's styles (:func:`labkit.models.hf.model_tp_plan`).

Every check raises ValueError naming the field and the fix, in the notebook, before an
engine is called (:func:`check_tensor_parallel`).
"""
from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

TP_MODES = ("megatron", "dtensor")
STYLES = ("colwise", "rowwise", "colwise_gather_output")
# Hugging Face's names for the same splits (``base_model_tp_plan``): an embedding split by rows
# is labkit's vocabulary-parallel embedding.
STYLE_ALIASES = {"embedding_rowwise": "rowwise"}
SP_STYLES = ("scatter_output", "sequence", "gather_input")


def match_plan(model: nn.Module, plan: dict) -> dict[str, str]:
    """Module name → style for every module a key of ``plan`` matches (model order).

    >>> match_plan(labkit.models.gpt(n_layer=1)(), {"*.mlp.fc": "colwise"})
    {'1.mlp.fc': 'colwise'}
    """
    matched = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        for key, style in plan.items():
            atoms = key.split(".")
            if name and len(atoms) == len(parts) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms)):
                matched[name] = STYLE_ALIASES.get(style, style)
    return matched


def suggest_plan(model: nn.Module, limit: int = 8) -> dict[str, str]:
    """A Megatron plan from ``model``'s own Linear layers (Shoeybi et al. 2019, §3): in an
    ``nn.Sequential``, consecutive Linear layers whose sizes chain make colwise/rowwise pairs;
    under any other parent, the Linear child that the most earlier ones could feed (their
    out_features = its in_features; ties: the widest) is rowwise and those are colwise (an
    MLP's fc/proj, SwiGLU's gate and up with down, an attention's q, k, v with its output). One all-reduce joins each group. A repeated block's
    index becomes ``*``. ``{}`` when the model has no such group.

    >>> suggest_plan(labkit.models.mlp(depth=4)())
    {'0': 'colwise', '2': 'rowwise', '4': 'colwise', '6': 'rowwise'}
    """
    plan: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        linears = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        for child, style in _groups(linears, isinstance(parent, nn.Sequential)):
            parts = (parent_name.split(".") if parent_name else []) + [child]
            key = ".".join("*" if p.isdigit() and k < len(parts) - 1 else p for k, p in enumerate(parts))
            plan.setdefault(key, style)
        if len(plan) >= limit:
            break
    return plan


def _groups(linears: list, sequential: bool) -> list[tuple[str, str]]:
    """(child name, style) of one parent's Linear children, by :func:`suggest_plan`'s rule."""
    if sequential:
        out, i = [], 0
        while i + 1 < len(linears):
            (a, first), (b, second) = linears[i], linears[i + 1]
            if first.out_features == second.in_features:
                out += [(a, "colwise"), (b, "rowwise")]
                i += 2
            else:
                i += 1
        return out
    out, used = [], set()
    while True:          # the Linear fed by the most earlier ones (ties: the widest input) closes a group
        groups = [([a for a, m in linears[:i] if a not in used and m.out_features == last.in_features],
                   last.in_features, name) for i, (name, last) in enumerate(linears) if name not in used]
        feeding, _, name = max(groups, key=lambda g: (len(g[0]), g[1]), default=([], 0, None))
        if not feeding:
            return out
        out += [(a, "colwise") for a in feeding] + [(name, "rowwise")]
        used.update(feeding + [name])


def resolve_plan(model: nn.Module, plan: dict | None = None) -> dict:
    """The plan given, else the model's own ``tp_plan``; ValueError if there is neither."""
    if plan is None and type(getattr(model, "config", None)).__module__.startswith("transformers."):
        from ...models.hf import model_tp_plan
        plan = model_tp_plan(model)        # a transformers model's own plan, in labkit's styles
    plan = plan if plan is not None else getattr(model, "tp_plan", None)
    if not plan:
        suggested = suggest_plan(model)
        example = f"tp_plan={suggested!r}, built from the model's own Linear layers (colwise then rowwise: one " \
                  "all-reduce per pair)" if suggested else \
            "tp_plan={'<name of a Linear>': 'colwise', '<the Linear after it>': 'rowwise'} (the model has no two " \
            "chained Linear layers under one parent to suggest)"
        raise ValueError(f"tp_plan: the model has no tensor-parallel plan; give the model a tp_plan attribute or "
                         f"pass lab.run(..., {example})")
    if not isinstance(plan, dict):
        raise ValueError(f"tp_plan={plan!r} must be a dict of module-name globs to 'colwise' or 'rowwise'")
    return plan


def check_tensor_parallel(tp: int, tp_mode: str, model_or_factory, plan: dict | None = None,
                          sequence_parallel: bool = False, seq_len: int | None = None) -> dict[str, str]:
    """Raise ValueError (naming the field and the fix) unless ``model_or_factory`` can be split
    over ``tp`` ranks in ``tp_mode`` by ``plan`` (default: the model's ``tp_plan``), and, with
    ``sequence_parallel``, its sequences of ``seq_len`` tokens cut by the model's ``sp_plan``.

    Returns the matched plan (module name → style); ``{}`` when tp is 1.
    """
    if tp_mode not in TP_MODES:
        raise ValueError(f"Strategy.tp_mode={tp_mode!r} is unknown; use one of {', '.join(map(repr, TP_MODES))}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"Strategy.tp={tp!r} must be a whole number ≥ 1")
    if tp == 1:
        return {}
    model = _built(model_or_factory)
    plan = resolve_plan(model, plan if plan is not None else getattr(model_or_factory, "tp_plan", None))
    modules = dict(model.named_modules())
    for key, style in plan.items():
        if STYLE_ALIASES.get(style, style) not in STYLES:
            raise ValueError(f"tp_plan[{key!r}]={style!r} is unknown; use 'colwise' or 'rowwise' (also "
                             f"{', '.join(map(repr, STYLES[2:] + tuple(STYLE_ALIASES)))}), or pass "
                             "lab.run(..., tp_plan=...) without that key")
        if not match_plan(model, {key: style}):
            names = [n for n in modules if n][:8]
            raise ValueError(f"tp_plan key {key!r} names no module of the model; its modules are named like "
                             f"{names} (a '*' matches one name: 'layers.*.attn.wq' matches 'layers.0.attn.wq', "
                             f"and '*.attn.qkv' matches '1.attn.qkv')")
    matched = match_plan(model, plan)
    for name, style in matched.items():
        _check_module(name, modules[name], style, tp)
        _check_heads(name, modules, tp)
    if matched:
        _check_model_heads(model, tp)
    _check_untied(model, matched, tp_mode)
    if sequence_parallel:
        _check_sequence_parallel(model, matched, tp, tp_mode, seq_len)
    return matched


def _check_sequence_parallel(model: nn.Module, matched: dict, tp: int, tp_mode: str, seq_len) -> None:
    if tp_mode != "megatron":
        raise ValueError("Strategy.sequence_parallel is built for tp_mode='megatron' only; use that mode")
    sp_plan = getattr(model, "sp_plan", None)
    if not sp_plan:
        raise ValueError("sequence_parallel: the model has no sp_plan (where the sequence is cut and joined); "
                         "use labkit.models.gpt, or switch sequence_parallel off")
    if set(sp_plan.values()) - set(SP_STYLES) or not all(match_plan(model, {k: v}) for k, v in sp_plan.items()):
        raise ValueError(f"sp_plan={sp_plan} must name modules of the model, each with one of {SP_STYLES}")
    if "colwise_gather_output" in matched.values():
        raise ValueError("sequence_parallel with a 'colwise_gather_output' layer is not built; make that layer "
                         "'colwise' with a gather_input sp_plan entry, or switch sequence_parallel off")
    if any(isinstance(model.get_submodule(name), nn.Embedding) for name in matched):
        raise ValueError("sequence_parallel with a vocab-parallel embedding is not built; leave the embedding "
                         "out of tp_plan or switch sequence_parallel off")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence_parallel cuts each sequence of block_size={seq_len} tokens over "
                         f"Strategy.tp={tp}; use a block_size that is a multiple of {tp}")


def _built(model_or_factory) -> nn.Module:
    """The model itself, or the factory's model built without touching the caller's RNG."""
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    with torch.random.fork_rng(devices=[]):
        return model_or_factory()


def _check_module(name: str, module: nn.Module, style: str, tp: int) -> None:
    if isinstance(module, nn.Linear):
        dim, size = ("in_features", module.in_features) if style == "rowwise" else ("out_features", module.out_features)
    elif isinstance(module, nn.Embedding):
        if style != "rowwise":
            raise ValueError(f"tp_plan[{name!r}]='colwise' on an Embedding: labkit splits embeddings by "
                             f"vocabulary (Megatron's VocabParallelEmbedding); use 'rowwise'")
        if module.padding_idx is not None:
            raise ValueError(f"tp_plan[{name!r}] splits an Embedding with padding_idx={module.padding_idx}, whose "
                             "row the vocab-parallel split would train; build it with padding_idx=None (a "
                             "transformers config with pad_token_id=None), or leave it out of tp_plan")
        dim, size = "num_embeddings", module.num_embeddings
    else:
        raise ValueError(f"tp_plan names {name!r}, a {type(module).__name__}; tensor parallelism splits only "
                         f"nn.Linear and nn.Embedding modules: change the key to match those")
    if size % tp and (isinstance(module, nn.Embedding) or style == "colwise_gather_output"):
        raise ValueError(f"tp_plan[{name!r}]={style!r} splits the vocabulary ({dim}={size}) over Strategy.tp={tp}, "
                         f"which does not divide it; pad the vocabulary as Megatron-LM does (a model with "
                         f"vocab_size={-(-size // tp) * tp}, a multiple of {tp}; the extra ids never occur in the "
                         f"data), or use a tp that divides {size}")
    if size % tp:
        raise ValueError(f"tp_plan[{name!r}]={style!r} splits {dim}={size} over Strategy.tp={tp}, which does not "
                         f"divide it; use a tp that divides {size}, or a width that is a multiple of {tp}")


# Where models keep their head counts: labkit's and torchtitan's names, then Hugging Face's.
HEAD_FIELDS = ("n_head", "n_heads", "num_heads", "n_kv_heads", "num_key_value_heads", "num_attention_heads")


def _check_heads(name: str, modules: dict, tp: int) -> None:
    """A split attention layer must give every rank whole heads (query and key/value heads)."""
    parent_name = name.rpartition(".")[0]
    _check_head_counts(modules.get(parent_name), f"attention {parent_name!r}", tp)


def _check_model_heads(model: nn.Module, tp: int) -> None:
    """The same rule on the model's own counts: ``model.n_head``/``n_kv_heads``, or a Hugging
    Face ``model.config.num_attention_heads``/``num_key_value_heads``."""
    _check_head_counts(model, type(model).__name__, tp)
    _check_head_counts(getattr(model, "config", None), f"{type(model).__name__}.config", tp)


def _check_head_counts(owner, where: str, tp: int) -> None:
    for field in HEAD_FIELDS:
        heads = getattr(owner, field, None)
        if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
            raise ValueError(f"{field}={heads} ({where}) does not divide by Strategy.tp={tp}: tp ranks split "
                             f"the heads; use {field} a multiple of {tp}, or a tp that divides {heads}")


def tied_vocab_pair(modules: dict, matched: dict, names: list[str]) -> bool:
    """Whether ``names`` (the modules sharing one weight) are an embedding split by vocabulary
    and a head split by vocabulary (colwise): one shard serves both, as Megatron-LM ties its
    vocab-parallel embedding and output layer."""
    kinds = sorted(((isinstance(modules[n], nn.Embedding), matched.get(n)) for n in names), key=lambda k: k[0])
    return len(names) == 2 and kinds[0][0] is False and kinds[1] == (True, "rowwise") \
        and kinds[0][1] in ("colwise", "colwise_gather_output")


def _check_untied(model: nn.Module, matched: dict, tp_mode: str = "megatron") -> None:
    """A planned weight may be shared with another module only as a tied embedding and head,
    both split by vocabulary (megatron mode: one shard serves both)."""
    owners: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(full.rpartition(".")[0])
    modules = dict(model.named_modules())
    for full, p in model.named_parameters(remove_duplicate=False):
        name = full.rpartition(".")[0]
        others = [o for o in owners[id(p)] if o != name]
        if name not in matched or not others:
            continue
        if tied_vocab_pair(modules, matched, owners[id(p)]) and tp_mode == "megatron":
            continue
        if tied_vocab_pair(modules, matched, owners[id(p)]):
            raise ValueError(f"tp_plan splits {name!r}, whose weight is tied to {others[0]!r}: one vocab-parallel "
                             "shard for both is built for tp_mode='megatron'; use that mode")
        raise ValueError(f"tp_plan splits {name!r}, whose weight is tied to {others[0]!r}; split both by "
                         "vocabulary (the embedding 'rowwise' and the head 'colwise' or 'colwise_gather_output': "
                         "one shard serves both), leave both out of the plan, or untie them "
                         "(labkit.models.gpt(tie=False))")
