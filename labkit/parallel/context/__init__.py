"""Context parallelism: every sequence cut over ``cp`` ranks, attention computed across them.

Each rank of a cp group holds the same parameters and a slice of every sequence's tokens, so
activation memory per rank falls as 1/cp. Everything in a transformer but attention works
token by token; attention needs every earlier token's keys and values, and those travel
between the ranks (:mod:`.ring`, :mod:`.allgather`). Gradients are averaged over dp × cp:
with equal tokens per rank, the mean of the ranks' token means is the global mean.

Causal load balancing (Megatron-LM, Llama 3): the sequence is cut into 2·cp chunks and rank
i holds chunks i and 2·cp − 1 − i, so under the causal mask every rank has the same number
of (query, key) pairs to compute. ``Strategy.cp_balance=False`` gives the contiguous split
(rank i holds tokens i·T/cp …), where the last rank does 2·cp − 1 times the first one's work.

**How a model opts in.** Its attention core calls :func:`attention` in place of torch's
``scaled_dot_product_attention``, and its rotary (or any) position encoding takes its
positions from :func:`positions`, which gives the global positions of the tokens this rank
holds (``arange(T)`` without cp)::

    pos = labkit.parallel.context.positions(T, device)          # (T,) global positions
    q, k = rope(q, pos), rope(k, pos)                           # (B, H, T, hd), (B, Hkv, T, hd)
    y = labkit.parallel.context.attention(q, k, v, causal=True) # torch's sdpa without cp

Keys and values may have fewer heads than queries (grouped-query attention): they travel
unrepeated.

**A Hugging Face model needs no change.** transformers' own models call their attention
through its registry (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``):
under cp > 1 labkit registers :func:`attention` there and sets the model's
``config._attn_implementation`` to it on every engine, and gives the model's forward the
``position_ids`` of the tokens the rank holds (:mod:`.hf`). A ``LlamaForCausalLM(config)``
built in the user's own factory runs ring, all-gather or Ulysses attention as it is.

:func:`check_model` runs the model once on a probe and refuses cp for a model whose
attention reaches :func:`attention` neither way. This file owns the axis's rules (:func:`check_strategy`, called by
``Strategy``; :func:`check_model`, called before any engine) and imports nothing heavy; the
engine side (the ring, the collectives) is reached through :mod:`.layout`.
"""
from __future__ import annotations

from ...attention import activate, active, attention, current, deactivate, local_attention, positions  # noqa: F401  (the hook a model calls, re-exported)

CP_MODES = ("ring", "allgather", "ulysses")       # .ring, .allgather, .ulysses


def check_strategy(s) -> None:
    """Raise ValueError naming the field and the fix for an impossible context-parallel setting."""
    if s.cp == 1:
        return
    # what it composes with is what the exactness tests cover: dp (every mode, zero), Megatron
    # tp, pp (every schedule) and ep; not these
    unsupported = (("sequence_parallel", s.sequence_parallel, False, "sequence_parallel=False"),
                   ("sync_batchnorm", s.sync_batchnorm, False, "sync_batchnorm=False"),
                   ("tp_mode", s.tp_mode, "megatron", "tp_mode='megatron'"))
    for name, value, default, fix in unsupported:
        if value != default and (name != "tp_mode" or s.tp > 1):
            raise ValueError(f"Strategy.cp={s.cp} with {name}={value!r}: context parallelism composes with dp, "
                             f"zero, pp, ep and Megatron tp here, not (yet) with this; use {fix}, or cp=1")


def sequence_divisor(s) -> int:
    """What the sequence length must divide by: 2·cp chunks, balanced or not. Unbalanced, a
    rank's slice of T/cp tokens is still two chunks of T/(2·cp) (attention works chunk by
    chunk, :mod:`.layout`), so a T that cp divides but 2·cp does not would leave tokens out."""
    return 2 * s.cp


def check_model(s, built, data) -> None:
    """The model- and data-dependent rules, before any engine: a sequence that splits evenly,
    targets cut along with it, and a model whose attention and positions go through this module."""
    if s.cp == 1:
        return
    import torch
    x, y = data(0)
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 2 and y.dim() >= 2
            and x.shape[1] == y.shape[1]):
        raise ValueError(f"Strategy.cp={s.cp}: the data's inputs and targets must both be (batch, sequence, …) with "
                         f"one sequence length (got {tuple(getattr(x, 'shape', ()))} and "
                         f"{tuple(getattr(y, 'shape', ()))}); use token data such as labkit.data.text, or cp=1")
    t, n = x.shape[1], sequence_divisor(s)
    if t % n:
        what = (f"2·cp = {n} chunks (causal load balancing)" if s.cp_balance else
                f"cp = {s.cp} slices of two equal chunks (2·cp = {n}: attention works chunk by chunk)")
        raise ValueError(f"Strategy.cp={s.cp}: a sequence of {t} tokens does not cut into {what}; use a block_size "
                         f"that is a multiple of {n}")
    for name, m in built.named_modules():
        if getattr(m, "aux_loss_coef", 0) and hasattr(m, "n_experts"):
            # routing is per token (exact under cp), but the balance loss is a product of means
            # over each whole sequence: a rank's slice gives another loss
            raise ValueError(f"Strategy.cp={s.cp}: MoE layer {name} has aux_loss_coef={m.aux_loss_coef}, a "
                             "sequence-wise balance loss that a slice of the sequence cannot compute; use "
                             "labkit.models.llama(aux_loss_coef=0), or cp=1")
    from .hf import check_hf, routed
    check_hf(s, built, t)
    with routed(built):                  # a transformers model: its attention through the registry
        calls = probe(built, x[:1])
    if not calls["attention"] or not calls["positions"]:
        missing = [k for k in ("attention", "positions") if not calls[k]]
        raise ValueError(f"Strategy.cp={s.cp}: the model never calls labkit.parallel.context."
                         f"{' nor '.join(missing)}, so its attention cannot see the other ranks' tokens; opt in "
                         "one of two ways: call labkit.parallel.context.attention and .positions in the model's "
                         "attention (see its docstring: labkit.models.llama does), or call the attention through "
                         "transformers' registry, ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation"
                         ", ...) with position_ids taken from the forward's arguments, as transformers' own models "
                         "do (labkit then routes it); or use cp=1")
    if s.cp_mode == "ulysses":
        for what, heads in (("query", calls["q_heads"]), ("key/value", calls["kv_heads"])):
            if heads % (s.tp * s.cp):
                raise ValueError(f"Strategy.cp_mode='ulysses' splits the {what} heads ({heads}"
                                 f"{f' over tp={s.tp}' if s.tp > 1 else ''}) over cp={s.cp} ranks; use "
                                 f"{what} heads divisible by {s.tp * s.cp}, a cp dividing them, or cp_mode='ring'")


def probe(model, x) -> dict:
    """Run ``model`` on ``x`` counting its calls to :func:`attention` and :func:`positions`,
    stopping at the first attention once positions were asked for: the checks' model may sit
    on the ``meta`` device, where what follows (a MoE router's data-dependent indexing) cannot run."""
    import torch
    weight = next(model.parameters(), None)
    if weight is not None and weight.is_meta and isinstance(x, torch.Tensor) and x.is_floating_point():
        x = x.to("meta")                 # features into a meta Linear (token ids index a meta table as they are)
    before, counting = current(), _Probe()
    activate(counting)
    try:
        with torch.no_grad():
            model(x)
    except _Seen:
        pass
    finally:
        activate(before)
    return counting.calls


class _Seen(Exception):
    """The probe has seen what it needs."""


class _Probe:
    """A stand-in context that computes as cp = 1 and counts the calls."""

    def __init__(self):
        self.calls = {"attention": 0, "positions": 0, "q_heads": 0, "kv_heads": 0}

    def attention(self, q, k, v, causal, scale=None):
        self.calls["attention"] += 1
        self.calls["q_heads"], self.calls["kv_heads"] = q.shape[1], k.shape[1]
        if self.calls["positions"]:
            raise _Seen
        return local_attention(q, k, v, causal, scale)

    def positions(self, t, device):
        import torch
        self.calls["positions"] += 1
        return torch.arange(t, device=device)


