"""The notebook side: the Lab facade over engines, ranks, the torch.distributed world and runs.

>>> with labkit.Lab.start(engines=2) as lab:          # two local CPU engines, gloo
...     run = lab.run(labkit.Strategy(dp=2), model=labkit.models.mlp(width=64, depth=4))
...     run.timeline.plot()

Data flows one way: attach (engines, ranks, devices) → process groups → strategy builder →
instrumented steps → events gathered after each step → metrics, plots, trace files. The Lab
holds the state and delegates each job to its own module: starting engines through a launcher
(:mod:`.launch`, local being one of them), the rank map and the store's address
(:mod:`.ranks`), remote calls and their failure triage (:mod:`.calls`), waiting on the ranks
and recovering from a failed call (:mod:`.health`), ``Lab.start``'s
argument checks (:mod:`.checks`), the local processes' lifetime (:mod:`.lifetime`), the step
loop (:mod:`labkit.run.runner`).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable

import ipyparallel as ipp

from .. import engine
from ..config import Strategy
from ..grid import ParallelDims
from ..errors import LabError
from ..link import Link
from ..parallel.build import RunSpec
from ..run.result import Run
from ..view.status import StatusLine, link_text
from . import calls, lifetime
from .health import Recovery
from .checks import check_start
from .launch import Launched, start_engines
from .ranks import map_ranks, master_address


class Lab(Recovery):
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

    def _check_open(self) -> None:
        if self.client is None:
            raise LabError("the lab is closed; start a new one with labkit.Lab.start(...) "
                           "or labkit.Lab.connect(...)")

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
    def grid(self, strategy: Strategy, ax=None):
        """Draw ``strategy``'s rank grid on this lab: each rank's box names its coordinates and,
        on a two-tier link, the emulated node it sits on (so a group whose boxes differ in
        colour crosses nodes). Returns the Figure (:func:`labkit.view.grid.draw_grid`)."""
        from ..view.grid import draw_grid

        if strategy.world_size != self.world_size:
            raise ValueError(f"grid: {strategy.label()} needs {strategy.world_size} ranks; this lab has {self.world_size}")
        return draw_grid(strategy, ax=ax, gpus_per_node=getattr(self.link, "gpus_per_node", None))

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
