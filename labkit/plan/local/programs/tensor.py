"""Tensor parallelism in the planner's programs: Megatron's split as labkit's tp_mode="megatron"
runs it (parallel/tensor/): the sharded Linears' products at 1/tp, a blocking all-reduce after
each row-parallel Linear's forward (g) and at each column-parallel one's input in backward (f).
:class:`TensorPrograms` is a part of :class:`labkit.plan.local.physical.Builder`.
"""
from __future__ import annotations

from fnmatch import fnmatch


class TensorPrograms:
    """The Builder's tp methods (they use its grid and calls)."""

    def tp_split(self, plan: dict) -> None:
        """The model's Linears the tensor plan shards: column- and row-parallel."""
        linears = {q for b in self.w.blocks for q in b.linears}
        self.col = {q for q in linears if _matches(q, plan, "colwise")}
        self.row = {q for q in linears if _matches(q, plan, "rowwise")}

    def scale(self, op) -> float:
        """The share of ``op``'s work on one tp rank: 1/tp of a sharded Linear's, else all of it."""
        return 1.0 / self.s.tp if op.linear in self.col or op.linear in self.row else 1.0

    def tp_group(self, d: int, p: int) -> tuple:
        return tuple(self.grid.group("t", dp=d, pp=p))

    def tp_calls(self, b, fwd: bool, d: int, p: int, mb) -> list:
        """Block ``b``'s tp all-reduces: g after each row-parallel Linear (forward), f at each
        column-parallel one's input (backward), each of the block's output's bytes."""
        which, tag = (self.row, "g") if fwd else (self.col, "f")
        out = []
        for q in sorted(which & set(b.linears)):
            out += self.blocking((tag, q, d, p, mb), self.tp_group(d, p), "all_reduce", 4 * b.out_numel * self.w.size,
                                 "allreduce", f"tp {tag} {q}", mb)
        return out


def _matches(qualified: str, plan: dict, style: str) -> bool:
    return any(v == style and (fnmatch(qualified, k) or qualified == k) for k, v in plan.items())
