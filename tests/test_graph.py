"""The step as a graph: the critical path, what bounds a step, straggler scores, and the what-if
replay — on steps the planner's simulator makes (known exactly), on a synthetic 8-GPU profiler
trace, and on runs of real engines.

    python -m pytest tests/test_graph.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import labkit
from labkit.analysis.graph import StepGraph
from labkit.parallel.pipeline.schedules import build_schedule
from labkit.analysis.des import Compute, Issue, Sim, Wait
from labkit.analysis.whatif import _link_seconds, replay_step

DATA = os.path.join(os.path.dirname(__file__), "data")
MB = 1 << 20


# -- steps made by the simulator: every edge known -------------------------------------------------
def dp_programs(slow_rank=2, slow=3.0, link=None, n=4, compute=1.0):
    """dp=n: a forward, a backward in two halves with a bucket issued after each (the first goes
    out while the second half computes), both waited for before the optimizer."""
    programs = []
    for r in range(n):
        f = (slow if r == slow_rank else 1.0) * compute
        group = tuple(range(n))
        def bucket(k):
            nbytes = int(2 * (n - 1) / n * MB)
            return Issue(("bucket", k), group, 0.0, "allreduce", f"bucket {k}", nbytes,
                         link=_link_seconds(link, "allreduce", nbytes, group))
        programs.append([Compute(0.004 * f, "fwd", "forward"), Compute(0.004 * f, "bwd", "block 1"), bucket(0),
                         Compute(0.004 * f, "bwd", "block 0"), bucket(1), Wait(("bucket", 0)), Wait(("bucket", 1)),
                         Compute(0.001 * compute, "optimizer", "step")])
    return programs


def run_sim(programs, links=True):
    return Sim(programs, cores=float(len(programs)), links=links).run()


def test_a_straggler_holds_the_path_and_the_path_covers_the_step():
    link = labkit.Link(bandwidth=500e6, latency=1e-4)
    tl = labkit.Timeline(run_sim(dp_programs(link=link)))
    path = tl.critical_path()
    compute = [e for e in path.events if e["stream"] == "compute" and e["kind"] != "untraced"]
    share = sum(e["end"] - e["start"] for e in compute if e["rank"] == 2) / sum(e["end"] - e["start"] for e in compute)
    assert share >= 0.6
    step = tl.step_durations()[0]
    assert path.events[0]["start"] == pytest.approx(0.0, abs=1e-9)
    assert path.events[-1]["end"] == pytest.approx(step)
    covered = sum(e["end"] - e["start"] for e in path.events)
    assert covered == pytest.approx(step, rel=1e-6)          # a chain, no overlaps, no holes
    assert str(tl.bound_by()).startswith("rank 2's compute")
    scores = tl.straggler_scores()
    assert scores.worst().rank == 2 and scores[2].bounds == 1.0 and scores[2].slowdown > 2.5
    assert all(s.score == pytest.approx(1.0) for s in scores if s.rank != 2)


def test_without_the_straggler_the_link_bounds_the_step():
    slow_link = labkit.Link(bandwidth=20e6, latency=1e-4)
    tl = labkit.Timeline(run_sim(dp_programs(slow=1.0, link=slow_link)))
    verdict = tl.bound_by()
    assert verdict.parts[0][0] == "the allreduces of ranks 0–3" and verdict.rank is not None
    assert sum(share for _, _, share in verdict.parts) == pytest.approx(1.0)


def gpipe_programs(slow_stage=1, m=4, p=2):
    """GPipe over p stages, stage ``slow_stage`` computing 4× slower; messages as the planner's."""
    programs = []
    for r, actions in enumerate(build_schedule("gpipe", p, m, 1)):
        f = 4.0 if r == slow_stage else 1.0
        prog = []
        for a in actions:
            if a.op in ("F", "B"):
                prog.append(Compute((0.002 if a.op == "F" else 0.004) * f, "fwd" if a.op == "F" else "bwd",
                                    str(a), a.microbatch))
            elif a.op.startswith("SEND"):
                prog.append(Issue((a.op[-1], a.stage, a.microbatch), (r, a.peer), 0.0005, "send", str(a), 1000,
                                  peer=a.peer, microbatch=a.microbatch, ordered=False))
            else:
                key = (a.op[-1], a.stage - 1 if a.op.endswith("F") else a.stage + 1, a.microbatch)
                prog += [Issue(key, (a.peer, r), 0.0005, "recv", str(a), 0, peer=a.peer, microbatch=a.microbatch,
                               ordered=False), Wait(key)]
        programs.append(prog)
    return programs


def test_a_slow_pipeline_stage_is_on_the_path_for_every_microbatch():
    tl = labkit.Timeline(run_sim(gpipe_programs(), links=False))
    path = tl.critical_path()
    on_path = {(e["kind"], e["microbatch"]) for e in path.events if e["rank"] == 1}
    assert {("fwd", k) for k in range(4)} <= on_path
    assert {("bwd", k) for k in range(4)} <= on_path
    assert not any(e["kind"] == "wait" for e in path.events)      # waiting is never what bounds a step
    assert str(tl.bound_by()).startswith("rank 1's compute")


def test_replaying_a_step_unchanged_gives_it_back_and_a_new_link_gives_the_run_on_that_link():
    old, new = labkit.Link(bandwidth=50e6, latency=2e-4), labkit.Link(bandwidth=200e6, latency=1e-4)
    measured = run_sim(dp_programs(link=old))
    same = replay_step(measured, 4, old, old)
    assert max(e["end"] for e in same) == pytest.approx(max(e["end"] for e in measured), rel=1e-9)
    faster = replay_step(measured, 4, old, new)
    truth = run_sim(dp_programs(link=new))
    assert max(e["end"] for e in faster) == pytest.approx(max(e["end"] for e in truth), rel=1e-9)
    healed = replay_step(measured, 4, old, old, straggler=2)
    assert max(e["end"] for e in healed) == pytest.approx(max(e["end"] for e in run_sim(dp_programs(slow=1.0, link=old))),
                                                         rel=1e-9)
    quick = replay_step(measured, 4, old, old, compute=0.1)
    assert max(e["end"] for e in quick) == pytest.approx(
        max(e["end"] for e in run_sim(dp_programs(link=old, compute=0.1))), rel=1e-9)


def test_on_the_link_gloo_and_the_link_queue_apart_and_each_member_notes_its_call_itself():
    """Two calls of one group back to back: a (gloo 1 s, link 3 s), b (gloo 3 s, link 1 s). With
    gloo_queue b's gloo work starts once gloo is through a, under a's link time (ends 1 + 3),
    without it once a's link is through too (3 + 3); a member's own tail delays that member alone."""
    def program(tail):
        return [Issue("a", (0, 1), 1.0, "allreduce", "a", link=3.0, tail=tail), Issue("b", (0, 1), 3.0, "allreduce",
                "b", link=1.0), Wait("a"), Wait("b")]
    ends = {q: {(e["rank"], e["name"]): e["end"] for e in Sim([program(0.0), program(0.5)], cores=2, links=True,
                                                             gloo_queue=q).run()} for q in (True, False)}
    assert ends[True][(0, "b")] == pytest.approx(4.0) and ends[False][(0, "b")] == pytest.approx(6.0)
    assert ends[True][(0, "a")] == pytest.approx(3.0) and ends[True][(1, "a")] == pytest.approx(3.5)
    # a call priced below zero (a recorder's rounding) ends at once instead of never
    assert Sim([[Issue("c", (0,), -1e-9, "allreduce", "c"), Wait("c")]], links=True, gloo_queue=True).run()

def test_a_prediction_has_a_critical_path_too():
    tl = labkit.Timeline(run_sim(dp_programs(link=labkit.Link(bandwidth=100e6))))
    assert all("group" in e for e in tl.events if e["kind"] == "allreduce")
    assert all("waited" in e for e in tl.events if e["kind"] == "allreduce")
    assert len(tl.critical_path()) > 0



# -- one replay core: the pipeline schedules' model runs on it ----------------------------------------
def test_an_eager_message_leaves_on_its_senders_post_and_fractions_stay_exact():
    from fractions import Fraction

    third = Fraction(1, 3)
    message = Issue("m", (0, 1), third, "send", "m", peer=1, ordered=False, link=0, eager=True)
    receive = Issue("m", (0, 1), third, "recv", "m", peer=0, ordered=False, link=0, eager=True)
    late = Sim([[message, Compute(third, "fwd")], [Compute(2 * third, "fwd"), receive, Wait("m")]], cores=2).run()
    recv = next(e for e in late if e["kind"] == "recv")
    assert (recv["start"], recv["end"]) == (2 * third, 2 * third)      # there already: taken at once
    assert all(isinstance(e["end"], Fraction) for e in late)
    early = Sim([[Compute(third, "fwd"), message], [receive, Wait("m")]], cores=2).run()
    assert [(e["kind"], e["start"], e["end"]) for e in early if e["rank"] == 1] == [
        ("wait", 0, third), ("recv", third, 2 * third)]


def test_the_schedule_model_is_a_replay_on_the_planners_core(monkeypatch):
    from labkit.parallel.pipeline.simulate import simulate
    from labkit.analysis import des

    runs = []
    original = des.Sim.run
    monkeypatch.setattr(des.Sim, "run", lambda self: runs.append(len(self.programs)) or original(self))
    events = simulate(build_schedule("1f1b", 3, 4), 1, 2, 0.5)
    assert runs == [3]
    assert max(e["end"] for e in events) == 22       # what the model's own loop drew before it ran on the core
    stuck = [[Issue("x", (1, 0), 1, "recv", "x", ordered=False, eager=True), Wait("x")], []]
    with pytest.raises(des.Deadlock) as err:
        Sim(stuck).run()
    assert err.value.stuck == {0: 1}


def test_a_rebuild_is_refused_where_it_does_not_reach():
    from types import SimpleNamespace

    for strategy in (labkit.Strategy(pp=2), labkit.Strategy(dp=2, zero=1), labkit.Strategy(dp=2, dp_mode="naive")):
        run = SimpleNamespace(strategy=strategy, params={}, timeline=labkit.Timeline([]), link=None)
        with pytest.raises(ValueError, match="plain data parallelism"):
            labkit.analysis.whatif.whatif(run, bucket_mb=1)
    run = SimpleNamespace(strategy=labkit.Strategy(dp=2), params={}, timeline=labkit.Timeline([]), link=None)
    with pytest.raises(ValueError, match="kept no parameters"):
        labkit.analysis.whatif.whatif(run, bucket_mb=1)
    with pytest.raises(ValueError, match="MiB"):
        labkit.analysis.whatif.whatif(run, bucket_mb=0)


# -- bad input -----------------------------------------------------------------------------------
def ev(rank, kind, start, end, stream=None, **extra):
    from labkit.analysis.events import make_event
    return {**make_event(rank, kind, kind, 0, start, end, stream=stream), **extra}


def test_no_comm_or_one_rank_gives_an_honest_single_rank_path():
    tl = labkit.Timeline([ev(0, "fwd", 0.0, 1.0), ev(0, "bwd", 1.2, 3.0), ev(1, "fwd", 0.0, 2.0)])
    path = tl.critical_path()
    assert [(e["rank"], e["kind"]) for e in path.events] == [(0, "fwd"), (0, "untraced"), (0, "bwd")]
    assert "rank 0's compute" in str(tl.bound_by())


def test_a_step_that_does_not_exist_or_collectives_without_their_ranks_are_refused():
    tl = labkit.Timeline([ev(0, "fwd", 0.0, 1.0), ev(0, "allreduce", 1.0, 2.0), ev(1, "fwd", 0.0, 1.5),
                          ev(1, "allreduce", 1.5, 2.0)])
    with pytest.raises(ValueError, match=r"holds steps \[0\]"):
        tl.critical_path(step=3)
    with pytest.raises(ValueError, match="groups='world'"):
        tl.critical_path()
    path = tl.critical_path(groups="world")           # the caller says every collective spans all
    assert [(e["rank"], e["kind"]) for e in path.events] == [(1, "fwd"), (0, "allreduce")]
    assert [e["kind"] for e in tl.critical_path(rank=0).events] == ["fwd", "allreduce"]
    with pytest.raises(ValueError, match="no events"):
        labkit.Timeline([]).critical_path()


def test_many_ranks_each_collective_waits_for_its_slowest_member():
    rng = np.random.default_rng(0)
    world, everyone, events = 256, ",".join(map(str, range(256))), []
    for r in range(world):
        t = 0.0
        for k in range(50):
            d = 1e-3 * (1 + 0.1 * rng.random() + (0.5 if r == 77 and k % 2 else 0))
            events += [ev(r, "fwd", t, t + d, microbatch=k), ev(r, "allreduce", t + d, t + d, "comm", group=everyone)]
            t += d
    path = StepGraph(events).critical_path()
    assert {e["rank"] for e in path if e["kind"] == "fwd" and e["microbatch"] % 2} == {77}


# -- a profiler trace --------------------------------------------------------------------------------
def test_a_gpu_profiler_trace_names_its_throttled_rank():
    paths = sorted(os.path.join(DATA, "kineto_gpu", f) for f in os.listdir(os.path.join(DATA, "kineto_gpu")))
    tl = labkit.Timeline.from_profiler(paths)
    assert all(e.get("group") == "0,1,2,3,4,5,6,7" for e in tl.events if e["stream"] == "comm")
    assert str(tl.bound_by()).startswith("rank 5's compute")
    assert tl.straggler_scores().worst().rank == 5


# -- real engines ------------------------------------------------------------------------------------
def test_a_run_records_what_the_graph_needs_and_replays_itself(lab2):
    from labkit.models import mlp

    run = lab2.run(labkit.Strategy(dp=2, dp_mode="overlap", bucket_mb=0.05), model=mlp(width=64, depth=4),
                   batch=16, steps=3)
    comm = [e for e in run.timeline.events if e["kind"] == "allreduce"]
    assert comm and all(e["group"] == "0,1" and "waited" in e for e in comm)
    step = run.timeline.steps[-1]
    path = run.timeline.critical_path(step)
    duration = run.timeline.step_durations()[step]
    assert path.events[-1]["end"] == pytest.approx(duration)
    assert sum(e["end"] - e["start"] for e in path.events) == pytest.approx(duration, rel=0.15)
    same = run.whatif()
    assert same.step_time_s == pytest.approx(same.measured_step_s, rel=0.05)
    with pytest.raises(TypeError, match="labkit.plan.simulate"):
        run.whatif(microbatches=2)
    rebuilt = run.whatif(bucket_mb=run.strategy.bucket_mb)    # the run's own buckets, rebuilt: the replay
    assert rebuilt.step_time_s == pytest.approx(same.step_time_s, rel=1e-6)
    from labkit.parallel.data import fill_buckets
    sizes = [(k, t.numel() * 4) for k, t in run.params.items()]
    small = run.whatif(bucket_mb=0.01)
    last = small.timeline.step(step).events
    assert len([e for e in last if e["rank"] == 0 and e["kind"] == "allreduce"]) == \
        len(fill_buckets(sizes, lambda p: p[1], 0.01 * MB)) > len(comm) // (2 * len(run.timeline.steps))
    assert "rebuilt" in small.what
    fig = run.timeline.plot(critical_path=True)
    assert "critical path" in fig.axes[0].get_title()
