"""Zero-bubble compute orders: ZB-H1 and ZB-V (Qi et al., ICLR 2024, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241).

Each backward splits in two: ``I``, the gradient w.r.t. the stage input, which the upstream
stage waits for, and ``W``, the weight gradients, which nothing downstream waits for and can
therefore fill idle slots. These builders return one rank's compute order as
``(op, microbatch, chunk)`` triples, like the other builders in :mod:`labkit.schedules`, which
wraps them with the sends and receives they need and places chunks on stages.

    >>> " ".join(f"{op}{mb}" for op, mb, _ in zb_h1(1, 2, 3))
    'F0 I0 F1 I1 W0 F2 I2 W1 W2'
"""
from __future__ import annotations


def zb_h1(r: int, p: int, m: int, v: int = 1) -> list[tuple]:
    """ZB-H1 (paper §2.1, Figure 3 top) on rank r of p, m micro-batches, one stage per rank.

    1F1B's three phases with B replaced by I, and each W run r micro-batches after its I: the
    I's travel upstream sooner (the upstream stage no longer waits for downstream W's), and the
    deferred W's fill the cool-down's idle slots. Every rank then holds at most p micro-batches
    between F and W, as many as 1F1B's first rank, the one with the most; so peak memory stays
    1F1B's while the bubble shrinks to (p-1)(T_F + T_B - T_W), a third of 1F1B's for equal costs.
    """
    warmup = min(p - r - 1, m)          # as 1F1B (Megatron): fill the pipe
    order = [("F", i, 0) for i in range(warmup)]
    for k in range(m):                  # k-th input-gradient; steady state while forwards remain
        if warmup + k < m:
            order.append(("F", warmup + k, 0))
        order.append(("I", k, 0))
        if k >= r:                      # the W owed from r micro-batches ago
            order.append(("W", k - r, 0))
    return order + [("W", i, 0) for i in range(max(m - r, 0), m)]   # cool-down: W's left


def zbv(r: int, p: int, m: int, v: int = 2) -> list[tuple]:
    """ZB-V (paper §6) on rank r of p: chunk 0 is stage r, chunk 1 stage 2p-1-r.

    The V puts the first and last stages on rank 0 (the model's input and its loss on one
    rank), and every rank holds two half-size chunks; the turn from stage p-1 to p is local.
    With equal F/I/W costs the phases below keep each rank busy from its first forward to its
    last W and hold at most 2p chunk activations (p full micro-batches: 1F1B's first rank).

    `v` is always 2 (checked by :func:`labkit.schedules.validate`). Built for at least 2p-1
    micro-batches (what filling the V takes); with fewer, the actions of the missing
    micro-batches are dropped, which keeps every dependency (the simulator checks it).
    """
    n = max(m, 2 * p - 1)
    done = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0, ("W", 0): 0, ("W", 1): 0}
    order: list[tuple] = []

    def emit(*ops):
        for op, chunk in ops:
            order.append((op, done[op, chunk], chunk))
            done[op, chunk] += 1

    for _ in range(2 * (p - r) - 1):        # warm-up: chunk 0 forwards until chunk 1's first input
        emit(("F", 0))
    for _ in range(r):                      # then both chunks' forwards alternate
        emit(("F", 1), ("F", 0))
    for _ in range(p - r):                  # chunk 1's first backwards come back: F, I, W
        emit(("F", 1), ("I", 1), ("W", 1))
    while done["F", 0] < n or done["F", 1] < done["F", 0]:   # steady state: a full V per turn
        if done["F", 0] < n:
            emit(("F", 0))
        emit(("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    for _ in range(r):                      # cool-down: input gradients first, W's wait
        emit(("I", 0), ("I", 1))
    for _ in range(p - r):
        emit(("I", 0), ("W", 0))
    order += [("W", i, 1) for i in range(done["W", 1], n)]   # the W's owed, chunk 1 first
    order += [("W", i, 0) for i in range(done["W", 0], n)]
    return [(op, mb, chunk) for op, mb, chunk in order if mb < m]
