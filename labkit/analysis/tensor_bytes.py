"""Tensor-parallel bytes on the wire, measured against Megatron's formula.

Megatron-LM (Shoeybi et al. 2019, §3) puts, per transformer layer, two all-reduces in the
forward (g after attention, g after the MLP) and two in the backward (f in front of each),
each of ``b·s·h`` values; a ring all-reduce puts ``2(t−1)/t`` of its payload on the wire
per rank (nccl-tests' bus factor). So one rank sends, per step,

    layers · 4 · b·s·h · bytes_per_value · 2(t−1)/t

with ``b`` the rank's share of the global batch (micro-batches add up to it). Sequence
parallelism (Korthikanti et al. 2022) swaps each all-reduce for an all-gather plus a
reduce-scatter, ``(t−1)/t`` each: the same bytes. The measurement sums the bytes of the
f/g calls (and their sequence-parallel replacements) that labkit.comm recorded.

>>> rows = tp_bytes_table(run, n_embd=128, seq=64)       # one row per rank
"""
from __future__ import annotations

# f and g (tp), and the sequence-parallel gathers / reduce-scatters that replace them; not
# the LayerNorm gradient sums ("sp grad") nor the parameter gather ("tp gather").
TP_CALLS = ("tp f ", "tp g ", "sp gather ", "sp reduce-scatter ")


def megatron_tp_bytes(layers: int, batch: int, seq: int, hidden: int, tp: int, bytes_per_value: int = 4) -> float:
    """Bytes one rank sends per step for ``layers`` transformer layers (formula above)."""
    if tp == 1:
        return 0.0
    return layers * 4 * batch * seq * hidden * bytes_per_value * 2 * (tp - 1) / tp


def measured_tp_bytes(events, rank: int) -> tuple[float, int]:
    """(bytes per step, tensor-parallel layers) of ``rank``: the f/g calls it recorded,
    averaged over the steps present; layers counted from its attention output projections."""
    mine = [e for e in events if e["rank"] == rank and e["name"].startswith(TP_CALLS) and e["bytes"]]
    steps = {e["step"] for e in mine}
    layers = {e["name"].split(" ")[-1] for e in mine if e["name"].endswith("attn.proj")}
    return (sum(e["bytes"] for e in mine) / len(steps) if steps else 0.0), len(layers)


def tp_bytes_table(run, n_embd: int, seq: int, skip_first: bool = True) -> list[dict]:
    """Per rank: TP bytes per step measured, Megatron's formula for the layers it holds, ratio."""
    s = run.strategy
    events = run.timeline.events
    if skip_first and len({e["step"] for e in events}) >= 3:
        events = [e for e in events if e["step"] > 0]
    rows = []
    for rank in range(s.world_size):
        measured, layers = measured_tp_bytes(events, rank)
        formula = megatron_tp_bytes(layers, run.batch // s.dp, seq, n_embd, s.tp)
        rows.append({"rank": rank, "layers": layers, "measured_bytes": measured, "formula_bytes": formula,
                     "ratio": measured / formula if formula else float("nan")})
    return rows


def format_tp_bytes(rows: list[dict]) -> str:
    """The table as text: rank, layers, measured, formula, ratio."""
    lines = [f"{'rank':>4} {'layers':>6} {'measured KiB':>13} {'formula KiB':>12} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['layers']:>6} {r['measured_bytes'] / 1024:>13.1f} "
                     f"{r['formula_bytes'] / 1024:>12.1f} {r['ratio']:>6.3f}")
    return "\n".join(lines)
