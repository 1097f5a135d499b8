"""Tables for notebooks: several runs' metrics side by side.

>>> labkit.report.table({"naive": run_a, "overlap": run_b})     # renders as HTML in Jupyter
"""
from __future__ import annotations

COLUMNS = (
    ("step_time_s", "step (ms)", lambda v: f"{1e3 * v:.2f}"),
    ("throughput_samples_s", "samples/s", lambda v: f"{v:,.0f}"),
    ("comm_fraction", "comm", lambda v: f"{v:.2f}"),
    ("exposed_comm_fraction", "exposed comm", lambda v: f"{v:.2f}"),
    ("overlap_fraction", "overlap", lambda v: f"{v:.2f}"),
    ("bubble_fraction", "idle (bubble)", lambda v: f"{v:.2f}"),
    ("schedule_bubble_fraction", "of which schedule", lambda v: f"{v:.2f}"),
    ("lab_overhead_fraction", "of which overhead", lambda v: f"{v:.2f}"),
    ("bytes_sent", "KiB sent / rank", lambda v: f"{max(v) / 1024:,.1f}"),
)


class Table:
    """Rows of labelled runs; shows as HTML in a notebook and as text elsewhere."""

    def __init__(self, rows: list[tuple[str, dict]], extra: dict[str, dict] | None = None):
        self.rows, self.extra = rows, extra or {}

    def _cells(self):
        heads = ["run"] + [title for _, title, _ in COLUMNS] + list(self.extra)
        body = []
        for label, metrics in self.rows:
            cells = [label] + [fmt(metrics[key]) for key, _, fmt in COLUMNS]
            cells += [str(column.get(label, "")) for column in self.extra.values()]
            body.append(cells)
        return heads, body

    def _repr_html_(self) -> str:
        heads, body = self._cells()
        head = "".join(f"<th>{h}</th>" for h in heads)
        rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
        return f"<table><tr>{head}</tr>{rows}</table>"

    def __repr__(self) -> str:
        heads, body = self._cells()
        widths = [max(len(str(r[i])) for r in [heads] + body) for i in range(len(heads))]
        return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in [heads] + body)


def table(runs: dict, extra: dict[str, dict] | None = None) -> Table:
    """Metrics of ``{label: run}`` as a table; ``extra`` adds columns ``{title: {label: value}}``."""
    return Table([(label, run.metrics) for label, run in runs.items()], extra)
