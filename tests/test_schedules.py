"""Pure tests of pipeline schedules: no processes, only the action lists and their simulation.

Exact bubble checks use Fractions so that 1/3-sized chunk costs add up with no rounding.
"""
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from labkit.parallel.pipeline.schedules import (Action, build_schedule, ideal_bubble, in_flight, parse_action,
                              simulate, validate)

GRID = [(s, p, m, 1) for s in ("gpipe", "1f1b") for p in range(1, 5) for m in range(1, 9)]
GRID += [("interleaved", p, m, v) for v in (2, 3) for p in range(1, 5) for m in range(p, 9, p)]
IDS = [f"{s}-p{p}-m{m}-v{v}" for s, p, m, v in GRID]


def compute_spans(events):
    """(op, stage, microbatch) -> (start, end) of its compute event."""
    spans = {}
    for e in events:
        if e["stream"] == "compute":
            a = parse_action(e["name"])
            spans[a.op, a.stage, a.microbatch] = (e["start"], e["end"])
    return spans


def bubbles(events, ranks):
    """Per rank (T - busy) / T, T the overall makespan (DESIGN's bubble with free comm)."""
    total = max(e["end"] for e in events)
    busy = Counter()
    for e in events:
        if e["stream"] == "compute":
            busy[e["rank"]] += e["end"] - e["start"]
    return [(total - busy[r]) / total for r in range(ranks)]


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_every_stage_and_microbatch_runs_once_on_its_rank(schedule, p, m, v):
    seen = Counter()
    for rank, actions in enumerate(build_schedule(schedule, p, m, v)):
        for a in actions:
            assert a.stage % p == rank and a.chunk == a.stage // p, a
            if a.op in ("F", "B"):
                seen[a.op, a.stage, a.microbatch] += 1
    expected = {(op, s, i) for op in "FB" for s in range(p * v) for i in range(m)}
    assert set(seen) == expected and set(seen.values()) == {1}


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
@pytest.mark.parametrize("costs", [(1, 2, 0), (1, 1, Fraction(1, 2))])
def test_simulation_respects_dependencies(schedule, p, m, v, costs):
    events = simulate(build_schedule(schedule, p, m, v), *costs)  # raises on deadlock
    spans, last = compute_spans(events), p * v - 1
    hop = costs[2] if p > 1 else 0  # with one rank every neighbour stage is local: no transfer
    for s in range(p * v):
        for i in range(m):
            fwd, bwd = spans["F", s, i], spans["B", s, i]
            assert bwd[0] >= fwd[1]
            if s > 0:
                assert fwd[0] >= spans["F", s - 1, i][1] + hop
            if s < last:
                assert bwd[0] >= spans["B", s + 1, i][1] + hop
    for rank in range(p):  # one compute at a time per rank
        mine = sorted((e["start"], e["end"]) for e in events
                      if e["rank"] == rank and e["stream"] == "compute")
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_sends_and_receives_pair_up_in_order(schedule, p, m, v):
    # Stronger than the simulator's per-kind matching: per (src, dst) pair the mixed
    # sequence of F and B messages agrees too, so order-matched p2p (NCCL) is safe.
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(build_schedule(schedule, p, m, v)):
        for a in actions:
            if a.op.startswith("SEND"):
                to = a.stage + (1 if a.op == "SEND_F" else -1)
                assert a.peer == to % p
                sends[rank, a.peer].append((a.op[-1], a.microbatch, to))
            elif a.op.startswith("RECV"):
                frm = a.stage + (-1 if a.op == "RECV_F" else 1)
                assert a.peer == frm % p
                recvs[a.peer, rank].append((a.op[-1], a.microbatch, a.stage))
    assert sends == recvs
    assert sum(map(len, sends.values())) == (0 if p == 1 else 2 * m * (p * v - 1))


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
@pytest.mark.parametrize("bwd", [1, 2])
def test_simulated_bubble_equals_formula_exactly(schedule, p, m, v, bwd):
    # Interleaved: each chunk costs 1/v, so a rank's work equals the non-interleaved case.
    chunk = Fraction(1, v)
    events = simulate(build_schedule(schedule, p, m, v), chunk, bwd * chunk, 0)
    expected = Fraction(p - 1, v * m + p - 1)
    assert bubbles(events, p) == [expected] * p
    assert ideal_bubble(schedule, p, m, v) == pytest.approx(float(expected))


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_in_flight_microbatches(schedule, p, m, v):
    for rank, actions in enumerate(build_schedule(schedule, p, m, v)):
        if schedule == "gpipe":
            assert in_flight(actions) == m
        elif schedule == "1f1b":  # Megatron warm-up p-r-1, DeepSpeed min(p - r, m) buffers
            assert in_flight(actions) == min(p - rank, m)
        else:  # Megatron interleaved warm-up, plus the steady state's first forward
            warmup = 2 * (p - rank - 1) + (v - 1) * p
            assert in_flight(actions) == min(warmup + 1, m * v)


def compute_order(actions):
    return " ".join(str(a) for a in actions if a.op in ("F", "B"))


def test_known_orders():
    gpipe = build_schedule("gpipe", 2, 3)
    assert compute_order(gpipe[0]) == "0F0 0F1 0F2 0B0 0B1 0B2"
    one_f = build_schedule("1f1b", 3, 4)
    assert compute_order(one_f[0]) == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"
    assert compute_order(one_f[2]) == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    # Megatron, p=2 m=4 v=2, rank 0 (stages 0 and 2): warm-up 2*1 + 1*2 = 4 forwards.
    inter = build_schedule("interleaved", 2, 4, 2)[0]
    assert compute_order(inter) == ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 "
                                    "2B2 2B3 0B2 0B3")
    assert [str(a) for a in inter[:6]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1",
                                           "2RECV_F0", "2F0"]


def test_single_rank_has_no_communication():
    for actions in (build_schedule("1f1b", 1, 4)[0], build_schedule("interleaved", 1, 3, 2)[0]):
        assert {a.op for a in actions} == {"F", "B"}


def test_action_strings_round_trip():
    assert str(Action("F", 3, 0, 0)) == "0F3"
    assert str(Action("B", 2, 0, 1, None)) == "1B2"
    assert str(Action("SEND_F", 3, 0, 0, 1)) == "0SEND_F3"
    for schedule, p, m, v in [("1f1b", 4, 6, 1), ("interleaved", 3, 6, 2)]:
        for actions in build_schedule(schedule, p, m, v):
            assert [parse_action(str(a), stages=p) for a in actions] == actions
    with pytest.raises(ValueError, match="bad action"):
        parse_action("F3")


def test_waits_and_comm_cost_on_the_comm_stream():
    events = simulate(build_schedule("gpipe", 2, 1), fwd_cost=1, bwd_cost=1, comm_cost=0.25)
    assert set(events[0]) == {"rank", "stream", "kind", "name", "step", "microbatch", "start",
                              "end", "bytes", "peer"}
    assert max(e["end"] for e in events) == 4.5  # 4 compute units + 2 transfers
    waits = [(e["rank"], e["start"], e["end"]) for e in events if e["kind"] == "wait"]
    assert waits == [(1, 0, 1), (0, 1, 3.25)]  # blocked until the peer posted its send
    recvs = [(e["rank"], e["end"] - e["start"]) for e in events if e["kind"] == "recv"]
    assert recvs == [(1, 0.25), (0, 0.25)]
    assert all(e["stream"] == "comm" for e in events if e["kind"] in ("send", "recv", "wait"))


def test_simulator_detects_deadlock_and_mismatch():
    acts = build_schedule("1f1b", 2, 2)
    # rank 1 expecting a gradient before its forward: both ranks end up blocked in a RECV
    swapped = [acts[0], [Action("RECV_B", 0, 0, 1, 0)] + acts[1]]
    stuck = "deadlock: rank 0 blocked at 0RECV_B0, rank 1 blocked at 1RECV_B0"
    with pytest.raises(RuntimeError, match=stuck):
        simulate(swapped)
    reordered = [acts[0], acts[1][4:6] + acts[1][2:4] + acts[1][:2] + acts[1][6:]]  # mb 1 first
    with pytest.raises(RuntimeError, match="mismatch"):
        simulate(reordered)
    with pytest.raises(RuntimeError, match="unmatched sends"):
        simulate([acts[0] + [Action("SEND_F", 9, 0, 0, 1)], acts[1]])


def test_ideal_bubble_values():
    assert ideal_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert ideal_bubble("1f1b", 1, 5) == 0


@pytest.mark.parametrize("args,message", [
    (("zb", 2, 4, 1), "choose one of gpipe, 1f1b, interleaved"),
    (("1f1b", 0, 4, 1), "stages must be >= 1"),
    (("1f1b", 2, 0, 1), "microbatches must be >= 1"),
    (("1f1b", 2, 4, 2), "needs schedule='interleaved'"),
    (("gpipe", 2, 4, 3), "needs schedule='interleaved'"),
    (("interleaved", 2, 4, 1), "use 1f1b or set chunks >= 2"),
    (("interleaved", 4, 6, 2), r"microbatches % stages == 0 \(got 6 % 4\): use 4 or 8"),
    (("interleaved", 4, 3, 2), "use 4 microbatches"),
])
def test_bad_input_names_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        validate(*args)
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)
