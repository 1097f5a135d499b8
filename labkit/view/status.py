"""Status lines and tables: the lab's progress line, the dashboard's status line, run labels,
the metrics of a run, two runs compared.

The lab's progress ("3/4 engines up") is one quiet line: in a notebook one output that updates
in place (``display(..., display_id=...)``), plain text on the cell's normal output, not
stderr, which JupyterLab paints as a pink error box. In a terminal it goes to stderr, where
scripts and the CLI expect progress.

>>> line = StatusLine(); line.say("labkit: 1/2 engines up"); line.say("labkit: 2/2 engines up")
"""
from __future__ import annotations

import html
import sys


def in_notebook() -> bool:
    """True inside a Jupyter kernel (ipykernel), where display() reaches the cell's output."""
    shell = sys.modules.get("IPython") and __import__("IPython").get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class StatusLine:
    """A line that each ``say`` replaces (notebook) or appends to stderr (terminal)."""

    def __init__(self):
        self.handle = None

    def say(self, text: str) -> None:
        text = text.lstrip("\r")
        if not in_notebook():
            print(text, file=sys.stderr, flush=True)
            return
        from IPython.display import display

        if self.handle is None:
            self.handle = display(_Plain(text), display_id=True)
        else:
            self.handle.update(_Plain(text))


class _Plain:
    """Text shown as text (display() of a bare str would show its quotes)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def link_text(link, backend: str = "gloo") -> str:
    """The lab's link in a few words: the emulated one (a labkit.Link), or the backend's own."""
    if link is None:
        return f"link: {backend} at this machine's own speed"
    return f"emulated link {link}"


# -- the dashboard ----------------------------------------------------------------------------
COLORS = {"ok": "#1b7a3d", "busy": "#1f5fa8", "problem": "#a35a00", "error": "#b00020"}


def status_html(kind: str, text: str) -> str:
    """The status line: one coloured sentence ("ok", "busy", "problem", "error")."""
    return f'<span style="color:{COLORS[kind]}">{html.escape(text)}</span>'


def labels(a, b) -> tuple[str, str]:
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
    # idle time that is neither compute nor comm: a pipeline's bubble (plus the lab's own gaps);
    # without a pipeline there is no bubble to read, so the row says so instead of a number
    ("pipeline bubble", lambda r: 100 * r.metrics["bubble_fraction"] if r.strategy.pp > 1 else None, "{:.1f}%"),
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


def metrics_table(live) -> str:
    if live is None or not live.run.losses:
        return "<i>No run yet: press Run or change a setting.</i>"
    values = [_shown(get(live.run), fmt) for _, get, fmt in ROWS]
    link = getattr(live.run, "link", None)
    done = live.step + 1
    name = f"run {live.number}, " + (f"median of steps 2–{done}" if done > 2 else f"step {done}") \
        + (f" (link {link})" if link is not None else "")
    return _table([""] + [label for label, _, _ in ROWS], [[name] + values])


def _shown(value, fmt: str) -> str:
    return "— (pp = 1)" if value is None else fmt.format(value)


def _change(a: float | None, b: float | None, points: bool) -> str:
    """Fractions differ in percentage points, everything else relatively."""
    if a is None or b is None:
        return "—"
    if points:
        return f"{b - a:+.1f} pts"
    return f"{(b - a) / abs(a):+.0%}" if a else f"{b - a:+.3g}"


def diff_table(a, b, labels) -> str:
    rows = [[labels[0]] + [_shown(get(a.run), fmt) for _, get, fmt in ROWS]]
    if b is not None:
        rows.append([labels[1]] + [_shown(get(b.run), fmt) for _, get, fmt in ROWS])
        rows.append(["change"] + [_change(get(a.run), get(b.run), fmt.endswith("%")) for _, get, fmt in ROWS])
    return _table([""] + [label for label, _, _ in ROWS], rows)
