"""Timelines drawn: one lane per (rank, stream), or, for many ranks, lanes that aggregate.

:func:`plot_timeline` draws a :class:`labkit.analysis.timeline.Timeline` (``tl.plot()``);
:func:`compare` stacks two on one time axis. Each kind of span is one ``PolyCollection``
(not one artist per span), labels go only on spans wide enough to hold them, and the figure
is at most :data:`MAX_HEIGHT_IN` tall, so 256 ranks × 400 spans draw in about a second.

Past :data:`AGGREGATE_ABOVE` ranks the plot aggregates: for each pipeline stage (all ranks
when the Timeline has no grid), the lanes of its slowest, median and fastest replica by
compute time, above a ranks × time heatmap of what every rank was doing (computing,
communicating with no compute to hide it, idle). ``plot(ranks=[...])`` or ``plot(stage=1)``
zooms back into individual ranks.

    >>> tl.plot()                     # ≤ 32 ranks: every lane; more: aggregated
    >>> tl.plot(stage=2)              # the replicas of pipeline stage 2, every lane
    >>> compare(gpipe.timeline, one_f_one_b.timeline, labels=("GPipe", "1F1B"))
"""

from __future__ import annotations

import re
from statistics import median

import matplotlib
import matplotlib.colors
import matplotlib.figure
import matplotlib.text
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path

from ..analysis.events import KINDS, OTHER_COLOR, STREAMS
from ..analysis.table import EventTable, reach_before
from ..analysis.timeline import Timeline
from ..analysis.traces import TRACE_COLORS

# Colours come from the kind table (labkit.analysis.events), in its order for the legend.
PALETTE = {name: kind.color for name, kind in KINDS.items()}
# Spans of one kind that a timeline must tell apart: tensor parallelism's all-reduces (f and g,
# named "tp …") beside data parallelism's buckets on a tp × dp grid (notebook 07) get a darker
# shade of the kind's colour and their own legend entry. (kind, name prefix) → (label, colour).
VARIANTS = {("allreduce", "tp "): ("allreduce (tp)", "#8F3E00")}
# Characters of x-small text that fit across a default-width figure: a span that is 10% of
# the x range holds about 11; spans with room for fewer than 2 get no label.
LABEL_CHARS_PER_AXIS = 110
# At most this many labels per plot (the widest spans): beyond it text is unreadable anyway.
MAX_LABELS = 300
# Spans of one lane overlapping by less than this are drawn as touching, in one row.
TOUCH_S = 50e-6
# More ranks than this and plot() aggregates (see the module docstring): 32 ranks are 64
# lanes, about the most a 12-inch figure shows with readable tick labels.
AGGREGATE_ABOVE = 32
EDGELESS_ABOVE = 20_000
MAX_HEIGHT_IN = 12.0
# Comm between emulated nodes (labkit.Link's "inter" tier): cross-hatched over the kind's colour.
INTER_HATCH, INTER_EDGE, INTER_LABEL = "xx", "#222222", "between nodes (hatched)"
LANE_IN = 0.45
# Heatmap states, in drawing order (0, 1, 2), and time bins across the axis.
# A pipeline action's name as torch spells it: stage, op, micro-batch ("0RECV_B3").
_ACTION = re.compile(r"^\d+(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_ACTION_LABEL = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": "→F", "RECV_F": "←F",
                 "SEND_B": "→B", "RECV_B": "←B"}
_KIND_LETTER = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W"}
# The key to the span labels, one line per family, each shown only when a label of it was
# written (a data-parallel run's "F0"/"B0" need the first line, not the pipeline's arrows).
KEY = (("F3 · B3  forward · backward of micro-batch 3", ("F", "B")),
       ("I3 · W3  its input · weight gradient", ("I", "W")),
       ("→F3 · ←F3  send · receive its activations", ("→F", "←F")),
       ("→B3 · ←B3  send · receive its gradient", ("→B", "←B")))


def key_for(labels) -> str | None:
    """The lines of KEY that explain ``labels`` (the pipeline labels drawn), or None."""
    prefixes = {label.rstrip("0123456789") for label in labels}
    lines = [line for line, family in KEY if prefixes & set(family)]
    return "\n".join(lines) or None


def plot_timeline(tl: Timeline, ax=None, step=None, figsize=None, labels: bool = True,
                  ranks=None, stage: int | None = None, aggregate: bool | None = None,
                  critical_path: bool = False):
    """Draw `tl`; return the Figure.

    step: a step number, "all" (back to back, as in the trace) or None for the last step.
    ax: draw into this Axes instead of a new figure (the aggregated view then draws its lanes
    only, no heatmap). labels: write "F3"/"B3" or the event name inside spans wide enough.
    ranks / stage: draw only these ranks / the replicas of this pipeline stage (needs the
    Timeline's grid). aggregate: force the aggregated view on or off (default: on past
    AGGREGATE_ABOVE ranks when neither ranks nor stage is given). critical_path: outline the
    spans on the step's critical path (labkit.analysis.graph) in black, and say in the title
    what holds it.
    """
    table, shift, offsets = _window(tl, step)
    shown = _shown_ranks(tl, ranks, stage)
    if aggregate is None:
        aggregate = ranks is None and stage is None and len(shown) > AGGREGATE_ABOVE
    extent = float(np.max(shift + table["end"], initial=0.0)) * 1e3
    lanes = _representatives(tl, table, shown) if aggregate else [(r, _rank_name(tl, r)) for r in shown]
    heat_ax = None
    if ax is None:      # into a given Axes the aggregated view draws its lanes only
        ax, heat_ax = _axes(len(lanes), aggregate, figsize)
    _draw_lanes(ax, [name for _, name in lanes])
    written, crossed = _draw_spans(ax, table, shift, [r for r, _ in lanes], extent if labels else None)
    key = key_for(written)
    for boundary in sorted(offsets.values())[1:]:  # step "all": where each step starts
        ax.axvline(boundary * 1e3, color="#444444", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, extent or 1.0)
    ax.set_title(_plot_title(tl, step) + (f" — {len(shown)} ranks, 3 per stage shown" if aggregate else ""))
    if critical_path:
        from .paths import outline_path
        outline_path(ax, tl, step, [r for r, _ in lanes])
    _legend(ax, set(np.unique(shown_kinds(table["kind"], table["name"])).tolist()), key, crossed)
    if heat_ax is not None:
        from .heatmap import draw_heatmap
        draw_heatmap(heat_ax, table, shift, shown, extent, tl)
        ax = heat_ax
    spec = ax.get_subplotspec()
    if spec is None or spec.is_last_row():     # one x-label per figure, under the bottom panel
        ax.set_xlabel("time (ms)")
    return ax.figure


def _axes(lanes: int, heat: bool, figsize):
    """A new figure's Axes for `lanes` ranks' lanes (and the heatmap's below), at most
    MAX_HEIGHT_IN tall; (lanes Axes, heatmap Axes or None)."""
    height = min(MAX_HEIGHT_IN, 1.0 + LANE_IN * 2 * lanes + (4.0 if heat else 0.0))
    if not heat:
        return _new_figure(figsize or (10, height))[1], None
    _, (ax, heat_ax) = _new_figure(figsize or (10, height), nrows=2, sharex=True,
                                   gridspec_kw={"height_ratios": [2 * lanes, 2 * lanes + 4]})
    return ax, heat_ax


def _legend(ax, kinds: set, key: str | None, crossed: bool = False) -> None:
    """The kinds drawn, in the palette's order; above them the key to the "F3", "←B0" labels
    drawn; and, where comm crossed nodes on a two-tier link, the hatching that marks it."""
    handles = _legend_handles(kinds)
    if crossed:
        handles.append(Patch(facecolor="white", hatch=INTER_HATCH, edgecolor=INTER_EDGE, label=INTER_LABEL))
    legend = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1),
                       fontsize="small", frameon=False, title=key,
                       title_fontsize="x-small", alignment="left")
    if key:
        legend.get_title().set_family("monospace")


def compare(a: Timeline, b: Timeline, labels=("A", "B"), step=None):
    """Two timelines stacked on one time scale (e.g. GPipe above 1F1B); returns the Figure."""
    ratios = [min(a.world_size, AGGREGATE_ABOVE), min(b.world_size, AGGREGATE_ABOVE)]
    fig, (ax_a, ax_b) = _new_figure(
        (10, min(MAX_HEIGHT_IN, 1.5 + LANE_IN * 2 * sum(ratios))), nrows=2, sharex=True,
        gridspec_kw={"height_ratios": ratios})
    right = 0.0
    for tl, ax, label in ((a, ax_a, labels[0]), (b, ax_b, labels[1])):
        tl.plot(ax=ax, step=step)
        ax.set_title(f"{label} — {ax.get_title()}")
        right = max(right, ax.get_xlim()[1])  # read now: the next plot resets both
    ax_a.set_xlim(0, right)
    ax_a.set_xlabel("")
    return fig


# --- what to draw ---------------------------------------------------------------------------


def _window(tl: Timeline, step):
    """(events to draw, each one's step offset in s, the offsets) for ``step``."""
    table = tl.table
    if step == "all":
        offsets = tl.step_offsets()
        shift = np.array([offsets[s] for s in table["step"].tolist()]) if len(table) else np.zeros(0)
        return table, shift, offsets
    if step is None:
        steps = tl.steps
        step = steps[-1] if steps else 0
    table = table.select(table["step"] == step)
    return table, np.zeros(len(table)), {step: 0.0}


def _shown_ranks(tl: Timeline, ranks, stage) -> list[int]:
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < tl.world_size]
        if bad:
            raise ValueError(f"plot(ranks=...): ranks {bad} are outside 0..{tl.world_size - 1}")
        return list(ranks)
    if stage is not None:
        if tl.grid is None:
            raise ValueError("plot(stage=...) needs the Timeline's grid: Timeline(..., grid=ParallelDims(dp, pp, tp))")
        if not 0 <= stage < tl.grid.pp:
            raise ValueError(f"plot(stage={stage}): the grid has stages 0..{tl.grid.pp - 1}")
        return [r for r in tl.ranks if tl.coords(r).get("pp") == stage]
    return tl.ranks


def _rank_name(tl: Timeline, rank: int) -> str:
    """ "rank 5", or "rank 5 dp1 pp1" with a grid (axes of degree 1 left out), and "node 2"
    where the run's emulated link has several nodes (``Timeline.gpus_per_node``)."""
    coords = tl.coords(rank)
    parts = [f"{axis}{i}" for axis, i in coords.items() if getattr(tl.grid, axis, 1) > 1]
    if tl.gpus_per_node is not None and tl.world_size > tl.gpus_per_node:
        parts.append(f"node {rank // tl.gpus_per_node}")
    return " ".join([f"rank {rank}"] + parts)


def _representatives(tl: Timeline, table: EventTable, shown: list[int]) -> list[tuple[int, str]]:
    """Per pipeline stage, its slowest, median and fastest rank by compute time (a rank that
    computes longest holds its dp peers back at the next collective)."""
    busy = np.bincount(table["rank"], np.where(table["stream"] == "compute", table["end"] - table["start"], 0.0),
                       minlength=tl.world_size)
    stages: dict[int, list[int]] = {}
    for r in shown:
        stages.setdefault(tl.coords(r).get("pp", 0), []).append(r)
    lanes = []
    for stage, members in sorted(stages.items()):
        order = sorted(members, key=lambda r: (-busy[r], r))
        where = f"pp{stage} " if tl.grid is not None and tl.grid.pp > 1 else ""
        picks = {"slowest": order[0], "median": order[len(order) // 2], "fastest": order[-1]}
        seen = set()
        for role, r in picks.items():
            if r not in seen:
                seen.add(r)
                lanes.append((r, f"{where}{role}: {_rank_name(tl, r)}"))
    return lanes


# --- lanes and spans ------------------------------------------------------------------------


def _lane(ranks, rank: int, stream: str) -> int:
    """y of a lane: rank 0 compute at the top, each comm lane right below its compute."""
    return 2 * ranks.index(rank) + (0 if stream == "compute" else 1)


def _draw_lanes(ax, names: list[str]) -> None:
    """Tick labels "<name> compute" / "<name> comm" per lane (about 60 at most, evenly picked:
    more are unreadable), and a rule between ranks."""
    rows = [f"{n} {s}" for n in names for s in STREAMS]
    size = "medium" if len(rows) <= 16 else "small" if len(rows) <= 40 else "x-small"
    shown = range(0, len(rows), 2 * max(1, len(names) // 30)) if len(rows) > 64 else range(len(rows))
    ax.set_yticks(list(shown), [rows[i] for i in shown], fontsize=size)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # inverted: the first lane on top
    if len(names) > 1:
        ax.hlines(np.arange(1, len(names)) * 2 - 0.5, 0, 1, transform=ax.get_yaxis_transform(),
                  color="#DDDDDD", linewidth=0.8)


def _draw_spans(ax, table: EventTable, shift, lane_ranks: list[int], extent: float | None) -> tuple[set[str], bool]:
    """Every span of the lanes' ranks, one PolyCollection per kind; labels where they fit; comm
    that crossed nodes (``tier`` "inter" on an emulated two-tier link) hatched over its colour.
    Returns the pipeline labels ("F3", "←B0") written, so the caller keys what it drew, and
    whether any span crossed nodes."""
    index = np.full(int(max(lane_ranks, default=0)) + 1, -1)
    index[lane_ranks] = np.arange(len(lane_ranks))
    rank = table["rank"]
    keep = rank < len(index)
    keep[keep] = index[rank[keep]] >= 0
    t = table.select(keep)
    lane = 2 * index[t["rank"]] + (t["stream"] != "compute")
    x0 = (shift[keep] + t["start"]) * 1e3
    width = (t["end"] - t["start"]) * 1e3
    row, rows = _rows(lane, x0, x0 + width, TOUCH_S * 1e3)
    height = 0.8 / rows
    y = lane - 0.4 + height * (row + 0.5)
    kinds = shown_kinds(t["kind"], t["name"])
    for kind in np.unique(kinds).tolist():
        m = kinds == kind
        bars = _bars(x0[m], width[m], y[m], height[m], kind)
        ax.add_collection(bars)
        if kind == "wait":
            ax.add_artist(_hatching(bars))
    crossed = t["tier"] == "inter"
    if crossed.any():
        bars = _bars(x0[crossed], width[crossed], y[crossed], height[crossed], "inter")
        ax.add_artist(_hatching(bars, INTER_HATCH, INTER_EDGE))
    return (_draw_labels(ax, t, x0, width, y, rows, extent) if extent else set()), bool(crossed.any())


def _bars(x0, width, y, height, kind: str) -> PolyCollection:
    """Rectangles (x0, y ± height/2, width) as one collection in the kind's colour."""
    lo, hi = y - height / 2, y + height / 2
    verts = np.stack([np.stack([x0, lo], 1), np.stack([x0, hi], 1),
                      np.stack([x0 + width, hi], 1), np.stack([x0 + width, lo], 1)], 1)
    wait = kind == "wait"
    # White edges part neighbouring bars; past EDGELESS_ABOVE bars they are thinner than a
    # pixel apart anyway, and stroking them costs a quarter of the drawing time.
    edges = 0.0 if len(x0) > EDGELESS_ABOVE else 0.5
    return PolyCollection(verts, facecolors=_color(kind), label=kind,
                          edgecolors="#777777" if wait else "white", linewidths=edges)


def _hatching(bars: PolyCollection, hatch: str = "//", color: str = "#777777") -> PathPatch:
    """The hatching of wait bars (or of comm between nodes), as one path over all of them: Agg
    renders the hatch pattern once per path, and per bar it took longer than every other kind drawn."""
    path = Path.make_compound_path(*bars.get_paths())
    return PathPatch(path, facecolor="none", edgecolor=color, linewidth=0, hatch=hatch)


def _rows(lane, x0, x1, touch: float):
    """(row, rows) per span: spans that overlap in one lane (several buckets in flight at
    once) get thinner rows of that lane instead of hiding each other. Most lanes have no
    overlap; only those that do go through the greedy row assignment."""
    row, rows = np.zeros(len(lane), dtype=int), np.ones(len(lane), dtype=int)
    if not len(lane):
        return row, rows
    order = np.lexsort((x0, lane))
    # spans that only touch (a backward closing a few µs after the next one opened)
    # share a row: stacking them would split every compute lane into slivers
    overlapping = x0[order] + touch < reach_before(lane[order], x0[order], x1[order])
    sorted_lane = lane[order]
    bounds = np.flatnonzero(np.diff(sorted_lane)) + 1
    for members, hit in zip(np.split(order, bounds), np.split(overlapping, bounds)):
        if not hit.any():
            continue
        row_ends: list[float] = []
        for i in members.tolist():
            r = next((k for k, end in enumerate(row_ends) if end <= x0[i] + touch), len(row_ends))
            if r == len(row_ends):
                row_ends.append(0.0)
            row_ends[r] = x1[i]
            row[i] = r
        rows[members] = len(row_ends)
    return row, rows


def _draw_labels(ax, t: EventTable, x0, width, y, rows, extent: float) -> set[str]:
    """A label inside each span with room for it, the widest MAX_LABELS at most; returns the
    pipeline labels among them."""
    room = (LABEL_CHARS_PER_AXIS * width / extent).astype(int)
    candidates = np.flatnonzero((room >= 2) & (rows <= 3))
    candidates = candidates[np.argsort(-width[candidates], kind="stable")[:MAX_LABELS]]
    keyed: set[str] = set()
    names, kinds, mbs = t["name"], t["kind"], t["microbatch"]
    for i in sorted(candidates.tolist()):
        label, is_action = _span_label(str(kinds[i]), names[i], int(mbs[i]))
        if len(label) > room[i]:   # a cut label, "0.…", reads as a different name
            continue
        if is_action:
            keyed.add(label)
        color = _color(str(kinds[i]))
        ax.add_artist(_FittedLabel(x0[i], width[i], y[i], label, color=_text_color(color)))
    return keyed


def _span_label(kind: str, name: str, microbatch: int) -> tuple[str, bool]:
    """(label, whether it is a pipeline action): "F3"/"B3"/"I3"/"W3" for a micro-batch's
    compute, "→F3"/"←B0" for a pipeline send/receive (torch's "0SEND_F3"/"0RECV_B0"), else
    the name."""
    action = _ACTION.match(name or "")
    if action:
        return _ACTION_LABEL[action.group(1)] + action.group(2), True
    if kind in _KIND_LETTER and microbatch >= 0:
        return f"{_KIND_LETTER[kind]}{microbatch}", True
    return name or kind, False


# --- the heatmap ----------------------------------------------------------------------------


def _plot_title(tl: Timeline, step) -> str:
    durations = tl.step_durations()
    if step == "all" or not durations:
        typical = median(durations.values()) if durations else 0.0
        detail = f"{len(durations)} steps, median {typical * 1e3:.2f} ms"
    else:
        step = tl.steps[-1] if step is None else step
        detail = f"step {step}: {durations.get(step, 0.0) * 1e3:.2f} ms"
    return f"{tl.title} — {detail}" if tl.title else detail


# --- figures --------------------------------------------------------------------------------


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


def shown_kinds(kinds, names):
    """Each span's kind as drawn: its kind, or the VARIANTS label its name selects."""
    out = np.asarray(kinds).astype(object)
    for (kind, prefix), (label, _) in VARIANTS.items():
        mask = out == kind
        if mask.any():
            picked = np.fromiter((str(n).startswith(prefix) for n in np.asarray(names)[mask]), bool, mask.sum())
            where = np.flatnonzero(mask)[picked]
            out[where] = label
    return out


_VARIANT_COLORS = {label: color for label, color in VARIANTS.values()}


def _color(kind: str) -> str:
    """The kind table's colour (or its VARIANTS shade), a profiler trace's kinds next
    (labkit.analysis.traces), else grey."""
    return PALETTE.get(kind) or _VARIANT_COLORS.get(kind) or TRACE_COLORS.get(kind, OTHER_COLOR)


def _text_color(hex_color: str) -> str:
    """Black on light bars, white on dark ones (relative luminance, sRGB weights)."""
    r, g, b = matplotlib.colors.to_rgb(hex_color)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _legend_handles(kinds) -> list[Patch]:
    """One patch per kind present, in the palette's fixed order, unknown kinds last."""
    variants = {base: label for (base, _), (label, _) in VARIANTS.items()}
    ordered = [v for k in PALETTE for v in (k, variants.get(k)) if v in kinds]
    ordered += sorted(kinds - set(ordered))
    return [Patch(facecolor=_color(k), hatch="//" if k == "wait" else None,
                  edgecolor="#777777", label=k) for k in ordered]
