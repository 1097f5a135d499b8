"""Runs for the dashboard: step by step, on a worker thread, one at a time.

``lab.run`` holds the notebook until the run ends; a dashboard must not. :class:`LiveRunner`
runs each submitted spec through the very step loop ``lab.run`` uses
(:func:`labkit.run.runner.execute`) on a worker thread, so the kernel stays free, every
step's timeline and metrics arrive as soon as that step ends, and a failure or a change of
degrees is handled exactly as in ``lab.run`` (fresh store, blocked ranks freed). While a run
is in flight the lab is held: a ``lab.run`` or ``lab.apply`` from the notebook raises
LabError instead of interleaving with it on the engines.

    >>> live = LiveRunner(lab, on_update=lambda lr: print(lr.step, lr.run.losses[-1]))
    >>> live.submit(RunSpec(Strategy(dp=2), labkit.models.mlp(width=64, depth=4), steps=5))
    >>> live.submit(spec2)     # a run is in flight: queued; a later submit replaces it
    >>> live.stop()            # end the run at the next step boundary, drop the queue
    >>> live.wait()            # scripts and tests only: block until idle

Coalescing: at most one run is in flight; of the specs submitted meanwhile only the latest
runs next. ``engine.ensure_groups`` keeps the process groups when the degrees are unchanged;
each run records what it answered in ``LiveRun.groups_rebuilt``.

Callbacks (``on_start``, ``on_update``, ``on_finish``) run on the worker thread: they must be
quick (widget updates; drawing goes to the dashboard's painter thread).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import PEER_ERRORS, LabError
from ..parallel.build import RunSpec
from ..analysis.timeline import Timeline
from .result import Run
from .runner import execute, ship_by_value, validate


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

    # -- the worker thread ----------------------------------------------------------------------
    def _begin(self, spec: RunSpec) -> LiveRun:
        """Under the lock: make ``spec`` the run in flight."""
        self.started += 1
        run = Run(spec.strategy, [], Timeline([], self.lab.world_size, grid=spec.strategy), {}, spec.batch, ranks=self.lab.ranks)
        self.current = LiveRun(spec, self.started, run)
        self._idle.clear()
        return self.current

    def _start(self, live: LiveRun) -> None:
        threading.Thread(target=self._drive, args=(live,), name=f"labkit-run-{live.number}", daemon=True).start()

    def _drive(self, live: LiveRun) -> None:
        """The run, through lab.run's own step loop; never lets an exception die on the thread."""
        _notify(self.on_start, live)
        try:
            run = execute(self.lab, live.spec, on_step=lambda run, step: self._stepped(live, run, step),
                          stop=lambda: live.stop_requested, on_groups=lambda rebuilt: self._grouped(live, rebuilt),
                          what=f"dashboard run {live.number}")
        except BaseException as exc:
            self._finish(live, "failed", exc)
            return
        live.run = run
        self._finish(live, "stopped" if run.interrupted else "done")

    def _grouped(self, live: LiveRun, rebuilt: list[bool]) -> None:
        live.groups_rebuilt, live.state = rebuilt, "running"

    def _stepped(self, live: LiveRun, run: Run, step: int) -> None:
        live.run, live.step = run, step
        live.step_done_at.append(time.perf_counter())
        _notify(self.on_update, live)

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
    """One line for a status bar: the root cause — the rank whose own error started it, not a
    peer that timed out waiting for it — else the exception itself."""
    if isinstance(error, LabError) and error.reports:
        more = f" (+{len(error.reports) - 1} more)" if len(error.reports) > 1 else ""
        return root_cause(error) + more
    return f"{type(error).__name__}: {_first_line(str(error))}"


def root_cause(error: LabError) -> str:
    """A rank's own error if one raised it; else the rank a hang report names as missing; else
    the first report. Peers that timed out or lost their connection are only the echo."""
    own = [r for r in error.reports if r.error not in PEER_ERRORS]
    if own:
        return _say(own[0])
    hang = getattr(error, "hang", None)
    if hang is not None and hang.not_reached:
        return (f"rank {hang.not_reached[0]} never reached {hang.op} '{hang.name}' (step {hang.step}); "
                f"rank(s) {hang.reached} timed out waiting for it")
    return _say(error.reports[0])


def _say(report) -> str:
    where = "rank ?" if report.rank is None else f"rank {report.rank}"
    return f"{where}: {report.error}: {_first_line(report.message)}"


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]
