"""The compute around expert parallelism's exchanges, counted as :mod:`.work` counts a
model's: which experts each step's tokens choose as the router trains, the rows each rank sends
each other, and one ep rank's sort, experts and un-permute.
"""
from __future__ import annotations

import weakref

import torch

from .profile import one_thread
from .work import Ops, _ops


def routes(model, batch: int, data, ranks: int, microbatches: int, steps=(0,), lr: float = 0.1, seed: int = 0,
           momentum: float = 0.0, loss="mse", optimizer: str = "sgd") -> dict:
    """{step: per dp rank, per micro-batch: {MoE layer name: the experts each token chose
    (tokens, top_k)}} for each of ``steps``, as the run routes them: its seeded weights trained
    by the steps before, on that step's data (one process, the whole batch, as
    :func:`labkit.reference` trains, which every strategy equals). A router moves as it trains,
    and how unevenly it sends tokens moves with it."""
    from ...parallel.expert import fused_experts, moe_layers
    from ...run.reference import _train

    wanted, seen, out, forwards = set(steps), {}, {}, []

    def take(step: int) -> None:       # the whole batch's (B, T, k) choices, cut as ranks and micro-batches
        if step in wanted:
            whole = {name: c.reshape(batch, -1, c.shape[-1]) for name, c in seen.items()}
            out[step] = [[{name: c[rows].reshape(-1, c.shape[-1]) for name, c in whole.items()}
                          for rows in part.chunk(microbatches)] for part in torch.arange(batch).chunk(ranks)]
        forwards.append(step)

    def watch(net):
        for name, moe in moe_layers(net):
            def hook(m, args, logits, name=name, moe=moe):     # MoE.forward's own top-k of the router's softmax
                seen[name] = logits.detach().float().softmax(dim=-1).topk(moe.top_k, dim=-1).indices
            moe.router.register_forward_hook(hook)
        for name, experts in fused_experts(net):              # a transformers block hands its experts the choices
            experts.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[1].detach()))
        net.register_forward_hook(lambda m, args, o: take(len(forwards)))     # one forward a step
    _train(model, batch, max(wanted) + 1, lr, seed, data, loss, momentum, False, optimizer, watch=watch)
    return out


def shape(moe) -> tuple[int, int]:
    """(experts, width of a token) of an MoE layer: labkit's MoE, or a transformers block's
    fused experts (:func:`labkit.parallel.expert.fused_experts`)."""
    from ...models.moe import MoE
    from ...parallel.expert import n_experts
    if isinstance(moe, MoE):
        return moe.n_experts, moe.router.in_features
    return n_experts(moe), moe.hidden_dim


def _routed(moe, chosen, counts) -> dict:
    """The three parts of one ep rank's compute around a MoE layer's exchanges, as
    :class:`labkit.parallel.expert.dispatch.ExpertParallelMoE` runs them (for a transformers
    block's fused experts, :class:`~labkit.parallel.expert.dispatch.ExpertParallelExperts` on
    a copy holding the first ep rank's slice): part → (forward, backward), each a function of
    no argument (the backward runs the last forward's)."""
    from types import SimpleNamespace

    from ...models.moe import MoE
    from ...parallel.expert.dispatch import ExpertParallelExperts, ExpertParallelMoE
    ep, local = counts.shape
    k, (_, c), n = chosen.shape[-1], shape(moe), len(chosen)
    if isinstance(moe, MoE):
        EP, me = ExpertParallelMoE, SimpleNamespace(top_k=k, n_experts=moe.n_experts,   # every expert has the same shapes
                                                     experts={str(e): moe.experts[e] for e in range(local)})
    else:
        EP, me = ExpertParallelExperts, _first_slice(moe, ep)
        me.top_k = k
    x, gates = torch.randn(n, c, requires_grad=True), torch.rand(n, k, requires_grad=True)
    arrived = torch.randn(int(counts.sum()), c, requires_grad=True)
    back = torch.randn(n * k, c, requires_grad=True)
    got = {}

    def pre():
        got["order"], got["token"], _ = EP._sort(me, chosen)
        got["pre"] = x.index_select(0, got["token"])

    def experts():
        got["experts"] = EP._experts(me, arrived, counts)

    def post():
        got["post"] = EP._unpermute(me, x.detach(), back, gates, got["order"], got["token"])

    def backward(part):
        return lambda: got[part].backward(torch.ones_like(got[part]))
    return {part: (fn, backward(part)) for part, fn in (("pre", pre), ("experts", experts), ("post", post))}


_SLICES = weakref.WeakKeyDictionary()
"""A transformers block's fused experts → {ep: its first ep rank's slice} (:func:`_first_slice`)."""


def _first_slice(experts, ep: int):
    """:class:`~labkit.parallel.expert.dispatch.ExpertParallelExperts` on a copy of ``experts``
    holding the first of ``ep`` ranks' rows (every rank's have the same shapes), made once per
    layer and ep (each step and rank prices it again), its gradients cleared."""
    import copy

    from ...parallel.expert.dispatch import ExpertParallelExperts
    by_ep = _SLICES.setdefault(experts, {})
    if ep not in by_ep:
        mine = copy.deepcopy(experts)
        mine.__dict__.pop("forward", None)      # the class's own, not a count's or profile's stand-in
        by_ep[ep] = ExpertParallelExperts(mine, 0, ep, None, "", "none")
    for p in by_ep[ep].parameters():
        p.grad = None
    return by_ep[ep]


def expert_bytes(moe, ep: int) -> int:
    """Bytes of the routed experts' weights one of ``ep`` ranks holds in an MoE layer (its
    ``n_experts/ep`` experts, or a transformers block's first slice: every rank's are alike)."""
    from ...models.moe import MoE
    if isinstance(moe, MoE):
        mine = [p for e in range(moe.n_experts // ep) for p in moe.experts[e].parameters()]
    else:
        mine = list(_first_slice(moe, ep).parameters())
    return sum(p.numel() * p.element_size() for p in mine)


def routed_ops(moe, chosen, counts) -> dict:
    """One ep rank's compute around a MoE layer's exchanges (:func:`_routed`): "pre" sorts its
    tokens' ``chosen`` (tokens, top_k) experts and gathers their rows, "experts" runs its local
    experts on what arrives (``counts``: [sender, local expert] rows), "post" weights the results
    back into the tokens; each (forward Ops, backward Ops), counted."""
    return {part: (Ops(_ops(fwd)), Ops(_ops(bwd))) for part, (fwd, bwd) in _routed(moe, chosen, counts).items()}


def routed_seconds(moe, chosen, counts, repeats: int = 5) -> dict:
    """The same three parts timed in sequence on this process, one thread (as
    :func:`labkit.plan.local.profile.profile` times a model's pieces: no unsharded step runs them):
    part → (forward seconds, backward seconds), each the median of ``repeats`` after one."""
    import time
    from statistics import median

    out = {}
    with one_thread():
        for part, (fwd, bwd) in _routed(moe, chosen, counts).items():
            runs = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                fwd()
                t1 = time.perf_counter()
                bwd()
                runs.append((t1 - t0, time.perf_counter() - t1))
            out[part] = (median(r[0] for r in runs[1:]), median(r[1] for r in runs[1:]))
    return out


def exchange(chosen: list, n_experts: int, ep: int) -> tuple[list, list]:
    """From each ep rank's tokens' ``chosen`` experts: rows[s][r], the rows rank s sends rank r,
    and per receiving rank r its [sender, local expert] counts (rank r holds experts
    [r·E/ep, (r+1)·E/ep))."""
    per = torch.stack([torch.bincount(c.reshape(-1), minlength=n_experts) for c in chosen])    # (ep, E)
    local = n_experts // ep
    return per.view(ep, ep, local).sum(-1).tolist(), [per[:, r * local:(r + 1) * local] for r in range(ep)]
