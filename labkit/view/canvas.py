"""The dashboard's canvas: a figure redrawn in place, and one painter thread that draws.

A figure shows as ipympl's canvas widget (``%matplotlib widget``) or, without ipympl, as a
PNG in an Image widget. All drawing happens on one daemon thread; a newer drawing job of the
same kind replaces an older one, so a slow redraw never holds up the next step and only the
newest timeline is drawn.
"""
from __future__ import annotations

import io
import threading

import ipywidgets as W
import matplotlib


class WidgetFigure:
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
