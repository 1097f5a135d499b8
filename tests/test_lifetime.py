"""A local lab's processes live no longer than the process that started them, and a dead
controller is named and recovered from.

Each scenario runs in its own Python process (this file as a script), which starts a lab of
two engines and prints the process ids of everything the lab started (controller and its
scheduler processes, engines, their nannies). The test then kills that "notebook" process,
or its controller, and checks with a deadline that nothing is left behind.

    python tests/test_lifetime.py hold          # start a lab, print its processes, wait
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

DEADLINE = 240         # parent-side limit per scenario (s): starting engines is slow here
GONE_WITHIN = 20       # how long the lab's processes get to go away (generous: a loaded machine)


def _emit(check: str, **fields) -> None:
    print("RESULT " + json.dumps({"check": check, **fields}), flush=True)


def _tree() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)]


def scenario_hold():
    import labkit

    lab = labkit.Lab.start(engines=2, timeout=10, progress=False)
    _emit("started", pids=_tree(), controller=lab.cluster.controller.process.pid)
    time.sleep(DEADLINE)


def scenario_controller():
    import labkit

    lab = labkit.Lab.start(engines=2, timeout=10, progress=False)
    controller = lab.cluster.controller.process.pid
    old = [p for p in _tree()]
    threading.Timer(1.0, os.kill, (controller, signal.SIGKILL)).start()     # while a call waits
    for check in ("detected", "refused"):
        t0 = time.monotonic()
        try:
            lab.apply(time.sleep, 5)
            _emit(check, kind=None, message="", seconds=time.monotonic() - t0)
        except labkit.LabError as exc:
            _emit(check, kind=type(exc).__name__, message=str(exc), seconds=time.monotonic() - t0)
    t0 = time.monotonic()
    lab.recover()
    run = lab.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=8, depth=2), batch=8, steps=2)
    _emit("recovered", seconds=time.monotonic() - t0, losses=len(run.losses),
          old_left=[p for p in old if _alive(p)])
    lab.close()
    time.sleep(1)
    _emit("closed", left=[p for p in old + _tree() if _alive(p)])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the tests (parent process) ---------------------------------------------------------------
def _start(name: str, tmp_path) -> subprocess.Popen:
    from conftest import release_labs

    release_labs()                         # one lab at a time on this machine
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, __file__, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)


def _next_result(proc: subprocess.Popen, deadline: float) -> dict:
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    proc.kill()
    pytest.fail(f"the scenario gave no result in time:\n{proc.stderr.read()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_notebook_leaves_no_lab_processes(tmp_path, sig):
    proc = _start("hold", tmp_path)
    started = _next_result(proc, time.monotonic() + DEADLINE)
    pids = started["pids"]
    assert started["controller"] in pids and len(pids) >= 5        # controller + schedulers, engines, nannies
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    t0 = time.monotonic()
    while time.monotonic() - t0 < GONE_WITHIN and any(_alive(p) for p in pids):
        time.sleep(0.25)
    left = [p for p in pids if _alive(p)]
    print(f"{sig.name}: {len(pids)} lab processes, {len(left)} left after {time.monotonic() - t0:.1f} s")
    for pid in left:                       # never leave them to the rest of the suite
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"{len(left)} of {len(pids)} lab processes outlived the notebook ({sig.name})"


@pytest.mark.slow
def test_a_dead_controller_is_named_and_recover_restarts_the_cluster(tmp_path):
    proc = _start("controller", tmp_path)
    try:
        deadline = time.monotonic() + DEADLINE
        detected = _next_result(proc, deadline)
        assert detected["kind"] == "ControllerDiedError", detected
        assert "controller" in detected["message"] and "lab.recover()" in detected["message"]
        refused = _next_result(proc, deadline)
        assert refused["kind"] == "ControllerDiedError", refused
        recovered = _next_result(proc, deadline)
        assert recovered["losses"] == 2 and recovered["old_left"] == [], recovered
        print(f"controller killed 1 s into a call, detected {detected['seconds']:.1f} s after the call began; "
              f"next call refused in {refused['seconds']:.2f} s; recover + run {recovered['seconds']:.1f} s")
        closed = _next_result(proc, deadline)
        assert closed["left"] == [], closed
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()
