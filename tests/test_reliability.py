"""Every failure names its rank, op and step, in bounded time, and leaves a usable lab.

Failures are provoked in a separate Python process (this file run as a script with a
scenario name) that starts its own lab with a short collective timeout and prints one JSON
line per check: what was raised, its message, how long detection took. The test waits with
a deadline of its own, so a hang fails the test instead of freezing the suite; ``mp.spawn``
is avoided because it kills the survivors before their errors can be read.

    python tests/test_reliability.py hang        # run one scenario by hand
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

import cloudpickle
import pytest
import torch
import zmq

import labkit
from labkit import comm, diagnose, engine

TIMEOUT = 4.0          # the scenarios' collective timeout (s)
SLACK = 5.0            # "within the collective timeout plus a few seconds"
DEADLINE = 300         # parent-side limit per scenario process (s): starting engines is slow here


# -- scenarios (run in the child process) -------------------------------------------------------
def _emit(check: str, **fields) -> None:
    print("RESULT " + json.dumps({"check": check, **fields}), flush=True)


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except labkit.LabError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, exc
    return None, "", time.monotonic() - t0, None


def _skip_on_rank1():
    t = torch.ones(4)
    comm.all_reduce(t, name="skipped")          # rank 1 never gets here
    return t.tolist()


def _one_skips():
    if int(os.environ["RANK"]) == 1:
        return None
    return _skip_on_rank1()


def _sum_ranks():
    t = torch.tensor([float(os.environ["RANK"])])
    comm.all_reduce(t, name="sum")
    return t.item()


def _straggler_data(step):
    """Rank 1 is late at step 1 by more than the collective timeout."""
    if step == 1 and int(os.environ["RANK"]) == 1:
        time.sleep(TIMEOUT + 1.5)
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _dying_data(step):
    """Rank 1's engine is killed at step 1 (as the OOM killer would)."""
    if step == 1 and int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _send_recv(send_shape, recv_shape, recv_dtype=torch.float32):
    if int(os.environ["RANK"]) == 0:
        comm.send(torch.ones(send_shape), 1, name="activation")
        return "sent"
    buf = torch.zeros(recv_shape, dtype=recv_dtype)
    comm.recv(buf, 0, name="activation")
    return buf.sum().item()


def _small_run(lab, **kw):
    model = labkit.models.mlp(width=16, depth=2)
    return lab.run(labkit.Strategy(dp=2, dp_mode="naive"), model=model, batch=8, steps=3, **kw)


def scenario_hang(lab, _out):
    kind, msg, t, exc = _timed(lambda: lab.apply(_one_skips))
    _emit("skip", kind=kind, message=msg, seconds=t,
          reached=exc.hang.reached if exc is not None and exc.hang else None,
          not_reached=exc.hang.not_reached if exc is not None and exc.hang else None)
    _emit("after_skip", value=lab.apply(_sum_ranks))
    kind, msg, t, exc = _timed(lambda: _small_run(lab, data=_straggler_data))
    _emit("straggler", kind=kind, message=msg, seconds=t,
          step=exc.hang.step if exc is not None and exc.hang else None)
    _emit("after_straggler", losses=len(_small_run(lab).losses))


def scenario_mismatch(lab, _out):
    pids = [r["pid"] for r in lab.ranks]
    for label, args in (("shape", ((8,), (4,))), ("dtype", ((4,), (4,), torch.float64))):
        kind, msg, t, exc = _timed(lambda: lab.apply(_send_recv, *args))
        remote = [r.error for r in exc.reports] if exc is not None else []
        _emit(label, kind=kind, message=msg, seconds=t, remote=remote)
    _emit("matching", value=lab.apply(_send_recv, (4,), (4,)))
    _emit("alive", same_pids=[r["pid"] for r in lab.apply(engine.describe)] == pids)


def scenario_dead(lab, out):
    Path(out).write_bytes(lab.client.session.key)          # for the parent's "no key in output" check
    ids = sorted(lab.client.ids)
    kind, msg, t, exc = _timed(lambda: _small_run(lab, data=_dying_data))
    _emit("killed_mid_run", kind=kind, message=msg, seconds=t, dead=exc.dead if exc is not None else None)
    kind, msg, t, _ = _timed(lambda: lab.apply(engine.describe))
    _emit("refused_until_recover", kind=kind, message=msg, seconds=t)
    t0 = time.monotonic()
    lab.recover()
    _emit("recovered", seconds=time.monotonic() - t0, new_ids=sorted(lab.client.ids) != ids,
          ranks=[r["rank"] for r in lab.ranks], losses=len(_small_run(lab).losses))
    os.kill(lab.ranks[0]["pid"], signal.SIGKILL)            # dies between calls this time
    time.sleep(0.5)
    kind, msg, t, exc = _timed(lambda: lab.apply(engine.describe))
    _emit("killed_between_calls", kind=kind, message=msg, seconds=t, dead=exc.dead if exc is not None else None)


def _main(name: str, out: str) -> None:
    lab = labkit.Lab.start(engines=2, timeout=TIMEOUT, progress=False)
    try:
        globals()[f"scenario_{name}"](lab, out)
    finally:
        lab.close()


# -- the tests (parent process) -------------------------------------------------------------
def _run_scenario(name: str, tmp_path) -> tuple[dict, str]:
    from conftest import release_labs

    release_labs()                         # one lab at a time on this machine
    out = tmp_path / "key"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    try:
        proc = subprocess.run([sys.executable, __file__, name, str(out)], capture_output=True, text=True,
                              timeout=DEADLINE, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenario {name} did not finish within {DEADLINE} s (a hang):\n{exc.stdout}\n{exc.stderr}")
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT "):])
            results[item.pop("check")] = item
    assert proc.returncode == 0, f"scenario {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return results, proc.stdout + proc.stderr


@pytest.mark.slow
def test_hang_is_reported_with_rank_op_step(tmp_path):
    results, _ = _run_scenario("hang", tmp_path)
    skip = results["skip"]
    assert skip["kind"] == "CollectiveTimeoutError", skip
    assert "all_reduce 'skipped'" in skip["message"] and "rank 0" in skip["message"]
    assert skip["reached"] == [0] and skip["not_reached"] == [1]
    assert "reached by ranks [0], not reached by ranks [1]" in skip["message"]
    assert TIMEOUT <= skip["seconds"] <= TIMEOUT + SLACK, skip["seconds"]
    assert results["after_skip"]["value"] == [1.0, 1.0]            # fresh groups: the lab goes on

    late = results["straggler"]
    assert late["kind"] == "CollectiveTimeoutError", late
    # the late rank is still making its data when the others wait at the step's start
    assert late["step"] == 1 and "step 1" in late["message"] and "barrier 'start of step 1'" in late["message"]
    assert "not reached by ranks [1]" in late["message"]
    assert late["seconds"] <= TIMEOUT + SLACK + 3, late["seconds"]    # + steps 0 and the set-up
    assert results["after_straggler"]["losses"] == 3


@pytest.mark.slow
def test_p2p_mismatch_names_both_ranks_and_engines_survive(tmp_path):
    results, _ = _run_scenario("mismatch", tmp_path)
    for label, sent, expected in (("shape", "shape (8,) float32", "shape (4,) float32"),
                                  ("dtype", "shape (4,) float32", "shape (4,) float64")):
        r = results[label]
        assert r["kind"] == "LabError" and r["remote"] == ["CommMismatch"], r
        assert "rank 1" in r["message"] and "rank 0 sent " + sent in r["message"], r["message"]
        assert "expected " + expected in r["message"] and "recv 'activation'" in r["message"]
        assert r["seconds"] < SLACK, r["seconds"]
    assert results["matching"]["value"] == ["sent", 4.0]
    assert results["alive"]["same_pids"] is True


@pytest.mark.slow
def test_dead_engine_is_named_and_recover_restarts(tmp_path):
    results, output = _run_scenario("dead", tmp_path)
    killed = results["killed_mid_run"]
    assert killed["kind"] == "EngineDiedError" and killed["dead"] == [1], killed
    assert "rank(s) [1] died" in killed["message"] and "recover" in killed["message"]
    assert killed["seconds"] < 5 + 3, killed["seconds"]              # + steps 0 and the set-up
    refused = results["refused_until_recover"]
    assert refused["kind"] == "EngineDiedError" and refused["seconds"] < 1
    back = results["recovered"]
    assert back["new_ids"] and back["ranks"] == [0, 1] and back["losses"] == 3
    between = results["killed_between_calls"]
    assert between["kind"] == "EngineDiedError" and between["dead"] == [0], between
    assert between["seconds"] < 5
    key = (tmp_path / "key").read_bytes()
    assert key and key.decode() not in output                          # no HMAC key in any output


def test_interrupt_from_another_thread_stops_at_a_step_boundary(lab2):
    started = threading.Event()
    timer = threading.Thread(target=lambda: started.wait(60) and lab2.interrupt())
    timer.start()
    run = lab2.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=16, depth=2), batch=8, steps=200,
                   on_step=lambda run, step: started.set())
    timer.join()
    assert run.interrupted and 1 <= len(run.losses) < 200
    assert len(lab2.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=16, depth=2),
                        batch=8, steps=2).losses) == 2                # engines alive, next run fine


def test_interrupt_from_a_step_callback(lab2):
    run = lab2.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=16, depth=2), batch=8, steps=5,
                   on_step=lambda run, step: step == 1 and lab2.interrupt())
    assert run.interrupted and len(run.losses) == 2


def _use_groups():
    """An all-reduce over dp and a send down the pipeline, on whatever groups are built."""
    s = engine.session()
    t = torch.ones(2)
    comm.all_reduce(t, group=s.groups.dp, name="dp")
    pp = s.groups.pp_ranks
    stage = pp.index(s.rank)
    x = torch.full((3,), float(s.rank))
    if stage + 1 < len(pp):
        comm.send(x, pp[stage + 1], name="act")
    if stage > 0:
        comm.recv(x, pp[stage - 1], name="act")
    return t[0].item(), x[0].item(), s.store is not None


def test_ten_changes_of_degrees_each_on_a_fresh_store(lab2):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # engines cannot import this file
    stores = []
    for i in range(10):
        dp, pp = (2, 1) if i % 2 == 0 else (1, 2)
        lab2.ensure_groups(dp, pp, 1)
        stores.append(lab2.store)
        out = lab2.apply(_use_groups)
        assert [o[0] for o in out] == [float(dp)] * 2
        assert [o[1] for o in out] == ([0.0, 1.0] if pp == 1 else [0.0, 0.0])
    assert len(set(stores)) == 10                                    # a fresh store every time


def test_local_lab_listens_on_loopback_only(lab2):
    host, port = lab2.store
    addresses = diagnose.listening_addresses(port)
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc to list listening sockets")
    assert addresses and all(diagnose.is_loopback(a) for a in addresses), addresses
    url = lab2.client._query_socket.getsockopt_string(zmq.LAST_ENDPOINT)      # the controller's port
    controller = diagnose.listening_addresses(int(url.rsplit(":", 1)[1]))
    assert controller and all(diagnose.is_loopback(a) for a in controller), (url, controller)
    key = lab2.client.session.key.decode()
    assert key not in repr(lab2) and key not in lab2._repr_html_()


def test_settings_check_flags_overlap_killers():
    found = diagnose.check_settings({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "INFO",
                                     "TORCH_NCCL_BLOCKING_WAIT": "1"}, threads=4, cpus=2, local_ranks=2)
    names = [f.variable for f in found]
    assert names == ["TORCH_NCCL_BLOCKING_WAIT", "OMP_NUM_THREADS"]     # one queue helps overlap: not flagged
    assert diagnose.check_settings({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == []
    table = diagnose.explain()
    for name in ("NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                 "TORCH_DISTRIBUTED_DEBUG"):
        assert name in repr(table) and name in table._repr_html_()
    with pytest.raises(ValueError):
        diagnose.explain("NOT_A_VARIABLE")


def _entry(op, channel, call, state="done", t=0.0, step=2, name="grad", group=(0, 1, 2)):
    return {"op": op, "channel": channel, "call": call, "state": state, "time": t, "step": step,
            "name": name, "group": list(group)}


def test_explain_hang_lines_up_the_logs():
    world = "world [0, 1, 2]"
    logs = {0: [_entry("all_reduce", world, 1), _entry("all_reduce", world, 2, "timeout", t=1.0)],
            1: [_entry("all_reduce", world, 1), _entry("all_reduce", world, 2, "timeout", t=1.1)],
            2: [_entry("all_reduce", world, 1)]}
    report = diagnose.explain_hang(logs)
    assert (report.step, report.op, report.call, report.reached, report.not_reached) == (2, "all_reduce", 2, [0, 1], [2])
    assert "stopped at call #1" in report.notes[2]
    assert str(report).startswith("step 2, all_reduce 'grad' (call #2 on world [0, 1, 2]): "
                                  "reached by ranks [0, 1], not reached by ranks [2]")
    p2p = {0: [_entry("send", "p2p 0->1", 1, "timeout", name="act", group=(0, 1))], 1: []}
    assert diagnose.explain_hang(p2p, timeout_s=4).not_reached == [1]
    late = {0: [_entry("recv", "p2p 1->0", 1, "timeout", t=0.0)], 1: [_entry("send", "p2p 1->0", 1, "failed", t=9.0)]}
    assert diagnose.explain_hang(late, timeout_s=4).not_reached == [1]
    assert diagnose.explain_hang({0: [_entry("all_reduce", world, 1)]}) is None


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.devnull)
