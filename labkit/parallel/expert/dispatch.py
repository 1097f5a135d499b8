"""Expert parallelism by hand: dispatch, local experts, combine; and the experts' own sync.

One MoE layer on one rank of an ep group of ``ep`` ranks, holding experts
``[i·E/ep, (i+1)·E/ep)`` (GShard, Lepikhin et al. 2020, §2.2; DeepSeek-V3, arXiv 2412.19437, §3.2.2):

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

With ``Strategy(ep_overlap="microbatch")`` the layer's tokens are cut into two micro-batches
that take turns (DeepSeek-V3's prefilling, arXiv 2412.19437: two micro-batches of similar
work; Megatron-Core's "EP A2A overlap"): micro-batch B's dispatch is in flight while A's
experts compute, and A's combine while B's experts compute; a shared expert, which needs no
exchange, runs while both dispatches travel. The exchanges are issued async
(:class:`_Start` / :class:`_Wait`), and their backward is the same pattern reversed: autograd
runs the later micro-batch's nodes first, so one micro-batch's gradient all-to-all travels under the other's expert backward.

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
from ..tensor.mappings import gather_from_sequence_parallel, scatter_to_sequence_parallel
from . import fused_experts, moe_layers, n_experts


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


class _Start(torch.autograd.Function):
    """Issue the exchange of ``x`` async; returns the (not yet filled) receive buffer, the
    handle kept in ``box`` for :class:`_Wait`. Backward waits the gradient's return trip."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, name: str, box: dict):
        ctx.box = box
        out = x.new_empty((sum(recv), *x.shape[1:]))
        box["x"] = x.contiguous()                      # alive until the exchange completes
        box["handle"] = comm.all_to_all_single(out, box["x"], recv, send, group=group, name=name, async_op=True)
        box.update(send=send, recv=recv, group=group, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        box = ctx.box
        _wait(box.pop("back_handle"))
        box.pop("grad")
        return box.pop("back"), None, None, None, None, None


class _Wait(torch.autograd.Function):
    """Wait for :class:`_Start`'s exchange; backward issues the gradient's exchange async."""

    @staticmethod
    def forward(ctx, out, box: dict):
        ctx.box = box
        _wait(box.pop("handle"))
        box.pop("x")
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        box = ctx.box
        grad = grad.contiguous()
        back = grad.new_empty((sum(box["send"]), *grad.shape[1:]))
        box["back"], box["grad"] = back, grad
        box["back_handle"] = comm.all_to_all_single(back, grad, box["send"], box["recv"], group=box["group"],
                                                    name=f"{box['name']} backward", async_op=True)
        return grad, None                # _Start's backward hands on what comes back


def _wait(handle) -> None:
    """Wait for an async exchange; the time blocked is exposed comm, cut out of the compute
    span around it, as a blocking call's is (labkit.comm)."""
    recorder = comm.context().recorder
    start = recorder.mark()
    handle.wait()
    recorder.blocked(start, recorder.mark())


def _start(x, send, recv, group, name):
    box: dict = {}
    return _Start.apply(x, send, recv, group, name, box), box


class Routing:
    """Dispatch, local experts, combine (the module docstring's five steps), for a layer that
    sets ``ep``, ``ep_group``, ``n_experts``, ``top_k``, ``layer_name`` and ``shared`` and runs
    its local experts in ``_experts(arrived rows, counts[sender, local expert])``."""

    def _routed_blocking(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.n_experts // self.ep
        # 1. one row per (token, choice), sorted by expert: grouped by destination rank, then expert
        order, token, per_expert = self._sort(chosen)
        # 2. sizes first: [sender, my local expert] → rows coming
        counts = torch.empty_like(per_expert)
        comm.all_to_all_single(counts, per_expert, group=self.ep_group, name=f"{self.layer_name} counts")
        counts = counts.view(ep, local)
        send, recv = per_expert.view(ep, local).sum(1).tolist(), counts.sum(1).tolist()
        # 3. dispatch
        arrived = AllToAll.apply(x.index_select(0, token), send, recv, self.ep_group, f"{self.layer_name} dispatch")
        # 4. the local experts; 5. combine, then weight by the gates where they were computed
        y = self._experts(arrived, counts)
        back = AllToAll.apply(y, recv, send, self.ep_group, f"{self.layer_name} combine")
        return self._unpermute(x, back, gates, order, token)

    def _sort(self, chosen):
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        return order, order // self.top_k, torch.bincount(flat, minlength=self.n_experts)

    def _unpermute(self, x, back, gates, order, token):
        weighted = back * gates.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, weighted)

    def _routed_overlapped(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, whole: torch.Tensor):
        """Two micro-batches of tokens, A and B, each exchange async under the other's experts:
        dispatch A, B; wait A, experts A, combine A; wait B, experts B, combine B; wait both.
        Returns the routed output and the shared expert's on ``whole`` (None without one)."""
        ep, local, name = self.ep, self.n_experts // self.ep, self.layer_name
        parts = [(xs, cs, gs) for xs, cs, gs in zip(x.tensor_split(2), chosen.tensor_split(2), gates.tensor_split(2))]
        sorted_ = [self._sort(cs) for _, cs, _ in parts]
        # sizes of both micro-batches in one exchange: [destination, micro-batch, its local expert]
        mine = torch.stack([pe.view(ep, local) for *_, pe in sorted_], dim=1).contiguous()
        counts = torch.empty_like(mine)
        comm.all_to_all_single(counts, mine, group=self.ep_group, name=f"{name} counts")
        plans = []
        for m, ((xs, _, _), (order, token, _)) in enumerate(zip(parts, sorted_)):
            send, recv = mine[:, m].sum(1).tolist(), counts[:, m].sum(1).tolist()
            arrived, box = _start(xs.index_select(0, token), send, recv, self.ep_group, f"{name} dispatch mb{m}")
            plans.append((send, recv, arrived, box))
        # the shared expert needs no exchange: it runs while both dispatches travel
        shared = self.shared(whole) if self.shared is not None else None
        combined = []
        for m, (send, recv, arrived, box) in enumerate(plans):
            y = self._experts(_Wait.apply(arrived, box), counts[:, m])     # the other's exchange in flight
            combined.append(_start(y, recv, send, self.ep_group, f"{name} combine mb{m}"))
        out = [self._unpermute(xs, _Wait.apply(back, box), gs, order, token)
               for (xs, _, gs), (order, token, _), (back, box) in zip(parts, sorted_, combined)]
        return torch.cat(out), shared


class ExpertParallelMoE(Routing, MoE):
    """A :class:`~labkit.models.moe.MoE` holding only its ep rank's experts (``experts`` keyed
    by their global index, so state_dict keys stay the whole model's) and routing by all-to-all."""

    overlap = "none"
    shared_in_routed = True
    tp_group = None

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        whole, shared = x, None
        if self.tp_group is not None:       # the tokens are replicated over tp: each tp rank routes 1/tp
            x, chosen, gates = self._my_tokens(x, chosen, gates)
        if self.overlap == "microbatch" and len(x) > 1:
            out, shared = self._routed_overlapped(x, chosen, gates, whole)
        else:
            out = self._routed_blocking(x, chosen, gates)
        if self.tp_group is not None:       # every tp rank's share back together (backward: its slice)
            out = gather_from_sequence_parallel(out.unsqueeze(0), self.tp_group, f"{self.layer_name} tokens",
                                                grad_is_partial=False).squeeze(0)
        if self.shared is not None:
            out = out + (shared if shared is not None else self.shared(whole))
        return out

    def _my_tokens(self, x, chosen, gates):
        """This tp rank's 1/tp of the tokens (Megatron-Core's MoE under tp likewise routes each
        token from one tp rank only); backward gathers their gradients (the router's included)."""
        tp = self.tp_group.size()
        if len(x) % tp:
            raise ValueError(f"{self.layer_name}: {len(x)} tokens per micro-batch do not split over tp={tp} ranks "
                             f"for expert parallelism; use a batch whose tokens per rank and micro-batch are "
                             f"a multiple of {tp}")
        x = scatter_to_sequence_parallel(x.unsqueeze(0), self.tp_group, f"{self.layer_name} tokens").squeeze(0)
        gates = scatter_to_sequence_parallel(gates.unsqueeze(0), self.tp_group, f"{self.layer_name} gates").squeeze(0)
        return x, chosen.chunk(tp)[self.tp_group.rank()], gates

    def _experts(self, arrived: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows from every sender (every expert runs, on zero rows if
        none came); ``counts``: [sender, local expert]. The result is in arrival order."""
        ep, local = counts.shape
        expert_of_row = torch.arange(local, device=arrived.device).repeat(ep).repeat_interleave(counts.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        rows = arrived.index_select(0, by_expert).split(counts.sum(0).tolist())
        y = torch.cat([expert(r) for expert, r in zip(self.experts.values(), rows)])
        return y.index_select(0, by_expert.argsort())


class ExpertParallelExperts(Routing, nn.Module):
    """A transformers sparse block's experts (fused tensors of ``n_experts`` rows, called as
    ``experts(hidden_states, top_k_index, top_k_weights)``) holding only this ep rank's rows,
    under the same parameter names (state_dict keys stay the model's; the shapes are the
    slice). The tokens go to their experts' ranks by the all-to-alls of :class:`Routing`, and
    there the model's own experts module computes them (its forward, on this rank's rows,
    each row routed to its local expert with weight 1); the router's weights are applied
    where the token lives, as in the model."""

    shared = None         # a shared expert stays in the model's block, outside the exchange

    def __init__(self, experts: nn.Module, index: int, ep: int, group, name: str, overlap: str):
        super().__init__()
        self.n_experts, self.ep, self.ep_group, self.layer_name, self.overlap = n_experts(experts), ep, group, name, overlap
        local = self.n_experts // ep
        for pname, p in list(experts.named_parameters(recurse=False)):
            mine = nn.Parameter(p.detach()[index * local:(index + 1) * local].clone(), requires_grad=p.requires_grad)
            setattr(self, pname, mine)
            setattr(experts, pname, mine)       # one Parameter: the model's module computes with this rank's rows
        if hasattr(experts, "num_experts"):
            experts.num_experts = local
        self.__dict__["inner"] = experts         # not a submodule: its parameters are registered here

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        self.top_k = top_k_index.shape[1]
        if self.overlap == "microbatch" and len(hidden_states) > 1:
            return self._routed_overlapped(hidden_states, top_k_index, top_k_weights, hidden_states)[0]
        return self._routed_blocking(hidden_states, top_k_index, top_k_weights)

    def _experts(self, arrived: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The model's experts module on the rows that arrived (``counts``: [sender, local expert])."""
        ep, local = counts.shape
        expert_of_row = torch.arange(local, device=arrived.device).repeat(ep).repeat_interleave(counts.reshape(-1))
        y = self.inner(arrived, expert_of_row.unsqueeze(1), arrived.new_ones(len(arrived), 1))
        # every parameter in the graph (a zero gradient when no row came), as labkit's MoE runs every expert
        return y + sum(p.reshape(-1)[:0].sum() for p in self.parameters())


def build_expert_parallel(model: nn.Module, groups, ep: int, overlap: str = "none", tp_group=None) -> nn.Module:
    """Keep only this rank's slice of every MoE layer's experts (cut from the whole, seeded
    model) and route through the ep group, two micro-batches in turn when ``overlap`` is
    "microbatch". ``groups``: :class:`~labkit.engine.grid.ExpertGroups`. ``tp_group`` (tp > 1):
    each tp rank routes its 1/tp of the tokens, and the experts' gradients sum over tp too."""
    i = groups.index
    for name, moe in moe_layers(model):
        local = moe.n_experts // ep
        mine = range(i * local, (i + 1) * local)
        moe.experts = nn.ModuleDict({str(e): moe.experts[e] for e in mine})
        moe.__class__ = ExpertParallelMoE
        moe.ep, moe.ep_group, moe.layer_name, moe.overlap, moe.tp_group = ep, groups.ep, name, overlap, tp_group
    for name, experts in fused_experts(model):          # a transformers model's sparse blocks
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ExpertParallelExperts(experts, i, ep, groups.ep, name, overlap))
    return model


@contextmanager
def _hidden(params: list):
    """``params`` with requires_grad off inside: a sync wrapped here collects the others only."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the experts this rank holds, in ``module``'s naming."""
    return [(f"{name}.experts.{key}", p) for name, moe in moe_layers(module)
            for key, p in moe.experts.named_parameters()] + [
        (f"{name}.{key}", p) for name, m in module.named_modules() if isinstance(m, ExpertParallelExperts)
        for key, p in m.named_parameters()]


class ExpertSync:
    """A data-parallel sync for the dense parameters, plus the experts' own average.

    The dense sync (any of the four dp modes, or ZeRO-1/2) is built over all of dp (dp × cp)
    but sees only the dense parameters. The experts' gradients are summed over their replicas
    (the expert-dp group, dp/ep ranks; and over tp and cp, whose ranks route other tokens
    through the same copies) after it and divided by dp (dp·cp). With ZeRO, ``sharded`` (a
    :class:`~labkit.parallel.zero.sync.Zero1Sync` or ``Zero2Sync`` over every rank holding
    the same experts, ``ExpertGroups.replicas``) reduce-scatters them instead, so the experts'
    optimizer state (and gradients) are cut over their own copies, as Megatron-Core's
    distributed optimizer shards its expert parameters over the expert-data-parallel group.
    """

    def __init__(self, dense, groups, dp: int, sharded=None, cp_group=None):
        self.dense, self.groups, self.dp, self.sharded, self.cp_group = dense, groups, dp, sharded, cp_group
        self.times_forward, self.times_backward = dense.times_forward, dense.times_backward

    def wrap(self, module: nn.Module) -> nn.Module:
        self.experts = expert_parameters(module)
        self.tp_group = next((moe.tp_group for _, moe in moe_layers(module)), None)
        if isinstance(self.dense, DDPSync):     # DDP's own way to leave parameters alone
            DDP._set_params_and_buffers_to_ignore_for_model(module, [n for n, _ in self.experts])
        experts = {id(p) for _, p in self.experts}
        dense = [p for p in module.parameters() if p.requires_grad and id(p) not in experts]
        with _hidden([p for _, p in self.experts if p.requires_grad]):       # from the dense sync's buckets and hooks
            module = self.dense.wrap(module)
        if self.sharded is not None:
            with _hidden(dense):                          # the expert sync's units hold only experts
                self.sharded.wrap(module)
            for unit in self.sharded.units:               # summed over every copy, a mean over dp (dp·cp)
                unit.divisor = self.dp
        return module

    @property
    def units(self) -> list:
        """The flat units the sharded optimizer steps (with ZeRO): the dense ones, then the experts'."""
        return list(getattr(self.dense, "units", ())) + list(getattr(self.sharded, "units", ()))

    def defer(self):
        return self.dense.defer()

    @contextmanager
    def backward(self, last: bool):
        with self.dense.backward(last):
            if self.sharded is None:
                yield
            else:
                with self.sharded.backward(last):
                    yield

    def finish(self) -> None:
        self.dense.finish()
        if self.sharded is not None:
            self.sharded.finish()
            return
        if not self.experts:              # a pipeline stage without MoE layers
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.experts]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.tp_group is not None:    # each tp rank routed 1/tp of the tokens through its copy
            comm.all_reduce(flat, self.tp_group, name="expert grads over tp")
        if self.cp_group is not None:    # each cp rank routed its slice of every sequence through its copy
            comm.all_reduce(flat, self.cp_group, name="expert grads over cp")
        if len(self.groups.edp_ranks) > 1:
            comm.all_reduce(flat, self.groups.edp, name="expert grads")
        flat.div_(self.dp)
        offset = 0
        for (_, p), g in zip(self.experts, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def after_step(self) -> None:
        self.dense.after_step()
        if self.sharded is not None:
            self.sharded.after_step()

    def held_bytes(self, module: nn.Module) -> dict:
        held = self.dense.held_bytes(module)
        if self.sharded is not None:
            experts = self.sharded.held_bytes(module)
            held = {key: value + experts.get(key, 0) for key, value in held.items()}
        return held

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
        for name, m in module.named_modules():     # fused experts: this rank's rows, gathered along dim 0
            if isinstance(m, ExpertParallelExperts):
                for key, p in m.named_parameters():
                    out = p.new_empty((ep * p.shape[0], *p.shape[1:]))
                    comm.all_gather(out, p.detach().contiguous(), self.groups.ep, name=f"{name}.{key} gathered")
                    state[f"{name}.{key}"] = out.cpu()
        ordered, layers = {}, list(gathered)
        for key, value in state.items():          # the whole model's order, each layer's experts in place
            layer = next((n for n in layers if key.startswith(f"{n}.experts.")), None)
            if layer is None:
                ordered[key] = value
            else:                                 # global index order (j-major, then position)
                ordered.update(gathered.pop(layer, {}))
        return ordered
