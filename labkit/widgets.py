"""The dashboard: tune a strategy with widgets and watch every rank's timeline redraw live.

    %matplotlib widget                       # ipympl: the timeline redraws in place
    dash = labkit.widgets.Dashboard(lab, model=labkit.models.mlp(width=256, depth=8), batch=64)
    dash                                     # show it; change a slider and the run follows

Every change of a control checks the settings in the notebook (an impossible combination is
shown in the status line and disables Run; it never reaches the engines) and, with "run on
change" ticked, submits a run. Runs go through :class:`labkit.run.live.LiveRunner`, the same
step loop as ``lab.run`` on a worker thread: one at a time, the latest settings queued, Stop
at the next step boundary. The kernel never waits, and one painter thread does all the
drawing, so a slow redraw never holds up the next step and only the newest timeline is drawn.

The parts: the form (:mod:`labkit.view.form`, controls from Strategy's field metadata), the
status line and tables (:mod:`labkit.view.status`), the canvas and painter
(:mod:`labkit.view.canvas`), and this app wiring them to the runner. It sits above both
``run/`` and ``view/``, as the CLI does: the views never import the run driver, nor it them.

Pin keeps the latest run; the Compare tab then shows it above the newest run on one time
axis, with the metric differences. From code (tests, a guided tour)::

    dash.set(microbatches=4, dp_mode="bucketed")     # one run for both changes
    dash.wait()                                      # block until idle (not in callbacks)
    dash.latest.run.metrics["overlap_fraction"]
"""
from __future__ import annotations

import re
import threading
import time

import ipywidgets as W

from .config import SCHEDULES, Strategy
from .parallel.build import RunSpec
from .run.live import LiveRun, LiveRunner, describe_error
from .run.runner import validate
from .view import form
from .view.canvas import Painter, WidgetFigure, fit_title, use_ipympl
from .view.form import STRATEGY_FIELDS
from .view.status import diff_table, labels, metrics_table, status_html
from .view.timeline import MAX_HEIGHT_IN

_READ = object()     # Dashboard._choice: read, do not replace
CONTROL_WIDTH = "240px"


class Dashboard:
    """Strategy controls, Run/Stop/Pin, a live per-rank timeline, metrics and a status line."""

    def __init__(self, lab, model, batch: int = 64, steps: int = 3, data=None, loss="mse",
                 lr: float = 0.1, seed: int = 0, strategy: Strategy | None = None,
                 auto: bool = True, plot: str = "auto"):
        self.lab, self.batch, self.lr, self.seed = lab, batch, lr, seed
        self.models = form.model_choices(model, data, loss, batch)   # the model control's choices
        self.pinned: LiveRun | None = None
        self.draws = 0                   # timeline redraws so far
        self.last_draw: tuple | None = None       # (run number, step, perf_counter) of the latest
        self._problem, self._state = "", ("ok", "ready")
        self._holding = False
        self._status_lock = threading.Lock()      # the notebook and client threads both write it
        self.runner = LiveRunner(lab, on_start=self._started, on_update=self._stepped,
                                 on_finish=self._finished)
        self._painter = Painter()
        self._build_controls(strategy or Strategy(dp=lab.world_size), steps, auto)
        self._build_views(plot)
        self.widget = self._layout()
        self._check()
        self._closing = threading.Event()
        threading.Thread(target=self._watch_lab, name="labkit-dashboard-watch", daemon=True).start()

    # -- what a notebook or test calls --------------------------------------------------------
    def run(self, *_) -> str | None:
        """Submit the current settings ("started", "queued", "running" when the run in flight
        already has them, or None when they are invalid)."""
        spec = self._check()
        if spec is None:
            return None
        current = self.runner.current
        if current is not None and self.runner.pending is None and _same(spec, current.spec):
            # a control that re-sent its own value (a front end syncing a slider) is no change
            self._show(("busy", f"run {current.number} in flight with these settings"))
            return "running"
        try:
            outcome = self.runner.submit(spec, checked=True)
        except Exception as exc:                 # validation raced a change: show, do not raise
            self._set_problem(describe_error(exc))
            return None
        if outcome == "queued":
            self._show(("busy", f"run {self.runner.current.number if self.runner.current else '?'} "
                                f"in flight · your change is queued"))
        return outcome

    def stop(self, *_) -> None:
        """End the run in flight at the next step boundary; drop queued changes, and say so:
        the controls then show settings that have not run."""
        dropped = self.runner.pending
        self.runner.stop()
        self._dropped = dropped is not None
        if dropped is not None:
            self._show(("busy", f"stopping · your queued change ({_describe(dropped.strategy)}) is dropped: "
                                "press Run to run it"))

    def pin(self, *_) -> str | None:
        """Keep the latest finished run to compare the next ones against (Compare tab); the
        status line confirms, or says why there is nothing to pin yet."""
        live = self.runner.last
        if live is None or not live.run.losses:
            self._show(("busy", "nothing to pin yet: pin keeps a finished run"))
            return None
        self.pinned = live
        self._show(("ok", f"pinned run {live.number} ({_describe(live.spec.strategy)}): "
                          "the Compare tab shows it above the next runs"))
        self._painter.request("compare", self._draw_compare)
        return f"run {live.number}"

    def set(self, **values) -> str | None:
        """Set several controls at once (one check, one run when "run on change" is ticked)."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise KeyError(f"no such control: {sorted(unknown)}; controls are {sorted(self.controls)}")
        if "model" in values:         # first: what the other controls offer depends on it
            form.check_offered("model", values["model"], self.controls["model"])
            self._holding = True
            try:
                self.controls["model"].value = values["model"]
            finally:
                self._holding = False
            self._fit_to_model()
        for name, value in values.items():
            try:
                form.check_offered(name, value, self.controls[name])
            except ValueError as exc:       # not offered for this model: say why
                why = self._limits.get({"tp": "tp", "schedule": "interleaved"}.get(name, ""))
                raise ValueError(f"{exc}; {why}" if why else str(exc)) from None
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        if self.controls["auto"].value:
            return self.run()
        self._check()
        return None

    def wait(self, timeout: float = 120.0) -> LiveRun | None:
        """Block until no run is in flight or queued and the timeline is drawn. Not in callbacks."""
        live = self.runner.wait(timeout)
        self._painter.wait(timeout)
        return live

    @property
    def latest(self) -> LiveRun | None:
        """The run in flight, else the last one that ended."""
        return self.runner.current or self.runner.last

    @property
    def status_text(self) -> str:
        return self._problem or self._state[1]

    def strategy(self) -> Strategy:
        """The Strategy the controls describe (ValueError if impossible)."""
        return Strategy(**{name: self.controls[name].value for name in STRATEGY_FIELDS})

    def _choice(self, part: int, value=_READ):
        """Read (or, with ``value``, replace) part ``part`` (0 model, 1 data, 2 loss) of the
        model control's current choice."""
        name = self.controls["model"].value
        if value is not _READ:
            entry = list(self.models[name])
            entry[part] = value
            self.models[name] = tuple(entry)
        return self.models[name][part]

    model = property(lambda self: self._choice(0), lambda self, v: self._choice(0, v),
                     doc="The chosen model; setting it replaces that choice's model.")
    data = property(lambda self: self._choice(1), lambda self, v: self._choice(1, v),
                    doc="The chosen model's data (None: synthetic); settable.")
    loss = property(lambda self: self._choice(2), lambda self, v: self._choice(2, v),
                    doc="The chosen model's loss; settable.")

    def spec(self) -> RunSpec:
        return RunSpec(self.strategy(), self.model, self.data, self.loss, self.batch,
                       self.controls["steps"].value, self.lr, 0.0, self.seed)

    def close(self) -> None:
        self._closing.set()
        self.runner.stop()
        self._painter.close()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- building -----------------------------------------------------------------------------
    def _build_controls(self, s: Strategy, steps: int, auto: bool) -> None:
        # 240 px a control: three groups side by side in a notebook on a 1024 px screen
        style = {"description_width": "96px"}
        c = form.build_controls(s, self.lab.world_size)
        c.update({
            "steps": W.IntSlider(value=steps, min=1, max=20, description="steps per run"),
            "model": W.Dropdown(options=list(self.models), description="model"),
            "auto": W.Checkbox(value=auto, description="run on change", indent=False),
        })
        for name, w in c.items():
            if name != "auto":
                w.style, w.layout.width = style, CONTROL_WIDTH
            w.observe(self._changed, names="value")
            w.add_class(f"labkit-{name}")            # stable handles for browser tests
        self.controls = c
        def button():                    # never squeezed to "…" by a narrow notebook column
            return W.Layout(width="90px", flex="0 0 auto")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play", layout=button())
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True, layout=button())
        self.pin_button = W.Button(description="Pin", icon="thumb-tack", layout=button(),
                                   tooltip="keep this run; the Compare tab shows it beside the next")
        self.run_button.on_click(self.run)
        self.stop_button.on_click(self.stop)
        self.pin_button.on_click(self.pin)
        # a view of the drawn step, not a setting: it redraws, it never starts a run
        self.path_box = W.Checkbox(value=False, description="critical path", indent=False,
                                   tooltip="outline the chain of spans that set the step's length")
        self.path_box.add_class("labkit-critical-path")
        self.path_box.observe(lambda _change: self._redraw(), names="value")
        self.progress = W.IntProgress(value=0, min=0, max=steps, layout=W.Layout(width="120px", flex="0 0 auto"))
        self.status = W.HTML(layout=W.Layout(min_width="280px", flex="1 1 280px"))
        self.status.add_class("labkit-status")
        # per group, what this model cannot run and why (form.model_limits), under its title
        self.notes = {axis: W.HTML(layout=W.Layout(width=CONTROL_WIDTH)) for _, axis in form.GROUPS}
        self._fit_to_model()

    def _build_views(self, plot: str) -> None:
        interactive = use_ipympl(plot)
        world = self.lab.world_size
        self.timeline_view = WidgetFigure(timeline_figsize(world), 1, interactive)
        self.compare_view = WidgetFigure(timeline_figsize(world, panels=2), 2, interactive, sharex=True)
        self.metrics = W.HTML(metrics_table(None))
        self.metrics.add_class("labkit-metrics")
        self.timeline_view.widget.add_class("labkit-timeline")
        self.diff = W.HTML("<i>Pin a run, change a setting, run again: the two appear here.</i>")
        self.tabs = W.Tab(children=[W.VBox([self.timeline_view.widget, self.metrics]),
                                    W.VBox([self.compare_view.widget, self.diff])])
        self.tabs.set_title(0, "Timeline")
        self.tabs.set_title(1, "Compare")

    def _layout(self) -> W.Widget:
        """Two fixed rows (buttons and the status; the run's model and options), then the
        groups, three a row at 1024 px, so nothing wraps mid-row and the timeline starts high."""
        c = self.controls
        axis_of = dict(form.GROUPS)

        def group(title, names):
            return W.VBox([W.HTML(f"<b>{title}</b>"), self.notes[axis_of[title]]] + [c[n] for n in names],
                          layout=W.Layout(width=CONTROL_WIDTH, margin="0 12px 6px 0"))
        panel = W.HBox([group(title, names) for title, names in form.groups()],
                       layout=W.Layout(flex_flow="row wrap"))
        buttons = W.HBox([self.run_button, self.stop_button, self.pin_button, self.progress, self.status],
                         layout=W.Layout(align_items="center", flex_flow="row wrap"))   # the status under them when narrow
        options = W.HBox([c["model"], c["steps"], c["auto"], self.path_box], layout=W.Layout(flex_flow="row wrap"))
        return W.VBox([buttons, options, panel, self.tabs], layout=W.Layout(width="100%"))

    def _fit_to_model(self) -> None:
        """Offer only what the chosen model can run (tp without a tp_plan, interleaved on
        blocks no stage count divides: the dashboard has no control for either fix), and say
        why beside the group; the bucket slider gets the model's largest gradient as a hint."""
        from .run.runner import model_for_checks

        try:
            limits = form.model_limits(model_for_checks(self.model, self.seed), self.lab.world_size)
        except Exception:             # a model the checks cannot read: the status line says why on Run
            limits = {}
        self._limits = limits
        c, held = self.controls, self._holding
        self._holding = True          # the changes below are the dashboard's, not a reader's
        try:
            tp_off = "tp" in limits
            if tp_off and c["tp"].value > 1:      # its ranks go to dp: the lab's engines stay used
                c["dp"].value, c["tp"].value = c["dp"].value * c["tp"].value, 1
            c["tp"].options = [1] if tp_off else list(range(1, self.lab.world_size + 1))
            for name in ("tp", "tp_mode", "sequence_parallel"):
                c[name].disabled = tp_off
            schedules = [x for x in SCHEDULES if x != "interleaved" or "interleaved" not in limits]
            if c["schedule"].value not in schedules:
                c["schedule"].value = "1f1b"
            c["schedule"].options = schedules
        finally:
            self._holding = held
        notes = {"tp": limits.get("tp"), "pp": limits.get("interleaved"), "dp": limits.get("bucket")}
        for axis, note in self.notes.items():
            note.value = f"<small style='color:#666'>{notes[axis]}</small>" if notes.get(axis) else ""

    # -- checking and submitting (notebook thread) ------------------------------------------------
    def _changed(self, change) -> None:
        if self._holding or change.get("old") == change.get("new"):
            return
        if change.get("owner") is self.controls["model"]:
            self._fit_to_model()
        if self._check() is not None and self.controls["auto"].value and change["owner"] is not self.controls["auto"]:
            self.run()

    def _check(self) -> RunSpec | None:
        """The spec the controls describe, or None after showing why it cannot run."""
        if getattr(self.lab, "closed", False):     # lab.close() ran, in any cell
            self._set_problem("the lab is closed: start a new one")
            return None
        try:
            spec = self.spec()
            validate(spec, self.lab.world_size)
        except Exception as exc:      # ValueError from Strategy/validate; ImportError: pp not built
            self._set_problem(f"cannot run: {_first_line(exc)}")
            return None
        self._set_problem("")
        return spec

    def _watch_lab(self, every: float = 0.5) -> None:
        """Show "the lab is closed" as soon as ``lab.close()`` ran, wherever it was called: the
        status line must not promise a Run that would fail (a reader closes it when done)."""
        while not self._closing.wait(every):
            if getattr(self.lab, "closed", False):
                self._check()
                return

    def _set_problem(self, text: str) -> None:
        self.run_button.disabled = bool(text)
        self._render_status(problem=text)

    def _show(self, state: tuple[str, str]) -> None:
        self._render_status(state=state)

    def _render_status(self, problem: str | None = None, state: tuple[str, str] | None = None) -> None:
        """One line: a settings problem while there is one, else the run's state."""
        with self._status_lock:
            self._problem = self._problem if problem is None else problem
            self._state = state or self._state
            kind, text = ("problem", self._problem) if self._problem else self._state
            self.status.value = status_html(kind, text)

    # -- runner callbacks (ipyparallel's client thread: quick, no waiting) -----------------------
    def _started(self, live: LiveRun) -> None:
        self.progress.max, self.progress.value = live.steps, 0
        self.stop_button.disabled = False
        self._show(("busy", f"run {live.number}: starting {_describe(live.spec.strategy)}"))

    def _stepped(self, live: LiveRun) -> None:
        self.progress.value = live.step + 1
        queued = " · 1 change queued" if self.runner.pending is not None else ""
        self._show(("busy", f"run {live.number}: step {live.step + 1}/{live.steps} · "
                            f"loss {live.run.losses[-1]:.4g}{queued}"))
        self.metrics.value = metrics_table(live)
        timeline, step = live.run.timeline, live.step        # this step's, whatever comes next
        self._painter.request("timeline", lambda: self._draw_timeline(live, timeline, step))

    def _finished(self, live: LiveRun) -> None:
        self.stop_button.disabled = self.runner.pending is None
        if live.state == "failed":
            self._show(("error", f"run {live.number} failed: {describe_error(live.error)}"))
            return
        m, groups = live.run.metrics, "kept" if not any(live.groups_rebuilt or [True]) else "rebuilt"
        ended = "done" if live.state == "done" else f"stopped after step {live.step + 1}/{live.steps}"
        unrun = " · the controls' queued change was dropped: press Run" if getattr(self, "_dropped", False) else ""
        self._dropped = False
        self._show(("ok", f"run {live.number} {ended} · {1e3 * m.get('step_time_s', 0):.1f} ms/step "
                          f"(median over its steps) · process groups {groups}{unrun}"))
        if self.pinned is not None and self.pinned is not live:
            self._painter.request("compare", self._draw_compare)

    # -- drawing (painter thread) --------------------------------------------------------------
    def _draw_timeline(self, live: LiveRun, timeline, step: int) -> None:
        title = f"run {live.number} · {_describe(live.spec.strategy)}"
        self._drawn = (live, timeline, step)
        redraw_timeline(self.timeline_view, timeline, step, title, critical_path=self.path_box.value)
        self.draws += 1
        self.last_draw = (live.number, step, time.perf_counter())

    def _redraw(self) -> None:
        """The step on show drawn again (the critical-path toggle changed)."""
        drawn = getattr(self, "_drawn", None)
        if drawn is not None:
            self._painter.request("timeline", lambda: self._draw_timeline(*drawn))

    def _draw_compare(self) -> None:
        a, b = self.pinned, self.runner.last
        if a is None:
            return
        if b is None or b is a or not b.run.losses:
            b = None
        names = labels(a, b)
        view = self.compare_view
        right = 0.0
        for ax, live, label in zip(view.axes, (a, b), names):   # as labkit.view.timeline.compare
            ax.clear()
            if live is None:
                ax.set_title("run again with other settings to compare", fontsize="medium")
                continue
            live.run.timeline.plot(ax=ax)
            ax.set_title(fit_title(view.fig, f"{label} — {ax.get_title()}"), fontsize="medium")
            right = max(right, ax.get_xlim()[1])
        view.axes[0].set_xlim(0, right or 1.0)
        view.axes[0].set_xlabel("")
        view.show()
        self.diff.value = diff_table(a, b, names)


def timeline_figsize(world: int, panels: int = 1) -> tuple[float, float]:
    """The timeline tab's figure (`panels` stacked timelines): 0.6 inch a rank per panel, at
    most MAX_HEIGHT_IN per panel as a plot(): taller, a page shows a fraction of it and every
    redraw renders and ships pixels nobody sees."""
    return 8, panels * min(MAX_HEIGHT_IN, 0.6 + 0.6 * world) + 0.6


def redraw_timeline(view: WidgetFigure, timeline, step: int, title: str, critical_path: bool = False) -> None:
    """Draw `step` of `timeline` into `view` in place of what it showed, titled
    "<title> · <the plot's title>" (benchmarks/bench_timeline.py --redraw times this);
    ``critical_path``: the step's critical path outlined, and what holds it in the title."""
    ax = view.axes[0]
    view.clear(ax)
    timeline.plot(ax=ax, step=step, critical_path=critical_path)
    # y given: the title sits at the top edge, not above the measured boxes of every tick
    # label (there are none on top, and measuring them each redraw is slow)
    # "this step": the metrics table gives the median over the run's steps, which can differ
    ax.set_title(fit_title(view.fig, f"{title} · {ax.get_title()} (this step)"), fontsize="medium", y=1.0)
    view.show()


# -- text helpers ------------------------------------------------------------------------------
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _same(a: RunSpec, b: RunSpec) -> bool:
    """Whether two specs would train the same run (a model factory compares by identity)."""
    try:
        return bool(a == b)
    except Exception:           # a field whose == is not a bool (a tensor in extra): not the same
        return False


def _describe(s: Strategy) -> str:
    """The settings that matter for these degrees, short (Strategy.label), numbers to the
    slider's precision ("0.0156 MiB", not "0.015625 MiB")."""
    return re.sub(r"\d+\.\d{4,}", lambda m: f"{float(m[0]):.3g}", s.label())
