"""A frozen rank is not a dead one: a stopped engine is reported as not answering, naming its
rank, process and silence; the lab goes on by itself once it runs again; a killed engine is
still reported as dead; a stopped engine does not outlive the notebook. One 2-engine lab with a
short collective timeout for the module (and one in a child process that dies).

    python tests/test_frozen.py          # the child: start a lab, stop rank 1, die
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

import labkit
from labkit.errors import RankReport
from labkit.session import calls

TIMEOUT = 5.0


def _freezing(step):
    """Rank 1's engine stops itself at step 1 (as a hung driver or a swapped-out process looks)."""
    if step == 1 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)


def _run(lab, data=None):
    model = labkit.models.mlp(width=16, depth=2)
    return lab.run(labkit.Strategy(dp=2), model=model, data=data, batch=16, steps=3)


def _stop_one_and_die():
    """The child: a lab whose rank 1 is stopped, then the notebook is killed."""
    lab = labkit.Lab.start(engines=2, timeout=TIMEOUT, progress=False)
    pids = lab.apply(os.getpid)
    os.kill(pids[1], signal.SIGSTOP)
    print("PIDS", *pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_engine_does_not_outlive_the_notebook(tmp_path):
    from conftest import release_labs

    release_labs()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=180, env=env,
                           cwd=tmp_path)
    line = next((x for x in child.stdout.splitlines() if x.startswith("PIDS ")), None)
    assert line is not None, child.stdout + child.stderr
    engines = []
    for pid in line.split()[1:]:
        try:
            engines.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            continue                                            # already gone
    try:
        gone, alive = psutil.wait_procs(engines, timeout=15)
        assert not alive, [(p.pid, p.status()) for p in alive]     # the stopped one included
    finally:
        for proc in engines:
            if proc.is_running():
                proc.kill()


@pytest.fixture(scope="module")
def lab():
    from conftest import release_labs

    release_labs()                         # one lab at a time on this machine
    lab = labkit.Lab.start(engines=2, timeout=TIMEOUT, progress=False)
    pids = [r["pid"] for r in lab.ranks]
    try:
        yield lab
    finally:
        for pid in pids:                   # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        lab.close()


def _raised(fn):
    t0 = time.monotonic()
    with pytest.raises(labkit.LabError) as caught:
        fn()
    return caught.value, time.monotonic() - t0


@pytest.mark.slow
def test_a_stopped_rank_is_not_answering_and_the_lab_goes_on_when_it_runs_again(lab):
    pid = lab.ranks[1]["pid"]
    reference = labkit.reference(labkit.models.mlp(width=16, depth=2), batch=16, steps=3)
    try:
        error, seconds = _raised(lambda: _run(lab, data=_freezing))
        assert type(error) is labkit.EngineNotAnsweringError, error
        assert seconds < TIMEOUT + 3, seconds                   # within the lab's timeout
        assert error.silent == [1] and "rank(s) [1] not answering" in str(error), error
        assert f"pid {pid}" in str(error) and "stopped" in str(error) and "lab.recover()" in str(error)
        assert "stale result" not in str(error) and "keys: /" not in str(error), error

        again, seconds = _raised(lambda: lab.apply(os.getpid))  # refused at once: nothing queued behind it
        assert type(again) is labkit.EngineNotAnsweringError and again.silent == [1], again
        assert seconds < 1 and again.seconds >= error.seconds, (seconds, again.seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    run = _run(lab)                                             # no lab.recover()
    assert run.max_diff(reference) < 1e-5
    assert lab.apply(os.getpid)[1] == pid                       # the same engine, not a restart


@pytest.mark.slow
def test_a_killed_engine_is_still_reported_as_died(lab):
    os.kill(lab.ranks[1]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    error, _ = _raised(lambda: lab.apply(os.getpid))
    assert type(error) is labkit.EngineDiedError and error.dead == [1], error


def test_a_store_timeout_is_put_in_words():
    raw = RankReport(0, "DistStoreError", "wait timeout after 10000ms, keys: /0//1//cpu//0/1")
    said = calls.in_words(raw, "ensure_groups", [1])
    assert said.message == "waited 10 s in the rendezvous store for rank(s) [1] to join (ensure_groups), then gave up"
    assert "keys: /0//1//cpu//0/1" in said.traceback          # kept for whoever asks for the detail
    error = calls.triage([raw], "ensure_groups", [1], TIMEOUT, lambda busy: {})
    assert "keys: /" not in str(error) and "rank(s) [1]" in str(error), error


def test_a_reply_to_a_closed_call_is_dropped_quietly(capsys):
    seen = []
    client = SimpleNamespace(outstanding={"open"}, history=["closed", "open"],
                             _queue_handlers={"apply_reply": seen.append, "execute_reply": seen.append})
    calls.quiet_stale_results(client)
    calls.quiet_stale_results(client)                          # once only, however often the lab attaches
    for msg_id in ("closed", "open"):
        client._queue_handlers["apply_reply"]({"parent_header": {"msg_id": msg_id}})
    assert [m["parent_header"]["msg_id"] for m in seen] == ["open"]
    assert capsys.readouterr().out == ""


def test_a_generator_as_data_is_refused_with_how_to_wrap_it():
    from labkit.parallel.build import RunSpec
    from labkit.run.runner import validate

    batches = ((torch.randn(16, 16), torch.randn(16, 16)) for _ in range(3))
    spec = RunSpec(labkit.Strategy(dp=2), labkit.models.mlp(width=16, depth=2), batches, "mse", 16, 3, 0.1, 0.0, 0,
                   True, extra={})
    with pytest.raises(TypeError, match=r"data must be a callable data\(step\) -> \(x, y\), got a generator.*"
                                        r"data=lambda step: batches\[step\]"):
        validate(spec, engines=2)


if __name__ == "__main__":
    _stop_one_and_die()
