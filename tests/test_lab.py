"""The Lab itself: ranks from the environment, apply, errors that name the rank, close, CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

import labkit


def test_ranks_come_from_the_environment(lab2):
    infos = lab2.apply(lambda: __import__("os").environ["RANK"])
    assert infos == ["0", "1"]
    assert [r["rank"] for r in lab2.ranks] == [0, 1]
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in lab2.ranks)
    assert "rank 1" in repr(lab2) and "<table>" in lab2._repr_html_()


def test_apply_runs_user_code_with_groups_ready(lab2):
    def total():
        import torch
        import labkit
        t = torch.ones(3) * (labkit.engine.session().rank + 1)
        labkit.comm.all_reduce(t, name="by hand")
        return t.tolist()

    assert lab2.apply(total) == [[3.0] * 3, [3.0] * 3]


def test_failure_names_the_rank_and_carries_its_traceback(lab2):
    def fail_on_one():
        import labkit
        if labkit.engine.session().rank == 1:
            raise ValueError("bad input on this rank")
        return "fine"

    with pytest.raises(labkit.LabError) as info:
        lab2.apply(fail_on_one)
    err = info.value
    assert err.ranks == [1]
    assert "rank 1: ValueError: bad input on this rank" in str(err)
    assert "fail_on_one" in err.traceback(1)
    assert lab2.apply(lambda: 1) == [1, 1]            # the lab is still usable


def test_the_controller_keeps_no_answers_and_steps_report_cpu_time(lab2):
    """The controller keeps no task database (it would hold every step's answer), and every
    step reports its CPU time beside its wall time."""
    run = lab2.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=32, depth=2), batch=8, steps=3)
    from labkit.session import lifetime
    started = lifetime.controller_process(lab2.cluster).cmdline()
    assert "--nodb" in started
    assert "--HeartMonitor.period=1000" in started        # registration within a beat or two, not 6 s
    assert len(run.step_cpu_times) == len(run.step_times) == 3
    assert all(c > 0 for c in run.step_cpu_times)


def test_groups_survive_a_change_of_mode_and_rebuild_for_new_degrees(lab2):
    from labkit import engine
    from labkit.grid import ParallelDims
    model = labkit.models.mlp(width=16, depth=2)
    lab2.run(labkit.Strategy(dp=2, dp_mode="naive"), model=model, batch=8, steps=1)
    assert lab2.apply(engine.ensure_groups, ParallelDims(2, 1, 1)) == [False, False]
    lab2.run(labkit.Strategy(dp=2, dp_mode="ddp", bucket_mb=0.5, microbatches=2), model=model, batch=8, steps=1)
    assert lab2.apply(engine.ensure_groups, ParallelDims(2, 1, 1)) == [False, False]


def _live_on_engines(lab):
    """Per rank: torch Parameters and labkit gradient syncs that Python still holds."""
    def count():
        import gc
        import torch
        from labkit.parallel.data.sync import GradSync
        gc.collect()
        objects = gc.get_objects()
        return (sum(isinstance(o, torch.nn.Parameter) for o in objects),
                sum(isinstance(o, GradSync) for o in objects))
    return lab.apply(count)


def test_a_replaced_run_leaves_nothing_alive_on_the_engines(lab2):
    """A run's parameters carry hooks held from C++ (and DDP's reducer holds its comm hook's
    state); unbroken, those cycles kept every replaced job alive with its process groups. Two
    rounds of the same runs must leave the engines holding the same objects."""
    model = labkit.models.mlp(width=16, depth=2)
    runs = [labkit.Strategy(dp=2, dp_mode="overlap"), labkit.Strategy(dp=2, dp_mode="ddp"),
            labkit.Strategy(dp=2, zero=1), labkit.Strategy(dp=2, zero=3), labkit.Strategy(pp=2, microbatches=2)]
    counts = []
    for _ in range(2):
        for s in runs:
            lab2.run(s, model=model, batch=8, steps=1)
        counts.append(_live_on_engines(lab2))
    assert counts[1] == counts[0]
    assert all(syncs <= 1 for _, syncs in counts[1])        # the pipeline run's one sync at most


@pytest.mark.slow
def test_close_leaves_no_process_behind():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with labkit.Lab.start(engines=2, timeout=30, progress=False) as lab:
        pids = [r["pid"] for r in lab.ranks]
        assert lab.apply(lambda: 2 + 2) == [4, 4]
    assert lab.client is None
    psutil.wait_procs([p for p in map(_proc, pids) if p], timeout=10)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != "zombie"}
    assert after <= before


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_start_rejects_nonsense():
    with pytest.raises(ValueError, match="engines"):
        labkit.Lab.start(engines=0)


@pytest.mark.slow
def test_cli_run_writes_json_trace_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "run", "--engines", "2", "--dp", "2",
                          "--dp-mode", "bucketed", "--width", "32", "--depth", "3", "--batch", "16",
                          "--steps", "3", "--json", str(tmp_path / "run.json"), "--trace",
                          str(tmp_path / "trace.json"), "--plot", str(tmp_path / "tl.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert set(run) == {"strategy", "losses", "metrics", "events"}
    assert len(run["losses"]) == 3 and run["strategy"]["dp_mode"] == "bucketed"
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert (tmp_path / "tl.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_rejects_impossible_strategy_before_starting():
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "run", "--engines", "3", "--dp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "dp*pp*tp" in out.stderr


@pytest.mark.slow
def test_connect_attaches_to_a_running_cluster_and_assigns_ranks():
    """Engines started without rank variables (like SSH engines): the lab assigns ranks."""
    import logging

    import ipyparallel as ipp

    from conftest import release_labs
    release_labs()
    cluster = ipp.Cluster(n=2, log_level=logging.ERROR, controller_ip="127.0.0.1")
    cluster.start_cluster_sync()
    try:
        lab = labkit.Lab.connect(cluster_id=cluster.cluster_id, profile=cluster.profile, engines=2, timeout=30)
        try:
            assert sorted(r["rank"] for r in lab.ranks) == [0, 1]
            assert {r["rank_source"] for r in lab.ranks} == {"lab"}
            model = labkit.models.mlp(width=16, depth=2)
            run = lab.run(labkit.Strategy(dp=2, dp_mode="bucketed"), model=model, batch=8, steps=2)
            assert run.max_diff(labkit.reference(model, batch=8, steps=2)) <= 1e-5
        finally:
            lab.close()
        assert cluster.engines            # connect() leaves someone else's cluster running
    finally:
        cluster.stop_cluster_sync()
