"""Per-rank timelines of compute and communication: one set of events, three views.

A :class:`Timeline` wraps the events gathered from every rank (schema in docs/design.md,
"Events") and shows them as

* a matplotlib figure, one lane per (rank, stream): ``tl.plot()``;
* a Chrome trace file for Perfetto or chrome://tracing: ``tl.save_trace("t.json")``;
* the docs/design.md metrics: ``tl.metrics(global_batch=64)``.

Event times restart at 0 each step. Wherever steps are shown together (``plot(step="all")``
and the trace file) they are laid back to back: step s starts where step s−1 ended, its
end being the latest end over all ranks.

    >>> tl = Timeline(run_events)
    >>> tl                                   # Timeline(4 ranks, 3 steps, 212 events, ...)
    >>> tl.step(2).plot()
    >>> compare(gpipe.timeline, one_f_one_b.timeline, labels=("GPipe", "1F1B"))
"""

from __future__ import annotations

import json
from statistics import median

import matplotlib
import matplotlib.colors
import matplotlib.figure
import matplotlib.text
from matplotlib.patches import Patch

from ..analysis import metrics as _metrics
from ..analysis.events import KINDS, OTHER_COLOR, STREAMS

# Trace thread ids. Integers with thread_name metadata, as the trace format specifies:
# Perfetto reads string tids only through a "quick-and-dirty" hack, and tid 0 is Linux's
# idle thread, which it treats specially (perfetto json_trace_parser_impl.cc; issue #394).
STREAM_TIDS = {"compute": 1, "comm": 2}

# Colours come from the kind table (labkit.analysis.events), in its order for the legend.
PALETTE = {name: kind.color for name, kind in KINDS.items()}
# Characters of x-small text that fit across a default-width figure: a span that is 10% of
# the x range holds about 11; spans with room for fewer than 2 get no label.
LABEL_CHARS_PER_AXIS = 110
# Spans of one lane overlapping by less than this are drawn as touching, in one row.
TOUCH_S = 50e-6


class Timeline:
    """Events of a run, every rank and step; see the module docstring for the views."""

    def __init__(self, events, world_size: int | None = None, title: str | None = None):
        self.events = [dict(e) for e in events]
        inferred = 1 + max((e["rank"] for e in self.events), default=-1)
        self.world_size = world_size if world_size is not None else max(inferred, 1)
        self.title = title

    def __len__(self) -> int:
        return len(self.events)

    def extend(self, events) -> None:
        """Append more events (a step's, as it arrives); those already held are not copied again."""
        self.events.extend(dict(e) for e in events)

    def __repr__(self) -> str:
        durations = list(self.step_durations().values())
        time = f", step {median(durations) * 1e3:.2f} ms" if durations else ""
        name = f"{self.title!r}, " if self.title else ""
        return (f"Timeline({name}{self.world_size} ranks, {len(self.steps)} steps, "
                f"{len(self)} events{time})")

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def steps(self) -> list[int]:
        return sorted({e["step"] for e in self.events})

    def step(self, s: int) -> "Timeline":
        """The events of step `s` only, as a new Timeline."""
        return Timeline([e for e in self.events if e["step"] == s], self.world_size, self.title)

    def step_durations(self) -> dict[int, float]:
        """Each step's duration: the latest end over all ranks."""
        ends: dict[int, float] = {}
        for e in self.events:
            ends[e["step"]] = max(ends.get(e["step"], 0.0), float(e["end"]))
        return dict(sorted(ends.items()))

    def step_offsets(self) -> dict[int, float]:
        """Start of each step on a continuous axis: the sum of the durations before it."""
        offsets, t = {}, 0.0
        for s, duration in self.step_durations().items():
            offsets[s], t = t, t + duration
        return offsets

    def metrics(self, global_batch: int, peak_activation_bytes=None) -> dict:
        """docs/design.md metrics of these events (see labkit.metrics.step_metrics)."""
        return _metrics.step_metrics(self.events, self.world_size, global_batch,
                                     peak_activation_bytes)

    # --- Chrome trace ------------------------------------------------------------------------

    def to_chrome_trace(self) -> dict:
        """Chrome trace JSON (pid = rank, one thread per stream, ph "X", times in µs)."""
        offsets = self.step_offsets()
        spans = [_trace_span(e, offsets[e["step"]]) for e in self.events]
        return {"traceEvents": self._trace_metadata() + spans, "displayTimeUnit": "ms"}

    def save_trace(self, path) -> None:
        """Write the Chrome trace to `path`; open it in ui.perfetto.dev or chrome://tracing."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)

    def _trace_metadata(self) -> list[dict]:
        """Name and order the processes "rank N" and their threads "compute"/"comm"."""
        meta = []
        for rank in self.ranks:
            meta.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
            meta.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
            for stream, tid in STREAM_TIDS.items():
                meta.append(_meta("thread_name", rank, tid, {"name": stream}))
                meta.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
        return meta

    # --- matplotlib --------------------------------------------------------------------------

    def plot(self, ax=None, step=None, figsize=None, labels: bool = True):
        """Draw one lane per (rank, stream); return the Figure.

        step: a step number, "all" (back to back, as in the trace) or None for the last step.
        ax: draw into this Axes instead of a new figure. labels: write "F3"/"B3" or the
        event name inside spans wide enough to hold it.
        """
        if ax is None:
            _, ax = _new_figure(figsize or (10, 1.0 + 0.45 * 2 * self.world_size))
        events, offsets = self._plot_events(step)
        _draw_lanes(ax, self.ranks)
        extent = max((offsets[e["step"]] + e["end"] for e in events), default=0.0) * 1e3
        slots = _stack_overlaps(events, offsets)
        for e in events:
            _draw_span(ax, self.ranks, e, offsets[e["step"]], extent if labels else None, slots[id(e)])
        for boundary in sorted(offsets.values())[1:]:  # step "all": where each step starts
            ax.axvline(boundary * 1e3, color="#444444", linestyle="--", linewidth=0.8)
        ax.set_xlim(0, extent or 1.0)
        spec = ax.get_subplotspec()
        if spec is None or spec.is_last_row():     # one x-label per figure, under the bottom panel
            ax.set_xlabel("time (ms)")
        ax.set_title(self._plot_title(step))
        kinds = {e["kind"] for e in events}
        ax.legend(handles=_legend_handles(kinds), loc="upper left", bbox_to_anchor=(1.01, 1),
                  fontsize="small", frameon=False)
        return ax.figure

    def _plot_events(self, step):
        """The events to draw and the offset of each step (0 for a single step)."""
        if step == "all":
            return self.events, self.step_offsets()
        if step is None:
            step = self.steps[-1] if self.steps else 0
        return [e for e in self.events if e["step"] == step], {step: 0.0}

    def _plot_title(self, step) -> str:
        durations = self.step_durations()
        if step == "all" or not durations:
            typical = median(durations.values()) if durations else 0.0
            detail = f"{len(durations)} steps, median {typical * 1e3:.2f} ms"
        else:
            step = self.steps[-1] if step is None else step
            detail = f"step {step}: {durations.get(step, 0.0) * 1e3:.2f} ms"
        return f"{self.title} — {detail}" if self.title else detail


def compare(a: Timeline, b: Timeline, labels=("A", "B"), step=None):
    """Two timelines stacked on one time scale (e.g. GPipe above 1F1B); returns the Figure."""
    ratios = [a.world_size, b.world_size]
    fig, (ax_a, ax_b) = _new_figure(
        (10, 1.5 + 0.45 * 2 * sum(ratios)), nrows=2, sharex=True,
        gridspec_kw={"height_ratios": ratios})
    right = 0.0
    for tl, ax, label in ((a, ax_a, labels[0]), (b, ax_b, labels[1])):
        tl.plot(ax=ax, step=step)
        ax.set_title(f"{label} — {ax.get_title()}")
        right = max(right, ax.get_xlim()[1])  # read now: the next plot resets both
    ax_a.set_xlim(0, right)
    ax_a.set_xlabel("")
    return fig


# --- helpers --------------------------------------------------------------------------------


def _trace_span(e: dict, offset: float) -> dict:
    """One event as a Chrome "complete" event, its step shifted by `offset` seconds."""
    start = (offset + float(e["start"])) * 1e6
    return {
        "name": e.get("name") or e["kind"], "cat": e["kind"], "ph": "X",
        "pid": int(e["rank"]), "tid": STREAM_TIDS.get(e["stream"], len(STREAM_TIDS) + 1),
        "ts": start, "dur": (float(e["end"]) - float(e["start"])) * 1e6,
        "args": {k: _plain(e.get(k)) for k in ("stream", "kind", "step", "microbatch",
                                               "bytes", "peer")},
    }


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _plain(value):
    """numpy scalars → Python numbers, so json.dump accepts them."""
    return value.item() if hasattr(value, "item") else value


def _new_figure(figsize, **kwargs):
    """A pyplot figure that a notebook shows exactly once, with or without a trailing ``;``.

    In a notebook the figure stays open, so the backend shows it at the end of the cell even
    when ``;`` hides the returned value. The returned :class:`TimelineFigure` shows itself at
    most once (see there). Scripts and tests (Agg and other file backends) get it closed, so
    figures do not pile up.
    """
    import matplotlib.pyplot as plt  # here, so importing labkit never picks a backend

    fig, axes = plt.subplots(figsize=figsize, layout="constrained", FigureClass=TimelineFigure, **kwargs)
    backend = matplotlib.get_backend().lower()
    if backend in ("agg", "pdf", "svg", "ps", "cairo", "pgf", "template"):
        plt.close(fig)
    return fig, axes


class TimelineFigure(matplotlib.figure.Figure):
    """A Figure that IPython displays once, whoever asks first.

    Inline backend: both the cell's value and the end-of-cell flush display the figure; the
    first one shows its picture and closes it in pyplot, so the other finds nothing to show.
    ipympl: while the figure is open its canvas widget is already on screen, so the cell's
    value adds nothing; once closed, it shows as a picture.
    """

    def _ipython_display_(self):
        import matplotlib.pyplot as plt
        from IPython.display import display

        is_open = plt.fignum_exists(getattr(self, "number", -1))
        backend = matplotlib.get_backend().lower()
        if is_open and ("ipympl" in backend or "widget" in backend):
            return
        display(_Shown(self))
        if is_open:
            plt.close(self)


class _Shown:
    """The figure's picture, for a figure pyplot no longer holds."""

    def __init__(self, fig):
        self.fig = fig

    def _repr_png_(self):
        import io

        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def _lane(ranks, rank: int, stream: str) -> int:
    """y of a lane: rank 0 compute at the top, each comm lane right below its compute."""
    return 2 * ranks.index(rank) + (0 if stream == "compute" else 1)


def _draw_lanes(ax, ranks) -> None:
    names = [f"rank {r} {s}" for r in ranks for s in STREAMS]
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # inverted: rank 0 on top
    for y in range(1, len(ranks)):
        ax.axhline(2 * y - 0.5, color="#DDDDDD", linewidth=0.8)


def _stack_overlaps(events, offsets) -> dict[int, tuple[int, int]]:
    """(row, rows) per event: spans that overlap in one lane (several buckets in flight at
    once) get thinner rows of that lane instead of hiding each other."""
    lanes: dict[tuple, list[dict]] = {}
    for e in events:
        lanes.setdefault((e["rank"], e["stream"]), []).append(e)
    slots = {}
    for lane in lanes.values():
        lane.sort(key=lambda e: offsets[e["step"]] + e["start"])
        row_ends: list[float] = []
        rows_of = {}
        for e in lane:
            start = offsets[e["step"]] + e["start"]
            # spans that only touch (a backward closing a few µs after the next one opened)
            # share a row: stacking them would split every compute lane into slivers
            row = next((i for i, end in enumerate(row_ends) if end <= start + TOUCH_S), len(row_ends))
            if row == len(row_ends):
                row_ends.append(0.0)
            row_ends[row] = offsets[e["step"]] + e["end"]
            rows_of[id(e)] = row
        for e in lane:
            slots[id(e)] = (rows_of[id(e)], len(row_ends))
    return slots


def _draw_span(ax, ranks, e: dict, offset: float, extent: float | None, slot=(0, 1)) -> None:
    """One event as a bar in its lane (or in row ``slot[0]`` of ``slot[1]`` when spans
    overlap); labelled when `extent` is given and it is wide."""
    if e["rank"] not in ranks:
        return
    row, rows = slot
    height = 0.8 / rows
    y = _lane(ranks, e["rank"], e["stream"]) - 0.4 + height * (row + 0.5)
    start, width = (offset + e["start"]) * 1e3, (e["end"] - e["start"]) * 1e3
    color = PALETTE.get(e["kind"], OTHER_COLOR)
    ax.broken_barh([(start, width)], (y - height / 2, height), facecolors=color,
                   edgecolor="white" if e["kind"] != "wait" else "#777777", linewidth=0.5,
                   hatch="//" if e["kind"] == "wait" else None)
    room = int(LABEL_CHARS_PER_AXIS * width / extent) if extent else 0
    label = _span_label(e, room)
    if label and rows <= 3:
        ax.add_artist(_FittedLabel(start, width, y, label, color=_text_color(color)))


class _FittedLabel(matplotlib.text.Text):
    """A span's label that is drawn only if it fits inside its bar as finally drawn.

    The bar's width on screen is known only at draw time: a notebook may widen the x range
    afterwards (several panels on one time axis), and a label that fitted then overflows
    into its neighbours. Checked against the rendered text's width, it is left out instead.
    """

    def __init__(self, start: float, width: float, y: float, label: str, color: str):
        super().__init__(start + width / 2, y, label, ha="center", va="center", fontsize="x-small",
                         color=color, clip_on=True)
        self.span = (start, start + width)

    def draw(self, renderer):
        ax = self.axes
        if ax is not None:
            (x0, _), (x1, _) = ax.transData.transform([(self.span[0], 0), (self.span[1], 0)])
            if self.get_window_extent(renderer).width > 0.95 * abs(x1 - x0):
                return
        super().draw(renderer)


def _span_label(e: dict, room: int) -> str | None:
    """ "F3"/"B3" for a micro-batch's forward/backward, else the name; None when it does not
    fit in ``room`` characters (a cut label, "0.…", reads as a different name)."""
    if e["kind"] in ("fwd", "bwd") and e.get("microbatch") is not None:
        label = f"{e['kind'][0].upper()}{e['microbatch']}"
    else:
        label = e.get("name") or e["kind"]
    return label if len(label) <= room else None


def _text_color(hex_color: str) -> str:
    """Black on light bars, white on dark ones (relative luminance, sRGB weights)."""
    r, g, b = matplotlib.colors.to_rgb(hex_color)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _legend_handles(kinds) -> list[Patch]:
    """One patch per kind present, in the palette's fixed order, unknown kinds last."""
    ordered = [k for k in PALETTE if k in kinds] + sorted(kinds - PALETTE.keys())
    return [Patch(facecolor=PALETTE.get(k, OTHER_COLOR), hatch="//" if k == "wait" else None,
                  edgecolor="#777777", label=k) for k in ordered]
