"""The dashboard's canvas: a figure redrawn in place, and one painter thread that draws.

A figure shows as ipympl's canvas widget (``%matplotlib widget``) or, without ipympl, as a
PNG in an Image widget. All drawing happens on one daemon thread; a newer drawing job of the
same kind replaces an older one, so a slow redraw never holds up the next step and only the
newest timeline is drawn.
"""
from __future__ import annotations

import io
import textwrap
import threading

import ipywidgets as W
import matplotlib
import matplotlib.image

IMAGE_DPI = 90


class WidgetFigure:
    """A figure shown in a widget and redrawn in place: ipympl's canvas, or a PNG (fallback)."""

    def __init__(self, figsize, nrows: int, interactive: bool, **kwargs):
        from matplotlib.figure import Figure

        # the PNG fallback is drawn at IMAGE_DPI; ipympl scales to the page itself
        self.fig = Figure(figsize=figsize, layout="constrained", dpi=None if interactive else IMAGE_DPI)
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
        self._laid_out = None     # what the last constrained layout was computed for

    def show(self) -> None:
        """Render the figure into the widget.

        Constrained layout measures every tick label, title and legend entry, and savefig()
        draws the whole figure twice for it (once to lay out, once to render). So the PNG is
        rendered in one pass (``canvas.draw()`` lays out as it draws), and the layout is
        computed again only when what sits around the Axes changed (:meth:`_layout_key`):
        between steps the lanes and the legend stay the same, the Axes keep their positions
        and nothing is measured.
        """
        for ax in self.axes:
            ax.set_axis_on()
        key = self._layout_key()
        self.fig.set_layout_engine("constrained" if key != self._laid_out else "none")
        self._laid_out = key
        if self.interactive:
            # A whole frame, not a difference from the last one: a page that missed a frame
            # (drawn while it was busy) would otherwise keep stale pixels.
            self.fig.canvas._force_full = True
            self.fig.canvas.draw()
        else:
            # canvas.draw() lays out and renders in one pass, where savefig() draws twice
            self.fig.canvas.draw()
            buf = io.BytesIO()
            # zlib level 1: a plot's flat colours compress nearly as well, several times faster
            matplotlib.image.imsave(buf, self.fig.canvas.buffer_rgba(), format="png",
                                    pil_kwargs={"compress_level": 1})
            self.widget.value = buf.getvalue()

    def clear(self, ax) -> None:
        """Remove what was drawn into `ax` (spans, labels, rules, legend), keeping the Axes
        and its tick artists: ``ax.clear()`` discards them, and 64 lanes' ticks made anew
        each redraw cost more than the spans."""
        for artist in [*ax.collections, *ax.lines, *ax.texts, *ax.artists, *ax.images, *ax.patches]:
            artist.remove()
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        ax.set_title("")

    def _layout_key(self) -> tuple:
        """What the constrained layout depends on: the figure's size, and per Axes the texts
        beside it (y tick labels, axis labels, titles, legend entries and title). The x tick
        labels are left out: their height does not change with the numbers they show."""
        key = [tuple(self.fig.get_size_inches()), self.fig.dpi]
        for ax in self.axes:
            legend = ax.get_legend()
            legend_texts = () if legend is None else (legend.get_title().get_text(),
                                                       *(t.get_text() for t in legend.get_texts()))
            key.append((ax.axison, tuple(t.get_text() for t in ax.get_yticklabels()),
                        tuple(t.get_fontsize() for t in ax.get_yticklabels()[:1]),
                        ax.get_xlabel(), ax.get_ylabel(), legend_texts,
                        tuple(ax.get_title(loc).count("\n") + bool(ax.get_title(loc))
                              for loc in ("left", "center", "right"))))
        return tuple(key)


def fit_title(fig, text: str, fontsize="medium") -> str:
    """``text`` broken into lines that fit ``fig``'s width: a centred title wider than its
    figure is cut off on both sides (a run's label and the step's time make a long one). An
    average character of matplotlib's sans-serif is taken as 0.6 of the font size."""
    from matplotlib.font_manager import FontProperties

    points = FontProperties(size=fontsize).get_size_in_points()
    per_line = max(20, int(0.95 * fig.get_figwidth() * 72 / (0.6 * points)))
    return "\n".join(part for line in text.split("\n")
                     for part in textwrap.wrap(line, per_line, break_on_hyphens=False) or [""])


class Painter:
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


def use_ipympl(plot: str) -> bool:
    if plot not in ("auto", "ipympl", "image"):
        raise ValueError(f"plot={plot!r}; use 'auto', 'ipympl' or 'image'")
    if plot == "auto":
        backend = matplotlib.get_backend().lower()
        return "ipympl" in backend or backend == "widget"
    return plot == "ipympl"
