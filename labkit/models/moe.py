"""The SwiGLU MLP and a mixture-of-experts layer built from it, with no token dropped.

:class:`MoE` (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeekMoE, Dai et al. 2024):

* a router (``router``: Linear to ``n_experts``), softmax over the experts, the ``top_k``
  largest per token; their gates renormalised to sum to 1 as Mixtral and Qwen3-MoE do
  (``norm_topk_prob``; with ``top_k=1`` the gate is then 1 and the router learns only
  from the balance loss, so ``norm_topk_prob=False`` is the Switch Transformer's choice);
* ``n_experts`` SwiGLU experts (``experts``), each run on exactly the tokens routed to it —
  no capacity factor, no token dropped — and summed back with their gates; every expert runs
  every step, on zero tokens if none chose it, so every parameter takes part in backward
  (DDP needs no ``find_unused_parameters``) and every tp rank issues the same collectives;
* an optional shared expert (``shared``) that every token passes through (DeepSeekMoE §3.2);
* the sequence-wise load-balancing loss of DeepSeek-V3 (arXiv 2412.19437, §2.1.2,
  eqs. 17–20), weighted by ``aux_loss_coef``.

>>> moe = MoE(n_embd=32, hidden=64, n_experts=4, top_k=2, shared=False, aux_loss_coef=0.01)
>>> out = moe(torch.randn(2, 8, 32)); out.shape, moe.pop_aux_loss().shape, moe.tokens_per_expert.sum()
(torch.Size([2, 8, 32]), torch.Size([]), tensor(32.))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class MoEOutput:
    """What a model with a balance loss returns: ``logits`` (B, T, V) and ``aux_loss``, a
    scalar already weighted by ``aux_loss_coef`` and summed over layers, for the training
    loss to add as it is."""

    logits: torch.Tensor
    aux_loss: torch.Tensor


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (and optionally a shared one). ``forward(x)`` returns the
    output, like the dense MLP it replaces, and keeps the balance loss for
    :meth:`pop_aux_loss` (None when ``aux_loss_coef`` is 0)."""

    shared_in_routed = False
    """True where ``_routed`` adds the shared expert itself (expert parallelism runs it while
    the dispatch travels)."""

    def __init__(self, n_embd: int, hidden: int, n_experts: int, top_k: int, shared: bool,
                 aux_loss_coef: float, norm_topk_prob: bool = True):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef, self.norm_topk_prob = aux_loss_coef, norm_topk_prob
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(n_embd, hidden) for _ in range(n_experts))
        self.shared = SwiGLU(n_embd, hidden) if shared else None
        self.tokens_per_expert: torch.Tensor | None = None
        """Tokens each expert received in the last forward (detached), for routing plots."""
        self.aux_loss: torch.Tensor | None = None
        """The last forward's balance loss, until the model collects it (pop_aux_loss)."""

    def pop_aux_loss(self) -> torch.Tensor | None:
        """The balance loss of the last forward, and forget it (it holds part of the graph)."""
        aux, self.aux_loss = self.aux_loss, None
        return aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        probs = self.router(x).float().softmax(dim=-1)                   # (B, T, E)
        gates, chosen = probs.topk(self.top_k, dim=-1)                   # (B, T, k)
        if self.norm_topk_prob:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        counts = torch.zeros(b, self.n_experts, device=x.device).scatter_add_(
            1, chosen.view(b, -1), torch.ones(b, t * self.top_k, device=x.device))   # (B, E) per sequence
        self.tokens_per_expert = counts.sum(0).detach()
        out = self._routed(x.reshape(-1, c), chosen.view(-1, self.top_k), gates.view(-1, self.top_k).to(x.dtype))
        out = out.view(b, t, c)
        if self.shared is not None and not self.shared_in_routed:
            out = out + self.shared(x)
        self.aux_loss = self._balance_loss(probs, counts)
        return out

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts of gate · expert(token), expert by expert."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)           # tokens routed to e (maybe none)
            y = expert(x.index_select(0, token)) * gates[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        return out

    def _balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """DeepSeek-V3's sequence-wise balance loss, α · mean over sequences of Σ_i f_i·P_i:
        f_i = E/(k·T) · (tokens of the sequence routed to expert i), P_i = the mean router
        probability of expert i over the sequence (eqs. 17–20; softmax scores already sum to 1).

        Computed per sequence and then averaged over the batch's rows, it is a mean over rows
        like the cross-entropy: data parallelism and micro-batches (equal row counts, gradients
        averaged) give exactly the single-process gradient. Switch's batch-level f_i·P_i is a
        product of two batch means, which a mean of per-shard values does not reproduce.
        """
        if not self.aux_loss_coef:
            return None
        t = probs.shape[1]
        f = counts * self.n_experts / (self.top_k * t)                  # (B, E), no gradient (a count)
        p = probs.mean(dim=1)                                           # (B, E)
        return self.aux_loss_coef * (f * p).sum(dim=-1).mean()
