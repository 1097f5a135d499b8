"""split_waits: receives matched with sends in order per (src, dst) pair, no processes."""
from __future__ import annotations

import pytest

from labkit.analysis.metrics import per_rank_metrics
from labkit.parallel.pipeline.schedules import build_schedule, simulate
from labkit.analysis.waits import split_waits


def ev(rank, kind, start, end, peer=None, step=0, stream=None, name="", nbytes=0):
    return {"rank": rank, "stream": stream or ("comm" if kind in ("send", "recv") else "compute"),
            "kind": kind, "name": name or kind, "step": step, "microbatch": None, "start": start,
            "end": end, "bytes": nbytes, "peer": peer}


def spans(events, rank, kind):
    return [(e["start"], e["end"]) for e in events if e["rank"] == rank and e["kind"] == kind]


def test_late_sender_turns_the_start_of_a_receive_into_a_wait():
    events = [ev(0, "fwd", 0.0, 3.0), ev(0, "send", 3.0, 9.0, peer=1, nbytes=64),   # waited late
              ev(1, "recv", 1.0, 3.5, peer=0, nbytes=64)]
    out = split_waits(events)
    assert spans(out, 1, "wait") == [(1.0, 3.0)]
    assert spans(out, 1, "recv") == [(3.0, 3.5)]
    assert spans(out, 0, "send") == [(3.0, 3.5)]           # capped where the bytes arrived
    wait = next(e for e in out if e["kind"] == "wait")
    assert wait["stream"] == "comm" and wait["bytes"] == 0 and wait["peer"] == 0
    assert sum(e["bytes"] for e in out if e["kind"] == "send") == 64
    assert events[2]["start"] == 1.0                         # the input is not modified


def test_early_sender_leaves_the_receive_whole_and_trims_the_send():
    out = split_waits([ev(0, "send", 0.0, 5.0, peer=1), ev(1, "recv", 2.0, 2.5, peer=0)])
    assert spans(out, 1, "wait") == [] and spans(out, 1, "recv") == [(2.0, 2.5)]
    assert spans(out, 0, "send") == [(2.0, 2.5)]            # queued until the receiver posted


def test_matching_is_in_order_per_pair_and_per_step():
    events = [ev(0, "send", 1.0, 1.1, peer=1), ev(0, "send", 4.0, 4.1, peer=1),
              ev(2, "send", 0.0, 0.1, peer=1),                                    # another pair
              ev(1, "recv", 0.5, 1.2, peer=0), ev(1, "recv", 2.0, 4.2, peer=0),
              ev(1, "recv", 0.0, 0.2, peer=2),
              ev(0, "send", 3.0, 3.1, peer=1, step=1), ev(1, "recv", 0.0, 3.2, peer=0, step=1)]
    out = split_waits(events)
    assert spans(out, 1, "wait") == [(0.5, 1.0), (2.0, 4.0), (0.0, 3.0)]
    assert [e["step"] for e in out if e["kind"] == "wait"] == [0, 0, 1]
    assert spans(out, 1, "recv") == [(1.0, 1.2), (4.0, 4.2), (0.0, 0.2), (3.0, 3.2)]


def test_unmatched_and_collective_events_are_left_alone():
    dp = [ev(0, "allreduce", 0.0, 1.0, stream="comm"), ev(1, "allreduce", 0.0, 1.0, stream="comm")]
    assert split_waits(dp) is dp
    lonely = [ev(1, "recv", 0.0, 1.0, peer=0), ev(0, "allreduce", 0.0, 1.0, stream="comm")]
    assert split_waits(lonely) == lonely


def test_clock_skew_never_makes_negative_spans():
    out = split_waits([ev(0, "send", 2.0, 2.1, peer=1), ev(1, "recv", 0.0, 1.5, peer=0)])
    assert all(e["end"] >= e["start"] for e in out)
    assert spans(out, 1, "wait") == [(0.0, 1.5)] and spans(out, 1, "recv") == [(1.5, 1.5)]


def test_simulated_pipeline_waits_come_back_where_the_simulator_put_them():
    # Rebuild what ranks record (a receive spans post → arrival, no split) from the
    # simulator's split events, and check split_waits recovers the simulator's waits.
    sim = simulate(build_schedule("gpipe", 2, 3), fwd_cost=1, bwd_cost=2)
    raw, waits = [], {}
    for e in sim:
        if e["kind"] == "wait":
            waits[e["rank"], e["name"]] = e["start"]
    for e in sim:
        if e["kind"] == "wait":
            continue
        e = dict(e)
        if e["kind"] == "recv":
            e["start"] = waits.get((e["rank"], e["name"]), e["start"])
        raw.append(e)
    out = split_waits(raw)
    assert sorted(spans(out, 0, "wait") + spans(out, 1, "wait")) == \
        sorted((e["start"], e["end"]) for e in sim if e["kind"] == "wait")
    for rank in (0, 1):       # free comm: bubble is exactly GPipe's (p-1)/(m+p-1) = 1/4
        assert per_rank_metrics(out, rank, 0)["bubble_fraction"] == 0.25


def test_ranks_of_one_host_are_put_on_its_clock_before_the_split():
    from labkit.analysis.clocks import aligned, offsets

    # rank 1 left the step's barrier 2 ms after rank 0: by its own clock its receive ended at
    # 0.5 ms, before rank 0 had posted the send (at 1 ms by rank 0's clock)
    results = [{"rank": 0, "clock": {"host": "a", "origin_s": 100.000}, "events": [ev(0, "send", 1e-3, 4e-3, peer=1)]},
               {"rank": 1, "clock": {"host": "a", "origin_s": 100.002}, "events": [ev(1, "recv", 0.0, 0.5e-3, peer=0)]},
               {"rank": 2, "clock": {"host": "b", "origin_s": 7.0}, "events": [ev(2, "fwd", 0.0, 1e-3)]}]
    assert offsets({r["rank"]: r["clock"] for r in results}) == pytest.approx({0: 0.0, 1: 2e-3, 2: 0.0})
    out = aligned(results)
    assert spans(out, 1, "recv")[0] == pytest.approx((2e-3, 2.5e-3))     # on rank 0's clock: after the send
    assert spans(out, 2, "fwd") == [(0.0, 1e-3)]                          # another host: the barrier's zero
    split = split_waits(out)
    assert spans(split, 1, "wait") == [] and spans(split, 0, "send")[0] == pytest.approx((2e-3, 2.5e-3))
    # read on each rank's own clock, the same step showed a wait that did not happen
    own = split_waits([e for r in results for e in r["events"]])
    assert spans(own, 1, "wait")[0] == pytest.approx((0.0, 0.5e-3)) and spans(own, 1, "recv")[0] == pytest.approx((0.5e-3, 0.5e-3))
    # a rank that reports no clock keeps its times
    assert aligned([{"rank": 0, "events": [ev(0, "fwd", 0.0, 1.0)]}]) == [ev(0, "fwd", 0.0, 1.0)]
