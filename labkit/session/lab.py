"""The notebook side: the Lab facade over engines, ranks, the torch.distributed world and runs.

>>> with labkit.Lab.start(engines=2) as lab:          # two local CPU engines, gloo
...     run = lab.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=64, depth=4))
...     run.timeline.plot()

Data flows one way: attach (engines, ranks, devices) → process groups → strategy builder →
instrumented steps → events gathered after each step → metrics, plots, trace files. The Lab
holds the state and delegates each job to its own module: starting engines through a launcher
(:mod:`.launch`, local being one of them), the rank map and the store's address
(:mod:`.ranks`), remote calls and their failure triage (:mod:`.calls`), ``Lab.start``'s
argument checks (:mod:`.checks`), the local processes' lifetime (:mod:`.lifetime`), the step
loop (:mod:`labkit.run.runner`).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from typing import Callable

import ipyparallel as ipp
import psutil

from .. import engine
from ..config import Strategy
from ..grid import ParallelDims
from ..errors import ControllerDiedError, EngineDiedError, EngineNotAnsweringError, LabError
from ..link import Link
from ..parallel.build import RunSpec
from ..run.result import Run
from ..view.status import StatusLine, link_text
from . import calls, lifetime
from .checks import check_start
from .launch import Launched, start_engines
from .ranks import map_ranks, master_address


class Lab:
    """A set of engines, one rank each, with torch.distributed initialised on them."""

    def __init__(self, client: ipp.Client, cluster: ipp.Cluster | None, timeout: float,
                 threads: int | None = None, progress: bool = True):
        self.client, self.cluster, self._timeout = client, cluster, float(timeout)
        self.threads, self._progress = threads, progress
        self.ranks: list[dict] = []
        self._engine_of: dict[int, int] = {}     # rank → engine id
        self._rank_of: dict[int, int] = {}       # engine id → rank
        self._interrupt = False
        self._closing = False           # close() began: a call another thread waits on ends
        self.view = None
        self.debug = False
        self._dead: list[int] = []      # ranks whose engine died: lab.recover() restarts them
        self._dirty = False             # a call failed: fresh store and groups before the next one
        self._busy: list = []           # (rank, future) of ranks still running a call that failed elsewhere
        self._groups_key = None
        self._launched = Launched("connect", None, client)
        self._holder: tuple[int, str] | None = None     # (thread id, what) of a run holding the lab
        self._hold_lock = threading.Lock()
        self._limit: float | None = None      # lab.limit(seconds): bound on each call's wait
        self._stuck = None                    # (what, futures) of ranks that never answered a call
        self._processes: list = []            # a local cluster's processes (psutil, see lifetime.py)
        self._status: StatusLine | None = None     # the progress line (view.status), made on first use
        self._engine_procs: dict = {}         # rank → its engine's process, engines on this machine
        self._silent: dict[int, float] = {}   # rank → since when (monotonic) it has not answered
        self._link: Link | None = None        # the emulated link every rank obeys; None: raw gloo

    # -- starting and attaching -----------------------------------------------------------
    @classmethod
    def start(cls, engines: int = 2, timeout: float = 60.0, launcher: str = "local",
              progress: bool = True, start_timeout: float = 120.0, debug: bool = False,
              link: Link | None = None, **cluster_kwargs) -> "Lab":
        """Start ``engines`` engines (one rank each) through ``launcher`` and initialise torch.distributed.

        ``launcher``: "local" (CPU engines on this machine, the default), "slurm", "mpi" or
        "ssh" (see :mod:`labkit.session.launchers`). ``timeout`` is the collective timeout in
        seconds (every group and barrier gets it). ``debug=True`` starts the engines with
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (collectives checked across ranks for matching op
        and shapes; a few ms per call). ``link``: an emulated interconnect (:class:`labkit.Link`)
        every labkit.comm call obeys; None, the default, is gloo at this machine's own speed.
        """
        _check_link(link)
        check_start(engines, timeout, launcher, cluster_kwargs)
        status = StatusLine() if progress else None        # one line for the whole start
        launched = start_engines(launcher, engines, start_timeout, status and status.say, debug, **cluster_kwargs)
        lab = cls(launched.client, launched.cluster, timeout, threads=launched.threads, progress=progress)
        lab.debug, lab._launched, lab._status = debug, launched, status
        try:
            lab._attach(expected=engines)
            if link is not None:
                lab.link = link
        except BaseException:
            lab.close()
            raise
        return lab

    @classmethod
    def connect(cls, profile: str | None = None, cluster_id: str | None = None, url_file: str | None = None,
                engines: int | None = None, timeout: float = 60.0, wait: float = 60.0,
                link: Link | None = None) -> "Lab":
        """Attach to engines someone already started (``ipcluster start``, Slurm, MPI, SSH)."""
        _check_link(link)
        kwargs = {k: v for k, v in dict(profile=profile, cluster_id=cluster_id, url_file=url_file).items() if v}
        client = ipp.Client(**kwargs)
        if engines:
            client.wait_for_engines(engines, timeout=wait)
        if not client.ids:
            client.close()
            raise LabError(f"no engines are registered with the cluster ({kwargs or 'default profile'})")
        lab = cls(client, None, timeout)
        lab._attach(expected=len(client.ids))
        if link is not None:
            lab.link = link
        return lab

    def _say(self, text: str) -> None:
        if self._progress:     # one line updated in place in a notebook; stderr in a terminal
            self._status = self._status or StatusLine()
            self._status.say(text)

    def _attach(self, expected: int, targets=None) -> None:
        """Learn each engine's rank from its environment, then join the world group."""
        self._say(f"labkit: importing torch on {expected} engines…")
        self._engine_of, self.ranks = map_ranks(self.client, targets)
        self._rank_of = {eid: rank for rank, eid in self._engine_of.items()}
        self._engine_procs, self._silent = lifetime.engine_processes(self.ranks), {}
        calls.quiet_stale_results(self.client)
        self.view = self.client.direct_view(targets=self.engine_ids)
        self.view.use_cloudpickle()
        if self._launched.launcher == "local" and self.cluster is not None:
            self._tie_lifetime()
        self._init_distributed()

    def _tie_lifetime(self) -> None:
        """Local engines end with this process (engine/watchdog.py); remember what was started."""
        from ..engine.watchdog import watch_parent

        controller = lifetime.controller_process(self.cluster)
        pids = [info["pid"] for info in self.ranks]
        self.view.apply_async(watch_parent, os.getpid(), controller.pid if controller else None, pids).get(timeout=60)
        self._processes = [p for p in self._processes if p.is_running()] + lifetime.lab_processes(self.cluster)

    def _init_distributed(self) -> None:
        """A fresh rendezvous store on rank 0 (port chosen by the OS), then every rank joins."""
        world = len(self.ranks)
        master = master_address(self.ranks)
        self._dirty, self._groups_key = False, None
        port = self._on_rank(0, engine.open_store, master, world, self.timeout)
        limit, self._limit = self._limit, None            # the lab's own set-up: never the user's limit
        try:
            self.apply(engine.init_distributed, master, port, world, self.timeout, self.threads, debug=self.debug,
                       link=self._link)
            self.ranks = self.apply(engine.describe)
        finally:
            self._limit = limit
        self.store = (master, port)
        self._say(f"labkit: {world} ranks ready ({self.ranks[0]['backend']}, store {master}:{port}; "
                  f"{link_text(self._link, self.ranks[0]['backend'])})")

    # -- running code on the ranks ----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def engine_ids(self) -> list[int]:
        """ipyparallel's engine ids in rank order (they change when engines restart; ranks do not)."""
        return [self._engine_of[r] for r in range(self.world_size)]

    @property
    def timeout(self) -> float:
        """The collective timeout in seconds; setting it starts the next call on a fresh store
        (groups take their timeout when they are created)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"timeout={seconds!r} must be a number of seconds > 0")
        self._timeout, self._dirty = float(seconds), True

    @property
    def link(self) -> Link | None:
        """The emulated interconnect (:class:`labkit.Link`) every labkit.comm call obeys; None:
        gloo at this machine's own speed. Setting it takes effect from the next call on every
        rank (groups and the current run's build stay; only the calls' times change)."""
        return self._link

    @link.setter
    def link(self, link: Link | None) -> None:
        _check_link(link)
        if link is not None:
            if any(r["backend"] != "gloo" for r in self.ranks):
                raise ValueError("lab.link: an emulated link is for CPU engines (gloo); a GPU lab has its own "
                                 "interconnect, so leave lab.link = None")
            if len({r["host"] for r in self.ranks}) > 1:
                raise ValueError("lab.link: the emulation times calls on one clock, so every rank must run on "
                                 "one host; leave lab.link = None on a multi-host lab")
        self.apply(engine.set_link, link)
        self._link = link
        self._say(f"labkit: {link_text(link, self.ranks[0]['backend'] if self.ranks else 'gloo')}")

    @contextmanager
    def hold(self, what: str):
        """Keep the engines for one thread while ``what`` runs (a run of lab.run or the dashboard).

        Meanwhile a call from any other thread raises LabError instead of interleaving its
        calls with the run's on the engines. The holding thread's own calls go through.
        """
        me = threading.get_ident()
        with self._hold_lock:
            if self._holder is not None and self._holder[0] != me:
                raise _held_error(what, self._holder)
            outer, self._holder = self._holder, (me, what)
        try:
            yield self
        finally:
            with self._hold_lock:
                self._holder = outer

    def apply(self, fn: Callable, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; results in rank order; failures raise LabError.

        Every keyword goes to ``fn``; the lab's own bound on the wait is ``with lab.limit(s):``
        (default 10 × the collective timeout + 60 s). ``lab.interrupt()`` does not reach a
        call in flight (an engine runs one task at a time): a rank that is still running when
        the limit passes is reported, the next call is refused at once while it runs, and
        ``lab.recover()`` restarts the engines.
        """
        holder = self._holder
        if holder is not None and holder[0] != threading.get_ident():
            raise _held_error(f"lab.apply({getattr(fn, '__name__', 'call')})", holder)
        self._ready(getattr(fn, "__name__", "call"))
        ar = self.view.apply_async(fn, *args, **kwargs)
        return self._gather(ar, self._limit, what=getattr(fn, "__name__", "call"))

    @contextmanager
    def limit(self, seconds: float):
        """``with lab.limit(5): lab.apply(fn)``: wait at most ``seconds`` for each call inside."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"lab.limit({seconds!r}): give a number of seconds > 0")
        previous, self._limit = self._limit, float(seconds)
        try:
            yield self
        finally:
            self._limit = previous

    @contextmanager
    def straggler(self, rank: int, seconds: float):
        """A planted straggler: inside the block, every forward of a layer with weights on
        ``rank`` takes ``seconds`` longer (the engine sleeps in a forward hook, so the time counts
        as that rank's compute). ``run.timeline.stragglers()`` should then name it.

            >>> with lab.straggler(rank=5, seconds=0.01):
            ...     run = lab.run(labkit.Strategy(dp=8), model=..., steps=3)
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"lab.straggler(rank={rank!r}): give a rank from 0 to {self.world_size - 1}")
        check_seconds = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if not check_seconds or not 0 <= seconds < 60:
            raise ValueError(f"lab.straggler(seconds={seconds!r}): give the extra seconds per layer forward, "
                             f"0 ≤ seconds < 60 (e.g. 0.01)")
        self.apply(engine.plant_straggler, rank, float(seconds))
        try:
            yield self
        finally:
            self.apply(engine.plant_straggler, rank, 0.0)

    def trace(self, fn: Callable, *args, **kwargs):
        """Like ``apply``, but also record the comm calls ``fn`` makes: ``(results, Timeline)``."""
        from ..analysis.timeline import Timeline
        from ..analysis.clocks import aligned
        from ..analysis.waits import split_waits

        self._check_open()
        out = self.apply(engine.traced, fn, args, kwargs)
        events = split_waits(aligned(out))
        return [r["result"] for r in out], Timeline(events, self.world_size)

    def _on_rank(self, rank: int, fn: Callable, *args):
        ar = self.client[self._engine_of[rank]].apply_async(fn, *args)
        return self._gather(ar, None, what=fn.__name__)

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

    def _check_open(self) -> None:
        if self.client is None:
            raise LabError("the lab is closed; start a new one with labkit.Lab.start(...) "
                           "or labkit.Lab.connect(...)")

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

    def ensure_groups(self, grid, *degrees: int) -> list[bool]:
        """The engines' process groups for ``grid``: a :class:`~labkit.grid.ParallelDims`, a
        Strategy (its grid), or the degrees ``dp, pp, tp, cp``. A change of grid starts on a
        fresh store. Returns, per rank, whether its groups were built anew.

        Re-initialising costs well under a second and drops every old group and its sockets,
        so any number of changes in a row starts from the same clean state.
        """
        dims = grid if isinstance(grid, ParallelDims) else grid.grid() if hasattr(grid, "grid") \
            else ParallelDims(grid, *degrees)
        self._ready("ensure_groups")        # after a failure: free blocked ranks, fresh store
        if self._groups_key is not None and self._groups_key != dims:
            self._init_distributed()
        rebuilt = self.apply(engine.ensure_groups, dims)
        self._groups_key = dims
        return rebuilt

    # -- training ---------------------------------------------------------------------------
    def run(self, strategy: Strategy, model, data=None, loss="mse", batch: int = 64, steps: int = 5,
            lr: float = 0.1, seed: int = 0, momentum: float = 0.0, record: bool = True,
            on_step: Callable | None = None, snapshots: bool = False, allow_nonfinite: bool = False,
            tp_plan: dict | None = None, optimizer: str = "sgd", blocks: str | None = None,
            init: str = "auto", profile=False, checkpoint=None, checkpoint_every: int | None = None,
            resume=None, checkpoint_async: bool = False) -> Run:
        """Train ``model`` for ``steps`` under ``strategy``; see docs/design.md for the contract.

        ``tp_plan`` (tp > 1): which modules tensor parallelism splits, in DTensor's convention
        (``{"*.attn.qkv": "colwise", ...}``); default: the model's own ``tp_plan``.
        ``optimizer``: "sgd" or "adamw" (torch's own, torch's defaults, this ``lr``).
        ``model``: any ``nn.Module`` or a zero-argument callable returning one (pp > 1: a chain
        of layers, see labkit.parallel.pipeline.modules). ``blocks``: the dotted name of its ``nn.ModuleList`` of repeated
        blocks (``"layers"``), which zero=3, fsdp2 and recompute="full" work block by block;
        default: the largest such list, found. ``init``: "whole" builds the whole model on every
        engine, "per_rank" builds it on ``meta`` and materialises only what the rank holds (the
        same values), "auto" the latter when a split model would not fit comfortably
        (labkit.parallel.materialize).

        ``snapshots=True`` records every rank's parameters and gradient norms after each step,
        for ``labkit.drift`` and ``run.grad_norms()`` (see labkit.analysis.drift for the cost).
        A NaN or infinite loss stops the run with a LabError naming the step and ranks, unless
        ``allow_nonfinite=True``. ``tp_plan`` overrides the model's own ``tp_plan`` (DTensor's
        convention) when tp > 1.

        ``profile=True`` records a torch profiler trace per engine over the steps (CPU ops; on
        a GPU kernels and memcpys too), saved as ``rank{N}.json.gz`` in a new temporary folder,
        or in the folder ``profile`` names; ``run.profile`` reads them back as a Timeline
        (labkit.record.profiler, labkit.analysis.traces).

        ``checkpoint="ckpt/"`` saves parameters, optimizer state and the step with torch's
        distributed checkpoint into ``ckpt/step_N`` every ``checkpoint_every`` steps and at the
        end, each save atomic (``run.checkpoints`` lists them); ``resume="ckpt/"`` (its last
        complete checkpoint, or one ``step_N`` folder) starts this run, under any strategy, where
        that one stopped: ``steps`` more steps, ``data(step)`` from the saved step on
        (labkit.checkpoint). ``checkpoint_async=True`` writes each save behind the next steps
        (DCP's async_save); ``run.checkpoint_io`` says how long the steps waited for it.
        """
        from ..run.runner import execute
        self._check_open()
        spec = RunSpec(strategy, model, data, loss, batch, steps, lr, momentum, seed, record,
                       extra={"snapshots": snapshots, "profile": profile, "checkpoint": checkpoint,
                              "checkpoint_every": checkpoint_every, "resume": resume,
                              "checkpoint_async": checkpoint_async}, allow_nonfinite=allow_nonfinite, tp_plan=tp_plan,
                       optimizer=optimizer, blocks=blocks, init=init)
        self._interrupt = False
        return execute(self, spec, on_step, stop=lambda: self._interrupt)

    def interrupt(self) -> None:
        """Ask a running ``lab.run`` to stop at the next step boundary.

        It does not reach a ``lab.apply`` in flight (an engine runs one call at a time); bound
        those with ``with lab.limit(seconds):``.
        """
        self._interrupt = True

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group and, for a lab that started its engines, stop them all.
        A call another thread is waiting on (a ``lab.run`` in flight) ends with LabError
        within a second or so (:meth:`_check_closing`)."""
        self._closing = True
        self._kill_stopped()
        if self.view is not None and lifetime.controller_alive(self.cluster):
            try:
                self.view.apply_async(engine.shutdown).get(timeout=10)
            except Exception:
                pass
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.cluster is not None:
            self._launched.stop()                            # and what is left of their trees
            lifetime.terminate(self._processes)              # … or of a dead controller's
            self.cluster = None
        self.view = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the engines are gone, start a new lab."""
        return self.client is None and self.view is None

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        rows = [f"  rank {r['rank']}: {r['host']} local_rank {r['local_rank']} {r['device']} pid {r['pid']}"
                for r in self.ranks]
        state = "closed" if self.client is None else f"{self.world_size} ranks"
        return "\n".join([f"Lab({state}, backend={self.ranks[0]['backend'] if self.ranks else '?'})"] + rows)

    def _repr_html_(self) -> str:
        head = "<tr><th>rank</th><th>host</th><th>local rank</th><th>device</th><th>backend</th><th>pid</th></tr>"
        body = "".join(f"<tr><td>{r['rank']}</td><td>{r['host']}</td><td>{r['local_rank']}</td>"
                       f"<td>{r['device']}</td><td>{r['backend']}</td><td>{r['pid']}</td></tr>" for r in self.ranks)
        return f"<table>{head}{body}</table>"


def _check_link(link) -> None:
    if link is not None and not isinstance(link, Link):
        raise TypeError(f"link={link!r:.60} must be a labkit.Link (labkit.Link(bandwidth=..., latency=...), "
                        f"labkit.Link.preset(name), labkit.Link.scaled(target, lab)) or None for raw gloo")


def _held_error(what: str, holder: tuple[int, str]) -> LabError:
    return LabError(f"{what}: the engines are busy with {holder[1]}; wait for it to end "
                    f"(dash.wait()) or stop it (dash.stop()), then try again")
