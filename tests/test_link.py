"""The emulated link (labkit.Link): its α-β arithmetic, and the times labkit.comm calls take
under it on real engines.

The emulated time is the behaviour under test, so it is asserted, on links slow enough (20 MB/s,
calls of 50–1200 ms) that gloo's own transfer (a few ms on loopback) is a small part of it. The
lower bound is exact (a call may not complete before its link allows); the upper bound allows
the lab's own per-call time on a loaded 2-core machine, each bound says how much and why.
"""
from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

import labkit
from labkit import comm
from labkit.comm import collectives
from labkit.link import Link, compute_rate
from labkit.plan.scale.hardware import H100
from labkit.view.status import link_text

cloudpickle.register_pickle_by_value(sys.modules[__name__])     # engines cannot import this file
SLOW = Link(bandwidth=20e6, latency=1e-3)      # 20 MB/s: 4 MB all-reduced over 2 ranks in 0.2 s


# -- the arithmetic, no engines ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(bandwidth=-1.0), "bandwidth"), (dict(bandwidth=0), "bandwidth"),
    (dict(bandwidth=float("inf")), "bandwidth"),
    (dict(bandwidth=1e9, latency=-1e-6), "latency"), (dict(bandwidth=1e9, gpus_per_node=0), "gpus_per_node"),
    (dict(bandwidth=1e9, inter_bandwidth=-5.0, gpus_per_node=2), "inter_bandwidth"),
    (dict(bandwidth=1e9, inter_bandwidth=1e8), "gpus_per_node"),
])
def test_bad_fields_name_the_field_and_the_fix(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Link(**kwargs)


def test_fields_are_keyword_only_and_unknown_presets_list_the_names():
    with pytest.raises(TypeError):
        Link(1e9, 1e-6)
    with pytest.raises(ValueError, match="nvlink4"):
        Link.preset("token ring")


def test_a_bad_link_is_refused_before_any_engine(monkeypatch):
    import labkit.session.lab as lab_module

    def no_engines(*args, **kwargs):
        raise AssertionError("engines were started for a bad link")
    monkeypatch.setattr(lab_module, "start_engines", no_engines)
    with pytest.raises(TypeError, match="labkit.Link"):
        labkit.Lab.start(engines=2, link="fast")


def test_costs_are_the_ring_formulas_and_agree_with_the_collectives_model():
    link, S = Link(bandwidth=1e9, latency=1e-5), 8e6
    for n in (2, 3, 4, 8):
        assert link.seconds("all_reduce", S, n) == pytest.approx(collectives.predict("ring", S, n, 1e-5, 1e9))
        assert link.seconds("all_gather", S, n) == pytest.approx((n - 1) * 1e-5 + (n - 1) / n * S / 1e9)
        assert link.seconds("reduce_scatter", S, n) == link.seconds("all_gather", S, n)
    assert link.seconds("send", S, 2) == pytest.approx(1e-5 + S / 1e9)
    assert link.seconds("all_reduce", S, 1) == 0.0


def test_two_tiers_by_emulated_node():
    link = Link(bandwidth=1e9, latency=1e-5, gpus_per_node=2, inter_bandwidth=1e8, inter_latency=1e-4)
    assert link.tier([0, 1]) == "intra" and link.tier([2, 3]) == "intra" and link.tier([1, 2]) == "inter"
    assert link.seconds("send", 1e6, 2, "inter") == pytest.approx(1e-4 + 1e6 / 1e8)
    assert "2-engine nodes" in str(link) and "100 MB/s" in str(link)


def test_presets_carry_their_per_direction_figures():
    assert Link.preset("NVLink 4").bandwidth == 450e9
    assert Link.preset("pcie4 x16").bandwidth == pytest.approx(31.5e9)
    assert Link.preset("ib400").bandwidth == 50e9 and Link.preset("100 Gb/s InfiniBand").bandwidth == 12.5e9
    assert Link.preset("10gbe", gpus_per_node=2).gpus_per_node == 2
    assert "InfiniBand 400 Gb/s" in str(Link.preset("ib400"))


def test_scaled_keeps_the_targets_flops_per_byte():
    class FakeLab:       # two engines that each measured 20 GFLOP/s
        def apply(self, fn, *args):
            return [20e9, 20e9]
    link = Link.scaled("8xH100", FakeLab())
    target = H100.peak_flops * H100.gemm_max_efficiency
    assert 20e9 / link.bandwidth == pytest.approx(target / H100.nvlink.beta)
    assert 20e9 / link.alpha_beta("inter")[1] == pytest.approx(target / H100.ib.beta)
    assert link.latency * 20e9 == pytest.approx(H100.nvlink.alpha * target)    # α dilated as much
    assert link.gpus_per_node == 8
    assert compute_rate(seconds=0.02, dim=64) > 0


def test_balanced_makes_the_gradient_all_reduce_as_long_as_backward():
    from types import SimpleNamespace
    span = lambda kind, rank, start, end: {"kind": kind, "rank": rank, "start": start, "end": end}  # noqa: E731
    events = [span("bwd", 0, 0.0, 0.01), span("bwd", 0, 0.02, 0.03), span("bwd", 1, 0.0, 0.5), span("fwd", 0, 0.0, 0.5)]
    run = SimpleNamespace(timeline=SimpleNamespace(steps=[0, 1], events=events), parameter_bytes=[2e6, 2e6],
                          strategy=labkit.Strategy(dp=4))
    link = Link.balanced(run, latency=0.0)          # 10 ms of backward per step, rank 0
    assert link.seconds("all_reduce", 2e6, 4) == pytest.approx(0.01)


# -- on engines -------------------------------------------------------------------------------
@pytest.fixture
def linked2(lab2):
    """The shared 2-engine lab with no link again afterwards (it serves other test modules)."""
    yield lab2
    lab2.link = None


def _timed_all_reduce(numel: int, repeats: int) -> list[tuple[float, float]]:
    import torch.distributed as dist
    x, out = torch.ones(numel), []
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        comm.all_reduce(x)
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


def test_an_all_reduce_takes_its_alpha_beta_time_off_the_cpu(linked2):
    linked2.link = SLOW
    expected = SLOW.seconds("all_reduce", 4e6, 2)                      # 0.202 s
    for rank in linked2.apply(_timed_all_reduce, 1_000_000, 3):
        wall = min(w for w, _ in rank)
        assert wall >= expected                                         # never before the link allows
        assert wall <= 1.05 * expected                                  # gloo's ~5 ms is inside the 202
        assert max(c for _, c in rank) < 0.25 * expected                # the caller's thread slept


def _late_all_reduce(numel: int, late_s: float) -> float:
    import torch.distributed as dist
    x = torch.ones(numel)
    dist.barrier()
    t0 = time.perf_counter()
    if comm.rank() == 1:
        time.sleep(late_s)              # rank 1 joins late: the transfer cannot start before it
    comm.all_reduce(x)
    return time.perf_counter() - t0


def test_a_collective_starts_when_its_last_member_joins(linked2):
    linked2.link = SLOW
    expected = 0.1 + SLOW.seconds("all_reduce", 4e6, 2)
    for took in linked2.apply(_late_all_reduce, 1_000_000, 0.1):
        assert expected <= took <= 1.05 * expected


def _timed_send(numel: int) -> float:
    import torch.distributed as dist
    x = torch.ones(numel)
    dist.barrier()
    t0 = time.perf_counter()
    if comm.rank() == 0:
        comm.send(x, 1)
    else:
        comm.recv(x, 0)
    return time.perf_counter() - t0


def test_a_send_takes_alpha_plus_size_over_beta(linked2):
    linked2.link = SLOW
    expected = SLOW.seconds("send", 2e6, 2)                             # 1 ms + 100 ms
    sender, receiver = linked2.apply(_timed_send, 500_000)
    assert expected <= sender <= 1.05 * expected
    # the receiver's clock starts at its own barrier exit, up to a few ms before the sender's
    assert 0.98 * expected <= receiver <= 1.05 * expected


def _overlapped(numel: int, work: int) -> dict:
    import torch.distributed as dist
    x, a = torch.ones(numel), torch.randn(256, 256)
    dist.barrier()
    t0 = time.perf_counter()
    handle = comm.all_reduce(x, async_op=True)
    c0 = time.perf_counter()
    for _ in range(work):              # the compute beside the link's transfer
        a = torch.tanh(a @ a)
    compute = time.perf_counter() - c0
    handle.wait()
    return {"total": time.perf_counter() - t0, "compute": compute}


def test_overlap_hides_what_the_formula_says(linked2):
    linked2.link = SLOW
    link_time = SLOW.seconds("all_reduce", 4e6, 2)
    for rank in linked2.apply(_overlapped, 1_000_000, 150):
        hidden = link_time + rank["compute"] - rank["total"]
        assert rank["total"] >= link_time
        # α-β: min(compute, link) can hide; at least 80 % of it did (gloo's own few ms of
        # transfer compete with the compute for the 2 cores)
        assert hidden >= 0.8 * min(rank["compute"], link_time), rank


def test_runs_keep_their_values_and_their_calls_take_the_link_time(linked2):
    model = labkit.models.mlp(width=64, depth=4)
    link = Link(bandwidth=50e6, latency=1e-3)
    for strategy in (labkit.Strategy(dp=2, dp_mode="ddp", bucket_mb=0.02), labkit.Strategy(pp=2, microbatches=2),
                     labkit.Strategy(dp=2, zero=3, prefetch=1)):
        linked2.link = None
        raw = linked2.run(strategy, model=model, batch=16, steps=2)
        linked2.link = link
        emulated = linked2.run(strategy, model=model, batch=16, steps=2)
        assert emulated.max_diff(raw) == 0.0 and emulated.losses == raw.losses
        assert emulated.link is link and raw.link is None
        for e in emulated.timeline.events:
            if e["kind"] == "allreduce":          # bytes on the wire are S for n = 2
                assert e["end"] - e["start"] >= link.seconds("all_reduce", e["bytes"], 2) - 1e-6, e
            if e["kind"] == "allgather":          # S/2 on the wire of an S-byte gather
                assert e["end"] - e["start"] >= link.seconds("all_gather", 2 * e["bytes"], 2) - 1e-6, e
    assert "emulated link 50 MB/s" in link_text(link) and "own speed" in link_text(None)


def test_ring_and_server_take_their_alpha_beta_times(lab4):
    lab4.link = Link(bandwidth=20e6)
    try:
        S, n = 4e6, 4
        took = {alg: max(min(r["seconds"]) for r in lab4.apply(collectives.demo, alg, 1_000_000, repeats=2))
                for alg in ("ring", "ps")}
    finally:
        lab4.link = None
    ring, server = 2 * (n - 1) / n * S / 20e6, 2 * (n - 1) * S / 20e6      # 0.3 s and 1.2 s
    assert server <= took["ps"] <= 1.05 * server
    # the ring's 2(n-1) steps each wait for the last one: the lab's own time per message
    # (about 2 ms here) adds once per step, 6 steps on 50 ms each
    assert ring <= took["ring"] <= 1.12 * ring
    assert took["ps"] / took["ring"] >= 0.9 * n
