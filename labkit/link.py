"""An emulated interconnect: what a cluster's link would cost, imposed on a laptop's gloo.

On CPU engines gloo moves bytes with the cores that compute, so communication cannot hide
behind computation; on a GPU cluster it runs on copy engines and NICs beside the compute. A
:class:`Link` gives each rank a link of latency α and bandwidth β (two tiers: inside an
emulated node of ``gpus_per_node`` engines, and between nodes). With it, every
:mod:`labkit.comm` call takes at least its α-β time and the part beyond gloo's real transfer
is waited off the CPU (``labkit.comm.emulate``). Values never change, only times.

>>> lab = labkit.Lab.start(engines=2, link=labkit.Link(bandwidth=100e6, latency=1e-4))
>>> lab.link = labkit.Link.preset("ib400")            # on a live lab; None: raw gloo
>>> lab.link = labkit.Link.scaled("8xH100", lab)      # this machine's FLOPs per byte = an H100 node's

What goes through the link: every byte labkit moves during a step passes labkit.comm — the
four dp modes (DDP through its comm hook, whose futures complete at the link's time), ZeRO by
hand, FSDP2 (its all-gather and reduce-scatter are replaced by labkit.comm's), pipeline
sends and receives, Megatron-style tensor parallelism, compressed syncs. What does not:
``tp_mode="dtensor"``, whose collectives DTensor issues inside torch (functional collectives,
no hook for a caller's transport), and the barrier that aligns ranks at each step's start.
Those run at gloo's own speed. The link is for CPU engines on one host (one clock).

Pure data and arithmetic (no torch at import): the notebook builds a Link, the engines use it.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send")
RINGS = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives a ring runs, which spread over every link a node's ranks have (:meth:`Link.seconds`)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """Each rank's link, as the α-β model sees it: a message of S bytes costs α + S/β.

    Bandwidths are per rank and per direction (a rank sends and receives at once, each at
    β), the convention of NVIDIA's and the IBTA's per-direction figures. Each direction is
    shared: messages leaving one rank at once leave one after another, and so do messages
    arriving at one rank (incast: a parameter server takes in n-1 tensors in (n-1)·S/β; an
    all-to-all lasts as long as its busiest member's bytes). :meth:`tier` says which link a
    group's bytes cross (``run.metrics["bytes_sent_by_tier"]`` counts them).
    """

    bandwidth: float
    """Bytes per second each rank sends (and, at once, receives) inside a node."""
    latency: float = 0.0
    """Seconds of fixed cost per message inside a node (α; a ring step pays it once)."""
    gpus_per_node: int | None = None
    """Engines per emulated node, in rank order (ranks 0..g-1 form node 0); None: one node."""
    inter_bandwidth: float | None = None
    """Bytes per second per rank and direction between nodes; None: ``bandwidth``."""
    inter_latency: float | None = None
    """Seconds per message between nodes; None: ``latency``."""
    name: str = ""
    """What the link stands for ("NVLink 4"), shown in status lines and titles."""

    def __post_init__(self):
        _positive("bandwidth", self.bandwidth, "bytes per second, e.g. bandwidth=100e6 for 100 MB/s")
        _non_negative("latency", self.latency, "seconds per message, e.g. latency=1e-4 for 100 µs")
        if self.inter_bandwidth is not None:
            _positive("inter_bandwidth", self.inter_bandwidth, "bytes per second between nodes, or None")
        if self.inter_latency is not None:
            _non_negative("inter_latency", self.inter_latency, "seconds per message between nodes, or None")
        g = self.gpus_per_node
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"Link.gpus_per_node={g!r} must be a whole number ≥ 1 (engines per emulated "
                             f"node), or None for one node")
        if g is None and (self.inter_bandwidth is not None or self.inter_latency is not None):
            raise ValueError("Link.inter_bandwidth/inter_latency describe the link between nodes; give "
                             "gpus_per_node too (engines per emulated node)")
        if not isinstance(self.name, str):
            raise TypeError(f"Link.name={self.name!r} must be a str")

    # -- the two tiers ------------------------------------------------------------------------
    def tier(self, ranks) -> str:
        """"intra" when every rank of ``ranks`` sits in one emulated node, else "inter"."""
        if self.gpus_per_node is None:
            return "intra"
        return "intra" if len({r // self.gpus_per_node for r in ranks}) <= 1 else "inter"

    def nics(self, ranks) -> int:
        """The links a ring over ``ranks`` crosses between nodes on at once: each rank has its own
        (a DGX's NIC per GPU, NCCL's ring per NIC), so as many as the group's thinnest node
        holds of it; 1 inside a node."""
        if self.tier(ranks) == "intra":
            return 1
        return min(Counter(r // self.gpus_per_node for r in ranks).values())

    def alpha_beta(self, tier: str) -> tuple[float, float]:
        """(α seconds, β bytes/s) of one rank's link on ``tier``."""
        if tier == "inter":
            alpha = self.latency if self.inter_latency is None else self.inter_latency
            beta = self.bandwidth if self.inter_bandwidth is None else self.inter_bandwidth
            return alpha, beta
        return self.latency, self.bandwidth

    def seconds(self, op: str, nbytes: float, n: int, tier: str = "intra", nics: int = 1) -> float:
        """Seconds ``op`` on ``nbytes`` over ``n`` ranks takes on this link.

        ``nbytes`` is the op's size in nccl-tests' convention: the whole tensor for all-reduce
        and broadcast, the gathered output for all-gather, the input for reduce-scatter, the
        whole send buffer for all-to-all, the message for send. Ring algorithms, bandwidth
        optimal (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
        operations in MPICH", §4; the bus-bandwidth factors of nccl-tests' PERFORMANCE.md):

            all_reduce      2(n-1)·α + 2(n-1)/n · S/β   (reduce-scatter, then all-gather)
            all_gather      (n-1)·α + (n-1)/n · S/β
            reduce_scatter  (n-1)·α + (n-1)/n · S/β
            broadcast       (n-1)·α + S/β               (a pipelined chain; busbw = algbw)
            all_to_all      (n-1)·α + (n-1)/n · S/β     (pairwise exchange)
            send            α + S/β

        Across nodes, a ring collective (all-reduce, all-gather, reduce-scatter) of a group with
        ``nics`` ranks in each of its nodes (:meth:`nics`) runs one ring per rank's link, each
        with S/nics of the bytes, while the links inside a node carry the whole ring: the longer
        of the two (NCCL's 192 GB/s all-reduce busbw across DGX A100s with eight 25 GB/s NICs,
        NVIDIA/nccl#812). An all-to-all, a broadcast's chain and a send stay on one link.
        """
        if tier == "inter" and nics > 1 and op in RINGS:
            return max(self.seconds(op, nbytes / nics, n, "inter"), self.seconds(op, nbytes, n, "intra"))
        alpha, beta = self.alpha_beta(tier)
        if op == "send":
            return alpha + nbytes / beta
        if op not in OPS:
            raise ValueError(f"op={op!r} is unknown; use one of {', '.join(OPS)}")
        if n <= 1:
            return 0.0
        if op == "all_reduce":
            return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
        if op == "broadcast":
            return (n - 1) * alpha + nbytes / beta
        return (n - 1) * alpha + (n - 1) / n * nbytes / beta

    # -- named links ----------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "Link":
        """A named link at its real speed: "pcie4", "nvlink4", "ib100", "ib400", "10gbe".

        Real links are ~10⁴× faster than a laptop's compute is slow; for a cluster's balance
        on this machine use :meth:`scaled`. ``overrides`` replace fields (``gpus_per_node=2``).
        """
        key = re.sub(r"[\s_\-x/]", "", str(name).lower()).replace("infiniband", "ib").replace("gbs", "")
        key = {"pcie": "pcie4", "pcie416": "pcie4", "nvlink": "nvlink4", "ibhdr100": "ib100", "ibndr": "ib400",
               "ibndr400": "ib400", "100gib": "ib100", "400gib": "ib400", "10gbethernet": "10gbe",
               "10ge": "10gbe", "100ib": "ib100", "400ib": "ib400"}.get(key, key)
        if key not in PRESETS:
            raise ValueError(f"Link.preset({name!r}): unknown link; use one of {', '.join(map(repr, PRESETS))}, "
                             f"or Link(bandwidth=..., latency=...) for your own")
        return _replace(PRESETS[key], overrides)

    @classmethod
    def scaled(cls, target: str, lab, gpus_per_node: int | None = None, seconds: float = 0.2) -> "Link":
        """The link that gives this machine ``target``'s FLOPs per byte ("8xH100", "a100", …).

        Measures the engines' matmul rate (all at once, as in a step, for about ``seconds``)
        and slows the target's links by the same factor k = target FLOP/s ÷ measured FLOP/s:
        β = β_target / k, α = α_target · k. A step then has the target's comm/compute balance,
        k times slower. Inside a node: the target's NVLink; between nodes (engines beyond
        ``gpus_per_node``, by default the target's node size): its InfiniBand per GPU. The
        target's figures (achieved GEMM rate, nccl-tests bus bandwidths, small-message
        latencies) are the planner's (:mod:`labkit.plan.scale.hardware`). Latency is dilated too: an
        H100's 8 µs is the time of ~5 GFLOP, so here it is hundreds of milliseconds per message,
        and the course's small models, which a real H100 node would run latency-bound, are
        latency-bound here as well; ``dataclasses.replace(link, latency=...)`` sets another.
        """
        from .plan.scale.hardware import hardware

        match = re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?(.+?)\s*", str(target))
        if match is None:
            raise ValueError(f"Link.scaled({target!r}): give a GPU like 'h100' or a node like '8xH100'")
        count, hw = match.group(1), hardware(match.group(2))
        node = gpus_per_node or (min(int(count), hw.gpus_per_node) if count else hw.gpus_per_node)
        rates = sorted(lab.apply(compute_rate, seconds))
        measured = rates[len(rates) // 2]
        k = hw.peak_flops * hw.gemm_max_efficiency / measured
        return cls(bandwidth=hw.nvlink.beta / k, latency=hw.nvlink.alpha * k, gpus_per_node=node,
                   inter_bandwidth=hw.ib.beta / k, inter_latency=hw.ib.alpha * k,
                   name=f"{hw.name} scaled ×1/{k:.3g} ({measured / 1e9:.3g} GFLOP/s here)")

    @classmethod
    def balanced(cls, run, latency: float = 100e-6) -> "Link":
        """The link on which ``run``'s gradient all-reduce takes as long as its backward.

        That balance is what data-parallel training is tuned to on a cluster (bucketed comm
        that overlap can hide behind backward). β = 2(n-1)/n · S / backward, S the bytes of
        one rank's parameters, backward the mean per step of rank 0's backward spans, n = dp.
        """
        steps = run.timeline.steps
        backward = sum(e["end"] - e["start"] for e in run.timeline.events
                       if e["kind"] == "bwd" and e["rank"] == 0) / max(1, len(steps))
        if not backward > 0:
            raise ValueError("Link.balanced(run): the run recorded no backward spans; run it with record=True")
        n = run.strategy.dp
        wire = 2 * (n - 1) / n * run.parameter_bytes[0] if n > 1 else run.parameter_bytes[0]
        return cls(bandwidth=wire / backward, latency=latency)

    # -- shown to people -------------------------------------------------------------------------
    def __str__(self) -> str:
        intra = f"{_rate(self.bandwidth)}, α {_time(self.latency)}"
        text = f"{self.name}: " if self.name else ""
        if self.gpus_per_node is None:
            return text + intra
        a, b = self.alpha_beta("inter")
        return text + f"{intra} inside {self.gpus_per_node}-engine nodes; {_rate(b)}, α {_time(a)} between"


def compute_rate(seconds: float = 0.2, dim: int = 256) -> float:
    """This engine's float32 matmul rate in FLOP/s (``dim``-square products for ~``seconds``).

    ``dim`` 256 is the width of the course's models. Run on every engine at once (lab.apply),
    so the cores are shared as they are during a step.
    """
    import time

    import torch

    a, b = torch.randn(dim, dim), torch.randn(dim, dim)
    a @ b                                         # warm-up: allocation and thread pool
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        count += 1
    return 2 * dim ** 3 * count / elapsed


def _replace(link: Link, overrides: dict) -> Link:
    from dataclasses import replace
    return replace(link, **overrides) if overrides else link


def _positive(field: str, value, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Link.{field}={value!r} must be a finite number > 0 ({unit})")


def _non_negative(field: str, value, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Link.{field}={value!r} must be a finite number ≥ 0 ({unit})")


def _rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def _time(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


# Per-direction figures. PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 = 31.5 GB/s each way
# (PCI-SIG, PCIe 4.0 base spec). NVLink 4 (H100 SXM): 18 links × 25 GB/s = 450 GB/s each way
# (NVIDIA H100 datasheet: 900 GB/s both directions). InfiniBand HDR100 100 Gb/s and NDR
# 400 Gb/s: 12.5 and 50 GB/s each way (IBTA signalling rates; one NIC per GPU). 10 GbE:
# 1.25 GB/s each way. Latencies are small-message collective latencies, not wire latencies:
# NCCL ~8 µs over NVLink and ~15 µs over InfiniBand (the planner's table, labkit/plan/hardware.py),
# ~10 µs over PCIe through the host, ~50 µs for TCP over Ethernet (kernel stack).
PRESETS = {
    "pcie4": Link(bandwidth=31.5e9, latency=10e-6, name="PCIe 4.0 x16"),
    "nvlink4": Link(bandwidth=450e9, latency=8e-6, name="NVLink 4"),
    "ib100": Link(bandwidth=12.5e9, latency=15e-6, name="InfiniBand 100 Gb/s"),
    "ib400": Link(bandwidth=50e9, latency=15e-6, name="InfiniBand 400 Gb/s"),
    "10gbe": Link(bandwidth=1.25e9, latency=50e-6, name="10 GbE"),
}
