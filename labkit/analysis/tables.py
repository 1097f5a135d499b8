"""Plain tables that show as aligned text in a terminal and as HTML in Jupyter.

A class that defines ``_cells() -> (heads, body)`` (lists of strings) gets both views from
:class:`CellTable`; the drift finder's gradient table and the loss-curve summary use it.
"""
from __future__ import annotations


class CellTable:
    """``__repr__`` (right-aligned columns) and ``_repr_html_`` from ``self._cells()``."""

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        heads, body = self._cells()
        widths = [max(len(r[i]) for r in [heads] + body) for i in range(len(heads))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [heads] + body)

    def _repr_html_(self) -> str:
        heads, body = self._cells()
        rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in [heads] + body)
        return f"<table>{rows}</table>"
