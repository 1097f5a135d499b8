"""Expert parallelism: each mixture-of-experts layer's experts spread over ``ep`` ranks.

As DeepSeek-V3 and Megatron-Core do it, the ep ranks are drawn from the data-parallel ones:
the dense part of the model (attention, norms, routers, a shared expert) stays replicated and
averaged over all of dp, while each MoE layer's ``n_experts`` are cut into ``ep`` slices, one per
rank of a run of ``ep`` consecutive dp ranks. Under a pipeline the dp ranks are those of one
stage, so each stage's MoE layers are spread over its own dp group. Under tensor parallelism
each tp index has its own ep groups (the dp ranks sharing it): the routed experts stay whole
(replicated over tp, as ``labkit.models.llama`` leaves them), the tokens, replicated over tp,
are cut so that each tp rank routes 1/tp of them through its group (gathered again after the
combine), and an expert's gradient is summed over tp as well as over its replicas. Under
context parallelism the ep groups are drawn from the dp ranks sharing a cp index: each cp rank
routes its own slice of the sequences (routing is per token), and an expert's gradient is
summed over cp too. With ZeRO-1/2 the dense parameters' optimizer state (and gradients) are
sharded over dp as without ep, the experts' over their replicas (Megatron-Core's
expert-data-parallel group in its distributed optimizer). Tokens travel to their experts' rank
and back with two all-to-alls per layer (:mod:`.dispatch`), and an expert's gradient is
averaged over the dp/ep ranks that hold the same slice.

A transformers MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, and any family of the same shape)
needs no change: each sparse block's experts module, kept as fused tensors of ``n_experts``
rows and called by its block with the router's choices, is found where the config's
``base_model_ep_plan`` (or :data:`EXPERTS_AT`) puts it (:func:`fused_experts`) and replaced by
one holding this rank's rows and routing by the same all-to-alls; the model's own experts
code runs on the rows that arrive. The router stays in the block, so its logits, and the
auxiliary loss transformers computes from them (``output_router_logits``), are the model's.

This file owns the axis's rules: :func:`check_strategy` (called by ``Strategy``) and
:func:`check_model` (called before any engine, with the built model). It imports nothing
heavy, so a notebook can validate a strategy without torch.distributed.
"""
from __future__ import annotations

from contextlib import contextmanager


EP_OVERLAPS = ("none", "microbatch")


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible expert-parallel setting."""
    if s.ep == 1:
        if s.ep_overlap != "none":
            raise ValueError(f"Strategy.ep_overlap={s.ep_overlap!r} hides the experts' all-to-alls, and ep=1 has "
                             "none; use ep > 1, or ep_overlap='none'")
        return
    if s.dp % s.ep:
        raise ValueError(f"Strategy.ep={s.ep} must divide dp={s.dp}: the experts are spread over runs of ep "
                         f"data-parallel ranks; use an ep that divides {s.dp}, or a larger dp")
    if s.zero == 3 or (s.zero and s.zero_mode != "labkit"):
        raise ValueError(f"Strategy.ep={s.ep} with zero={s.zero} zero_mode={s.zero_mode!r}: the experts' "
                         "shards are built for labkit's ZeRO-1/2 only; use zero=1 or 2 with "
                         "zero_mode='labkit', or ep=1")
    if s.compression != "none":
        raise ValueError(f"Strategy.ep={s.ep} with compression={s.compression!r}: the experts' gradients are "
                         "averaged uncompressed over their own replicas; use compression='none', or ep=1")


def moe_layers(model) -> list[tuple[str, object]]:
    """(name, module) of every mixture-of-experts layer (labkit.models' MoE) in ``model``."""
    from ...models.moe import MoE
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


# Where transformers' MoE families keep a sparse block's experts, under the base model, for a
# config without ``base_model_ep_plan`` (Mixtral's older layout first, then today's).
EXPERTS_AT = ("layers.*.block_sparse_moe.experts", "layers.*.mlp.experts")
EXPERT_SHAPE = ("its experts as fused tensors, every parameter (n_experts, …), called as "
                "experts(hidden_states, top_k_index, top_k_weights) by its block, as transformers' Mixtral, "
                "Qwen2-MoE and Qwen3-MoE keep them")


def fused_experts(model) -> list[tuple[str, object]]:
    """(name, module) of every sparse MoE block's experts in a transformers model: where its
    config's ``base_model_ep_plan`` puts them (the keys styled ``ep_dispatch_experts``), else
    where :data:`EXPERTS_AT` says, under the base model. ValueError when a module found there
    is not of :data:`EXPERT_SHAPE`. ``[]`` for any other model."""
    from ..tensor.plan import match_plan
    config, prefix = getattr(model, "config", None), getattr(model, "base_model_prefix", "")
    if config is None or not hasattr(config, "_attn_implementation"):
        return []
    plan = getattr(config, "base_model_ep_plan", None) or {}
    keys = [k for k, style in plan.items() if style == "ep_dispatch_experts"] or list(EXPERTS_AT)
    keys = [f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k for k in keys]
    found = [name for key in keys for name in match_plan(model, {key: "experts"})]
    layers = [(name, model.get_submodule(name)) for name in found]
    for name, experts in layers:
        if n_experts(experts) is None:
            raise ValueError(f"Strategy.ep: {name} is a {type(experts).__name__}, not a module of the shape expert "
                             f"parallelism spreads ({EXPERT_SHAPE}); use ep=1 for this model")
    return layers


def n_experts(experts) -> int | None:
    """The expert count of a fused experts module (every direct parameter's leading dim, one of
    them 3-d), or None when it is not of that shape."""
    params = list(experts.named_parameters(recurse=False))
    sizes = {p.shape[0] if p.dim() else None for _, p in params}
    if not params or len(sizes) != 1 or None in sizes or not any(p.dim() == 3 for _, p in params):
        return None
    return sizes.pop()


def check_model(s, built) -> None:
    """The model-dependent rules, before any engine: MoE layers to split, evenly."""
    if s.ep == 1:
        return
    layers = [(name, moe.n_experts) for name, moe in moe_layers(built)]
    fused = [(name, n_experts(m)) for name, m in fused_experts(built)]
    if not layers and not fused:
        raise ValueError(f"Strategy.ep={s.ep}: the model has no mixture-of-experts layer to spread; use a model "
                         "with experts (labkit.models.llama(n_experts=...), or a transformers MoE model with "
                         f"{EXPERT_SHAPE}), or ep=1")
    if fused and s.tp > 1:
        raise ValueError(f"Strategy.ep={s.ep} with tp={s.tp}: a transformers model's fused experts are spread over "
                         "ep beside dp, pp and zero, not tp; use tp=1 with ep, or ep=1")
    for name, count in layers + fused:
        if count % s.ep:
            raise ValueError(f"Strategy.ep={s.ep}: layer {name} has n_experts={count}, which does not "
                             f"divide over {s.ep} ranks; use an ep that divides {count}, or "
                             f"n_experts a multiple of {s.ep}")


@contextmanager
def counting_routes(modules, report: bool = True):
    """Count, per MoE layer of ``modules``, the tokens this rank routes to each expert in the
    forwards run inside (every micro-batch), into the dict yielded: {layer name: [count per
    expert]}. A forward run again by activation recomputation runs inside backward and is
    not counted twice. ``report`` False (a tensor-parallel rank other than 0, whose tokens
    rank 0 already counts) yields an empty dict."""
    import torch

    counts: dict = {}
    if not report:
        yield counts
        return

    def hook(name):
        def count(moe, args, out):
            # -1 outside backward: the recomputed forward runs inside a backward graph task
            if moe.tokens_per_expert is not None and torch._C._current_graph_task_id() == -1:
                seen = moe.tokens_per_expert.cpu()
                counts[name] = (counts[name] + seen) if name in counts else seen
        return count

    handles = [moe.register_forward_hook(hook(_plain_name(name))) for m in modules for name, moe in moe_layers(m)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
        for name in counts:
            counts[name] = [int(c) for c in counts[name].tolist()]


def _plain_name(name: str) -> str:
    while name.startswith("module."):          # DDP's and the like's wrapper
        name = name[len("module."):]
    return name


def tokens_per_ep_rank(tokens_per_expert: list[int], ep: int) -> list[int]:
    """Tokens each rank of an ep group receives, from one layer's tokens per expert (rank i holds
    experts [i·E/ep, (i+1)·E/ep))."""
    local = len(tokens_per_expert) // ep
    return [sum(tokens_per_expert[i * local:(i + 1) * local]) for i in range(ep)]


def imbalance(counts: list[int]) -> float:
    """max / mean of a list of token counts: 1 is perfectly balanced, E (top-1) all on one."""
    return max(counts) * len(counts) / sum(counts) if sum(counts) else 1.0
