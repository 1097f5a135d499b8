"""One quiet status line for the lab's progress ("3/4 engines up").

In a notebook the line is one output that updates in place (``display(..., display_id=...)``),
plain text on the cell's normal output: not stderr, which JupyterLab paints as a pink error
box. In a terminal it goes to stderr, where scripts and the CLI expect progress.

>>> line = StatusLine(); line.say("labkit: 1/2 engines up"); line.say("labkit: 2/2 engines up")
"""
from __future__ import annotations

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
