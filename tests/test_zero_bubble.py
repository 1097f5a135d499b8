"""Pure tests of the zero-bubble schedules (ZB-H1, ZB-V): action lists and their simulation.

Figures checked, for equal F, I and W costs T (Qi et al., ICLR 2024, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241; and the authors' summary table, huggingface.co/spaces/sail/
pipeline-parallelism-with-controllable-memory, description2.md: bubble rate 1F1B (p-1)/m,
ZB1P (p-1)/3m, ZBV 0; activation memory 1x for all three):
  * ZB-H1 (§2.1, Figure 3 top): each rank idles (p-1)(T_F + T_B - T_W) = (p-1)T, a third of
    1F1B's (p-1)(T_F + T_B + T_W); bubble / ideal compute (p-1)/3m; F-to-W in flight <= p.
  * ZB-V (§6): zero bubble, i.e. no rank idles between its first forward and its last W, with
    at most 2p chunk activations (p micro-batches, as 1F1B) held at once.
torch's own ScheduleInterleavedZeroBubble (one stage per rank: ZB1P) and ScheduleZBVZeroBubble
are read without running them (FakeStore + ``pipeline_order``, FACTS.md) and compared.
"""
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from labkit.parallel.pipeline.schedules import (build_schedule, global_stage, ideal_bubble, in_flight, parse_action,
                              simulate, stage_rank, validate)

GRID = [("zb-h1", p, m, 1) for p in range(1, 5) for m in range(1, 10)]
GRID += [("zbv", p, m, 2) for p in range(1, 5) for m in range(1, 10)]
IDS = [f"{s}-p{p}-m{m}" for s, p, m, v in GRID]


def equal_costs(v):
    t = Fraction(1, v)      # a chunk's share of a stage's work
    return {"F": t, "I": t, "W": t, "B": 2 * t}


def place(schedule):
    return "v" if schedule == "zbv" else "loop"


def compute_spans(events, p, placement):
    return {(a.op, a.stage, a.microbatch): (e["start"], e["end"]) for e in events
            if e["stream"] == "compute" for a in [parse_action(e["name"], p, placement)]}


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_every_op_runs_once_on_its_stage_rank(schedule, p, m, v):
    seen = Counter()
    for rank, actions in enumerate(build_schedule(schedule, p, m, v)):
        for a in actions:
            assert stage_rank(a.stage, p, place(schedule)) == (rank, a.chunk), a
            assert global_stage(rank, a.chunk, p, place(schedule)) == a.stage
            if a.op in "FBIW":
                seen[a.op, a.stage, a.microbatch] += 1
    expected = {(op, s, i) for op in "FIW" for s in range(p * v) for i in range(m)}
    assert set(seen) == expected and set(seen.values()) == {1}   # no B: backward is split


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
@pytest.mark.parametrize("hop", [0, Fraction(1, 4)])
def test_dependencies_hold_in_simulation(schedule, p, m, v, hop):
    acts = build_schedule(schedule, p, m, v)
    events = simulate(acts, comm_cost=hop, costs=equal_costs(v))   # raises on deadlock
    spans, last = compute_spans(events, p, place(schedule)), p * v - 1
    rank = {s: stage_rank(s, p, place(schedule))[0] for s in range(p * v)}
    for s in range(p * v):
        for i in range(m):
            f, b, w = spans["F", s, i], spans["I", s, i], spans["W", s, i]
            assert f[1] <= b[0] and b[1] <= w[0]                  # F before I, W after I
            if s > 0:   # forward after upstream's forward, plus a transfer if on another rank
                assert f[0] >= spans["F", s - 1, i][1] + (hop if rank[s - 1] != rank[s] else 0)
            if s < last:   # I after downstream's I; upstream's I waits for no W
                assert b[0] >= spans["I", s + 1, i][1] + (hop if rank[s + 1] != rank[s] else 0)
    for r in range(p):
        mine = sorted((e["start"], e["end"]) for e in events
                      if e["rank"] == r and e["stream"] == "compute")
        assert all(x[1] <= y[0] for x, y in zip(mine, mine[1:]))


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_messages_pair_up_and_v_turns_locally(schedule, p, m, v):
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, actions in enumerate(build_schedule(schedule, p, m, v)):
        for a in actions:
            if a.op.startswith("SEND"):
                sends[r, a.peer].append((a.op[-1], a.microbatch, a.stage))
            elif a.op.startswith("RECV"):
                frm = a.stage + (-1 if a.op == "RECV_F" else 1)
                recvs[a.peer, r].append((a.op[-1], a.microbatch, frm))
            assert a.peer != r, a                   # never a message to oneself
    assert sends == recvs
    hops = sum(stage_rank(s, p, place(schedule))[0] != stage_rank(s + 1, p, place(schedule))[0]
               for s in range(p * v - 1))          # V: stages p-1 and p share a rank
    assert hops == (0 if p == 1 else p * v - 1 - (schedule == "zbv"))
    assert sum(map(len, sends.values())) == 2 * m * hops


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [4, 5, 8, 9])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    if m < p:
        pytest.skip("the figure needs a full pipe, m >= p")
    events = simulate(build_schedule("zb-h1", p, m), costs=equal_costs(1))
    total = max(e["end"] for e in events)
    for r in range(p):
        busy = sum(e["end"] - e["start"] for e in events
                   if e["rank"] == r and e["stream"] == "compute")
        assert busy == 3 * m and total - busy == p - 1       # (p-1)(T_F + T_B - T_W)
    one_f = simulate(build_schedule("1f1b", p, m), 1, 2)       # fused B = I + W
    assert max(e["end"] for e in one_f) - 3 * m == 3 * (p - 1)
    assert ideal_bubble("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [7, 8, 12])
def test_zbv_has_zero_bubble_between_first_and_last_op(p, m):
    assert m >= 2 * p - 1
    events = simulate(build_schedule("zbv", p, m, 2), costs=equal_costs(2))
    t = Fraction(1, 2)
    for r in range(p):
        mine = [e for e in events if e["rank"] == r and e["stream"] == "compute"]
        first, last = min(e["start"] for e in mine), max(e["end"] for e in mine)
        assert last - first == sum(e["end"] - e["start"] for e in mine) == 6 * m * t
        assert first == r * t                      # the V's skew: r chunk-forwards late
    assert ideal_bubble("zbv", p, m, 2) == pytest.approx((p - 1) / (6 * m + p - 1))
    if p > 1:   # per rank, in stage-work units: zbv idles (p-1)/2, zb-h1 p-1, 1f1b 3(p-1)
        assert ideal_bubble("zbv", p, m, 2) < ideal_bubble("zb-h1", p, m) < ideal_bubble("1f1b", p, m)


@pytest.mark.parametrize("schedule,p,m,v", GRID, ids=IDS)
def test_in_flight_stays_within_1f1b_memory(schedule, p, m, v):
    for r, actions in enumerate(build_schedule(schedule, p, m, v)):
        if schedule == "zb-h1":   # until I as 1F1B; until W at most 1F1B's first rank's p
            assert in_flight(actions, released_by=("I",)) == min(p - r, m)
            assert in_flight(actions) == min(p, m)
        else:                     # 2p half-size chunks = p micro-batches, 1F1B's peak
            assert in_flight(actions) <= 2 * min(p, m)
            assert in_flight(actions) <= 2 * p


def test_known_orders():
    order = lambda acts: " ".join(str(a) for a in acts if a.op in "FIW")
    h1 = build_schedule("zb-h1", 2, 4)
    assert order(h1[0]) == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3"
    assert order(h1[1]) == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"
    v = build_schedule("zbv", 2, 3, 2)    # rank 0: stages 0 and 3; rank 1: stages 1 and 2
    assert order(v[1]) == "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2"
    assert [str(a) for a in v[1][:4]] == ["1RECV_F0", "1F0", "2F0", "2SEND_F0"]   # local turn
    # Rank 0 sends activation 2 before gradient 0 on the same link: rank 1 takes it first.
    assert [str(a) for a in v[1][8:11]] == ["1RECV_F2", "2RECV_B0", "2I0"]


@pytest.mark.parametrize("args,message", [
    (("zbv", 2, 4, 1), "zbv places exactly two chunks per rank in a V.*set chunks=2"),
    (("zb-h1", 2, 4, 2), "needs schedule='interleaved'; or set chunks=1"),
    (("zb", 2, 4, 1), "choose one of gpipe, 1f1b, interleaved, zb-h1, zbv"),
])
def test_bad_input_names_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        validate(*args)
    with pytest.raises(ValueError, match="unknown placement 'u'"):
        stage_rank(0, 2, "u")


# -- torch's own zero-bubble schedules, read without running them --------------------------------
def torch_orders(schedule: str, p: int, m: int) -> dict[int, list[str]]:
    """{rank: compute actions} of torch's schedule for p ranks, from rank 0's fake group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = 2 * p if schedule == "zbv" else p
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), i, n, torch.device("cpu"))
                  for i in ([0, n - 1] if schedule == "zbv" else [0])]
        kind = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleInterleavedZeroBubble
        order = kind(stages, n_microbatches=m, loss_fn=torch.nn.functional.mse_loss).pipeline_order
        return {r: [str(a) for a in acts if a is not None] for r, acts in order.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule,p,m", [("zb-h1", 2, 4), ("zb-h1", 4, 8), ("zb-h1", 3, 5),
                                          ("zbv", 2, 4), ("zbv", 4, 3), ("zbv", 4, 9)])
def test_compute_order_equals_torchs(schedule, p, m):
    # Same compute order per rank (ZB-H1 = torch's ZB1P with one stage per rank). Where they
    # differ: torch rejects m that is not a multiple of max(1, m // p) rounds (e.g. p=2, m=5)
    # and places sends/receives by its own pass; labkit builds any m >= 1.
    mine = build_schedule(schedule, p, m, 2 if schedule == "zbv" else 1)
    assert torch_orders(schedule, p, m) == {r: [str(a) for a in acts if a.op in "FIW"]
                                            for r, acts in enumerate(mine)}
