"""Notebook side of a local lab's processes: is the controller alive, which processes did the
lab start, ending them all (also those a dead controller left behind), and whether an engine
on this machine is running, stopped or gone.

A SIGKILLed controller leaves its 8 scheduler processes running (they are forked, in the
controller's process group) and the client's requests go nowhere: ipyparallel's client has
no heartbeat of its own, so every call would wait out its full limit. For a local lab the
controller is a child process, and its liveness is a cheap check before and during calls.
"""
from __future__ import annotations

import socket
import time

import psutil


def controller_process(cluster) -> psutil.Process | None:
    """The controller of a cluster this process started (None: attached or not local)."""
    launcher = getattr(cluster, "controller", None) if cluster is not None else None
    process = getattr(launcher, "process", None)
    return process if isinstance(process, psutil.Process) else None


def controller_alive(cluster) -> bool:
    """False once the controller this process started has exited (or is a zombie)."""
    process = controller_process(cluster)
    if process is None:
        return True                     # not ours to watch: the call's limit applies
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def lab_processes(cluster) -> list[psutil.Process]:
    """Every process a local cluster started: controller and its schedulers, engines, nannies.

    Taken while the controller lives, so its schedulers can still be found (and ended) once
    it has died and they were re-parented.
    """
    roots = []
    process = controller_process(cluster)
    if process is not None:
        roots.append(process)
    for engine_set in getattr(cluster, "engines", {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if isinstance(getattr(launcher, "process", None), psutil.Process):
                roots.append(launcher.process)
    found = []
    for root in roots:
        try:
            found += [root] + root.children(recursive=True)
        except psutil.Error:
            continue
    return found


def terminate(processes: list[psutil.Process], grace: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the pids still alive after that.

    psutil's Process checks its creation time before signalling, so a pid the system has
    reused for another program since is left alone.
    """
    procs = []
    for proc in {p.pid: p for p in processes}.values():
        try:
            if _living(proc):
                proc.terminate()
                procs.append(proc)
        except psutil.Error:
            continue
    alive = _wait(procs, grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return [p.pid for p in _wait(alive, grace)]


def is_engine(proc: psutil.Process) -> bool:
    try:
        return "ipyparallel.engine" in proc.cmdline()
    except psutil.Error:
        return False


def _living(proc: psutil.Process) -> bool:
    """Running and not a zombie: an exited process whose parent has not reaped it yet (a
    nanny whose engine exited first) is gone, and waiting on it would last the whole grace."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to end; those still living."""
    deadline = time.monotonic() + timeout
    while (procs := [p for p in procs if _living(p)]) and time.monotonic() < deadline:
        psutil.wait_procs(procs, timeout=0.05)
    return procs


# -- is a rank's engine alive, stopped or gone (engines on this machine) --------------------------
def engine_processes(ranks: list[dict]) -> dict[int, psutil.Process]:
    """rank → its engine's process, for the ranks whose engine runs on this machine.

    Taken while the engines answer (at attach), so a pid the system later reuses for another
    program is not mistaken for the engine (psutil compares creation times).
    """
    here, found = socket.gethostname(), {}
    for info in ranks:
        if info.get("host") == here and info.get("pid"):
            try:
                found[info["rank"]] = psutil.Process(info["pid"])
            except psutil.Error:
                continue
    return found


def engine_state(proc: psutil.Process | None) -> str | None:
    """"running", "stopped" (SIGSTOP, Ctrl-Z, a debugger's stop), "gone" (exited or a zombie),
    or None when the process is not on this machine (a cluster's engine: only its
    registration with the controller tells)."""
    if proc is None:
        return None
    try:
        if not proc.is_running():
            return "gone"
        status = proc.status()
    except psutil.Error:
        return "gone"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "gone"
    return "stopped" if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) else "running"
