"""torch's own sharding as the comparator: FSDP2's ``fully_shard`` on each block (an
``nn.Sequential``'s children, any other model's repeated blocks), then the root.

``zero=3`` is ``reshard_after_forward=True`` (parameters freed after each block's forward and
gathered again for backward); ``zero=2`` is ``reshard_after_forward=False`` (parameters kept
whole between forward and backward, gradients still reduce-scattered: ZeRO-2's memory
pattern, as torch's docs describe it). ``prefetch`` = k becomes
``set_modules_to_forward_prefetch(next k blocks)`` and
``set_modules_to_backward_prefetch(previous k blocks)``.

How its collectives reach the timeline: FSDP2 lets a module replace its all-gather and its
reduce-scatter (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch ≥
2.7). :class:`LabkitAllGather` and :class:`LabkitReduceScatter` keep torch's buffer
allocation (``DefaultAllocMixin``) and issue the call through :mod:`labkit.comm`, so each is
timed, flight-logged and bounded by the lab's timeout like every labkit call. On CPU, FSDP2
issues its all-gathers synchronously (there are no streams to overlap on), so its prefetch
changes the order of gathers but hides less than the hand-built one, whose gathers are
asynchronous gloo work.

FSDP2 reduce-scatters only the gradients backward produced on each rank, so a parameter that
some replicas reach and others do not (a route taken by one replica's rows) gives the ranks
reduce-scatters of different sizes, and gloo aborts the process. Before each reduce-scatter the
ranks compare its size (a few bytes, kept off the timeline, as the executor's bookkeeping); a
difference raises :class:`~labkit.errors.CommMismatch` on every rank, naming the rank, the
step, the unit and the fix, and the engines stay alive.

HSDP (``Strategy.dp_shard``): the mesh is 2-D, ``(replicate, shard)``, one row per run of
dp_shard ranks, and ``fully_shard(mesh=...)`` shards along a row and all-reduces each shard's
gradient down a column (torch's own all-reduce: it does not pass through labkit.comm, so the
timeline shows the gathers and reduce-scatters but not that all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from ... import comm
from ...errors import CommMismatch
from ..blocks import find_blocks
from ..data.sync import GradSync


class LabkitAllGather(DefaultAllGather):
    """FSDP2's all-gather, issued through labkit.comm (completed before it returns)."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        comm.all_gather(output_tensor, input_tensor, group, name="fsdp2 all-gather")
        return None                 # done already: FSDP waits only on a Work it is given


class LabkitReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, issued through labkit.comm (torch's op: it divides around it),
    once every rank has the same size to send (:func:`same_size_everywhere`)."""

    def __init__(self, unit: str = "root"):
        self.unit = unit               # which fully_shard unit: "block layers.0", "root (a, b)"

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        same_size_everywhere(input_tensor.numel(), group, self.unit, input_tensor.device)
        comm.reduce_scatter(output_tensor, input_tensor, group, name="fsdp2 reduce-scatter", op=op)
        return None


def same_size_everywhere(numel: int, group, unit: str, device=None) -> None:
    """Raise CommMismatch on every rank unless every rank of ``group`` reduce-scatters
    ``numel`` elements: gloo would abort the process on a size that differs. The sizes travel
    on the gradients' ``device`` (NCCL moves only GPU tensors)."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([numel], device=device), group=group)
    sizes = [int(t) for t in sizes]
    if len(set(sizes)) == 1:
        return
    ranks = dist.get_process_group_ranks(group)
    short = [r for r, n in zip(ranks, sizes) if n < max(sizes)]
    ctx = comm.context()
    raise CommMismatch(
        f"rank {ctx.rank}, step {ctx.recorder.step}: reduce_scatter 'fsdp2 reduce-scatter' of {unit}: the ranks "
        f"would send {dict(zip(ranks, sizes))} gradient elements. torch's fully_shard reduce-scatters only the "
        f"gradients backward produced on each rank, and rank(s) {short} got none this step for some of these "
        "parameters while another rank did (a parameter only some replicas' rows reach); gloo would abort "
        "the process. Use zero_mode='labkit' (it sends a zero for a gradient a replica lacks, "
        "and skips a parameter no replica reached, as one process does), or make every replica reach "
        "the same parameters each step")


def _root_unit(model: nn.Module, blocks: list) -> str:
    """The root unit in words: the parameters no block holds (an embedding, a head)."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    names = [n for n, p in model.named_parameters() if id(p) not in inside]
    shown = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
    return f"the root unit ({shown})" if names else "the root unit"


class FSDP2Sync(GradSync):
    """The stage's blocks under ``fully_shard``; FSDP2 does the reducing inside backward."""

    times_forward = True           # per-block forward spans, outside FSDP2's pre-forward gather
    grads_to_none = True           # FSDP2 owns the gradients: none kept between steps (below)

    def __init__(self, group, dp: int, bucket_mb: float, recorder, zero: int, prefetch: int,
                 blocks: str | None = "", replicas=None):
        super().__init__(group, dp, bucket_mb)
        self.recorder, self.reshard, self.prefetch = recorder, zero == 3, prefetch
        self.replicas = replicas        # HSDP: (replicate group, the runs of ranks that shard alike)
        self.blocks_path = blocks       # labkit.parallel.blocks: "" is a Sequential's children

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from ..tensor import fresh_dtensor_caches

        super().wrap(model)
        fresh_dtensor_caches()          # a mesh on these ranks may have been used by an earlier run
        device = next(model.parameters()).device
        if self.replicas is None:
            mesh = DeviceMesh.from_group(self.group, device_type=device.type)
        else:                           # HSDP: replicate × shard
            replicate, runs = self.replicas
            mesh = DeviceMesh.from_group([replicate, self.group], device_type=device.type, mesh=runs,
                                         mesh_dim_names=("replicate", "shard"))
        named = find_blocks(model, self.blocks_path)
        blocks = [b for _, b in named if any(p.requires_grad for p in b.parameters())]
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard)
        units = [(b, f"block {n}") for n, b in named if b in blocks] + [(model, _root_unit(model, blocks))]
        for module, unit in units:
            module.set_custom_all_gather(LabkitAllGather())
            module.set_custom_reduce_scatter(LabkitReduceScatter(unit))
        k = self.prefetch
        for i, block in enumerate(blocks):
            if k:
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + k])
                block.set_modules_to_backward_prefetch(blocks[max(i - k, 0):i][::-1])
        for name, block in named:
            # registered after fully_shard's: the span starts once FSDP2 has gathered the block
            block.register_forward_pre_hook(lambda m, a: self._open())
            block.register_forward_hook(lambda m, a, out, n=name: self._close(n), prepend=True)
        return model

    def _open(self):
        self._start = self.recorder.mark()

    def _close(self, name: str):
        self.recorder.add("fwd", f"F block {name}", self._start, self.recorder.mark(),
                          microbatch=getattr(self.recorder, "microbatch", None))

    def finish(self) -> None:
        pass                 # FSDP2's backward already reduce-scattered every block

    def full_state_dict(self, module: nn.Module) -> dict:
        from torch.distributed.tensor import DTensor

        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in module.state_dict().items()}

    def held_bytes(self, module: nn.Module) -> dict:
        """Local shards at rest (peaks are FSDP2's business: not measured here)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
        grads = [g.to_local() if hasattr(g, "to_local") else g
                 for g in (p.grad for p in module.parameters()) if g is not None]
        params = sum(t.numel() * t.element_size() for t in local)
        grad_bytes = sum(t.numel() * t.element_size() for t in grads)
        return {"params": params, "params_peak": params, "grads": grad_bytes, "grads_peak": grad_bytes}

