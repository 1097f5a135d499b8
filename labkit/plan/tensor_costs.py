"""What tensor parallelism costs a step, measured: each block at its shard's width, and the f/g calls.

A tp rank does not run 1/tp of a block's time: the matmuls shrink by tp, the elementwise work
between a column- and a row-parallel layer (GELU, the attention core over this rank's heads)
too, but LayerNorms, residuals, the replicated bias and Python's per-module cost do not. So the
planner times the blocks as the tensor plan cuts them: every planned module is replaced by a
plain module of one rank's shard shape (:func:`build_local_shard`), without its collectives,
and timed like the whole model (:func:`labkit.plan.block_timing.time_blocks`). Forward hooks on the
planned modules note where Megatron's calls are (Shoeybi et al. 2019, §3):

* a row-parallel Linear or vocab-parallel Embedding: **g**, an all-reduce of its output in
  forward (identity backward);
* a column-parallel Linear whose input needs a gradient: **f**, an all-reduce of that input's
  gradient in backward (identity forward).

The calls themselves are timed apart, through labkit's own f and g
(:func:`time_tp_calls`): a g in forward and an f inside autograd's backward, on the lab's
world group, at the sizes the step sends; their α-β is fitted per direction.
"""
from __future__ import annotations

import time
from statistics import median

import torch
from torch import nn

from ..parallel.tensor.plan import match_plan, resolve_plan


class _VocabShard(nn.Module):
    """One rank's rows of a vocab-parallel embedding: out-of-slice ids look up zeros (no g)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.rows, self.weight = rows, nn.Parameter(torch.randn(rows, dim))

    def forward(self, ids):
        outside = ids >= self.rows
        out = nn.functional.embedding(ids.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _local(module: nn.Module, style: str, tp: int) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return _VocabShard(module.num_embeddings // tp, module.embedding_dim)
    bias = module.bias is not None
    if style == "colwise":
        return nn.Linear(module.in_features, module.out_features // tp, bias=bias)
    return nn.Linear(module.in_features // tp, module.out_features, bias=bias)


def build_local_shard(net: nn.Sequential, plan: dict | None, tp: int) -> dict[str, str]:
    """Replace (in place) each module ``plan`` names by a plain module of one tp rank's shard
    shape; returns the matched plan (module name → style)."""
    matched = match_plan(net, resolve_plan(net, plan))
    for name, style in matched.items():
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, child, _local(net.get_submodule(name), style, tp))
    return matched


def watch_calls(net: nn.Sequential, matched: dict[str, str]) -> tuple[dict, list]:
    """Forward hooks noting, per top-level block, the f/g calls of one forward: block index →
    [("g" | "f", elements per sample)]; returns (calls, hook handles)."""
    calls: dict[int, list] = {}
    handles = []
    for name, style in matched.items():
        block = int(name.split(".")[0])

        def hook(module, args, out, block=block, style=style):
            if style == "rowwise":
                calls.setdefault(block, []).append(("g", out[0].numel()))
            elif args[0].requires_grad:
                calls.setdefault(block, []).append(("f", args[0][0].numel()))
        handles.append(net.get_submodule(name).register_forward_hook(hook))
    return calls, handles


def time_tp_calls(sizes: list[int], iters: int = 5) -> dict:
    """This rank's seconds of one g (forward all-reduce) and one f (all-reduce of a gradient
    inside autograd's backward) per size in bytes, over the world group, recording on: the
    calls a tensor-parallel step makes, through the same code (labkit.parallel.tensor.mappings)."""
    import torch.distributed as dist

    from ..engine import session
    from ..parallel.tensor.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel

    recorder = session().recorder
    was_recording, recorder.enabled = recorder.enabled, True
    out = {"sizes": list(sizes), "g": [], "f": []}
    try:
        for nbytes in sizes:
            x = torch.randn(max(1, nbytes // 4), requires_grad=True)
            g, f = [], []
            for _ in range(iters + 1):
                dist.barrier()
                t0 = time.perf_counter()
                reduce_from_tensor_parallel(x.detach().clone(), None, "calibrate")
                g.append(time.perf_counter() - t0)
                y = copy_to_tensor_parallel(x, None, "calibrate") * 1.0
                dist.barrier()
                t0 = time.perf_counter()
                y.backward(torch.ones_like(y))
                f.append(time.perf_counter() - t0)
            out["g"].append(median(g[1:]))
            out["f"].append(median(f[1:]))
    finally:
        recorder.drain()
        recorder.enabled = was_recording
    return out


def fit_tp_calls(per_rank: list[dict], n: int) -> dict:
    """α-β per direction from the slowest rank's medians: t = α + 2(n−1)/n·S/β (ring all-reduce)."""
    from ..bench import fit_alpha_beta

    sizes = per_rank[0]["sizes"]
    fits = {}
    for direction in ("g", "f"):
        times = [max(r[direction][i] for r in per_rank) for i in range(len(sizes))]
        alpha, beta = fit_alpha_beta([2 * (n - 1) / n * s for s in sizes], times)
        fits[direction] = {"alpha_s": alpha, "beta_Bps": beta if beta != float("inf") else 1e30}
    return fits
