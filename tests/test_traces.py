"""Torch profiler traces read into a Timeline: a GPU trace built here, a CPU trace recorded
by torch.profiler in two gloo processes, and the bad inputs each named in an error or warning."""
import gzip
import json
import os

import pytest

from labkit import Timeline
from labkit.analysis.metrics import per_rank_metrics
from labkit.analysis.traces import comm_kind


# --- a GPU trace, built ----------------------------------------------------------------------
#
# The Kineto layout (torch.profiler's export_chrome_trace): host events on (pid 100, tid 1),
# kernels on (pid 0, tid = CUDA stream) with the launching cudaLaunchKernel's "correlation".
# Two ranks, steps 5 and 6, each rank on its own clock (base B). Times in µs from the step's
# start:
#
#   rank 0  step 5: sgemm 100–400, NCCL all-reduce 300–600 (stream 20), memcpy 650–700
#           step 6: sgemm 100–500, NCCL all-gather 500–600
#   rank 1  step 5: sgemm 100–500, NCCL all-reduce 500–600
#           step 6: sgemm 100–400, NCCL all-gather 500–600
#
# so step 5 lasts T = 700 µs (rank 0's memcpy), step 6 T = 600 µs.

KERNELS = {0: {5: [("ampere_sgemm_128x64_nn", 7, 100, 400), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 300, 600),
                   ("Memcpy DtoH (Device -> Pinned)", 7, 650, 700)],
               6: [("ampere_sgemm_128x64_nn", 7, 100, 500), ("ncclDevKernel_AllGather_RING_LL", 20, 500, 600)]},
           1: {5: [("ampere_sgemm_128x64_nn", 7, 100, 500), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 500, 600)],
               6: [("ampere_sgemm_128x64_nn", 7, 100, 400), ("ncclDevKernel_AllGather_RING_LL", 20, 500, 600)]}}


def kineto(rank, kernels=None, steps=(5, 6), info=True, base=None, world=2):
    """A Kineto-format trace of one rank (see the table above)."""
    base = base if base is not None else 1e6 * (rank + 3)
    events, corr = [], 0
    for i, step in enumerate(steps):
        zero = base + 1000 * i
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 100, "tid": 1,
                       "ts": zero, "dur": 1000})
        for name, stream, start, end in (kernels or KERNELS[rank]).get(step, []):
            corr += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1,
                           "ts": zero + 5 * corr, "dur": 4, "args": {"correlation": corr}})
            cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
            events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": zero + start,
                           "dur": end - start, "args": {"device": 0, "stream": stream, "correlation": corr}})
    trace = {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}
    if info:
        trace["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    return trace


def write(path, trace):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(trace, f)
    return path


def test_a_gpu_trace_reads_into_the_schema_with_metrics_by_hand(tmp_path):
    paths = [write(tmp_path / "rank1.json.gz", kineto(1)), write(tmp_path / "rank0.json", kineto(0))]
    tl = Timeline.from_profiler(paths)
    assert (tl.world_size, tl.steps) == (2, [5, 6])
    assert tl.step_durations() == pytest.approx({5: 700e-6, 6: 600e-6})
    kinds = {(e["rank"], e["step"], e["kind"], e["stream"]) for e in tl.events}
    assert (0, 5, "allreduce", "comm") in kinds and (1, 6, "allgather", "comm") in kinds
    assert (0, 5, "memcpy", "compute") in kinds and (0, 5, "compute", "compute") in kinds
    # rank 0, step 5: C = [100,400] ∪ [650,700] = 350, X = [300,600] = 300, C ∩ X = 100
    m = per_rank_metrics(tl.events, 0, 5)
    assert m["comm_fraction"] == pytest.approx(300 / 700)
    assert m["exposed_comm_fraction"] == pytest.approx(200 / 700)
    assert m["overlap_fraction"] == pytest.approx(1 / 3)
    assert m["bubble_fraction"] == pytest.approx(150 / 700)
    # rank 1, step 6: C = 300, X = 100, no overlap, idle 600 − 400
    m = per_rank_metrics(tl.events, 1, 6)
    assert (m["overlap_fraction"], m["bubble_fraction"]) == pytest.approx((0.0, 200 / 600))
    whole = tl.metrics(global_batch=8)
    assert whole["step_time_s"] == pytest.approx(650e-6)                  # median of 700 and 600 µs
    assert whole["overlap_fraction"] == pytest.approx((1 / 3 + 0 + 0 + 0) / 4)
    # HTA-style breakdown of rank 0 over its own windows: step 5 = 100–700, step 6 = 100–600
    b = tl.temporal_breakdown()[0]
    assert b["window_s"] == pytest.approx(1100e-6)
    assert b["compute_s"] == pytest.approx((300 + 400) * 1e-6)           # memcpy is not compute here
    assert b["non_compute_s"] == pytest.approx((200 + 50 + 100) * 1e-6)   # comm and memcpy not under compute
    assert b["idle_s"] == pytest.approx(50e-6)


def test_the_trace_gives_the_same_views_and_straggler_report(tmp_path):
    tl = Timeline.from_profiler([write(tmp_path / f"r{r}.json", kineto(r)) for r in (0, 1)])
    found = tl.stragglers(threshold=0.0)
    # step 5: rank 1 entered the all-reduce at 500 µs, rank 0 at 300: 100 µs after the median
    assert found.ranks()[:1] == [1] and found[0].cause == "compute"
    assert found[0].late_s == pytest.approx(50e-6)                       # 100 µs over two steps
    fig = tl.plot(step="all")
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} >= {"allreduce", "allgather", "compute"}


def test_a_kernel_belongs_to_the_step_that_launched_it(tmp_path):
    late = {5: [("ampere_sgemm_128x64_nn", 7, 1100, 1300)], 6: [("ampere_sgemm_128x64_nn", 7, 300, 400)]}
    tl = Timeline.load(write(tmp_path / "r0.json", kineto(0, late, world=1)))     # load() knows a Kineto trace
    assert sorted((e["step"], round(e["start"] * 1e6), round(e["end"] * 1e6)) for e in tl.events) == \
        [(5, 1100, 1300), (6, 300, 400)]            # ran after step 6's host start, still step 5's


def test_comm_kinds_from_names():
    assert comm_kind("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)") == "allreduce"
    assert comm_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reduce_scatter"
    assert comm_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "send"
    assert comm_kind("gloo:all_reduce") == comm_kind("c10d::allreduce_") == "allreduce"
    assert comm_kind("c10d::_allgather_base_") == "allgather"
    assert comm_kind("c10d::alltoall_base_") == "all_to_all"
    assert comm_kind("aten::mm") is None


# --- bad input -------------------------------------------------------------------------------


def test_a_trace_without_distributed_info_is_named_and_ranks_can_be_given(tmp_path):
    path = write(tmp_path / "single.json", kineto(0, info=False))
    with pytest.raises(ValueError, match="single.json.*ranks="):
        Timeline.from_profiler([path])
    with pytest.warns(UserWarning, match="none of these files is rank 0–2"):
        assert Timeline.from_profiler([path], ranks=[3]).world_size == 4


def test_truncated_and_non_trace_json_are_named(tmp_path):
    text = json.dumps(kineto(0))
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="cut.json.*not a complete JSON"):
        Timeline.from_profiler([cut])
    other = write(tmp_path / "config.json", {"lr": 0.1})
    with pytest.raises(ValueError, match="config.json.*not a Chrome trace"):
        Timeline.from_profiler([other])
    twice = [write(tmp_path / "a.json", kineto(0)), write(tmp_path / "b.json", kineto(0))]
    with pytest.raises(ValueError, match="b.json: rank 0 already"):
        Timeline.from_profiler(twice)


def test_different_step_counts_and_an_empty_step_warn_naming_the_file(tmp_path):
    short = write(tmp_path / "short.json", kineto(1, steps=(5,)))
    with pytest.warns(UserWarning, match="short.json: steps \\[5\\]"):
        tl = Timeline.from_profiler([write(tmp_path / "full.json", kineto(0)), short])
    assert tl.steps == [5, 6] and {e["rank"] for e in tl.events if e["step"] == 6} == {0}
    empty = write(tmp_path / "empty.json", kineto(0, kernels={5: KERNELS[0][5]}, world=1))
    with pytest.warns(UserWarning, match="empty.json: ProfilerStep \\[6\\] hold no kernel"):
        Timeline.from_profiler([empty])


# --- a CPU trace, recorded -------------------------------------------------------------------


def _profile_rank(rank, world, store, out):
    """One gloo process: a tiny model, three steps under torch.profiler (one warm-up, two recorded)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    # a file store: no port to pick (a port bound, closed and reused can be taken meanwhile)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(3):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            prof.step()
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))
    dist.barrier()
    # Leave without the interpreter's teardown: under load a thread the profiler or gloo left
    # behind was once destroyed while joinable ("terminate called without an active
    # exception", SIGABRT) after the trace was already written; the test is about the trace.
    os._exit(0)


@pytest.mark.slow       # two processes of its own
def test_a_cpu_trace_recorded_by_torch_profiler_on_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_profile_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    tl = Timeline.from_profiler(sorted(tmp_path.glob("rank*.json")))
    assert tl.world_size == 2 and len(tl.steps) == 2
    for rank in (0, 1):
        mine = [e for e in tl.events if e["rank"] == rank]
        assert {"compute", "allreduce"} <= {e["kind"] for e in mine}
        names = {e["name"] for e in mine if e["kind"] == "allreduce"}
        assert {"gloo:all_reduce", "c10d::allreduce_"} <= names      # the worker's and the issuing op
        assert all(0 <= e["start"] <= e["end"] for e in mine)
    m = tl.metrics(global_batch=8)
    assert m["step_time_s"] > 0 and 0 < m["comm_fraction"] <= 1 and 0 <= m["bubble_fraction"] <= 1
    assert sum(b["compute_s"] + b["non_compute_s"] + b["idle_s"] for b in tl.temporal_breakdown()) == \
        pytest.approx(sum(b["window_s"] for b in tl.temporal_breakdown()))
    tl.stragglers()
    tl.plot()


# --- the synthetic 8-GPU trace in tests/data (notebook 15 reads it) ----------------------------
DATA = os.path.join(os.path.dirname(__file__), "data")


def test_the_synthetic_gpu_traces_are_what_their_script_writes(tmp_path):
    import sys

    sys.path.insert(0, DATA)
    try:
        import make_kineto_gpu
    finally:
        sys.path.remove(DATA)
    for path in make_kineto_gpu.write(tmp_path):
        with open(path, "rb") as fresh, open(os.path.join(DATA, "kineto_gpu", path.name), "rb") as kept:
            assert fresh.read() == kept.read(), path.name


def test_an_eight_gpu_trace_names_its_slow_gpu_though_every_step_ends_together():
    paths = sorted(os.path.join(DATA, "kineto_gpu", f) for f in os.listdir(os.path.join(DATA, "kineto_gpu")))
    tl = Timeline.from_profiler(paths)
    assert tl.world_size == 8 and tl.steps == [10, 11, 12]
    assert {e["kind"] for e in tl.events} == {"compute", "memcpy", "allreduce"}
    last = tl.step(12).table
    ends = [float(last["end"][last["rank"] == r].max()) for r in range(8)]
    assert max(ends) - min(ends) < 50e-6                      # the all-reduce equalises the step
    found = tl.stragglers()
    assert found.ranks() == [5] and found[0].cause == "compute", repr(found)
    waits = {b["rank"]: b["non_compute_s"] for b in tl.temporal_breakdown()}
    assert waits[5] < min(w for r, w in waits.items() if r != 5) / 3        # the others wait in NCCL
    m = tl.metrics(global_batch=64)
    assert 0 < m["overlap_fraction"] < 1 and m["bubble_fraction"] < 0.01


def test_a_missing_rank_and_a_labkit_trace_given_as_a_profiler_trace_are_named(tmp_path):
    with pytest.warns(UserWarning, match="world of 3 ranks but none of these files is rank 1–2; "):
        tl = Timeline.from_profiler([write(tmp_path / "r0.json", kineto(0, world=3))])
    assert tl.world_size == 3
    saved = tmp_path / "own.json"
    tl.save_trace(saved)
    with pytest.raises(ValueError, match="own.json: a trace that Timeline.save_trace wrote.*Timeline.load"):
        Timeline.from_profiler([saved])
    assert len(Timeline.load(saved)) == len(tl)


def test_rank_ranges_are_short():
    from labkit.analysis.traces import _ranges

    assert _ranges([2, 3, 4, 7]) == "2–4, 7" and _ranges([5]) == "5"
