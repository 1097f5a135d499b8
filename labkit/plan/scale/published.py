"""Published tables to check the planner against, row by row.

    $ labkit plan --published sc21        # Megatron-LM SC21 Table 1 (GPT, A100), also --validate
    $ labkit plan --published llama       # Llama 3 Table 4 (405B, H100), torchtitan's A100 table and
                                          # its published peak memory
    $ python -m labkit.plan.scale.published llama

Every row is predicted with the hardware presets' datasheet figures and the GEMM efficiency
curve the SC21 reproduction uses, unchanged: nothing is fitted to these rows.

**SC21.** Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: weak scaling of GPT models
from 1.7B to 1T parameters on DGX A100 (80 GB) nodes, 8 GPUs per node with NVLink,
8×200 Gb/s HDR InfiniBand per node; sequence 2048, vocabulary 51,200; mixed precision,
activation recomputation on every layer. "Achieved TFLOP/s per GPU" counts FLOPs with the
paper's eq. 3 (recomputation included), which :func:`labkit.plan.scale.step.hardware_flops` follows.

    >>> rows = compare()          # one dict per row: published and predicted TFLOP/s, error
    >>> print(table(rows))

**Llama 3.** Source: Llama Team, "The Llama 3 Herd of Models" (arXiv 2407.21783 v3), §3.3.2,
Table 4: Llama 3 405B pre-training on H100 80 GB (700 W) in 8-GPU servers, NVLink inside,
400 Gb/s RoCE per GPU across; TP8, PP16, FSDP over DP that shards optimizer state and
gradients but keeps the weights gathered after forward (ZeRO-2 here), the interleaved
schedule, one layer fewer on the first and last stages, no activation checkpointing at 8K.
Published: TFLOP/s per GPU and BF16 MFU, model FLOPs (no recomputation), so the planner's
:meth:`~labkit.plan.scale.model.Decoder.model_flops` is compared. The third row is the long-context
stage: CP16 over 131,072-token sequences, with the paper's all-gather context parallelism
(§3.3.2: K and V all-gathered, then attention on the local query chunks, the chunks load
balanced; "the all-gather communication latency is exposed on the critical path"), priced
as ``cp_mode="allgather"``; there attention is most of the time, priced as the
FlashAttention-2 kernel's measured H100 rate (:data:`~labkit.plan.scale.hardware.FLASH_ATTENTION_2_H100`),
the public kernel when 405B was trained: FlashAttention-3's rate would put row 3 near +48 %,
so this row reads the kernel more than the parallelism. Chunks: one layer each (:data:`LLAMA3_CHUNKS`). Memory, on the
ranks that hold the most: under the interleaved schedule every rank runs 2(p − r − 1) + (v − 1)·p
chunk forwards before its first backward (all m·v at 16 micro-batches), so rank 1 holds 141 (at
32 micro-batches) or 128 layer-micro-batches; each layer keeps what its backward reads (the
paper: "we proactively deallocate tensors that will not be used for future computation"), with
sequence parallelism 27.75·s·b·h/t bytes (:mod:`labkit.plan.scale.memory`); and an H100 "80 GB" has
81559 MiB. So the rows fit, as they ran.

**torchtitan.** Source: pytorch/torchtitan ``docs/performance.md`` at commit
0413364 ("Llama 3 performance numbers", "Llama 2 performance numbers"): FSDP2 (ZeRO-3) over
64 A100 80 GB, local batch 1 or 2, Llama 3 at sequence 8192 and Llama 2 at 4096, bf16, no
torch.compile, tokens per second per GPU ("WPS"). The network of that cluster is not stated;
the A100 preset (DGX A100, 200 Gb/s HDR per GPU) is used. torchtitan's selective checkpointing
is the planner's ``recompute="selective"`` for a Decoder when it is "op" (``_save_list``: the
outputs of the matmuls but every second one, of attention and of the reduce-scatters; the rest
recomputed, for a Llama layer wk, wo and w3 and the elementwise ops); "layer" (every second
layer recomputed in full) has no twin and is priced as "op".

**Memory checked.** torchtitan ``docs/performance.md`` at commit d4c86e3 publishes the peak
memory of Llama 3.1 8B under FSDP, local batch 2, sequence 8192, selective op checkpointing,
eager (Tables 1 and 3, "FSDP" rows, H100 96 GB): 82.4 GiB on 8 GPUs, 67.0 GiB on 128. That
figure is torch's ``reserved_bytes.all.peak`` (torchtitan ``metrics.py``): the allocator's
cache on top of the peak of live tensors the planner counts (:func:`compare_memory`).
"""
from __future__ import annotations

import sys

from .hardware import Cluster, ModelShape
from .model import Decoder

# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU)
MEGATRON_SC21_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (MLSys
# 2023, arXiv 2205.05198): GPT on A100 80 GB, sequence 2048, vocabulary 51,200, data-parallel size
# one, with sequence parallelism and selective recomputation ("present work"): Table 3's shapes and
# degrees, Table 5's seconds per iteration, and the model FLOPs utilization the Megatron-LM README
# publishes for them (72·B·s·l·h²·(1 + s/6h + V/12lh) over time · GPUs · 312 TFLOP/s gives each back
# from its time to 0.2 point). No row of it shaped the planner: a held-out table.
# (billions, heads, hidden, layers, tp, pp, GPUs, global batch, seconds per iteration, MFU)
MEGATRON_MLSYS23 = (
    (22, 64, 6144, 48, 8, 1, 8, 4, 1.10, 0.415),
    (175, 96, 12288, 96, 8, 8, 64, 64, 13.75, 0.514),
    (530, 128, 20480, 105, 8, 35, 280, 280, 37.83, 0.560),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 71.49, 0.563),
)


def rows() -> list[dict]:
    """The table as dicts: model, cluster, degrees, batch and the published TFLOP/s."""
    return [{"billions": billions, "model": ModelShape(layers=layers, hidden=hidden, heads=heads),
             "cluster": Cluster.of(gpus, "a100"), "tp": tp, "pp": pp, "dp": gpus // (tp * pp), "batch": batch,
             "published_tflops": tflops}
            for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_SC21_TABLE1]


def _as_megatron_ran(model, cluster, batch: int, dp: int, pp: int, tp: int, microbatch_sizes, recompute: str,
                     sequence_parallel: bool = False):
    """The fastest strategy that fits at the published degrees among those Megatron-LM ran then:
    1F1B or interleaved (zb-h1 came in 2023), gradients reduced after backward, the micro-batch
    size tuned; None when none fits."""
    from .search import best_at

    return best_at(model, cluster, batch, dp=dp, pp=pp, tp=tp, recompute=(recompute,),
                   sequence_parallel=(sequence_parallel,), microbatch_sizes=microbatch_sizes, dp_mode="bucketed",
                   schedules=("1f1b", "interleaved"))


def compare(microbatch_sizes=(1, 2, 4, 8)) -> list[dict]:
    """Predict each row at its published degrees: the best micro-batch size and schedule
    that fit (the published runs were tuned the same way) among the schedules Megatron-LM had
    then (1F1B and interleaved: zb-h1 came in 2023), full recomputation, gradients reduced
    after backward as Megatron-LM did then."""
    result = []
    for row in rows():
        p = _as_megatron_ran(row["model"], row["cluster"], row["batch"], row["dp"], row["pp"], row["tp"],
                             microbatch_sizes, recompute="full")
        err = (p.tflops_per_gpu - row["published_tflops"]) / row["published_tflops"] if p else float("nan")
        result.append({**row, "prediction": p, "predicted_tflops": p.tflops_per_gpu if p else float("nan"),
                       "error": err})
    return result


def compare_mlsys23(microbatch_sizes=(1, 2, 4, 8)) -> list[dict]:
    """Predict each row of :data:`MEGATRON_MLSYS23` at its published degrees with sequence parallelism
    and Megatron's selective recomputation (the attention core again), the fastest micro-batch size
    and schedule that fit as in :func:`compare`; the error is of the model FLOPs utilization,
    counted as the paper counts it (:meth:`ModelShape.hardware_flops` without recomputation)."""
    result = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, seconds, mfu in MEGATRON_MLSYS23:
        model, cluster = ModelShape(layers=layers, hidden=hidden, heads=heads), Cluster.of(gpus, "a100")
        p = _as_megatron_ran(model, cluster, batch, gpus // (tp * pp), pp, tp, microbatch_sizes,
                             recompute="selective", sequence_parallel=True)
        predicted = (model.hardware_flops(batch, "none") / (p.step_time_s * gpus * cluster.hardware.peak_flops)
                     if p else float("nan"))
        result.append({"billions": billions, "tp": tp, "pp": pp, "gpus": gpus, "batch": batch, "published_s": seconds,
                       "published_mfu": mfu, "prediction": p, "predicted_mfu": predicted,
                       "error": (predicted - mfu) / mfu})
    return result


def table_mlsys23(result: list[dict]) -> str:
    lines = [f"{'params':>8} {'tp':>3} {'pp':>3} {'GPUs':>5} {'batch':>5} {'strategy':>38} {'published':>15} "
             f"{'predicted':>15} {'error':>7}"]
    for r in result:
        p = r["prediction"]
        label = p.strategy.label() if p else "does not fit"
        pred = f"{p.step_time_s:6.2f} s {100 * r['predicted_mfu']:4.1f}%" if p else "—"
        lines.append(f"{r['billions']:>7}B {r['tp']:>3} {r['pp']:>3} {r['gpus']:>5} {r['batch']:>5} {label:>38} "
                     f"{r['published_s']:6.2f} s {100 * r['published_mfu']:4.1f}% {pred:>15} {100 * r['error']:>6.1f}%")
    errors = [abs(r["error"]) for r in result]
    lines.append(f"worst |error| {100 * max(errors):.1f}%, mean |error| {100 * sum(errors) / len(errors):.1f}%  "
                 "(model FLOPs utilization, A100; Megatron-LM 2022: sequence parallel, selective recomputation)")
    return "\n".join(lines)


def table(result: list[dict]) -> str:
    lines = [f"{'params':>8} {'tp':>3} {'pp':>3} {'dp':>4} {'batch':>5} {'strategy':>34} "
             f"{'published':>9} {'predicted':>9} {'error':>7}"]
    for r in result:
        label = r["prediction"].strategy.label() if r["prediction"] else "does not fit"
        lines.append(f"{r['billions']:>7.1f}B {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['batch']:>5} {label:>34} "
                     f"{r['published_tflops']:>9.0f} {r['predicted_tflops']:>9.1f} {100 * r['error']:>6.1f}%")
    worst = max(abs(r["error"]) for r in result)
    lines.append(f"worst |error| {100 * worst:.1f}%, mean |error| "
                 f"{100 * sum(abs(r['error']) for r in result) / len(result):.1f}%  (TFLOP/s per GPU, A100)")
    return "\n".join(lines)


# -- Llama-family runs ------------------------------------------------------------------------
MODELS = {   # the shapes in the papers' and configs' own numbers (Llama 3 Table 3; Llama 2 configs)
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, ffn_hidden=14336),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, ffn_hidden=28672),
    "llama3-405b": dict(layers=126, hidden=16384, heads=128, ffn_hidden=53248),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, ffn_hidden=13824, kv_heads=40, vocab=32000),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, ffn_hidden=28672, vocab=32000),
}

# Llama 3 paper, Table 4: (GPUs, TP, CP, PP, DP, sequence, batch per DP, TFLOP/s per GPU, BF16 MFU).
# v3 of the paper prints DP=8 in the third row in one rendering and 4 in another; 8 is the one
# that multiplies out to 16,384 GPUs.
LLAMA3_TABLE4 = (
    (8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
    (16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
    (16384, 8, 16, 16, 8, 131072, 16, 380, 0.38),
)

LLAMA3_CHUNKS = 8
"""One layer a chunk: 126 layers on pp = 16 ranks with "one Transformer layer fewer each from the
first and the last stages ... the first model chunk on the first stage has only the embedding"
(§3.3.2) is 128 one-layer slots, 8 on each rank, two of them holding no layer."""

# torchtitan docs/performance.md @0413364, 64 A100: (model, sequence, local batch, activation
# checkpointing, tokens/s per GPU, MFU as published).
TORCHTITAN_A100 = (
    ("llama3-8b", 8192, 1, "selective layer", 2904, 0.568),
    ("llama3-8b", 8192, 1, "selective op", 2973, 0.582),
    ("llama3-70b", 8192, 1, "full", 331, 0.517),
    ("llama2-13b", 4096, 2, "none", 2162, 0.611),
    ("llama2-13b", 4096, 2, "selective layer", 1914, 0.541),
    ("llama2-13b", 4096, 2, "selective op", 1904, 0.538),
    ("llama2-70b", 4096, 1, "selective op", 355, 0.508),
    ("llama2-70b", 4096, 2, "full", 353, 0.505),
)


def _model(name: str, seq: int) -> Decoder:
    return Decoder(seq=seq, name=name, **{"kv_heads": 8, "vocab": 128256, **MODELS[name]})


# torchtitan docs/performance.md @d4c86e3, Tables 1 and 3, "FSDP" rows (no compile, no Float8):
# (model, GPUs, sequence, local batch, activation checkpointing, peak reserved GiB).
TORCHTITAN_H100_MEMORY = (
    ("llama3-8b", 8, 8192, 2, "selective op", 82.4),
    ("llama3-8b", 128, 8192, 2, "selective op", 67.0),
)


def compare_memory() -> list[dict]:
    """The planner's peak per GPU against torchtitan's published peaks: {"config", "published_gib",
    "predicted_gib", "ratio", "prediction"} per row."""
    from .hardware import GiB
    from .layout import ClusterStrategy
    from .step import predict

    out = []
    for name, gpus, seq, batch, ac, gib in TORCHTITAN_H100_MEMORY:
        p = predict(_model(name, seq), Cluster.of(gpus, "h100"), gpus * batch,
                    ClusterStrategy(dp=gpus, zero=3, microbatch_size=batch, recompute="selective", dp_mode="overlap"))
        out.append({"config": f"{name}, {gpus} H100, FSDP dp{gpus}, seq {seq}, batch {batch}/GPU, AC {ac}",
                    "published_gib": gib, "predicted_gib": p.memory["total"] / GiB,
                    "ratio": p.memory["total"] / GiB / gib, "prediction": p})
    return out


def table_memory(rows: list[dict]) -> str:
    lines = [f"{'memory per GPU (torchtitan docs/performance.md @d4c86e3)':<72} {'published':>9} {'predicted':>9}"]
    for r in rows:
        lines.append(f"{r['config']:<72} {r['published_gib']:>5.1f} GiB {r['predicted_gib']:>5.1f} GiB "
                     f"({100 * (r['ratio'] - 1):+.0f}%: live tensors against the allocator's reserved peak)")
    return "\n".join(lines)


def _note(p, *extra: str) -> str:
    """The dp traffic left exposed, ``extra`` remarks, and a memory count above what the run had."""
    from .memory import USABLE_FRACTION

    over = [] if p.fits else [f"{p.memory_gb_per_gpu:.0f} GB > {100 * USABLE_FRACTION:.0f}% of "
                              f"{p.cluster.hardware.hbm_bytes / 1e9:.1f} GB: the run fit, the planner over-counts"]
    return "; ".join([f"dp comm exposed {p.parts['dp_comm_s']:.1f} s of {p.step_time_s:.1f} s",
                      f"{p.memory_gb_per_gpu:.0f} GB a GPU", *extra, *over])


def compare_llama() -> list[dict]:
    """Predict every row of both Llama tables: {"source", "row", "model", "config", "metric",
    "published", "predicted", "error", "prediction", "note"} per row."""
    from .layout import ClusterStrategy
    from .search import candidates
    from .step import predict

    out = []
    for i, (gpus, tp, cp, pp, dp, seq, per_dp, tflops, mfu) in enumerate(LLAMA3_TABLE4, 1):
        model, cluster = _model("llama3-405b", seq), Cluster.of(gpus, "h100")
        # the published configuration: zero=2, no recomputation, interleaved, sequence parallel,
        # all-gather cp; the micro-batch size and chunks are not published: the fastest of those
        # the planner places
        p = min((predict(model, cluster, dp * per_dp, s) for s in candidates(
            model, cluster, dp * per_dp, zero=(2,), dp=dp, pp=pp, tp=tp, cp=cp, cp_modes=("allgather",),
            recompute=("none",), schedules=("interleaved",), sequence_parallel=(True,), dp_mode="overlap",
            chunks=(LLAMA3_CHUNKS,))),
            key=lambda p: p.step_time_s)
        predicted = p.mfu * cluster.hardware.peak_flops / 1e12
        out.append({"source": "Llama 3 paper, Table 4", "row": i, "model": "llama3-405b", "metric": "TFLOP/s per GPU",
                    "config": f"{gpus} H100, tp{tp} cp{cp} pp{pp} dp{dp}, seq {seq}, {per_dp} seq/dp",
                    "published": tflops, "prediction": p, "predicted": predicted, "error": (predicted - tflops) / tflops,
                    "note": _note(p, *([f"cp all-gathers exposed {p.parts['cp_comm_s']:.1f} s"] if cp > 1 else []))})
    for i, (name, seq, batch, ac, tps, mfu) in enumerate(TORCHTITAN_A100, 1):
        model, cluster = _model(name, seq), Cluster.of(64, "a100")
        rc = {"none": "none", "full": "full"}.get(ac, "selective")
        p = predict(model, cluster, 64 * batch, ClusterStrategy(dp=64, zero=3, microbatch_size=batch, recompute=rc,
                                                                  dp_mode="overlap"))
        predicted = p.throughput_tokens_s / cluster.gpus
        out.append({"source": "torchtitan docs/performance.md", "row": i, "model": name,
                    "config": f"64 A100, FSDP (zero=3) dp64, seq {seq}, batch {batch}/GPU, AC {ac}",
                    "metric": "tokens/s per GPU", "published": tps, "prediction": p, "predicted": predicted,
                    "error": (predicted - tps) / tps,
                    "note": _note(p, *(["torchtitan's 'layer' recomputes every second layer in full, priced "
                                        "as 'op'"] if ac == "selective layer" else []))})
    return out


def table_llama(rows: list[dict]) -> str:
    """The rows of :func:`compare_llama` with the error per row, then the mean |error| of those predicted."""
    lines = [f"{'source':<16} {'#':>2} {'model':<12} {'configuration':<72} {'published':>9} {'predicted':>9} "
             f"{'error':>7}  strategy / note"]
    for r in rows:
        source = "Llama 3 T4" if r["source"].startswith("Llama") else "torchtitan A100"
        label = r["prediction"].strategy.label() if r["prediction"] else ""
        err = "" if r["error"] != r["error"] else f"{100 * r['error']:+6.1f}%"
        pred = "—" if r["predicted"] != r["predicted"] else f"{r['predicted']:.0f}"
        lines.append(f"{source:<16} {r['row']:>2} {r['model']:<12} {r['config']:<72} {r['published']:>9} "
                     f"{pred:>9} {err:>7}  {label}{'; ' if label and r['note'] else ''}{r['note']}")
    done = [abs(r["error"]) for r in rows if r["error"] == r["error"]]
    lines.append(f"{len(done)} of {len(rows)} rows predicted; mean |error| {100 * sum(done) / len(done):.1f}%, "
                 f"worst {100 * max(done):.1f}%  (Llama 3: model TFLOP/s per GPU, 6·N + 12·L·h·s per token; "
                 "torchtitan: tokens/s per GPU)")
    return "\n".join(lines)


def main(which: str = "llama") -> int:
    """Print a published table with the planner's prediction and error per row."""
    if which == "sc21":
        print(table(compare()))
    elif which == "mlsys23":
        print(table_mlsys23(compare_mlsys23()))
    elif which == "llama":
        print(table_llama(compare_llama()))
        print(table_memory(compare_memory()))
    else:
        raise ValueError(f"published table {which!r} is unknown; use 'sc21', 'mlsys23' or 'llama'")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
