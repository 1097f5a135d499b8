"""The notebook side: start or attach engines, run strategies on them, gather what happened.

>>> with labkit.Lab.start(engines=2) as lab:          # two local CPU engines, gloo
...     run = lab.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=64, depth=4))
...     run.timeline.plot()

Data flows one way: attach (engines, ranks, devices) → process groups → strategy builder →
instrumented steps → events gathered after each step → metrics, plots, trace files.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from concurrent import futures
from typing import Callable

import ipyparallel as ipp

from .. import engine
from ..analysis import diagnose
from ..config import Strategy
from ..errors import CollectiveTimeoutError, EngineDiedError, LabError, RankReport
from ..parallel.build import RunSpec
from ..engine.placement import check_device_map
from ..run.result import Run

TIMEOUT_ERRORS = ("CollectiveTimeout",)
COMM_ERRORS = ("CollectiveTimeout", "CommFailure", "CommMismatch", "DistBackendError", "DistNetworkError")
# Once one rank has failed, how long the others get to finish or fail before the lab reports.
GRACE_S = 2.0


class Lab:
    """A set of engines, one rank each, with torch.distributed initialised on them."""

    def __init__(self, client: ipp.Client, cluster: ipp.Cluster | None, timeout: float,
                 master_addr: str | None = None, threads: int | None = None, progress: bool = True):
        self.client, self.cluster, self.timeout = client, cluster, float(timeout)
        self.threads, self._progress = threads, progress
        self._master_addr = master_addr
        self.ranks: list[dict] = []
        self._engine_of: dict[int, int] = {}     # rank → engine id
        self._rank_of: dict[int, int] = {}       # engine id → rank
        self._interrupt = False
        self.view = None
        self.debug = False
        self._dead: list[int] = []      # ranks whose engine died: lab.recover() restarts them
        self._dirty = False             # a call failed: fresh store and groups before the next one
        self._busy: list = []           # futures of ranks still running a call that failed elsewhere
        self._groups_key = None
        self._launcher = "connect"

    # -- starting and attaching -----------------------------------------------------------
    @classmethod
    def start(cls, engines: int = 2, timeout: float = 60.0, launcher: str = "local",
              progress: bool = True, start_timeout: float = 120.0, debug: bool = False,
              **cluster_kwargs) -> "Lab":
        """Start ``engines`` local engines (one rank each) and initialise torch.distributed.

        ``timeout`` is the collective timeout in seconds (every group and barrier gets it).
        ``debug=True`` starts the engines with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (collectives
        checked across ranks for matching op and shapes; a few ms per call).
        """
        if not isinstance(engines, int) or engines < 1:
            raise ValueError(f"engines={engines!r} must be a whole number ≥ 1")
        if launcher != "local":
            from .launchers import start_cluster
            cluster, client = start_cluster(launcher, engines, start_timeout, progress, **cluster_kwargs)
            lab = cls(client, cluster, timeout, progress=progress)
            lab.debug, lab._launcher = debug, launcher
        else:
            threads = max(1, (os.cpu_count() or 1) // engines)
            cluster = ipp.Cluster(n=engines, log_level=logging.ERROR, controller_ip="127.0.0.1", **cluster_kwargs)
            lab = cls(None, cluster, timeout, master_addr="127.0.0.1", threads=threads, progress=progress)
            lab.debug, lab._launcher = debug, "local"
            try:
                lab.client = _start_local(cluster, engines, threads, start_timeout, lab._say, debug)
            except BaseException:
                _stop_quietly(cluster)
                raise
        try:
            lab._attach(expected=engines)
        except BaseException:
            lab.close()
            raise
        return lab

    @classmethod
    def connect(cls, profile: str | None = None, cluster_id: str | None = None, url_file: str | None = None,
                engines: int | None = None, timeout: float = 60.0, wait: float = 60.0) -> "Lab":
        """Attach to engines someone already started (``ipcluster start``, Slurm, MPI, SSH)."""
        kwargs = {k: v for k, v in dict(profile=profile, cluster_id=cluster_id, url_file=url_file).items() if v}
        client = ipp.Client(**kwargs)
        if engines:
            client.wait_for_engines(engines, timeout=wait)
        if not client.ids:
            client.close()
            raise LabError(f"no engines are registered with the cluster ({kwargs or 'default profile'})")
        lab = cls(client, None, timeout)
        lab._attach(expected=len(client.ids))
        return lab

    def _say(self, text: str, end: str = "\n") -> None:
        if self._progress:     # one line updated in place in a notebook; stderr in a terminal
            from ..view.status import StatusLine
            self._status = getattr(self, "_status", None) or StatusLine()
            self._status.say(text)

    def _attach(self, expected: int, targets=None) -> None:
        """Learn each engine's rank from its environment, then join the world group."""
        self._say(f"labkit: importing torch on {expected} engines…")
        everyone = self.client.direct_view(targets if targets is not None else "all")
        infos = everyone.apply_async(engine.describe).get_dict(timeout=180)
        if any(info["rank"] is None for info in infos.values()):
            infos = self._assign_ranks(infos)
        self._engine_of = {info["rank"]: eid for eid, info in infos.items()}
        self._rank_of = {eid: rank for rank, eid in self._engine_of.items()}
        self.ranks = [infos[self._engine_of[r]] for r in sorted(self._engine_of)]
        check_device_map(self.ranks)
        self.view = self.client.direct_view(targets=[self._engine_of[r] for r in range(len(self.ranks))])
        self.view.use_cloudpickle()
        self._init_distributed()

    def _assign_ranks(self, infos: dict) -> dict:
        """No launcher rank variables (SSH): ranks by host, then process id; local ranks per host."""
        order = sorted(infos, key=lambda eid: (infos[eid]["host"], infos[eid]["pid"]))
        per_host: dict[str, int] = {}
        for rank, eid in enumerate(order):
            host = infos[eid]["host"]
            local = per_host[host] = per_host.get(host, -1) + 1
            infos[eid] = self.client[eid].apply_sync(engine.assign_rank, rank, len(order), local)
        return infos

    def _init_distributed(self) -> None:
        """A fresh rendezvous store on rank 0 (port chosen by the OS), then every rank joins."""
        world = len(self.ranks)
        master = self._master_addr or _master_address(self.ranks)
        self._dirty, self._groups_key = False, None
        port = self._on_rank(0, engine.open_store, master, world, self.timeout)
        self.apply(engine.init_distributed, master, port, world, self.timeout, self.threads, debug=self.debug)
        self.ranks = self.apply(engine.describe)
        self.store = (master, port)
        self._say(f"labkit: {world} ranks ready ({self.ranks[0]['backend']}, store {master}:{port})")

    # -- running code on the ranks ----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def apply(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; results in rank order; failures raise LabError."""
        self._ready()
        ar = self.view.apply_async(fn, *args, **kwargs)
        return self._gather(ar, timeout, what=getattr(fn, "__name__", "call"))

    def trace(self, fn: Callable, *args, **kwargs):
        """Like ``apply``, but also record the comm calls ``fn`` makes: ``(results, Timeline)``."""
        from ..view.timeline import Timeline
        from ..analysis.waits import split_waits

        out = self.apply(engine.traced, fn, args, kwargs)
        events = split_waits([e for r in out for e in r["events"]])
        return [r["result"] for r in out], Timeline(events, self.world_size)

    def _on_rank(self, rank: int, fn: Callable, *args):
        ar = self.client[self._engine_of[rank]].apply_async(fn, *args)
        return self._gather(ar, None, what=fn.__name__)

    def _gather(self, ar, timeout: float | None, what: str) -> list:
        """Wait for every rank; once one fails, the others get GRACE_S to finish or fail too.

        So a dead engine or a timed-out collective is reported within seconds, even when
        other ranks are still blocked (they are freed before the next call, see _ready).
        """
        limit = timeout if timeout is not None else 10 * self.timeout + 60
        children, targets = list(ar._children), list(ar._targets)
        deadline, first_failure, pending = time.monotonic() + limit, None, set(children)
        try:
            while pending:
                until = deadline if first_failure is None else min(deadline, first_failure + GRACE_S)
                if time.monotonic() >= until:
                    break
                done, pending = futures.wait(pending, timeout=until - time.monotonic(),
                                             return_when=futures.FIRST_COMPLETED)
                if first_failure is None and any(_error_of(f) for f in done):
                    first_failure = time.monotonic()
        except KeyboardInterrupt:
            self._dirty = True
            self._busy = [(self._rank_of.get(t), f) for t, f in zip(targets, children) if not f.done()]
            raise
        failed = [(t, _error_of(f)) for t, f in zip(targets, children) if f not in pending and _error_of(f)]
        if not failed and not pending:
            return ar.get(timeout=5)
        self._dirty = True
        self._busy = [(self._rank_of.get(t), f) for t, f in zip(targets, children) if f in pending]
        if not failed:
            raise LabError(f"{what}: no answer after {limit:g} s from ranks {[r for r, _ in self._busy]}")
        elist = []
        for target, exc in failed:
            if isinstance(exc, ipp.error.RemoteError):
                info = dict(exc.engine_info or {}, engine_id=(exc.engine_info or {}).get("engine_id", target))
                elist.append((exc.ename, exc.evalue, exc.traceback, info))
            else:
                elist.append((type(exc).__name__, str(exc), "", {"engine_id": target}))
        raise self._lab_error(elist, what) from None

    def _lab_error(self, elist, what: str) -> LabError:
        reports = []
        for ename, evalue, tb, info in elist:
            rank = self._rank_of.get((info or {}).get("engine_id"))
            reports.append(RankReport(rank, ename, str(evalue).strip(), tb or ""))
        names = {r.error for r in reports}
        failed = sorted(r.rank for r in reports if r.rank is not None)
        busy = sorted(r for r, _ in self._busy if r is not None)
        dead = sorted(r.rank for r in reports if r.error == "EngineError" and r.rank is not None)
        if dead:
            self._dead = dead
            cls, head = EngineDiedError, (f"the engine of rank(s) {dead} died (killed, crashed or out of memory); "
                                          f"lab.recover() restarts the engines")
        elif names & set(TIMEOUT_ERRORS):
            cls, head = CollectiveTimeoutError, f"a collective timed out on rank(s) {failed}"
        elif "CommMismatch" in names:
            cls, head = LabError, (f"a message's shape or dtype differs from what rank(s) {failed} expected "
                                   f"(nothing was corrupted; the engines are alive)")
        else:
            cls, head = LabError, f"failed on rank(s) {failed}"
        lines = [f"{what}: {head}"]
        if busy:
            lines.append(f"  rank(s) {busy} still busy after the others failed (blocked in the same step); "
                         f"the lab frees them before the next call")
        logs, hang = {}, None
        if not dead and (names & set(COMM_ERRORS) or busy):
            logs = self._flight_logs(skip=busy)
            hang = diagnose.explain_hang(logs, {r: "still busy" for r in busy}, self.timeout)
            if hang is not None and hang.not_reached:
                lines.append("  " + str(hang).replace("\n", "\n  "))
        error = cls("\n".join(lines), reports)
        error.hang, error.flight_logs, error.busy, error.dead = hang, logs, busy, dead
        return error

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

    def _ready(self) -> None:
        """Before a call: refuse while an engine is dead; after a failure, start on a fresh store."""
        registered = set(self.client.ids)
        self._dead = sorted(set(self._dead) | {r for r, e in self._engine_of.items() if e not in registered})
        if self._dead:
            error = EngineDiedError(f"the engine of rank(s) {self._dead} died; call lab.recover() to restart "
                                    f"the engines (the lab keeps its settings)")
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
                raise LabError(f"rank(s) {stuck} are still running the call that failed, {self.timeout + 10:g} s "
                               f"after the others left their groups (stuck outside labkit.comm?); "
                               f"lab.recover() restarts the engines")
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
        if debug is not None:
            self.debug = bool(debug)
        n, t0 = self.world_size, time.monotonic()
        old = set(self.client.ids)
        self._say(f"labkit: restarting {n} engines…")
        if self.cluster is not None and self._launcher == "local":
            for rank in range(n):
                try:
                    self.cluster.stop_engines_sync(engine_set_id=f"rank{rank}")
                except Exception:
                    pass               # its engine is already gone
            for rank in range(n):
                self.cluster.start_engines_sync(n=1, engine_set_id=f"rank{rank}",
                                                environment=_rank_env(rank, n, self.threads, self.debug))
        elif self.cluster is not None:
            self.cluster.restart_engines_sync()
        fresh = []
        while len(fresh) < n:
            if time.monotonic() - t0 > timeout:
                raise LabError(f"recover: only {len(fresh)} of {n} engines came back within {timeout:g} s")
            time.sleep(0.25)
            fresh = [e for e in self.client.ids if e not in old]
        self._dead, self._busy, self._dirty, self._groups_key = [], [], False, None
        self._attach(expected=n, targets=fresh[:n])
        self._say(f"labkit: {n} engines restarted ({time.monotonic() - t0:.0f} s)")
        return self

    def _ensure_groups(self, dp: int, pp: int, tp: int) -> None:
        """The engines' process groups for these degrees; a change of degrees starts on a fresh store.

        Re-initialising costs well under a second and drops every old group and its sockets,
        so any number of changes in a row starts from the same clean state.
        """
        if self._groups_key is not None and self._groups_key != (dp, pp, tp):
            self._init_distributed()
        self.apply(engine.ensure_groups, dp, pp, tp)
        self._groups_key = (dp, pp, tp)

    # -- training ---------------------------------------------------------------------------
    def run(self, strategy: Strategy, model, data=None, loss="mse", batch: int = 64, steps: int = 5,
            lr: float = 0.1, seed: int = 0, momentum: float = 0.0, record: bool = True,
            on_step: Callable | None = None) -> Run:
        """Train ``model`` for ``steps`` under ``strategy``; see DESIGN.md for the contract."""
        from ..run.runner import execute
        spec = RunSpec(strategy, model, data, loss, batch, steps, lr, momentum, seed, record)
        return execute(self, spec, on_step)

    def interrupt(self) -> None:
        """Ask a running ``lab.run`` to stop at the next step boundary."""
        self._interrupt = True

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group and, for a lab that started its engines, stop them all."""
        if self.view is not None:
            try:
                self.view.apply_async(engine.shutdown).get(timeout=10)
            except Exception:
                pass
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.cluster is not None:
            _stop_quietly(self.cluster)
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


def _error_of(future) -> Exception | None:
    """The error a finished per-engine future carries (ipyparallel returns remote errors as values)."""
    exc = future.exception()
    if exc is not None:
        return exc
    result = future.result()
    return result if isinstance(result, Exception) else None


def _master_address(ranks: list[dict]) -> str:
    """Where the rendezvous store listens: rank 0's MASTER_ADDR if its launcher set one, else
    rank 0's host — and never a loopback address when ranks live on several hosts."""
    first = ranks[0]
    if first.get("master_addr"):
        return first["master_addr"]
    if len({r["host"] for r in ranks}) == 1:
        return "127.0.0.1"
    address = _address_of(first["host"])
    if address.startswith("127."):
        raise LabError(f"rank 0's host {first['host']} resolves to {address}, which other hosts cannot reach; "
                       f"set MASTER_ADDR in the engines' environment to an address of {first['host']} on the "
                       f"cluster network")
    return address


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _rank_env(rank: int, n: int, threads: int, debug: bool = False) -> dict:
    """The environment of a local engine: its rank variables, loopback only, its thread share."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def _start_local(cluster: ipp.Cluster, n: int, threads: int, timeout: float, say, debug: bool = False) -> ipp.Client:
    """One engine set per rank, each with its own rank variables (never engine ids)."""
    t0 = time.monotonic()
    say(f"labkit: starting controller and {n} engines…")
    cluster.start_controller_sync()
    for rank in range(n):
        cluster.start_engines_sync(n=1, engine_set_id=f"rank{rank}", environment=_rank_env(rank, n, threads, debug))
    client = cluster.connect_client_sync()
    seen = -1
    while len(client.ids) < n:
        if time.monotonic() - t0 > timeout:
            raise LabError(f"only {len(client.ids)} of {n} engines registered within {timeout:g} s")
        if len(client.ids) != seen:
            seen = len(client.ids)
            say(f"labkit: {seen}/{n} engines up ({time.monotonic() - t0:.0f} s)")
        time.sleep(0.25)
    say(f"\rlabkit: {n}/{n} engines up ({time.monotonic() - t0:.0f} s)")
    return client


def _stop_quietly(cluster: ipp.Cluster) -> None:
    try:
        cluster.stop_cluster_sync()
    except Exception:
        pass
