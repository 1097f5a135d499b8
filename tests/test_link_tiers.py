"""A two-tier emulated link (labkit.Link(gpus_per_node=..., inter_bandwidth=...)): which tier each
comm event crossed, the bytes each tier carried (run.metrics["bytes_sent_by_tier"]) against the
collectives' formulas, where it shows (timeline hatching, node names on lanes and the grid),
and an all-to-all priced by its busiest member.

The pure layer builds events by hand; the engine tests run on 4 engines (2 nodes of 2). The
only time asserted is a lower bound the link guarantees (a call never ends before its link
allows), as in tests/test_link.py.
"""
from __future__ import annotations

import sys

import cloudpickle
import matplotlib.pyplot as plt
import pytest

import labkit
from labkit.analysis.metrics import step_metrics
from labkit.analysis.table import EventTable
from labkit.analysis.timeline import Timeline
from labkit.comm import collectives
from labkit.comm.emulate import LinkClock
from labkit.link import Link
from labkit.view.grid import ParallelDims, draw_grid
from labkit.view.timeline import INTER_LABEL, plot_timeline

cloudpickle.register_pickle_by_value(sys.modules[__name__])     # engines cannot import this file
TWO_NODES = Link(bandwidth=400e6, gpus_per_node=2, inter_bandwidth=20e6)


def _comm(rank, nbytes, tier, start=0.0, end=1e-3, group="0,1,2,3"):
    return {"rank": rank, "stream": "comm", "kind": "allreduce", "name": "g", "step": 0, "microbatch": None,
            "start": start, "end": end, "bytes": nbytes, "peer": None, "group": group, "tier": tier}


# -- the pure layer -----------------------------------------------------------------------------
def test_tier_of_a_group_is_where_its_ranks_sit():
    assert TWO_NODES.tier([0, 1]) == "intra" and TWO_NODES.tier([2, 3]) == "intra"
    assert TWO_NODES.tier([0, 2]) == "inter" and TWO_NODES.tier([0, 1, 2, 3]) == "inter"
    assert Link(bandwidth=1e9).tier([0, 7]) == "intra"              # one node: everything inside


def test_bytes_by_tier_add_up_per_rank_and_appear_only_with_tiers():
    events = [_comm(0, 100, "intra", group="0,1"), _comm(1, 100, "intra", group="0,1"),
              _comm(0, 300, "inter"), _comm(1, 300, "inter"), _comm(2, 700, "inter")]
    m = step_metrics(events, world_size=3, global_batch=1)
    assert m["bytes_sent_by_tier"] == {"intra": [100, 100, 0], "inter": [300, 300, 700]}
    assert [a + b for a, b in zip(*m["bytes_sent_by_tier"].values())] == m["bytes_sent"]
    untiered = [{k: v for k, v in e.items() if k != "tier"} for e in events]
    assert "bytes_sent_by_tier" not in step_metrics(untiered, world_size=3, global_batch=1)


def test_tier_survives_the_table_and_a_saved_trace(tmp_path):
    events = [_comm(0, 10, "inter"), _comm(1, 10, "intra", group="0,1")]
    assert [e["tier"] for e in EventTable.from_dicts(events).to_dicts()] == ["inter", "intra"]
    path = tmp_path / "t.json"
    Timeline(events, world_size=2).save_trace(path)
    assert sorted(e["tier"] for e in Timeline.load(path).events) == ["inter", "intra"]


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_the_timeline_hatches_comm_between_nodes_and_names_each_lanes_node():
    tl = Timeline([_comm(r, 10, "inter") for r in range(4)], world_size=4)
    tl.gpus_per_node = 2
    fig = plot_timeline(tl)
    assert INTER_LABEL in _legend_labels(fig)
    assert any(p.get_hatch() == "xx" for p in fig.axes[0].patches)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "rank 3 node 1 comm" in ticks and "rank 0 node 0 compute" in ticks
    plt.close(fig)
    inside = plot_timeline(Timeline([_comm(r, 10, "intra", group="0,1") for r in range(2)], world_size=2))
    assert INTER_LABEL not in _legend_labels(inside)                 # nothing crossed: no entry
    assert "node" not in " ".join(t.get_text() for t in inside.axes[0].get_yticklabels())
    plt.close(inside)


def test_the_grid_names_each_ranks_node():
    fig = draw_grid(labkit.Strategy(dp=2, tp=2), gpus_per_node=2)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum("node 0" in t for t in texts) == 2 and sum("node 1" in t for t in texts) == 2
    assert "node" not in " ".join(t.get_text() for t in draw_grid(ParallelDims(dp=2, tp=2)).axes[0].texts)
    plt.close("all")


def test_the_labs_grid_places_tp_across_nodes_when_the_order_says_so():
    from types import SimpleNamespace

    lab = SimpleNamespace(world_size=4, link=TWO_NODES)
    inside = labkit.Lab.grid(lab, labkit.Strategy(dp=2, tp=2))
    across = labkit.Lab.grid(lab, labkit.Strategy(dp=2, tp=2, order="dp,tp,cp,pp"))

    def nodes_of_tp0(fig):          # the node of each box whose coordinates say tp 0 of replica 0
        return {t.get_text().split("\n")[1] for t in fig.axes[0].texts if t.get_text().endswith("dp 0, pp 0, tp 0")
                or t.get_text().endswith("dp 0, pp 0, tp 1")}
    assert nodes_of_tp0(inside) == {"node 0"}
    assert nodes_of_tp0(across) == {"node 0", "node 1"}
    with pytest.raises(ValueError, match="needs 8 ranks"):
        labkit.Lab.grid(lab, labkit.Strategy(dp=4, tp=2))
    plt.close("all")


def test_an_all_to_all_is_priced_by_its_busiest_member():
    clock = LinkClock(Link(bandwidth=10e6, latency=1e-3), 0)
    # balanced: the busiest sends (n-1)/n of its buffer, as Link.seconds prices it
    assert clock.exchange_seconds(3e6, 4, "intra") == pytest.approx(Link(bandwidth=10e6, latency=1e-3)
                                                                   .seconds("all_to_all", 4e6, 4))
    # every rank's 1 MB to rank 0: rank 0 takes in 3 MB
    assert clock.exchange_seconds(3e6, 4, "intra") == pytest.approx(3e-3 + 0.3)


def test_a_ring_across_nodes_runs_on_every_link_its_nodes_ranks_have():
    """Each rank has its own link between nodes (a NIC per GPU) and NCCL a ring per NIC: a ring
    collective of 2 ranks a node carries half its bytes on each of the two, bounded by the links
    inside a node; one rank a node, an all-to-all or a send has one link's worth."""
    from labkit.analysis.whatif import _link_seconds

    link, S = Link(bandwidth=100e6, latency=1e-4, gpus_per_node=2, inter_bandwidth=20e6), 1e6
    assert [link.nics(r) for r in ([0, 1, 2, 3], [0, 2], [0, 1], [0, 1, 2])] == [2, 1, 1, 1]
    two = link.seconds("all_reduce", S, 4, "inter", nics=2)
    assert two == pytest.approx(6e-4 + 1.5 * (S / 2) / 20e6)          # 2(n-1)α + 2(n-1)/n·(S/2)/β
    assert two < link.seconds("all_reduce", S, 4, "inter")
    assert link.seconds("all_to_all", S, 4, "inter", nics=2) == link.seconds("all_to_all", S, 4, "inter")
    fast = Link(bandwidth=10e6, gpus_per_node=2, inter_bandwidth=20e6)  # the links inside are the bound
    assert fast.seconds("all_gather", S, 4, "inter", nics=2) == pytest.approx(fast.seconds("all_gather", S, 4, "intra"))
    # the engine's clock prices the call so, and the replay cuts a measured call by the same time
    assert LinkClock(link, 0).collective("all_reduce", S, [0, 1, 2, 3], 0.0)[2] == pytest.approx(two)
    assert _link_seconds(link, "allreduce", 1.5 * S, [0, 1, 2, 3]) == pytest.approx(two)
    assert _link_seconds(link, "allreduce", 1.0 * S, [0, 2]) == pytest.approx(2e-4 + S / 20e6)


def test_messages_arriving_at_once_share_the_receivers_side_and_only_they_do():
    second = 10_000 / 1e6                                            # 10 kB at 1 MB/s
    clock = LinkClock(Link(bandwidth=1e6), 0)
    assert [clock.arrive(r, 10_000, 0.0) for r in (1, 2, 3)] == pytest.approx([second, 2 * second, 3 * second])
    # waited for in another order than they left: the early one still ends at its own time
    clock = LinkClock(Link(bandwidth=1e6), 0)
    assert clock.arrive(1, 10_000, 5.0) == pytest.approx(5.0 + second)
    assert clock.arrive(2, 10_000, 0.0) == pytest.approx(second)
    # a gap too short for a message: it goes after the stretch that follows
    assert clock.arrive(3, 10_000, 5.0 + 0.5 * second) == pytest.approx(5.0 + 2 * second)
    # messages between nodes and inside one take different links
    two = LinkClock(TWO_NODES, 0)
    assert two.arrive(1, 4_000, 0.0) == pytest.approx(4_000 / 400e6)
    assert two.arrive(2, 4_000, 0.0) == pytest.approx(4_000 / 20e6)


# -- on engines: 2 nodes of 2 -------------------------------------------------------------------
@pytest.fixture
def two_nodes(lab4):
    lab4.link = TWO_NODES
    yield lab4
    lab4.link = None


def _tiers(run) -> dict:
    return run.metrics["bytes_sent_by_tier"]


def test_bytes_by_tier_follow_the_ring_formula(two_nodes):
    model = labkit.models.mlp(width=64, depth=4)
    # dp=4 spans both nodes: every gradient byte crosses, 2(n-1)/n·S per rank (S per bucket,
    # rounded to a byte each)
    run = two_nodes.run(labkit.Strategy(dp=4, dp_mode="ddp", bucket_mb=0.02), model=model, batch=16, steps=2)
    S, buckets = run.parameter_bytes[0], sum(1 for e in run.timeline.events if e["kind"] == "allreduce"
                                             and e["rank"] == 0) / len(run.timeline.steps)
    assert _tiers(run)["intra"] == [0] * 4
    for sent in _tiers(run)["inter"]:
        assert abs(sent - 2 * 3 / 4 * S) <= buckets
    assert {e["tier"] for e in run.timeline.events if e["stream"] == "comm"} == {"inter"}
    assert run.timeline.gpus_per_node == 2
    # tp=2 inside each node (ranks 0,1 and 2,3), dp=2 across: the dp all-reduce (n=2: S of each
    # rank's shard) is all the inter-node traffic, the tp all-reduces stay inside
    plan = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
    run = two_nodes.run(labkit.Strategy(dp=2, tp=2, dp_mode="ddp", bucket_mb=0.02), model=model, batch=16, steps=2,
                        tp_plan=plan)
    for rank, (intra, inter) in enumerate(zip(*_tiers(run).values())):
        assert inter == run.parameter_bytes[rank]
        tp_bytes = sum(e["bytes"] for e in run.timeline.events if e["rank"] == rank and e.get("group") in ("0,1", "2,3")
                       and e["kind"] == "allreduce") / len(run.timeline.steps)
        assert intra == tp_bytes > 0


def _ring_by_tier(numel: int) -> dict:
    """labkit's ring over the whole world (crossing nodes) and inside each node."""
    import torch
    import torch.distributed as dist

    from labkit import comm
    from labkit.comm import collectives
    from labkit.engine import session

    rec = session().recorder
    node = dist.new_group([0, 1]), dist.new_group([2, 3])
    rec.enabled = True
    rec.start_step(0)
    collectives.ring_all_reduce(torch.ones(numel))
    collectives.ring_all_reduce(torch.ones(numel), group=node[comm.rank() // 2], name="node ring")
    events = rec.drain()
    rec.enabled = False
    for g in node:
        dist.destroy_process_group(g)
    return {tier: sum(e["bytes"] for e in events if e["kind"] == "send" and e.get("tier") == tier)
            for tier in ("intra", "inter")}


def test_a_ring_counts_each_message_on_the_tier_it_crosses(two_nodes):
    numel, S = 40_000, 160_000
    for rank, sent in enumerate(two_nodes.apply(_ring_by_tier, numel)):
        # the world ring: a rank sends 2(n-1)/n·S, all to its right neighbour, so on the tier of
        # that hop (0→1 and 2→3 inside a node, 1→2 and 3→0 between); the node's ring: 2(2-1)/2·S
        world = 2 * 3 * S // 4
        crosses = TWO_NODES.tier([rank, (rank + 1) % 4]) == "inter"
        assert sent == {"intra": S + (0 if crosses else world), "inter": world if crosses else 0}
        assert crosses == (rank in (1, 3))


def test_an_all_to_all_into_one_rank_lasts_its_inbound_bytes_on_every_rank(lab4):
    link = Link(bandwidth=20e6)
    lab4.link = link
    try:
        took = [r["seconds"] for r in lab4.apply(collectives.incast_demo, 250_000)]   # 1 MB each to rank 0
    finally:
        lab4.link = None
    # rank 0 takes in 3 MB: 150 ms on its link; a sender's own 1 MB alone would be 50 ms
    assert min(took) >= 3 * 1e6 / link.bandwidth
