"""Rank labkit Strategies on this lab by their calibrated prediction, then confirm the top ones.

Tuning on a cluster is: predict, confirm, pick. Here the same loop runs on the lab's own
engines: every Strategy the lab can run (dp·pp = engines; schedules; micro-batches; dp modes)
is simulated from a cost table, and with ``verify=lab`` the ``top`` fastest are run for a few
steps, predicted beside measured.

    >>> costs = labkit.plan.calibrate(lab, model=model, batch=64)
    >>> result = labkit.plan.search_lab(costs, batch=64, engines=2, verify=lab, model=model, top=3)
    >>> print(result.table())
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import DP_MODES, Strategy
from .simulation import simulate


def lab_candidates(engines: int, batch: int, blocks: int, microbatches=(1, 2, 4, 8), split: bool = True):
    """Every Strategy with dp·pp = engines the executor accepts for a model of ``blocks`` blocks
    (``split``: the zero-bubble schedules too, which need a table that timed backward's halves)."""
    for pp in [p for p in range(1, engines + 1) if engines % p == 0 and p <= blocks]:
        dp = engines // pp
        modes = DP_MODES if dp > 1 else ("overlap",)
        for m in microbatches:
            if batch % (dp * m):
                continue
            plans = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)]
            if pp > 1 and m % pp == 0 and blocks % (2 * pp) == 0:
                plans.append(("interleaved", 2))
            if pp > 1 and split:
                plans += [("zb-h1", 1)] + ([("zbv", 2)] if blocks >= 2 * pp else [])
            for schedule, chunks in plans:
                for mode in modes:
                    if mode == "ddp" and schedule.startswith("zb"):
                        continue            # DDP's reducer wants one fused backward (Strategy refuses it)
                    yield Strategy(dp=dp, pp=pp, schedule=schedule, chunks=chunks, microbatches=m, dp_mode=mode)


@dataclass
class LabSearch:
    """Simulated strategies, fastest first; ``measured`` holds the runs of the verified ones."""

    ranked: list = field(default_factory=list)          # (Strategy, Simulated)
    measured: dict = field(default_factory=dict)        # index in ranked → measured step time

    def table(self, top: int = 10) -> str:
        lines = [f"{'#':>3} {'strategy':>52} {'predicted ms':>12} {'measured ms':>11}"]
        for i, (s, pred) in enumerate(self.ranked[:top]):
            label = f"dp{s.dp} pp{s.pp} {s.schedule if s.pp > 1 else ''} m{s.microbatches} {s.dp_mode if s.dp > 1 else ''}"
            seen = f"{1e3 * self.measured[i]:>11.2f}" if i in self.measured else f"{'':>11}"
            lines.append(f"{i + 1:>3} {label:>52} {1e3 * pred.metrics['step_time_s']:>12.2f} {seen}")
        return "\n".join(lines)


def search_lab(costs, batch: int, engines: int, verify=None, model=None, top: int = 3, steps: int = 4) -> LabSearch:
    """Simulate every runnable Strategy; with ``verify=lab`` (and ``model``) run the ``top`` fastest."""
    if verify is not None and model is None:
        raise ValueError("search_lab(verify=lab) runs the strategies: pass model= (the one calibrated)")
    if model is not None:
        costs.check(model)
    result = LabSearch()
    for s in lab_candidates(engines, batch, len(costs.blocks), split=costs.times_halves()):
        result.ranked.append((s, simulate(s, costs, batch=batch)))
    result.ranked.sort(key=lambda row: row[1].metrics["step_time_s"])
    if verify is not None:
        for i, (s, _) in enumerate(result.ranked[:top]):
            result.measured[i] = verify.run(s, model=model, batch=batch, steps=steps).metrics["step_time_s"]
    return result
