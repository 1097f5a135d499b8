"""Enumerate strategies for a model on a cluster and rank them by predicted throughput.

    >>> result = search(ModelShape(layers=96, hidden=12288, heads=96), Cluster(nodes=128), global_batch=1536)
    >>> print(result.table(top=10)); result.plot()

Candidates: every (dp, pp, cp, tp) with dp·pp·cp·tp = GPUs, tp a power of two within a node,
cp a power of two with 2·cp dividing a sequence of at least ``LONG_SEQUENCE`` tokens (ring and
all-gather; pass ``cp=`` to try it at any length), pp dividing the layers; every ZeRO stage, micro-batch size, schedule (GPipe, 1F1B, zb-h1, and
interleaved with 2 or 4 chunks where they divide the layers) and recomputation; for a model with
experts every ep dividing dp and the experts (the all-to-alls overlapped). Each is predicted by
:func:`labkit.plan.scale.step.predict`; those that do not fit in memory are counted and left out
of the ranking; a model that fits no strategy gives a result whose table says so.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import product

from .hardware import Cluster, ModelShape
from .layout import PRICED, ClusterStrategy
from .step import Prediction, predict

MICROBATCH_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 16384
"""Shortest sequence the search tries cp > 1 for unasked: context parallelism buys activation
memory per sequence at the price of K/V traffic and shorter GEMMs, and trying it on every
short-sequence layout multiplies the candidates many times over."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CHUNKS = (2, 4)
"""Model chunks per rank the interleaved schedule is tried with (Megatron-LM's usual settings)."""


def _schedules(pp: int, model, m: int, chunks=CHUNKS):
    yield "1f1b", 1
    if pp > 1:
        yield from (("gpipe", 1), ("zb-h1", 1))
        yield from (("interleaved", v) for v in chunks if model.can_split(pp * v) and m % pp == 0)


def candidates(model: ModelShape, cluster: Cluster, global_batch: int, zero=(0, 1, 2, 3),
               microbatch_sizes=MICROBATCH_SIZES, recompute=PRICED["recompute"], dp=None, pp=None, tp=None,
               dp_mode: str = "overlap", schedules=None, sequence_parallel=(False,), ep=None,
               ep_overlaps=("microbatch",), cp=None, cp_modes=PRICED["cp_mode"], chunks=CHUNKS, dp_shards=None):
    """Every placeable ClusterStrategy (degrees fixed where given; ``schedules``: only these).
    A model with experts also tries every ep dividing both dp and its experts, with the
    all-to-all overlap (``ep_overlaps``: the ep_overlap settings tried; the model never prices
    the overlap slower, so by default only "microbatch"). ``cp_modes``: the context-parallel
    modes tried for cp > 1. ``dp_shards``: the HSDP shard degrees tried with ZeRO (default: ZeRO
    over all of dp, and HSDP with its shard group filling one node, where that is a proper
    divisor of dp)."""
    n = cluster.gpus
    tps = [t for t in _divisors(n) if t <= cluster.gpus_per_node and t & (t - 1) == 0
           and model.heads % t == 0 and model.hidden % t == 0]
    for t in ([tp] if tp else tps):
        for c, mode in _context_degrees(model, n // t, cp, cp_modes):
            yield from _placed(model, global_batch, n, t, c, mode, dp, pp, zero, microbatch_sizes, recompute,
                               dp_mode, schedules, sequence_parallel, ep, ep_overlaps, chunks, dp_shards,
                               cluster.gpus_per_node)


def _context_degrees(model, room: int, cp, modes):
    """(cp, cp_mode) pairs: cp=1, and for a long sequence every power of two dividing ``room``
    and half the sequence."""
    long = model.seq >= LONG_SEQUENCE
    degrees = [cp] if cp else [c for c in _divisors(room)
                               if c == 1 or long and c & (c - 1) == 0 and model.seq % (2 * c) == 0]
    for c in degrees:
        for mode in (modes if c > 1 else ("ring",)):
            yield c, mode


def _placed(model, global_batch, n, t, c, mode, dp, pp, zero, microbatch_sizes, recompute, dp_mode, schedules,
            sequence_parallel, ep, ep_overlaps, chunks, dp_shards, node):
    """The candidates of one (tp, cp) pair: every pp, micro-batch size, schedule and knob."""
    for p in ([pp] if pp else _divisors(n // (t * c))):
        d = n // (t * c * p)
        if (dp and d != dp) or not model.can_split(p) or d * p * c * t != n:
            continue
        for mbs in (b for b in microbatch_sizes if global_batch % (d * b) == 0):
            for (schedule, v), z, rc, sp, (e, overlap) in product(
                    _schedules(p, model, global_batch // (d * mbs), chunks), zero if d * c > 1 else (0,), recompute,
                    sequence_parallel if t > 1 else (False,), _expert_degrees(model, d, ep, ep_overlaps)):
                if schedules is not None and schedule not in schedules:
                    continue
                for shard in _shard_degrees(d, p * c * t, node, z, e, dp_shards):
                    yield ClusterStrategy(dp=d, pp=p, tp=t, zero=z, microbatch_size=mbs, schedule=schedule,
                                          chunks=v, recompute=rc, dp_mode=dp_mode, sequence_parallel=sp,
                                          ep=e, ep_overlap=overlap, cp=c, cp_mode=mode, dp_shard=shard)


def _shard_degrees(dp: int, span: int, node: int, zero: int, ep: int, dp_shards):
    """dp_shard values for ``dp`` replicas ``span`` GPUs apart: None (ZeRO over all of dp) and, with
    ZeRO and ep = 1, HSDP whose shard group fills a node (or each of ``dp_shards``)."""
    if zero == 0 or ep > 1:
        return (None,)
    if dp_shards is not None:
        return tuple(d for d in dp_shards if d is None or dp % d == 0)
    fill = node // span if node % span == 0 else 0
    return (None, fill) if 1 < fill < dp and dp % fill == 0 else (None,)


def _expert_degrees(model, dp: int, ep, ep_overlaps):
    """(ep, ep_overlap) pairs for ``dp`` replicas: ep=1 alone for a dense model (or ``ep`` given)."""
    experts = getattr(model, "experts", 0)
    for e in ([ep] if ep else [e for e in _divisors(dp) if experts and experts % e == 0] or [1]):
        if dp % e == 0:
            for overlap in (ep_overlaps if e > 1 else ("none",)):
                yield e, overlap


@dataclass
class SearchResult:
    """Ranked predictions (fastest first) and how many candidates did not fit."""

    model: ModelShape
    cluster: Cluster
    global_batch: int
    ranked: list[Prediction]
    skipped: int = 0
    verified: list = field(default_factory=list)
    fitting: int | None = None
    """How many strategies fit before ``top`` cut ``ranked`` (None: all of them are in it)."""

    @property
    def fits(self) -> bool:
        return bool(self.ranked)

    def table(self, top: int = 10) -> str:
        head = f"{'#':>3} {'strategy':>40} {'step (s)':>9} {'MFU':>6} {'TFLOP/s':>8} {'mem (GB)':>9}"
        if not self.ranked:
            return (f"does not fit: none of {self.skipped} strategies fits {self.cluster.hardware.name} "
                    f"memory ({self.cluster.hardware.hbm_bytes / 1e9:.0f} GB); add GPUs, shorten the "
                    "sequence or shrink the model")
        lines = [head + (f" {'measured (s)':>12}" if self.verified else "")]
        for i, p in enumerate(self.ranked[:top]):
            v = self.verified[i] if i < len(self.verified) else None     # the first ones, in rank order
            seen = "" if v is None else f" {_seconds(v['measured_s'], 12)}" if "measured_s" in v else f" {'not run':>12}"
            lines.append(f"{i + 1:>3} {p.strategy.label():>40} {_seconds(p.step_time_s, 9)} {100 * p.mfu:>5.1f}% "
                         f"{p.tflops_per_gpu:>8.1f} {p.memory_gb_per_gpu:>9.1f}{seen}")
        for v in self.verified:
            if "error" in v:
                lines.append(f"not run on the lab: {v['strategy'].label()}: {v['error']}")
        fitting = len(self.ranked) if self.fitting is None else self.fitting
        lines.append(f"{fitting} strategies fit, {self.skipped} do not")
        return "\n".join(lines)

    def plot(self, top: int = 20):
        """Predicted step time and memory per GPU of the top strategies."""
        import matplotlib.pyplot as plt

        shown = self.ranked[:top]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 0.3 * len(shown) + 1.5), sharey=True)
        labels = [p.strategy.label() for p in shown]
        ax_t.barh(labels, [p.step_time_s for p in shown], color="#0072B2")
        ax_m.barh(labels, [p.memory_gb_per_gpu for p in shown], color="#E69F00")
        ax_m.axvline(self.cluster.hardware.hbm_bytes / 1e9, color="k", ls="--", lw=1, label="HBM")
        ax_t.invert_yaxis()
        ax_t.set(xlabel="predicted step time (s)", title=f"{self.cluster.gpus}× {self.cluster.hardware.name}")
        ax_m.set(xlabel="memory per GPU (GB)")
        ax_m.legend(fontsize="small")
        fig.tight_layout()
        return fig


def _seconds(x: float, width: int) -> str:
    """Seconds to three decimals, or in e-notation when that would read 0.000 (a toy model)."""
    return f"{x:>{width}.3f}" if x >= 0.01 else f"{x:>{width}.1e}"


def search(model: ModelShape, cluster: Cluster, global_batch: int, top: int | None = None, verify=None,
           steps: int = 4, **limits) -> SearchResult:
    """Rank every placeable strategy that fits by predicted step time (fastest first).

    ``limits`` narrow the candidates (zero=, microbatch_sizes=, recompute=, dp=, pp=, tp=, schedules=,
    sequence_parallel=, dp_mode=, ep_overlaps=, chunks=, dp_shards=).
    ``verify=lab``: then run the ``top`` fastest (default 3) on the lab for ``steps`` steps each,
    the GPT built by ``labkit.models.gpt`` on seeded random tokens, and keep the measured step
    time beside the predicted one (``.verified``, and a column of ``.table()``). The lab must
    have one engine per GPU of ``cluster`` (tune on the cluster itself: predict, confirm, pick);
    for the lab's own CPU engines, :func:`labkit.plan.search_lab` predicts from a calibration.
    """
    if verify is not None and not isinstance(model, ModelShape):
        raise ValueError("search(verify=lab) builds labkit.models.gpt, so it takes a labkit.plan.ModelShape; "
                         f"got {type(model).__name__}")
    if verify is not None and verify.world_size != cluster.gpus:
        raise ValueError(f"search(verify=lab): the lab has {verify.world_size} engines but the cluster "
                         f"{cluster.gpus} GPUs; verify on a lab with one engine per GPU of the cluster, or "
                         f"describe this lab as the cluster (Cluster(nodes=1, gpus_per_node={verify.world_size}, ...))")
    # sequence parallelism (Korthikanti et al. 2022) came after the GPT runs the GPT path
    # reproduces; a Decoder's candidates try it beside plain tp
    limits.setdefault("sequence_parallel", (False,) if isinstance(model, ModelShape) else (False, True))
    _deprecated_limits(limits)
    ranked, skipped = [], 0
    for s in candidates(model, cluster, global_batch, **limits):
        p = predict(model, cluster, global_batch, s)
        if p.fits:
            ranked.append(p)
        else:
            skipped += 1
    if not ranked and not skipped:
        raise ValueError(f"no strategy can be placed: {cluster.gpus} GPUs, {model.layers} layers, "
                         f"global_batch={global_batch}; check that the batch divides by the dp degrees")
    ranked.sort(key=lambda p: p.step_time_s)
    result = SearchResult(model, cluster, global_batch, ranked[:top] if top else ranked, skipped,
                          fitting=len(ranked))
    if verify is not None:
        result.verified = [verify_one(verify, model, global_batch, p.strategy, steps) for p in ranked[:top or 3]]
    return result


def _deprecated_limits(limits: dict) -> None:
    """search(dp_overlap=bool) and search(ep_overlap=(bool, …)): warned, and read as Strategy's names."""
    from .layout import REMOVAL

    if "dp_overlap" in limits:
        limits["dp_mode"] = "overlap" if limits.pop("dp_overlap") else "bucketed"
        warnings.warn(f"search(dp_overlap=…) is deprecated and goes on {REMOVAL}: write dp_mode='overlap' or "
                      "'bucketed' (labkit.Strategy's name)", FutureWarning, stacklevel=3)
    if "ep_overlap" in limits:
        limits["ep_overlaps"] = tuple("microbatch" if o else "none" for o in limits.pop("ep_overlap"))
        warnings.warn(f"search(ep_overlap=…) is deprecated and goes on {REMOVAL}: write ep_overlaps=('microbatch',) "
                      "or ('none',)", FutureWarning, stacklevel=3)


def verify_one(lab, model: ModelShape, global_batch: int, s: ClusterStrategy, steps: int) -> dict:
    """Run ``s`` on ``lab`` for ``steps`` steps: {"strategy", "measured_s"} or {"strategy", "error"}
    (a strategy the planner places but labkit does not run, e.g. zero=3 with pp > 1)."""
    from ... import models
    from ...data.text import RandomTokens

    try:
        strategy = s.to_strategy(global_batch)
        run = lab.run(strategy, model=models.gpt(n_layer=model.layers, n_head=model.heads, n_embd=model.hidden,
                                                 block_size=model.seq, vocab_size=model.vocab),
                      data=RandomTokens(model.vocab, global_batch, model.seq), loss="cross_entropy",
                      batch=global_batch, steps=steps)
    except ValueError as exc:
        return {"strategy": s, "error": str(exc)}
    return {"strategy": s, "measured_s": run.metrics["step_time_s"]}


def best_at(model: ModelShape, cluster: Cluster, global_batch: int, zero=(0,), **limits) -> Prediction | None:
    """The fastest strategy that fits among ``limits`` (e.g. the published degrees), or None."""
    try:
        result = search(model, cluster, global_batch, zero=zero, **limits)
    except ValueError:
        return None
    return result.ranked[0] if result.ranked else None
