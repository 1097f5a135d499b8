"""What the planner knows about the machines: GPU presets, a GPT's shape, a cluster.

Pure data (no torch, no processes). Numbers are the vendors' datasheet figures; where a
figure is what software achieves rather than what the wire carries, the comment says so.

    >>> from labkit.plan import Cluster, ModelShape
    >>> ModelShape(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048).params / 1e9   # GPT-3
    174.6...
    >>> Cluster(nodes=128, gpus_per_node=8, hardware="a100").gpus
    1024
"""
from __future__ import annotations

from dataclasses import dataclass

from ..wire import AlphaBeta

GB = 1e9
GiB = 2 ** 30
MiB = 2 ** 20


def require_whole(owner, fields, minimum: int = 1) -> None:
    """ValueError naming the field unless each of ``fields`` of ``owner`` (a dataclass, or a dict
    of arguments) is a whole number ≥ ``minimum``."""
    for name in fields:
        value = owner[name] if isinstance(owner, dict) else getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            where = "" if isinstance(owner, dict) else f"{type(owner).__name__}."
            raise ValueError(f"{where}{name}={value!r} must be a whole number ≥ {minimum}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU type and the node it sits in."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (no sparsity)."""
    hbm_bytes: float
    """Bytes of HBM the driver offers (nvidia-smi's memory.total): a GPU sold as "80 GB" has
    80 GiB of HBM (HBM stacks come in binary sizes), 85.5–85.9·10⁹ bytes, not 80·10⁹."""
    nvlink: AlphaBeta
    """Inside a node (tensor parallelism is placed here)."""
    ib: AlphaBeta
    """Across nodes, per GPU (one NIC per GPU in DGX-style nodes)."""
    hbm_bandwidth: float
    """Bytes per second to and from HBM (the optimizer step is bound by it)."""
    gpus_per_node: int = 8
    gemm_max_efficiency: float = 0.78
    """Share of peak that large bf16 GEMMs reach (cuBLAS on A100 reaches ~250 of 312 TFLOP/s
    for large square bf16 GEMMs; NVIDIA's matmul performance guide shows the same plateau)."""
    gemm_half_dim: float = 160.0
    """The GEMM dimension at which efficiency is half its plateau: the efficiency model is
    eff(d) = gemm_max_efficiency · d / (d + gemm_half_dim), d the smallest dimension of the
    layer's GEMMs on one GPU (hidden/tp, or tokens per micro-batch). Small GEMMs fill fewer
    SMs and waste tiles (NVIDIA, "Matrix Multiplication Background User's Guide", wave and
    tile quantisation)."""

    attention_flops: tuple[float, float] = ()
    """Measured (forward, backward) FLOP/s of the fused attention kernel the runs on this GPU
    use (FlashAttention), counted as its authors count them: the causal half of the s×s square,
    backward 2.5 × forward (5 matmuls against 2: it recomputes the scores). Empty: no such
    kernel measured here, and the core is priced as GEMMs over the full square (Megatron-LM
    2021's unfused attention, what the SC21 reproduction ran)."""

    def efficiency(self, d: float) -> float:
        """Share of peak a GEMM whose smallest dimension on one GPU is ``d`` reaches (the local
        Machine's ``efficiency`` has the same form, its plateau in the measured rate)."""
        return self.gemm_max_efficiency * d / (d + self.gemm_half_dim)


# A100 SXM4 80GB in a DGX A100: 312 TFLOP/s dense bf16, 80 GiB HBM2e (nvidia-smi: 81920 MiB) at
# 2.0 TB/s (NVIDIA A100 datasheet);
# NVLink 3: 600 GB/s both directions = 300 GB/s each way, nccl-tests busbw ~230 GB/s;
# 8× HDR InfiniBand 200 Gb/s per node = 25 GB/s per GPU, ~22 GB/s achieved (DGX A100 user
# guide; nccl-tests results NVIDIA publishes). Latencies: NCCL small-message all-reduce
# ~10 µs inside a node, ~20 µs across nodes.
A100 = Hardware(name="A100 80GB", peak_flops=312e12, hbm_bytes=81920 * MiB, hbm_bandwidth=2.0e12,
                nvlink=AlphaBeta(beta=230 * GB, alpha=10e-6), ib=AlphaBeta(beta=22 * GB, alpha=20e-6))

# H100 SXM5 in a DGX H100: 989 TFLOP/s dense bf16 (1979 is with 2:4 sparsity), 80 GiB HBM3
# (nvidia-smi on an "H100 80GB HBM3": 81559 MiB) at 3.35 TB/s (NVIDIA H100 datasheet); NVLink 4: 900 GB/s both directions = 450 GB/s each way, ~360 GB/s
# busbw; 8× NDR 400 Gb/s per node = 50 GB/s per GPU, ~45 GB/s achieved (DGX H100 guide).
# Attention: FlashAttention-2 on an H100 SXM5, bf16, head dim 128, 16 heads, sequence 16K: 335
# TFLOP/s forward with the causal mask, 322 backward (plotted without it) (Shah et al. 2024,
# "FlashAttention-3", arXiv 2407.08608, Figs. 5 and 6; Dao 2023, FlashAttention-2 §4.1: "up to
# 335 TFLOPs/s" on H100). 16 heads of 128 is a Llama 3 405B layer's share on one of tp = 8 GPUs. FlashAttention-2 is the
# public kernel of early 2024, when Llama 3 405B was trained; FlashAttention-3 (July 2024) reaches
# ~600 and would be a preset of its own.
FLASH_ATTENTION_2_H100 = (335e12, 322e12)
H100 = Hardware(name="H100 SXM", peak_flops=989e12, hbm_bytes=81559 * MiB, hbm_bandwidth=3.35e12,
                nvlink=AlphaBeta(beta=360 * GB, alpha=8e-6), ib=AlphaBeta(beta=45 * GB, alpha=15e-6),
                gemm_max_efficiency=0.70, gemm_half_dim=256.0, attention_flops=FLASH_ATTENTION_2_H100)

# H200 SXM: the same GH100 compute as H100 (989 TFLOP/s dense bf16) with 141 GB HBM3e
# (nvidia-smi: 143771 MiB) at 4.8 TB/s (NVIDIA H200 product brief); the same NVLink 4 and NDR fabric in a DGX H200.
H200 = Hardware(name="H200", peak_flops=989e12, hbm_bytes=143771 * MiB, hbm_bandwidth=4.8e12,
                nvlink=AlphaBeta(beta=360 * GB, alpha=8e-6), ib=AlphaBeta(beta=45 * GB, alpha=15e-6),
                gemm_max_efficiency=0.72, gemm_half_dim=256.0, attention_flops=FLASH_ATTENTION_2_H100)

PRESETS = {"a100": A100, "h100": H100, "h200": H200}


def hardware(name) -> Hardware:
    """A preset by name ("a100", "h100", "h200"), or a Hardware passed through."""
    if isinstance(name, Hardware):
        return name
    key = str(name).lower().replace(" ", "").replace("-", "").replace("_", "")
    for alias, preset in PRESETS.items():
        if key.startswith(alias):
            return preset
    raise ValueError(f"hardware={name!r} is unknown; use one of {', '.join(PRESETS)} or a labkit.plan.Hardware")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A GPT decoder described by its shape (the Megatron-LM papers' notation l, h, a, V, s)."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 51200
    seq: int = 2048

    def __post_init__(self):
        require_whole(self, ("layers", "hidden", "heads", "vocab", "seq"))
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape.hidden={self.hidden} must divide by heads={self.heads}")

    @property
    def params(self) -> float:
        """Parameters: 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (Narayanan et al. 2021, eq. 2)."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * l * h))

    @property
    def layer_params(self) -> float:
        """One transformer layer: 12h² + 13h (QKV, projection, two MLP matrices, norms, biases)."""
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def embedding_params(self) -> float:
        """Word and position embeddings, V·h + s·h (the output layer shares the word table)."""
        return (self.vocab + self.seq) * self.hidden

    def layer_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of one layer over ``tokens`` = b·s: 24·b·s·h² + 4·b·s²·h (GEMMs only,
        a multiply-add counted as 2; Narayanan et al. 2021, §5.1)."""
        return 24 * tokens * self.hidden ** 2 + 4 * tokens * self.seq * self.hidden

    def logit_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output projection onto the vocabulary: 2·b·s·h·V."""
        return 2 * tokens * self.hidden * self.vocab

    # What step.py and memory.py ask of a model (labkit.plan.Decoder answers the same).
    @property
    def active_params(self) -> float:
        return self.params

    def can_split(self, stages: int) -> bool:
        """Megatron-LM's GPT takes equal stages only."""
        return self.layers % stages == 0

    def stage_layers(self, stages: int) -> list[int]:
        return [self.layers // stages] * stages

    def kinds(self, first: int, count: int) -> dict:
        return {"dense": count}

    def kind_params(self, kind: str, active: bool = False) -> float:
        return self.layer_params

    def rank_params(self, pp: int, chunks: int = 1) -> list[float]:
        """Parameters on each pipeline rank: its L/p layers, the word and position embeddings on
        the first, and when pp > 1 a copy of the word embedding on the last for the output
        layer, as Megatron-LM keeps it."""
        out = [self.layers / pp * self.layer_params] * pp
        out[0] += self.embedding_params
        out[-1] += self.vocab * self.hidden if pp > 1 else 0
        return out

    def gemms(self, kind: str, tokens: int, tp: int) -> list[tuple[float, float, float]]:
        """One group: the whole layer's forward FLOPs, the weight GEMMs' 24·b·s·h² of them, and
        the smallest GEMM dimension on one GPU, min(h/tp, b·s)."""
        return [(self.layer_forward_flops(tokens), 24 * tokens * self.hidden ** 2, min(self.hidden / tp, tokens))]

    def attention_core_flops(self, tokens: int) -> float:
        return 4 * tokens * self.seq * self.hidden

    def selective_flops(self, kind: str, tokens: int) -> float:
        """Forward FLOPs recomputed under Megatron's selective recomputation: the attention core."""
        return self.attention_core_flops(tokens)

    def model_flops(self, tokens: int) -> float:
        """6·N·tokens (PaLM, Chowdhery et al. 2022, appendix B, without the attention term)."""
        return 6 * self.params * tokens

    def hardware_flops(self, global_batch: int, recompute: str) -> float:
        """FLOPs the GPUs execute per step, as Megatron-LM counts them (Narayanan et al. 2021,
        eq. 3): 72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V, and 96·… when every layer is recomputed."""
        B, s, l, h, V = global_batch, self.seq, self.layers, self.hidden, self.vocab
        layer = 24 * B * s * l * h * h * (1 + s / (6 * h))
        passes = {"none": 3, "selective": 3, "full": 4}[recompute]
        extra = 4 * B * s * s * h * l if recompute == "selective" else 0.0
        return passes * layer + extra + 6 * B * s * h * V

    def describe(self) -> str:
        return (f"GPT: {self.layers} layers, hidden {self.hidden}, {self.heads} heads, vocab {self.vocab}, "
                f"seq {self.seq}; {self.params / 1e9:.2f} B parameters")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` GPUs of one ``hardware`` type."""

    nodes: int
    gpus_per_node: int = 8
    hardware: Hardware | str = "a100"

    def __post_init__(self):
        require_whole(self, ("nodes", "gpus_per_node"))
        object.__setattr__(self, "hardware", hardware(self.hardware))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def of(cls, gpus: int, hardware="a100", gpus_per_node: int = 8) -> "Cluster":
        """A cluster of ``gpus`` GPUs in full nodes (fewer than a node: one partial node)."""
        require_whole({"gpus": gpus, "gpus_per_node": gpus_per_node}, ("gpus", "gpus_per_node"))
        if gpus < gpus_per_node:
            return cls(nodes=1, gpus_per_node=gpus, hardware=hardware)
        if gpus % gpus_per_node:
            raise ValueError(f"gpus={gpus} is not a whole number of {gpus_per_node}-GPU nodes; "
                             f"use a multiple of {gpus_per_node}")
        return cls(nodes=gpus // gpus_per_node, gpus_per_node=gpus_per_node, hardware=hardware)

    def seconds(self, family: str, nbytes: float, ranks: int, span: int) -> float:
        """Seconds of one call of ``family`` moving ``nbytes`` (nccl-tests' size) over ``ranks``
        ranks spread evenly over ``span`` consecutive GPUs.

        Inside a node, NVLink. Across nodes the group holds k = ranks·gpus_per_node/span GPUs of
        each node it spans, and each GPU has its own NIC (a DGX's eight). NCCL runs one ring per
        NIC, so a ring collective's bytes cross between nodes on k NICs at once: bus(ranks)·S/k
        on each, while NVLink carries each GPU's bus(ranks)·S inside the node; the longer of the
        two (a DGX A100's 8 HDR NICs: 192 GB/s all-reduce busbw measured by NCCL's maintainers,
        NVIDIA/nccl#812; a group with one GPU a node, dp beside tp = 8, has one NIC's worth). An
        all-to-all cannot spread over the NICs (NVIDIA/nccl-tests#267): each GPU sends its bytes
        for the other nodes, bus(nodes)·S, on its own NIC, as a send does."""
        hw = self.hardware
        if span <= self.gpus_per_node or ranks <= 1:
            return hw.nvlink.seconds(family, nbytes, ranks)
        k = max(1, ranks * self.gpus_per_node // span)
        if family in ("all_to_all", "send"):
            return hw.ib.seconds(family, nbytes, max(2, ranks // k))
        return max(hw.ib.seconds(family, nbytes / k, ranks), hw.nvlink.seconds(family, nbytes, ranks) if k > 1 else 0.0)
