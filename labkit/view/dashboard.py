"""The dashboard: tune a strategy with widgets and watch every rank's timeline redraw live.

    %matplotlib widget                       # ipympl: the timeline redraws in place
    dash = labkit.widgets.Dashboard(lab, model=labkit.models.mlp(width=256, depth=8), batch=64)
    dash                                     # show it; change a slider and the run follows

Every change of a control checks the settings in the notebook (an impossible combination is
shown in the status line and disables Run; it never reaches the engines) and, with "run on
change" ticked, submits a run. Runs go through :class:`labkit.live.LiveRunner`: one at a
time, the latest settings queued, Stop at the next step boundary. The kernel never waits;
answers arrive on ipyparallel's client thread, and one painter thread does all the drawing,
so a slow redraw never holds up the next step and only the newest timeline is drawn.

Pin keeps the latest run; the Compare tab then shows it above the newest run on one time
axis, with the metric differences. From code (tests, a guided tour)::

    dash.set(microbatches=4, dp_mode="bucketed")     # one run for both changes
    dash.wait()                                      # block until idle (not in callbacks)
    dash.latest.run.metrics["overlap_fraction"]
"""
from __future__ import annotations

import html
import io
import threading
import time

import ipywidgets as W
import matplotlib

from ..config import COMPRESSIONS, DP_MODES, SCHEDULES, Strategy
from ..parallel.build import RunSpec
from ..run.live import LiveRun, LiveRunner, describe_error
from ..run.runner import validate

# Controls that map one to one onto Strategy fields, in the order they are shown.
STRATEGY_FIELDS = ("dp", "pp", "tp", "schedule", "chunks", "microbatches", "dp_mode", "bucket_mb",
                   "compression")
COLORS = {"ok": "#1b7a3d", "busy": "#1f5fa8", "problem": "#a35a00", "error": "#b00020"}


class Dashboard:
    """Strategy controls, Run/Stop/Pin, a live per-rank timeline, metrics and a status line."""

    def __init__(self, lab, model, batch: int = 64, steps: int = 3, data=None, loss="mse",
                 lr: float = 0.1, seed: int = 0, strategy: Strategy | None = None,
                 auto: bool = True, plot: str = "auto"):
        self.lab, self.model, self.batch, self.data = lab, model, batch, data
        self.loss, self.lr, self.seed = loss, lr, seed
        self.pinned: LiveRun | None = None
        self.draws = 0                   # timeline redraws so far
        self.last_draw: tuple | None = None       # (run number, step, perf_counter) of the latest
        self._problem, self._state = "", ("ok", "ready")
        self._holding = False
        self._status_lock = threading.Lock()      # the notebook and client threads both write it
        self.runner = LiveRunner(lab, on_start=self._started, on_update=self._stepped,
                                 on_finish=self._finished)
        self._painter = _Painter()
        self._build_controls(strategy or Strategy(dp=lab.world_size), steps, auto)
        self._build_views(plot)
        self.widget = self._layout()
        self._check()

    # -- what a notebook or test calls --------------------------------------------------------
    def run(self, *_) -> str | None:
        """Submit the current settings ("started", "queued", or None when they are invalid)."""
        spec = self._check()
        if spec is None:
            return None
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
        """End the run in flight at the next step boundary; drop queued changes."""
        self.runner.stop()

    def pin(self, *_) -> None:
        """Keep the latest finished run to compare the next ones against (Compare tab)."""
        live = self.runner.last
        if live is None or not live.run.losses:
            return
        self.pinned = live
        self._painter.request("compare", self._draw_compare)

    def set(self, **values) -> str | None:
        """Set several controls at once (one check, one run when "run on change" is ticked)."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise KeyError(f"no such control: {sorted(unknown)}; controls are {sorted(self.controls)}")
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

    def spec(self) -> RunSpec:
        return RunSpec(self.strategy(), self.model, self.data, self.loss, self.batch,
                       self.controls["steps"].value, self.lr, 0.0, self.seed)

    def close(self) -> None:
        self.runner.stop()
        self._painter.close()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- building -----------------------------------------------------------------------------
    def _build_controls(self, s: Strategy, steps: int, auto: bool) -> None:
        degrees = list(range(1, self.lab.world_size + 1))
        style = {"description_width": "100px"}
        c = {
            "dp": W.Dropdown(options=degrees, value=s.dp, description="dp"),
            "pp": W.Dropdown(options=degrees, value=s.pp, description="pp"),
            "tp": W.Dropdown(options=degrees, value=s.tp, description="tp"),
            "schedule": W.Dropdown(options=SCHEDULES, value=s.schedule, description="schedule"),
            "chunks": W.IntSlider(value=s.chunks, min=1, max=4, description="chunks / rank"),
            "microbatches": W.IntSlider(value=s.microbatches, min=1, max=16, description="micro-batches"),
            "dp_mode": W.Dropdown(options=DP_MODES, value=s.dp_mode, description="dp mode"),
            "bucket_mb": W.FloatLogSlider(value=s.bucket_mb, base=2, min=-6, max=4, step=1,
                                          description="bucket (MiB)", readout_format=".3g"),
            "compression": W.Dropdown(options=COMPRESSIONS, value=s.compression, description="compression"),
            "steps": W.IntSlider(value=steps, min=1, max=20, description="steps per run"),
            "auto": W.Checkbox(value=auto, description="run on change", indent=False),
        }
        for name, w in c.items():
            if name != "auto":
                w.style, w.layout.width = style, "270px"
            w.observe(self._changed, names="value")
            w.add_class(f"labkit-{name}")            # stable handles for browser tests
        self.controls = c
        button = W.Layout(width="90px")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play", layout=button)
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True, layout=button)
        self.pin_button = W.Button(description="Pin", icon="thumb-tack", layout=button,
                                   tooltip="keep this run; the Compare tab shows it beside the next")
        self.run_button.on_click(self.run)
        self.stop_button.on_click(self.stop)
        self.pin_button.on_click(self.pin)
        self.progress = W.IntProgress(value=0, min=0, max=steps, layout=W.Layout(width="120px"))
        self.status = W.HTML(layout=W.Layout(min_width="400px"))
        self.status.add_class("labkit-status")

    def _build_views(self, plot: str) -> None:
        interactive = _use_ipympl(plot)
        world = self.lab.world_size
        self.timeline_view = _Figure((8, 1.2 + 0.6 * world), 1, interactive)
        self.compare_view = _Figure((8, 1.8 + 1.2 * world), 2, interactive, sharex=True)
        self.metrics = W.HTML(_metrics_table(None))
        self.metrics.add_class("labkit-metrics")
        self.timeline_view.widget.add_class("labkit-timeline")
        self.diff = W.HTML("<i>Pin a run, change a setting, run again: the two appear here.</i>")
        self.tabs = W.Tab(children=[W.VBox([self.timeline_view.widget, self.metrics]),
                                    W.VBox([self.compare_view.widget, self.diff])])
        self.tabs.set_title(0, "Timeline")
        self.tabs.set_title(1, "Compare")

    def _layout(self) -> W.Widget:
        c = self.controls
        group = lambda title, *names: W.VBox([W.HTML(f"<b>{title}</b>")] + [c[n] for n in names])  # noqa: E731
        panel = W.HBox([group("Degrees", "dp", "pp", "tp"),
                        group("Pipeline (pp > 1)", "schedule", "chunks", "microbatches"),
                        group("Data parallel", "dp_mode", "bucket_mb", "compression")],
                       layout=W.Layout(flex_flow="row wrap"))
        bar = W.HBox([self.run_button, self.stop_button, self.pin_button, c["steps"], c["auto"]],
                     layout=W.Layout(flex_flow="row wrap"))
        return W.VBox([bar, W.HBox([self.progress, self.status]), panel, self.tabs], layout=W.Layout(width="100%"))

    # -- checking and submitting (notebook thread) ------------------------------------------------
    def _changed(self, change) -> None:
        if self._holding:
            return
        if self._check() is not None and self.controls["auto"].value and change["owner"] is not self.controls["auto"]:
            self.run()

    def _check(self) -> RunSpec | None:
        """The spec the controls describe, or None after showing why it cannot run."""
        if getattr(self.lab, "closed", False):     # lab.close() ran (notebook 05 ends with it)
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
            self.status.value = f'<span style="color:{COLORS[kind]}">{html.escape(text)}</span>'

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
        self.metrics.value = _metrics_table(live)
        timeline, step = live.run.timeline, live.step        # this step's, whatever comes next
        self._painter.request("timeline", lambda: self._draw_timeline(live, timeline, step))

    def _finished(self, live: LiveRun) -> None:
        self.stop_button.disabled = self.runner.pending is None
        if live.state == "failed":
            self._show(("error", f"run {live.number} failed: {describe_error(live.error)}"))
            return
        m, groups = live.run.metrics, "kept" if not any(live.groups_rebuilt or [True]) else "rebuilt"
        ended = "done" if live.state == "done" else f"stopped after step {live.step + 1}/{live.steps}"
        self._show(("ok", f"run {live.number} {ended} · {1e3 * m.get('step_time_s', 0):.1f} ms/step · "
                          f"process groups {groups}"))
        if self.pinned is not None and self.pinned is not live:
            self._painter.request("compare", self._draw_compare)

    # -- drawing (painter thread) --------------------------------------------------------------
    def _draw_timeline(self, live: LiveRun, timeline, step: int) -> None:
        view = self.timeline_view
        ax = view.axes[0]
        ax.clear()
        timeline.plot(ax=ax, step=step)
        ax.set_title(f"run {live.number} · {_describe(live.spec.strategy)} · {ax.get_title()}", fontsize="medium")
        view.show()
        self.draws += 1
        self.last_draw = (live.number, step, time.perf_counter())

    def _draw_compare(self) -> None:
        a, b = self.pinned, self.runner.last
        if a is None:
            return
        if b is None or b is a or not b.run.losses:
            b = None
        labels = _labels(a, b)
        view = self.compare_view
        right = 0.0
        for ax, live, label in zip(view.axes, (a, b), labels):   # as labkit.timeline.compare
            ax.clear()
            if live is None:
                ax.set_title("run again with other settings to compare", fontsize="medium")
                continue
            live.run.timeline.plot(ax=ax)
            ax.set_title(f"{label} — {ax.get_title()}", fontsize="medium")
            right = max(right, ax.get_xlim()[1])
        view.axes[0].set_xlim(0, right or 1.0)
        view.axes[0].set_xlabel("")
        view.show()
        self.diff.value = _diff_table(a, b, labels)


class _Figure:
    """A figure shown in a widget and redrawn in place: ipympl's canvas, or a PNG (fallback)."""

    def __init__(self, figsize, nrows: int, interactive: bool, **kwargs):
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=figsize, layout="constrained")
        self.axes = list(self.fig.subplots(nrows, 1, squeeze=False, **kwargs)[:, 0])
        self.interactive = interactive
        if interactive:   # a canvas widget of our own: not in pyplot's list, never auto-shown
            from ipympl.backend_nbagg import Canvas, FigureManager

            canvas = Canvas(self.fig)
            FigureManager(canvas, 0)
            canvas.header_visible = canvas.footer_visible = False
            canvas.toolbar_position = "right"
            # ipympl keeps a PNG copy in the widget state until the page's view says it is
            # ready; a draw from our thread before then ships a copy the page cannot decode
            # and the canvas in a box stays 0×0. The page asks for a full image anyway.
            canvas.syncing_data_url = False
            self.widget = canvas
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            FigureCanvasAgg(self.fig)
            self.widget = W.Image(format="png", layout=W.Layout(max_width="900px"))
        for ax in self.axes:
            ax.set_axis_off()

    def show(self) -> None:
        for ax in self.axes:
            ax.set_axis_on()
        if self.interactive:
            # A whole frame, not a difference from the last one: a page that missed a frame
            # (drawn while it was busy) would otherwise keep stale pixels.
            self.fig.canvas._force_full = True
            self.fig.canvas.draw()
        else:
            buf = io.BytesIO()
            self.fig.savefig(buf, format="png", dpi=90)
            self.widget.value = buf.getvalue()


class _Painter:
    """One daemon thread that runs drawing jobs; a newer job of the same kind replaces an older."""

    def __init__(self):
        self._jobs: dict[str, object] = {}
        self._busy = self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def request(self, kind: str, job) -> None:
        with self._cv:
            self._jobs.pop(kind, None)
            self._jobs[kind] = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="labkit-painter", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout):
                raise TimeoutError(f"drawing did not finish within {timeout:g} s")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    return
                kind = next(iter(self._jobs))
                job, self._busy = self._jobs.pop(kind), True
            try:
                job()
            except Exception:
                import traceback
                traceback.print_exc()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


# -- text helpers ------------------------------------------------------------------------------
def _use_ipympl(plot: str) -> bool:
    if plot not in ("auto", "ipympl", "image"):
        raise ValueError(f"plot={plot!r}; use 'auto', 'ipympl' or 'image'")
    if plot == "auto":
        backend = matplotlib.get_backend().lower()
        return "ipympl" in backend or backend == "widget"
    return plot == "ipympl"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _describe(s: Strategy) -> str:
    """The settings that matter for these degrees, short: "dp=2 overlap 1 MiB mb=2"."""
    parts = [f"dp={s.dp}"] + ([f"pp={s.pp} {s.schedule}"] if s.pp > 1 else []) + ([f"tp={s.tp}"] if s.tp > 1 else [])
    if s.dp > 1:
        parts.append(s.dp_mode + (f" {s.bucket_mb:g} MiB" if s.dp_mode != "naive" else ""))
        if s.compression != "none":
            parts.append(s.compression)
    parts.append(f"mb={s.microbatches}")
    return " ".join(parts)


def _labels(a: LiveRun, b: LiveRun | None) -> tuple[str, str]:
    """Name two runs by the settings that differ ("microbatches=1" vs "microbatches=4")."""
    if b is None:
        return f"pinned run {a.number}", "—"
    sa, sb = a.spec.strategy.to_dict(), b.spec.strategy.to_dict()
    differ = [k for k in sa if sa[k] != sb[k]] + (["steps"] if a.steps != b.steps else [])
    if not differ:
        return f"pinned run {a.number}", f"run {b.number}"
    value = lambda live, k: live.steps if k == "steps" else getattr(live.spec.strategy, k)  # noqa: E731
    say = lambda live: ", ".join(f"{k}={value(live, k)}" for k in differ[:3])  # noqa: E731
    return f"pinned run {a.number} ({say(a)})", f"run {b.number} ({say(b)})"


ROWS = (  # (label, how to read it from a Run, format)
    ("step time", lambda r: 1e3 * r.metrics["step_time_s"], "{:.2f} ms"),
    ("samples/s", lambda r: r.metrics["throughput_samples_s"], "{:.0f}"),
    ("comm", lambda r: 100 * r.metrics["comm_fraction"], "{:.1f}%"),
    ("exposed comm", lambda r: 100 * r.metrics["exposed_comm_fraction"], "{:.1f}%"),
    ("overlap", lambda r: 100 * r.metrics["overlap_fraction"], "{:.1f}%"),
    ("bubble", lambda r: 100 * r.metrics["bubble_fraction"], "{:.1f}%"),
    ("sent / step", lambda r: r.metrics["bytes_sent_total"] / 2**10, "{:.0f} KiB"),
    ("peak activations", lambda r: max(r.metrics["peak_activation_bytes"] or [0]) / 2**10, "{:.0f} KiB"),
    ("loss", lambda r: r.losses[-1], "{:.4g}"),
)


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Metrics as columns, runs as rows: compact under a wide figure."""
    cell = '<{0} style="padding:2px 9px;text-align:{1};white-space:nowrap">{2}</{0}>'
    head = "".join(cell.format("th", "right" if i else "left", html.escape(h)) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell.format("td", "right" if i else "left", html.escape(v))
                                    for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f'<table style="border-collapse:collapse;font-size:90%"><tr>{head}</tr>{body}</table>'


def _metrics_table(live: LiveRun | None) -> str:
    if live is None or not live.run.losses:
        return "<i>No run yet: press Run or change a setting.</i>"
    values = [fmt.format(get(live.run)) for _, get, fmt in ROWS]
    return _table([""] + [label for label, _, _ in ROWS], [[f"run {live.number}, step {live.step + 1}"] + values])


def _change(a: float, b: float, points: bool) -> str:
    """Fractions differ in percentage points, everything else relatively."""
    if points:
        return f"{b - a:+.1f} pts"
    return f"{(b - a) / abs(a):+.0%}" if a else f"{b - a:+.3g}"


def _diff_table(a: LiveRun, b: LiveRun | None, labels) -> str:
    rows = [[labels[0]] + [fmt.format(get(a.run)) for _, get, fmt in ROWS]]
    if b is not None:
        rows.append([labels[1]] + [fmt.format(get(b.run)) for _, get, fmt in ROWS])
        rows.append(["change"] + [_change(get(a.run), get(b.run), fmt.endswith("%")) for _, get, fmt in ROWS])
    return _table([""] + [label for label, _, _ in ROWS], rows)
