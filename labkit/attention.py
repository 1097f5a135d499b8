"""The attention and positions a model calls, the one place that knows whether a context-parallel
job is active on this engine (:mod:`labkit.parallel.context`).

A model (``labkit.models.llama``, ``gpt``, a user's module) calls :func:`attention` in place of
torch's ``scaled_dot_product_attention`` and takes its token positions from :func:`positions`;
without cp they are torch's sdpa and ``arange(T)``. The context-parallel axis makes a job's
``ContextParallel`` the active one (:func:`activate`), and attention and positions go across its
group. This module sits below both models and the parallel axes and imports only torch, so a
model depends on it without depending on the axis that implements it; the axis re-exports it as
``labkit.parallel.context.attention`` / ``positions``.
"""
from __future__ import annotations

_active = None        # this engine's ContextParallel while a cp job is set up (labkit.parallel.build)


def current():
    """The active context (a ``ContextParallel``, the checks' probe, the planner's counter), or None."""
    return _active


def active() -> bool:
    """Whether attention on this rank goes across a cp group (or the checks' probe is counting):
    a model whose own attention differs from :func:`local_attention` (labkit's GPT writes its
    scores out) takes :func:`attention` only then, so its cp = 1 arithmetic stays its own."""
    return _active is not None


def attention(q, k, v, causal: bool = True, scale: float | None = None):
    """Softmax attention of ``q`` (B, H, T, hd) over ``k``, ``v`` (B, Hkv, T, hd), Hkv dividing H;
    across the cp group when a context-parallel job is built on this rank, else torch's sdpa.
    ``scale`` multiplies the scores (None: 1/√hd)."""
    if _active is None:
        return local_attention(q, k, v, causal, scale)
    if scale is None:          # the default scale: a stand-in context (the planner's counter) needs none
        return _active.attention(q, k, v, causal)
    return _active.attention(q, k, v, causal, scale)


def positions(t: int, device=None):
    """Global positions (t,) of the ``t`` tokens this rank holds (``arange(t)`` without cp)."""
    if _active is None:
        import torch
        return torch.arange(t, device=device)
    return _active.positions(t, device)


def local_attention(q, k, v, causal: bool = True, scale: float | None = None):
    """Torch's scaled_dot_product_attention, key/value heads repeated to the query heads."""
    import torch.nn.functional as F
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def activate(ctx) -> None:
    """Make ``ctx`` (a :class:`.layout.ContextParallel`) this engine's context; None forgets it."""
    global _active
    _active = ctx


def deactivate() -> None:
    """Forget this engine's context (its job is dropped): later code computes as one process."""
    activate(None)
