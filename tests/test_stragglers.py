"""Stragglers: the rank the others wait for, and why; synthetic events, then one planted on engines."""
import pytest

import labkit
from labkit import Timeline


def ev(rank, stream, kind, start, end, peer=None):
    return {"rank": rank, "stream": stream, "kind": kind, "name": kind, "step": 0, "microbatch": None,
            "start": start, "end": end, "bytes": 0, "peer": peer}


def dp_step(world=4, compute=None, wait=None):
    """Every rank: forward 0–1 ms, backward, then an all-reduce that ends for all at once at
    8 ms (synchronous: the step time is the same on every rank). compute: {rank: extra ms of
    backward}; wait: {rank: (ms, peer)} waited on a peer before the forward."""
    events = []
    for r in range(world):
        t = 0.0
        if wait and r in wait:
            ms, peer = wait[r]
            events.append(ev(r, "comm", "wait", 0.0, ms * 1e-3, peer))
            t = ms * 1e-3
        extra = (compute or {}).get(r, 0.0) * 1e-3
        events += [ev(r, "compute", "fwd", t, t + 0.001), ev(r, "compute", "bwd", t + 0.001, t + 0.003 + extra),
                   ev(r, "comm", "allreduce", t + 0.003 + extra, 0.008)]
    return events


def test_the_slow_rank_is_named_though_every_step_time_is_equal():
    tl = Timeline(dp_step(compute={2: 2.0}))
    ends = {r: max(e["end"] for e in tl.events if e["rank"] == r) for r in tl.ranks}
    assert len(set(ends.values())) == 1                       # the all-reduce equalised the ranks
    found = tl.stragglers()
    assert found.ranks() == [2]
    assert found[0].late_s == pytest.approx(0.002)            # entered 2 ms after the median
    assert found[0].cause == "compute"
    assert found[0].excess_s["compute"] == pytest.approx(0.002)
    assert "rank 2" in repr(found) and "compute" in repr(found)
    ax = found.plot().axes[0]
    assert [round(p.get_height(), 6) for p in ax.patches] == [0.0, 0.0, 2.0, 0.0]     # ms late, by rank
    assert [t.get_text() for t in ax.texts] == ["rank 2: compute"]


def test_waiting_on_a_peer_names_the_peer():
    found = Timeline(dp_step(wait={1: (1.5, 3)})).stragglers()
    assert found.ranks() == [1] and found[0].cause == "waiting on rank 3"


def test_a_slow_earlier_collective_is_a_late_collective():
    events = []
    for r in range(4):
        first_end = 0.004 if r == 3 else 0.001                # rank 3's first broadcast is slow
        events += [ev(r, "comm", "broadcast", 0.0, first_end), ev(r, "compute", "fwd", first_end, first_end + 0.001),
                   ev(r, "comm", "allreduce", first_end + 0.001, 0.007)]
    found = Timeline(events).stragglers()
    assert found.ranks() == [3] and found[0].cause == "a late collective"


def test_a_balanced_run_has_no_straggler_and_dp_groups_are_compared_apart():
    assert Timeline(dp_step()).stragglers() == []
    assert "no straggler" in repr(Timeline(dp_step()).stragglers())
    # dp=2 × pp=2: rank 3 (stage 1) is slow; its dp peer is rank 1, not the stage-0 ranks
    tl = Timeline(dp_step(compute={3: 2.0}), grid=labkit.Strategy(dp=2, pp=2))
    found = tl.stragglers()
    assert found.ranks() == [3] and found[0].coords == {"dp": 1, "pp": 1, "tp": 0}


def test_without_collectives_the_rank_computing_longest_is_named():
    events = [e for e in dp_step(compute={0: 3.0}) if e["kind"] != "allreduce"]
    assert Timeline(events).stragglers().ranks() == [0]


def test_a_planted_slow_rank_on_four_engines_is_named(lab4):
    """Rank 2 sleeps in every Linear's forward (torch's global forward hook: no labkit code
    patched); the others wait for it in the gradient all-reduce."""

    def plant(rank, seconds):
        import builtins
        import time

        import torch

        from labkit import engine

        def slow(module, args, output):
            if isinstance(module, torch.nn.Linear) and engine.session().rank == rank:
                time.sleep(seconds)

        builtins._planted_slow_rank = torch.nn.modules.module.register_module_forward_hook(slow)

    def unplant():
        import builtins

        handle = getattr(builtins, "_planted_slow_rank", None)
        if handle is not None:
            handle.remove()
            del builtins._planted_slow_rank

    lab4.apply(plant, 2, 0.004)
    try:
        run = lab4.run(labkit.Strategy(dp=4), model=labkit.models.mlp(width=16, depth=2), batch=8, steps=3)
    finally:
        lab4.apply(unplant)
    found = run.timeline.stragglers()
    assert found.ranks()[:1] == [2], repr(found)
    assert found[0].cause == "compute", repr(found)
    assert found[0].coords == {"dp": 2, "pp": 0, "tp": 0}


def test_a_rank_that_only_waited_comes_after_the_rank_it_waited_on():
    """Pipeline partners: rank 1 waited on rank 0 and entered its collective later still;
    the report names rank 0 first, its waiter right after it, then the others."""
    from labkit.analysis.stragglers import Straggler, _roots_first

    parts = lambda c, w: {"compute": c, "wait": w, "comm": 0.0, "other": 0.0}  # noqa: E731
    waiter = Straggler(1, {}, 0.040, parts(0.0, 0.039), peer=0)
    slow = Straggler(0, {}, 0.035, parts(0.034, 0.0))
    other = Straggler(6, {}, 0.020, parts(0.019, 0.0))
    assert waiter.cause == "waiting on rank 0" and slow.cause == "compute"
    assert [s.rank for s in _roots_first([waiter, slow, other])] == [0, 1, 6]
    assert [s.rank for s in _roots_first([other, waiter])] == [1, 6]      # its peer not named: by lateness
