"""Rank labkit Strategies on this lab by their predicted step, then confirm the top ones.

Tuning on a cluster is: predict, confirm, pick. Here the same loop runs on the lab's own
engines: every Strategy the lab can run (dp·pp = engines; schedules; micro-batches; dp modes)
is simulated on the measured :class:`~labkit.plan.local.machine.Machine`, and with ``verify=lab`` the
``top`` fastest are run for a few steps, predicted beside measured.

    >>> machine = labkit.plan.measure(lab)
    >>> result = labkit.plan.search_lab(machine, model=model, batch=64, engines=2, verify=lab, top=3)
    >>> print(result.table())
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...config import DP_MODES, Strategy
from .physical import simulate


def lab_candidates(engines: int, batch: int, blocks: int, microbatches=(1, 2, 4, 8), split: bool = True):
    """Every Strategy with dp·pp = engines the executor accepts for a model of ``blocks`` blocks
    (``split``: the zero-bubble schedules too)."""
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


def search_lab(machine, model, batch: int, engines: int, verify=None, top: int = 3, steps: int = 4) -> LabSearch:
    """Simulate every runnable Strategy of ``model`` on ``machine``; with ``verify=lab`` run the ``top`` fastest."""
    from torch.nn import Sequential

    from ...training import build_model
    from ...parallel.blocks import find_blocks

    if model is None:
        raise ValueError("search_lab(machine, model=...): pass the model whose strategies to rank")
    net = build_model(model, 0)
    blocks = len(find_blocks(net)) if isinstance(net, Sequential) else 1      # pipelines cut a Sequential
    result = LabSearch()
    for s in lab_candidates(engines, batch, blocks):
        result.ranked.append((s, simulate(s, machine, model=model, batch=batch)))
    result.ranked.sort(key=lambda row: row[1].metrics["step_time_s"])
    if verify is not None:
        for i, (s, _) in enumerate(result.ranked[:top]):
            result.measured[i] = verify.run(s, model=model, batch=batch, steps=steps).metrics["step_time_s"]
    return result
