"""Engine side: a local engine ends when the process that started the lab ends.

Under ipyparallel's local launcher the process tree is (measured, ipyparallel 9)::

    notebook ─┬─ controller ── 8 scheduler processes (the controller's process group)
              └─ engine (one per rank, own session) ── nanny (own session)

Nothing in that tree watches the notebook: SIGTERM or SIGKILL of the kernel or the CLI left
all of them running. ``prctl(PR_SET_PDEATHSIG)`` would reach the engine (its parent is the
notebook) but it fires when the *thread* that forked the engine exits, and ipyparallel
starts engines from whichever thread runs its event loop; it also cannot reach the
controller. So each engine runs a thread that polls its parent: once the notebook is gone
(the engine is re-parented), it stops the controller's process group and its own nanny, then
exits. A peer engine whose process is stopped (SIGSTOP, Ctrl-Z) cannot run its own thread and
was left behind stopped, for good: the first engine to notice kills it. Local labs only; a
cluster's engines belong to its scheduler.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil

POLL_S = 0.5
_watching: dict = {}


def watch_parent(parent_pid: int, controller_pid: int | None, engines: list[int] = ()) -> bool:
    """Start (once per engine process) the thread that ends this engine with ``parent_pid``;
    ``engines``: the pids of every engine of the lab (those stopped are ended too)."""
    if _watching.get("parent") == parent_pid:
        # a restarted controller or engine set has new pids
        _watching.update(controller=controller_pid, engines=list(engines))
        return False
    _watching.update(parent=parent_pid, controller=controller_pid, engines=list(engines))
    direct = os.getppid() == parent_pid
    thread = threading.Thread(target=_watch, args=(parent_pid, direct), name="labkit-watchdog", daemon=True)
    thread.start()
    return True


def _watch(parent_pid: int, direct: bool) -> None:
    while _parent_alive(parent_pid, direct):
        time.sleep(POLL_S)
    _end_lab(_watching.get("controller"), _watching.get("engines", []))


def _parent_alive(pid: int, direct: bool) -> bool:
    if direct:                                  # re-parenting is immune to pid reuse
        return os.getppid() == pid
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _end_lab(controller_pid: int | None, engines: list[int]) -> None:
    """The notebook is gone: stopped peers, the controller's group, this engine's children,
    then this engine."""
    for pid in engines:
        if pid != os.getpid() and _stopped_engine(pid):
            _signal(pid, signal.SIGKILL)        # a stopped process acts on nothing gentler
    if controller_pid:
        _signal_group(controller_pid, signal.SIGTERM)
    for child in _children(os.getpid()):
        _signal(child, signal.SIGTERM)
    time.sleep(1.0)
    if controller_pid:
        _signal_group(controller_pid, signal.SIGKILL)
    for child in _children(os.getpid()):
        _signal(child, signal.SIGKILL)
    os._exit(0)


def _stopped_engine(pid: int) -> bool:
    """An ipyparallel engine process, stopped (its cmdline guards against a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) and \
            "ipyparallel.engine" in proc.cmdline()
    except psutil.Error:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
