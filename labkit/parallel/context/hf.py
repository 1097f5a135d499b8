"""Context parallelism for a Hugging Face model as it is: its attention through transformers'
own registry, its positions through its forward's ``position_ids``.

A transformers model's attention layer computes q, k, v and RoPE itself, then calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` (the
"attention interface", ``transformers.AttentionInterface``) with q, k, v as (B, H, T, hd).
labkit registers :func:`hf_attention` there under :data:`ATTENTION` and sets the model's
``config._attn_implementation`` to it (:func:`route`, on every engine of a cp > 1 job): the
layer then runs :func:`labkit.parallel.context.attention` (ring, all-gather or Ulysses) with
the model's own scaling, and no class of the model is changed. transformers builds no mask
for an implementation its mask registry does not know, so nothing of size T² is made.

RoPE's positions come from the ``position_ids`` the model's forward takes (each model
builds ``arange(T)`` when none is given): a forward pre-hook gives it the global positions
of the tokens this rank holds (:func:`labkit.parallel.context.positions`, the balanced
chunks included). Pipeline stages recompute them the same way
(:mod:`labkit.parallel.pipeline.modules`).

>>> model = transformers.Qwen2ForCausalLM(config)        # the user's own factory
>>> with routed(model):                                   # what the checks' probe does
...     model(x)                                          # attention through labkit's
"""
from __future__ import annotations

from contextlib import contextmanager

ATTENTION = "labkit_cp"


def is_hf(model) -> bool:
    """Whether ``model`` is a transformers model (its ``config`` a transformers config)."""
    config = getattr(model, "config", None)
    return type(config).__module__.startswith("transformers.") and hasattr(config, "_attn_implementation")


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface signature over :func:`labkit.parallel.context.attention`:
    q (B, H, T, hd), k and v (B, Hkv, T, hd) in; (B, T, H, hd) and no weights out, as its sdpa."""
    from . import attention
    if attention_mask is not None:
        raise ValueError(f"{type(module).__name__}: context parallelism computes the causal mask from the tokens' "
                         "positions and cannot apply an attention_mask (padding); pass none (labkit's data has "
                         "none), or use cp=1")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    default = scaling is None or scaling == query.shape[-1] ** -0.5     # 1/√hd: every cp mode's own
    out = attention(query, key, value, causal=bool(causal), scale=None if default else scaling)
    return out.transpose(1, 2).contiguous(), None


def _configs(model) -> list:
    """Every distinct transformers config the model's modules read (one, for a causal LM)."""
    seen = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def _give_positions(module, args, kwargs):
    """Forward pre-hook: the global ``position_ids`` of this rank's tokens, unless given."""
    from . import positions
    if kwargs.get("position_ids") is not None:
        return None
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    weight = next(module.parameters(), None)       # where the embeddings are (meta, for the checks)
    kwargs["position_ids"] = positions(ids.shape[1], ids.device if weight is None else weight.device).unsqueeze(0)
    return args, kwargs


def route(model):
    """Engine side (cp > 1): ``model``'s attention through labkit's, its positions this rank's.
    Returns the hook's handle (``remove()`` undoes the positions; the configs keep the setting)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, hf_attention)
    for config in _configs(model):
        config._attn_implementation = ATTENTION
    return model.register_forward_pre_hook(_give_positions, with_kwargs=True)


@contextmanager
def routed(model):
    """:func:`route` for the span of the block, then the model as it was (a non-transformers
    model passes through untouched)."""
    if not is_hf(model):
        yield model
        return
    before = [(c, c._attn_implementation) for c in _configs(model)]
    handle = route(model)
    try:
        yield model
    finally:
        handle.remove()
        for config, implementation in before:
            config._attn_implementation = implementation


def check_hf(s, model, t: int) -> None:
    """What a transformers model's config must allow under cp: no attention dropout (the cp
    kernels have none), no sliding window shorter than the sequence (they attend to every
    earlier token), and no router loss (a product of two means over the whole batch's tokens,
    which a slice of each sequence does not give)."""
    if not is_hf(model):
        return
    config = model.config
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"Strategy.cp={s.cp}: config.output_router_logits=True adds the router's load-balancing "
                         "loss, a product of two means over every token of the batch, which each cp rank's slice "
                         "of the sequences cannot compute; use output_router_logits=False, or cp=1")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"Strategy.cp={s.cp}: config.attention_dropout={config.attention_dropout}, and context-"
                         "parallel attention has no dropout; use a config with attention_dropout=0.0, or cp=1")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < t:
        raise ValueError(f"Strategy.cp={s.cp}: config.sliding_window={window} is shorter than the {t}-token "
                         "sequence, and context-parallel attention sees every earlier token; use a config with "
                         f"sliding_window=None (or ≥ {t}), or cp=1")
