"""Runs for the dashboard: step by step, asynchronously, one at a time.

``lab.run`` holds the notebook until the run ends; a dashboard must not. :class:`LiveRunner`
makes the same calls as ``labkit.runner.execute`` (validate in the notebook, then
ensure_groups → setup_run → run_step per step on the engines) but chains them with
``AsyncResult.add_done_callback``, so the kernel stays free and every step's timeline and
metrics arrive as soon as that step ends.

    >>> live = LiveRunner(lab, on_update=lambda lr: print(lr.step, lr.run.losses[-1]))
    >>> live.submit(RunSpec(Strategy(dp=2), labkit.models.mlp(width=64, depth=4), steps=5))
    >>> live.submit(spec2)     # a run is in flight: queued; a later submit replaces it
    >>> live.stop()            # end the run at the next step boundary, drop the queue
    >>> live.wait()            # scripts and tests only: block until idle

Coalescing: at most one run is in flight; of the specs submitted meanwhile only the latest
runs next. ``engine.ensure_groups`` keeps the process groups when the degrees are unchanged;
each run records what it answered in ``LiveRun.groups_rebuilt``.

Callbacks (``on_start``, ``on_update``, ``on_finish``) run on ipyparallel's client thread:
they must be quick and must not wait for the engines (that thread delivers the answers).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import engine
from ..errors import LabError
from ..parallel.build import RunSpec
from .result import Run
from .runner import _global_loss, _metrics, ship_by_value, validate
from ..view.timeline import Timeline
from ..analysis.waits import split_waits


@dataclass
class LiveRun:
    """One submitted run as it goes: its spec, the growing ``Run`` and how it ended."""

    spec: RunSpec
    number: int
    run: Run
    state: str = "starting"          # starting → running → done | stopped | failed
    step: int = -1                   # the last step that finished
    error: BaseException | None = None
    groups_rebuilt: list[bool] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    step_done_at: list[float] = field(default_factory=list)
    finished_at: float | None = None
    stop_requested: bool = False
    peak: list[int] = field(default_factory=list, repr=False)   # activation bytes per rank
    finished: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def steps(self) -> int:
        return self.spec.steps

    @property
    def ended(self) -> bool:
        return self.state in ("done", "stopped", "failed")


class LiveRunner:
    """Runs specs on ``lab`` without blocking; see the module docstring."""

    def __init__(self, lab, on_start: Callable | None = None, on_update: Callable | None = None,
                 on_finish: Callable | None = None):
        self.lab = lab
        self.on_start, self.on_update, self.on_finish = on_start, on_update, on_finish
        self.current: LiveRun | None = None
        self.last: LiveRun | None = None           # the latest run that ended
        self.started = 0                           # runs started so far
        self._pending: RunSpec | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    # -- the notebook side --------------------------------------------------------------------
    def submit(self, spec: RunSpec, checked: bool = False) -> str:
        """Validate ``spec`` (ValueError/TypeError here, before any engine; ``checked``: the
        caller just did), then run it now ("started") or after the run in flight ("queued",
        replacing anything queued before)."""
        if not checked:
            validate(spec, self.lab.world_size)
        ship_by_value(spec.model, spec.data, spec.loss)
        with self._lock:
            if self.current is not None:
                self._pending = spec
                return "queued"
            live = self._begin(spec)
        self._start(live)
        return "started"

    def stop(self) -> None:
        """End the run in flight at its next step boundary and forget any queued spec."""
        with self._lock:
            self._pending = None
            if self.current is not None:
                self.current.stop_requested = True

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    @property
    def pending(self) -> RunSpec | None:
        return self._pending

    def wait(self, timeout: float = 120.0) -> LiveRun | None:
        """Block until no run is in flight or queued; return the last run. Not for callbacks."""
        if not self._idle.wait(timeout):
            raise TimeoutError(f"the live run did not finish within {timeout:g} s")
        return self.last

    # -- the chain of calls ---------------------------------------------------------------------
    def _begin(self, spec: RunSpec) -> LiveRun:
        """Under the lock: make ``spec`` the run in flight."""
        self.started += 1
        run = Run(spec.strategy, [], Timeline([], self.lab.world_size), {}, spec.batch, ranks=self.lab.ranks)
        self.current = LiveRun(spec, self.started, run)
        self._idle.clear()
        return self.current

    def _start(self, live: LiveRun) -> None:
        _notify(self.on_start, live)
        s = live.spec.strategy
        self._call(live, engine.ensure_groups, (s.dp, s.pp, s.tp), self._after_groups)

    def _call(self, live: LiveRun, fn, args: tuple, then: Callable) -> None:
        """``fn(*args)`` on every rank; ``then(live, results)`` once all have answered."""
        try:
            ar = self.lab.view.apply_async(fn, *args)
        except Exception as exc:          # a closed lab, a spec that does not pickle, ...
            self._finish(live, "failed", exc)
            return
        ar.add_done_callback(lambda _: self._resume(live, ar, fn.__name__, then))

    def _resume(self, live: LiveRun, ar, what: str, then: Callable) -> None:
        if live.ended:
            return
        try:
            results = self.lab._gather(ar, 5, what)      # done already: rank reports on failure
            then(live, results)
        except BaseException as exc:     # never let an exception die on the client thread
            self._finish(live, "failed", exc)

    def _after_groups(self, live: LiveRun, rebuilt: list[bool]) -> None:
        live.groups_rebuilt = rebuilt
        self._call(live, engine.setup_run, (live.spec,), self._after_setup)

    def _after_setup(self, live: LiveRun, _) -> None:
        live.state = "running"
        live.peak = [0] * self.lab.world_size
        if live.stop_requested:
            self._finish(live, "stopped")
            return
        self._call(live, engine.run_step, (0,), self._after_step)

    def _after_step(self, live: LiveRun, results: list[dict]) -> None:
        """As ``runner.execute`` does after each step: loss, events, timeline, metrics."""
        live.step += 1
        live.step_done_at.append(time.perf_counter())
        run, world = live.run, self.lab.world_size
        run.losses.append(_global_loss(results))
        events = list(run.timeline.events)
        step_events = []
        for r in results:
            step_events.extend(r["events"])
            live.peak[r["rank"]] = max(live.peak[r["rank"]], r.get("peak_activation_bytes", 0))
        events.extend(split_waits(step_events))
        run.timeline = Timeline(events, world)
        run.metrics = _metrics(events, world, live.spec, list(live.peak), live.step)
        last, stop = live.step == live.steps - 1, live.stop_requested
        if not last and not stop:   # send the next step first: the engines
            self._call(live, engine.run_step, (live.step + 1,), self._after_step)   # work meanwhile
        _notify(self.on_update, live)
        if last or stop:                   # Stop acts here, at a step boundary
            run.interrupted = not last
            self._finish(live, "done" if last else "stopped")

    def _finish(self, live: LiveRun, state: str, error: BaseException | None = None) -> None:
        """End ``live``; start the latest queued spec, if any."""
        with self._lock:
            if live.ended:
                return
            live.state, live.error, live.finished_at = state, error, time.perf_counter()
            self.last, self.current = live, None
            spec, self._pending = self._pending, None
            nxt = self._begin(spec) if spec is not None else None
        live.finished.set()
        _notify(self.on_finish, live)
        if nxt is not None:
            self._start(nxt)
            return
        with self._lock:
            if self.current is None:     # nothing was submitted meanwhile
                self._idle.set()


def _notify(callback: Callable | None, live: LiveRun) -> None:
    """Call a widget callback; its own errors must not stop the run."""
    if callback is None:
        return
    try:
        callback(live)
    except Exception:
        import traceback
        traceback.print_exc()


def describe_error(error: BaseException) -> str:
    """One line for a status bar: the failing ranks and why, else the exception itself."""
    if isinstance(error, LabError) and error.reports:
        first = error.reports[0]
        where = "rank ?" if first.rank is None else f"rank {first.rank}"
        more = f" (+{len(error.reports) - 1} more)" if len(error.reports) > 1 else ""
        return f"{where}: {first.error}: {_first_line(first.message)}{more}"
    return f"{type(error).__name__}: {_first_line(str(error))}"


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]
