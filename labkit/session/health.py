"""The lab's side of a call that went wrong: waiting on every rank, noticing a rank that failed,
stopped, died or hung (and which one caused it), and starting afresh or restarting engines.

:class:`Recovery` is the part of :class:`~labkit.session.lab.Lab` that handles this; the lab's
state (its ranks, engines, the call in flight) is the lab's own. What each failure is called
and how it is worded is :mod:`.calls`; the local processes' states are :mod:`.lifetime`.
"""
from __future__ import annotations

import time
from concurrent import futures
from typing import TYPE_CHECKING

import psutil

from .. import engine
from ..errors import ControllerDiedError, EngineDiedError, EngineNotAnsweringError, LabError
from . import calls, lifetime

if TYPE_CHECKING:                   # the class that inherits Recovery
    from .lab import Lab


class Recovery:
    """Waiting on the ranks, triage when they fail, and the way back (``lab.recover()``)."""

    def _gather(self, ar, timeout: float | None, what: str) -> list:
        """Wait for every rank (see :mod:`.calls`); on a failure, remember what it left behind."""
        limit = timeout if timeout is not None else 10 * self.timeout + 60
        children, targets = list(ar._children), list(ar._targets)
        sent, stopped_since = time.monotonic(), {}

        def still_there(pending):
            self._check_closing(what)
            self._check_controller(what)
            self._check_stopped(what, [self._rank_of.get(t) for t, f in zip(targets, children) if f in pending],
                                sent, stopped_since)
        try:
            pending = calls.wait_for_ranks(children, limit, still_there=still_there)
        except (KeyboardInterrupt, EngineNotAnsweringError):
            self._dirty = True
            self._busy = [(self._rank_of.get(t), f) for t, f in zip(targets, children) if not f.done()]
            raise
        failed = [(t, calls.error_of(f)) for t, f in zip(targets, children) if f not in pending and calls.error_of(f)]
        if not failed and not pending:
            self._silent.clear()
            return ar.get(timeout=5)
        self._dirty = True
        self._busy = [(self._rank_of.get(t), f) for t, f in zip(targets, children) if f in pending]
        busy = sorted(r for r, _ in self._busy if r is not None)
        for rank in busy:
            self._silent.setdefault(rank, sent)
        reports = calls.reports_of(failed, self._rank_of)
        stopped = [r for r in busy if self._state(r) == "stopped"]
        if stopped:         # the others gave up waiting for a stopped rank: it is the cause
            peers = [calls.in_words(r, what, stopped) for r in reports]
            raise calls.not_answering(what, self._silent_info(stopped), peers) from None
        if not failed:
            self._stuck, self._dirty = (what, list(self._busy)), False
            error = EngineNotAnsweringError(
                f"{what}: no answer after {limit:g} s from ranks {busy}; they are still running it (an engine runs "
                f"one call at a time, and lab.interrupt() does not reach it): wait for it, or lab.recover() "
                f"restarts the engines")
            error.silent, error.seconds = busy, time.monotonic() - sent
            raise error
        remote = [r for r in range(self.world_size) if self._state(r) is None]
        error = calls.triage(reports, what, busy, self.timeout, self._flight_logs, remote)
        alive = [r for r in error.dead if self._state(r) in ("running", "stopped")]
        if alive:           # unregistered by the controller (missed heartbeats) but not dead
            raise calls.not_answering(what, self._silent_info(alive), error.reports, dropped=True) from None
        if error.dead:
            self._dead = error.dead
        raise error from None

    def _state(self, rank: int) -> str | None:
        """Its engine's process: "running", "stopped", "gone", or None (not on this machine)."""
        return lifetime.engine_state(self._engine_procs.get(rank))

    def _silent_info(self, ranks: list[int]) -> dict[int, dict]:
        """What :func:`calls.not_answering` says of each silent rank: state, pid, host, for how long."""
        now, info = time.monotonic(), {}
        for rank in ranks:
            where = self.ranks[rank] if rank < len(self.ranks) else {}
            since = self._silent.get(rank)
            info[rank] = {"state": self._state(rank), "pid": where.get("pid"), "host": where.get("host"),
                          "seconds": None if since is None else now - since}
        return info

    def _check_stopped(self, what: str, ranks: list, sent: float, stopped_since: dict) -> None:
        """During a call: EngineNotAnsweringError once a rank's process has been stopped for
        GRACE_S (a stopped process answers nothing until it is continued, and the others would
        only time out waiting for it)."""
        now = time.monotonic()
        for rank in ranks:
            if self._state(rank) == "stopped":
                stopped_since.setdefault(rank, now)
            else:
                stopped_since.pop(rank, None)
        frozen = sorted(r for r, t in stopped_since.items() if now - t >= calls.GRACE_S)
        if frozen:
            for rank in frozen:
                self._silent.setdefault(rank, sent)
            raise calls.not_answering(what, self._silent_info(frozen), [])

    def _flight_logs(self, skip=()) -> dict[int, list[dict]]:
        """Every answering rank's flight recorder (rank → entries); {} if none can be read."""
        ranks = [r for r in range(self.world_size) if r not in skip]
        if not ranks:
            return {}
        try:
            ar = self.client.direct_view(targets=[self._engine_of[r] for r in ranks]).apply_async(engine.flight_log)
            return {log["rank"]: log["entries"] for log in ar.get(timeout=10)}
        except Exception:
            return {}

    def _check_closing(self, what: str) -> None:
        """LabError once :meth:`close` began (from another thread, while a call waits): the
        client that would deliver the answers is going away, so waiting would last the call's
        whole limit (10 × the collective timeout + 60 s) for answers that cannot come."""
        if self._closing:
            raise LabError(f"{what}: the lab was closed (lab.close(), from another thread) while this call ran, so "
                           "its answers cannot arrive; start a new lab with labkit.Lab.start(...) and run it again")

    def _check_controller(self, what: str) -> None:
        """ControllerDiedError once a local lab's controller is gone (local labs only, lifetime.py)."""
        if lifetime.controller_alive(self.cluster):
            return
        process = lifetime.controller_process(self.cluster)
        pid = f" (pid {process.pid})" if process is not None else ""
        self._dirty = True
        raise ControllerDiedError(f"{what}: the ipyparallel controller{pid} died, so no call can reach the "
                                  f"engines; lab.recover() restarts the whole local cluster")

    def _ready(self, what: str = "call") -> None:
        """Before a call: refuse on a closed lab, a dead controller, a rank that does not answer
        (stopped, or still running a call past its limit), or a dead engine; after a failure,
        start on a fresh store (which also drains what a rank that answers again left behind)."""
        self._check_open()
        self._check_controller(what)
        registered = set(self.client.ids)
        unregistered = [r for r, e in self._engine_of.items() if e not in registered]
        dropped = [r for r in unregistered if self._state(r) in ("running", "stopped")]
        if dropped:         # alive, but the controller gave it up after missed heartbeats
            raise calls.not_answering(what, self._silent_info(dropped), [], dropped=True)
        stopped = [r for r in range(self.world_size) if self._state(r) == "stopped"]
        if stopped:         # refused before anything is queued behind the stopped rank's last call
            for rank in stopped:
                self._silent.setdefault(rank, time.monotonic())
            raise calls.not_answering(what, self._silent_info(stopped), [])
        if self._stuck is not None:
            stuck_what, busy = self._stuck
            still = sorted(r for r, f in busy if not f.done())
            if still:
                error = EngineNotAnsweringError(
                    f"rank(s) {still} are still running {stuck_what} (it did not answer within the call's limit); "
                    f"wait for it to end, or lab.recover() restarts the engines")
                error.silent = still
                raise error
            self._stuck, self._busy, self._dirty = None, [], True
        self._dead = sorted(set(self._dead) | set(unregistered))
        if self._dead:
            frozen = calls.died_or_frozen(self._dead, [r for r in self._dead if self._state(r) is None])
            error = EngineDiedError(f"the engine of rank(s) {self._dead} died{frozen}; call lab.recover() to "
                                    f"restart the engines (the lab keeps its settings)")
            error.hang, error.flight_logs, error.busy, error.dead = None, {}, [], list(self._dead)
            raise error
        if self._dirty:
            self._reset()

    def _reset(self) -> None:
        """Leave the old groups (which frees ranks still blocked in them), then a fresh store."""
        self._dirty = False
        busy = {rank: future for rank, future in self._busy if not future.done()}
        if busy:
            idle = [self._engine_of[r] for r in range(self.world_size) if r not in busy]
            try:
                self.client.direct_view(targets=idle).apply_async(engine.shutdown).get(timeout=self.timeout + 10)
            except Exception:
                pass
            pending = futures.wait(list(busy.values()), timeout=self.timeout + 10)[1]
            if pending:
                self._dirty = True
                stuck = sorted(r for r, f in busy.items() if f in pending)
                raise EngineNotAnsweringError(
                    f"rank(s) {stuck} are still running the call that failed, {self.timeout + 10:g} s after the "
                    f"others left their groups (stuck outside labkit.comm?); lab.recover() restarts the engines")
        self._busy = []
        try:
            self._init_distributed()
        except BaseException:
            self._dirty = True
            raise

    def recover(self, timeout: float = 180.0, debug: bool | None = None) -> "Lab":
        """Restart the engines (after one died or got stuck) and start torch.distributed afresh.

        A local lab stops every rank's engine set and starts it again with the same
        environment; a lab on a launcher restarts its engine sets; a lab from ``connect()``
        waits for engines someone restarted. Engine ids change, so the rank map is rebuilt
        from the engines' environment, and the world group joins a fresh store. The next
        ``lab.run`` builds its process groups again. ``debug`` switches
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on or off for the restarted engines.
        """
        self._check_open()
        if debug is not None:
            self.debug = bool(debug)
        n, t0 = self.world_size, time.monotonic()
        if self._launched.launcher == "local" and self.cluster is not None and \
                not lifetime.controller_alive(self.cluster):
            return self._restart_cluster(timeout, t0)
        self._kill_stopped()
        old = set(self.client.ids)
        self._say(f"labkit: restarting {n} engines…")
        self._launched.restart(n, self.debug)
        fresh = []
        while len(fresh) < n:
            if time.monotonic() - t0 > timeout:
                raise LabError(f"recover: only {len(fresh)} of {n} engines came back within {timeout:g} s")
            time.sleep(0.25)
            fresh = [e for e in self.client.ids if e not in old]
        self._dead, self._busy, self._dirty, self._groups_key, self._stuck = [], [], False, None, None
        self._attach(expected=n, targets=fresh[:n])
        self._say(f"labkit: {n} engines restarted ({time.monotonic() - t0:.0f} s)")
        return self

    def _kill_stopped(self) -> None:
        """End the engines whose process is stopped, before a restart or close ends them anyway:
        stopped, they act on no SIGTERM and hold every call (the close's shutdown waits 10 s).
        Engines someone else started (``Lab.connect``) are theirs to end."""
        if self.cluster is None:
            return
        for rank, proc in self._engine_procs.items():
            if self._state(rank) == "stopped":
                try:
                    proc.kill()
                except psutil.Error:
                    pass

    def _restart_cluster(self, timeout: float, t0: float) -> "Lab":
        """The controller died: end everything the old cluster left, start a new one, attach."""
        n = self.world_size
        self._say(f"labkit: the controller died; restarting the local cluster ({n} engines)…")
        self.client.close()
        lifetime.terminate(self._processes + lifetime.lab_processes(self.cluster))
        self._processes = []
        self._launched = self._launched.relaunch(n, timeout, self._say, self.debug)
        self.client, self.cluster = self._launched.client, self._launched.cluster
        self._dead, self._busy, self._dirty, self._groups_key, self._stuck = [], [], False, None, None
        self._attach(expected=n)
        self._say(f"labkit: local cluster restarted ({time.monotonic() - t0:.0f} s)")
        return self
