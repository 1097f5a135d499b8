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
import sys
import time
from concurrent import futures
from typing import Callable

import ipyparallel as ipp

from . import diagnose, engine
from .config import Strategy
from .errors import CollectiveTimeoutError, EngineDiedError, LabError, RankReport
from .job import RunSpec
from .placement import check_device_map
from .run import Run

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
            lab.debug = debug
        else:
            threads = max(1, (os.cpu_count() or 1) // engines)
            cluster = ipp.Cluster(n=engines, log_level=logging.ERROR, controller_ip="127.0.0.1", **cluster_kwargs)
            lab = cls(None, cluster, timeout, master_addr="127.0.0.1", threads=threads, progress=progress)
            lab.debug = debug
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
        if self._progress:
            print(text, end=end, file=sys.stderr, flush=True)

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
        master = self._master_addr or _address_of(self.ranks[0]["host"])
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
        ar = self.view.apply_async(fn, *args, **kwargs)
        return self._gather(ar, timeout, what=getattr(fn, "__name__", "call"))

    def trace(self, fn: Callable, *args, **kwargs):
        """Like ``apply``, but also record the comm calls ``fn`` makes: ``(results, Timeline)``."""
        from .timeline import Timeline
        from .waits import split_waits

        out = self.apply(engine.traced, fn, args, kwargs)
        events = split_waits([e for r in out for e in r["events"]])
        return [r["result"] for r in out], Timeline(events, self.world_size)

    def _on_rank(self, rank: int, fn: Callable, *args):
        ar = self.client[self._engine_of[rank]].apply_async(fn, *args)
        return self._gather(ar, None, what=fn.__name__)

    def _gather(self, ar, timeout: float | None, what: str) -> list:
        deadline = timeout if timeout is not None else 10 * self.timeout + 60
        try:
            return ar.get(timeout=deadline)
        except ipp.error.CompositeError as exc:
            raise self._lab_error(exc.elist, what) from None
        except ipp.error.RemoteError as exc:
            raise self._lab_error([(exc.ename, exc.evalue, exc.traceback, exc.engine_info)], what) from None
        except TimeoutError:
            waiting = [self._rank_of.get(e) for e, done in zip(ar._targets, _done_flags(ar)) if not done]
            raise LabError(f"{what}: no answer after {deadline:g} s from ranks {waiting}") from None

    def _lab_error(self, elist, what: str) -> LabError:
        reports = []
        for ename, evalue, tb, info in elist:
            rank = self._rank_of.get((info or {}).get("engine_id"))
            reports.append(RankReport(rank, ename, str(evalue).strip(), tb or ""))
        names = {r.error for r in reports}
        if "EngineError" in names:
            cls, head = EngineDiedError, "an engine died"
        elif names & set(TIMEOUT_ERRORS):
            cls, head = CollectiveTimeoutError, "a collective timed out"
        else:
            cls, head = LabError, "failed"
        return cls(f"{what}: {head} on rank(s) {sorted(r.rank for r in reports if r.rank is not None)}", reports)

    # -- training ---------------------------------------------------------------------------
    def run(self, strategy: Strategy, model, data=None, loss="mse", batch: int = 64, steps: int = 5,
            lr: float = 0.1, seed: int = 0, momentum: float = 0.0, record: bool = True,
            on_step: Callable | None = None) -> Run:
        """Train ``model`` for ``steps`` under ``strategy``; see DESIGN.md for the contract."""
        from .runner import execute
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


def _done_flags(ar) -> list[bool]:
    return [msg_id not in ar._client.outstanding for msg_id in ar.msg_ids]


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _start_local(cluster: ipp.Cluster, n: int, threads: int, timeout: float, say) -> ipp.Client:
    """One engine set per rank, each with its own rank variables (never engine ids)."""
    t0 = time.monotonic()
    say(f"labkit: starting controller and {n} engines…")
    cluster.start_controller_sync()
    for rank in range(n):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
               "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
        cluster.start_engines_sync(n=1, engine_set_id=f"rank{rank}", environment=env)
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
