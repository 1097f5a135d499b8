"""Expert parallelism by hand: dispatch, local experts, combine; and the experts' own sync.

One MoE layer on one rank of an ep group of ``ep`` ranks, holding experts
``[i·E/ep, (i+1)·E/ep)`` (GShard, Lepikhin et al. 2020, §2.2; DeepSeek-V3 §3.2):

1. the router runs on this rank's tokens (the layer's own ``forward``); each (token, choice)
   pair is one row to send, sorted by expert, so rows bound for one rank are contiguous and,
   inside, grouped by expert;
2. sizes first: an all-to-all of per-expert counts tells every rank how many rows it will
   receive from each peer for each of its experts;
3. dispatch: a variable-size all-to-all carries the rows to their experts' ranks;
4. the local experts run on what arrived, each on its own rows (grouped across senders);
5. combine: the reverse all-to-all brings the results home, where they are weighted by their
   gates and summed into their tokens.

The backward of an all-to-all is the all-to-all with the sizes swapped (:class:`AllToAll`), so
both exchanges appear on the timeline forward and backward. Nothing is dropped (no capacity
factor): the result is the single-process layer's, up to float32 summation order.

Gradients: a rank's expert gradient sums what every sender of its ep group contributed, so
summing it over the dp/ep ranks that hold the same experts and dividing by dp gives the
gradient of the global mean loss; the dense parameters stay averaged over all of dp
(:class:`ExpertSync`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ... import comm
from ...models.moe import MoE
from ..data.sync import DDPSync
from . import moe_layers


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent in ``send`` sized slices to the group's ranks, ``recv`` rows received
    from each; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, name: str):
        ctx.send, ctx.recv, ctx.group, ctx.name = send, recv, group, name
        return _exchange(x, send, recv, group, name)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, f"{ctx.name} backward"), None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, name: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, name=name)
    return out


class ExpertParallelMoE(MoE):
    """A :class:`~labkit.models.moe.MoE` holding only its ep rank's experts (``experts`` keyed
    by their global index, so state_dict keys stay the whole model's) and routing by all-to-all."""

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, len(self.experts)
        # 1. one row per (token, choice), sorted by expert: grouped by destination rank, then expert
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        per_expert = torch.bincount(flat, minlength=self.n_experts)
        # 2. sizes first: [sender, my local expert] → rows coming
        counts = torch.empty_like(per_expert)
        comm.all_to_all_single(counts, per_expert, group=self.ep_group, name=f"{self.layer_name} counts")
        counts = counts.view(ep, local)
        send, recv = per_expert.view(ep, local).sum(1).tolist(), counts.sum(1).tolist()
        # 3. dispatch
        arrived = AllToAll.apply(x.index_select(0, token), send, recv, self.ep_group, f"{self.layer_name} dispatch")
        # 4. each local expert on its rows from every sender (every expert runs, on zero rows if none came)
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(counts.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        rows = arrived.index_select(0, by_expert).split(counts.sum(0).tolist())
        y = torch.cat([expert(r) for expert, r in zip(self.experts.values(), rows)])
        y = y.index_select(0, by_expert.argsort())           # back in arrival order
        # 5. combine, then weight by the gates where they were computed
        back = AllToAll.apply(y, recv, send, self.ep_group, f"{self.layer_name} combine")
        weighted = back * gates.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, weighted)


def build_expert_parallel(model: nn.Module, groups, ep: int) -> nn.Module:
    """Keep only this rank's slice of every MoE layer's experts (cut from the whole, seeded
    model) and route through the ep group. ``groups``: :class:`~labkit.engine.grid.ExpertGroups`."""
    i = groups.index
    for name, moe in moe_layers(model):
        local = moe.n_experts // ep
        mine = range(i * local, (i + 1) * local)
        moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in mine})
        moe.__class__ = ExpertParallelMoE
        moe.ep, moe.ep_group, moe.layer_name = ep, groups.ep, name
    return model


def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the experts this rank holds, in ``module``'s naming."""
    return [(f"{name}.experts.{key}", p) for name, moe in moe_layers(module)
            for key, p in moe.experts.named_parameters()]


class ExpertSync:
    """A data-parallel sync for the dense parameters, plus the experts' own average.

    The dense sync (any of the four dp modes) is built over all of dp but sees only the dense
    parameters; the experts' gradients are summed over their replicas (the expert-dp group,
    dp/ep ranks) after it and divided by dp.
    """

    def __init__(self, dense, groups, dp: int):
        self.dense, self.groups, self.dp = dense, groups, dp
        self.times_forward, self.times_backward = dense.times_forward, dense.times_backward

    def wrap(self, module: nn.Module) -> nn.Module:
        self.experts = expert_parameters(module)
        if isinstance(self.dense, DDPSync):     # DDP's own way to leave parameters alone
            DDP._set_params_and_buffers_to_ignore_for_model(module, [n for n, _ in self.experts])
        held = [p for _, p in self.experts if p.requires_grad]
        for p in held:                     # hidden from the dense sync's buckets and hooks
            p.requires_grad_(False)
        try:
            return self.dense.wrap(module)
        finally:
            for p in held:
                p.requires_grad_(True)

    def defer(self):
        return self.dense.defer()

    @contextmanager
    def backward(self, last: bool):
        with self.dense.backward(last):
            yield

    def finish(self) -> None:
        self.dense.finish()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.experts]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if len(self.groups.edp_ranks) > 1:
            comm.all_reduce(flat, self.groups.edp, name="expert grads")
        flat.div_(self.dp)
        offset = 0
        for (_, p), g in zip(self.experts, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def after_step(self) -> None:
        self.dense.after_step()

    def held_bytes(self, module: nn.Module) -> dict:
        return self.dense.held_bytes(module)

    def full_state_dict(self, module: nn.Module) -> dict:
        """The whole model's parameters: the dense ones as they are, every expert gathered over
        the ep group (every rank of it joins) and keyed by its global index."""
        state = self.dense.full_state_dict(module)
        ep, gathered = len(self.groups.ep_ranks), {}
        for name, moe in moe_layers(module):
            mine = [(pos, rest, t) for pos, expert in enumerate(moe.experts.values())
                    for rest, t in expert.state_dict().items()]
            flat = torch.cat([t.detach().reshape(-1) for *_, t in mine])
            out = flat.new_empty(ep * flat.numel())
            comm.all_gather(out, flat, self.groups.ep, name=f"{name} experts gathered")
            local = len(moe.experts)
            for j, part in enumerate(out.chunk(ep)):
                offset = 0
                for pos, rest, t in mine:
                    key = f"{name}.experts.{j * local + pos}.{rest}"
                    gathered.setdefault(name, {})[key] = part[offset:offset + t.numel()].view_as(t).clone()
                    offset += t.numel()
        ordered, layers = {}, list(gathered)
        for key, value in state.items():          # the whole model's order, each layer's experts in place
            layer = next((n for n in layers if key.startswith(f"{n}.experts.")), None)
            if layer is None:
                ordered[key] = value
            else:                                 # global index order (j-major, then position)
                ordered.update(gathered.pop(layer, {}))
        return ordered
