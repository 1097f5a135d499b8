"""The α-β model of a wire, which both planners price every call with: here on the lab's
measured gloo (α paid at each ring step), at scale on a GPU preset's NVLink and InfiniBand (α
once per call). Hockney's model with nccl-tests' bus factors (PERFORMANCE.md)."""
from __future__ import annotations

from dataclasses import dataclass


def ring_steps(family: str, n: int) -> int:
    """Messages each rank sends, one after another, in the ring (or pairwise) algorithm of
    ``family`` on n ranks: 2(n−1) for all-reduce, n−1 for the others, 1 for a send."""
    return 1 if family == "send" else (2 * (n - 1) if family == "all_reduce" else n - 1)


def bus_factor(family: str, n: int) -> float:
    """Bytes each rank sends per byte of the call (nccl-tests' bus factor, PERFORMANCE.md):
    2(n−1)/n for all-reduce, (n−1)/n for all-gather, reduce-scatter and all-to-all, 1 for a send."""
    return 1.0 if family == "send" else (2 * (n - 1) / n if family == "all_reduce" else (n - 1) / n)


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """One kind of wire in the α-β model, for both planners: a call of ``family`` moving S bytes
    (nccl-tests' size) on n ranks takes k·α + bus(n)·S/β, bus(n) nccl-tests' bus factor."""

    beta: float
    """Bytes per second one rank moves on this link in one direction (bus bandwidth)."""
    alpha: float
    """Seconds of fixed cost: per call, or per ring step with ``per_step``."""
    per_step: bool = False
    """Whether α is paid at each of the ring's steps (k = 2(n−1) for all-reduce, n−1 for the
    others: gloo on CPU sends each step as a message and waits for it, the local machine) or
    once per call (k = 1: NCCL pipelines a ring's steps, so a small call costs one launch and
    one latency, the at-scale presets)."""

    def seconds(self, family: str, nbytes: float, n: int) -> float:
        """Seconds of one call of ``family`` (all_reduce, all_gather, reduce_scatter, all_to_all,
        send) moving ``nbytes`` over ``n`` ranks; a collective of one rank is free."""
        if family != "send" and n <= 1:
            return 0.0
        steps = ring_steps(family, n) if self.per_step else 1
        return steps * self.alpha + bus_factor(family, n) * nbytes / self.beta
