"""Build tests/data/kineto_gpu/: a SYNTHETIC torch profiler (Kineto) trace of an 8-GPU
data-parallel job, one gzipped file per rank, in the layout torch.profiler's
``export_chrome_trace`` writes (docs: FACTS.md, "torch profiler trace files"). No GPU ran it.

    python tests/data/make_kineto_gpu.py         # rewrites tests/data/kineto_gpu/rank{0..7}.json.gz

The job: a 4-layer transformer block stack, dp = 8, three profiled steps (ProfilerStep#10-12).
Per step and rank, on the compute stream (7): an input memcpy, per layer a forward of three
GEMMs and two elementwise kernels, then the backward in reverse (two GEMMs per forward GEMM);
gradients go out in two buckets on the NCCL stream (20): bucket 0 (layers 3-2) when layer 2's
backward is done, overlapping layers 1-0's backward, bucket 1 (layers 1-0) at the end; then the
optimizer's fused kernel once both all-reduces are done. Each NCCL kernel carries the process
group's args as torch's profiler writes them ("Process Group Ranks", …; pg_config in
distributedInfo), which the step graph joins collectives by.

Rank 5 runs its kernels 1.4× slower (a throttled GPU). An NCCL all-reduce kernel starts on each
rank when its stream reaches it and ends for everyone when the last rank has joined plus the
transfer, as NCCL's kernels spin until every peer arrives: so the others' all-reduce kernels are
long (waiting) and rank 5's short, and every rank's step ends together.

Each rank's host clock has its own base (as on different hosts); the reader aligns ranks at
their ProfilerStep annotations.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

OUT = Path(__file__).parent / "kineto_gpu"
WORLD, LAYERS, STEPS = 8, 4, (10, 11, 12)
SLOW_RANK, SLOW = 5, 1.4
# kernel durations, µs, on a healthy GPU
FWD = [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_qkv", 180),
       ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 140),
       ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_mlp", 260),
       ("vectorized_elementwise_kernel<4, GeluFunctor<c10::BFloat16>>", 30),
       ("triton_red_fused_native_layer_norm_0", 25)]
BWD_SCALE = 2.0
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
TRANSFER_US = 420          # each bucket's ring all-reduce once every rank has joined
OPTIMIZER = ("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>", 90)
MEMCPY = ("Memcpy HtoD (Pinned -> Device)", 40)
# what torch's profiler writes on an NCCL kernel and in distributedInfo about its process group
COLLECTIVE_ARGS = {"Collective name": "allreduce", "dtype": "BFloat16", "Group size": WORLD,
                   "Process Group Name": "0", "Process Group Description": "default_pg",
                   "Process Group Ranks": str(list(range(WORLD)))}
PG_CONFIG = [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": WORLD,
              "ranks": list(range(WORLD))}]


def rank_compute(rank: int) -> list[tuple[str, float, str]]:
    """(name, duration µs, tag) of the rank's compute kernels in order; tags mark the bucket points."""
    f = SLOW if rank == SLOW_RANK else 1.0
    seq = [(MEMCPY[0], MEMCPY[1], "memcpy")]
    for _ in range(LAYERS):
        seq += [(n, d * f, "") for n, d in FWD]
    for layer in reversed(range(LAYERS)):
        seq += [(n.replace("fwd", "bwd").replace("_tn_", "_nt_"), d * f * BWD_SCALE, "") for n, d in FWD]
        if layer == 2:
            seq[-1] = (*seq[-1][:2], "bucket0")
    seq[-1] = (*seq[-1][:2], "bucket1")
    return seq


def build() -> dict[int, list[dict]]:
    """Every rank's trace events over the steps, on a global clock first (µs)."""
    events = {r: [] for r in range(WORLD)}
    corr = {r: 0 for r in range(WORLD)}
    t_step = 0.0
    for step in STEPS:
        starts = {r: t_step + 3.0 * ((r * 7 + step) % 5) for r in range(WORLD)}       # a few µs of skew
        ready = {}          # (rank, bucket) -> when the rank's NCCL stream reaches the bucket
        done_compute = {}
        for r in range(WORLD):
            t, host = starts[r] + 20.0, starts[r] + 5.0
            for name, dur, tag in rank_compute(r):
                corr[r] += 1
                events[r].append(_launch(host, corr[r]))
                host += 6.0
                cat = "gpu_memcpy" if tag == "memcpy" else "kernel"
                events[r].append(_kernel(name, cat, 7, t, dur, corr[r]))
                t += dur
                if tag.startswith("bucket"):
                    ready[(r, int(tag[-1]))] = t
            done_compute[r] = t
        ends = {}
        for b in (0, 1):
            joined = max(ready[(r, b)] for r in range(WORLD))
            stream_free = {r: ends.get((r, b - 1), 0.0) for r in range(WORLD)}
            for r in range(WORLD):
                start = max(ready[(r, b)], stream_free[r])
                ends[(r, b)] = max(joined, start) + TRANSFER_US
                corr[r] += 1
                events[r].append(_launch(ready[(r, b)] - 4.0, corr[r]))
                kernel = _kernel(ALLREDUCE, "kernel", 20, start, ends[(r, b)] - start, corr[r])
                kernel["args"].update(COLLECTIVE_ARGS)
                events[r].append(kernel)
        step_end = 0.0
        for r in range(WORLD):
            t = max(done_compute[r], ends[(r, 1)])
            corr[r] += 1
            events[r].append(_launch(t - 3.0, corr[r]))
            events[r].append(_kernel(OPTIMIZER[0], "kernel", 7, t, OPTIMIZER[1], corr[r]))
            step_end = max(step_end, t + OPTIMIZER[1])
        for r in range(WORLD):
            events[r].append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 4000 + r,
                              "tid": 4000 + r, "ts": starts[r], "dur": step_end + 10.0 - starts[r]})
        t_step = step_end + 60.0           # the host's gap before the next step
    return events


def _launch(ts: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 4.0,
            "args": {"correlation": correlation, "cbid": 211}}


def _kernel(name: str, cat: str, stream: int, ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": correlation}}


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, events in build().items():
        base = 1.7e15 + 12_345_678.0 * rank           # each host's own clock
        for e in events:
            e["ts"] = round(e["ts"] + base, 3)
            e["dur"] = round(e["dur"], 3)
            if e["cat"] in ("cuda_runtime", "user_annotation"):
                e["pid"], e["tid"] = 4000 + rank, 4000 + rank
        trace = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
                 "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": WORLD, "pg_config": PG_CONFIG},
                 "traceEvents": sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms",
                 "traceName": f"synthetic, labkit tests/data/make_kineto_gpu.py, rank {rank}"}
        path = out / f"rank{rank}.json.gz"
        with gzip.GzipFile(path, "wb", mtime=0) as f:      # mtime 0: the same bytes every time
            f.write(json.dumps(trace).encode())
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write():
        print(p, p.stat().st_size, "bytes")
