"""Warnings raised on the engines, raised again in the notebook.

An engine's warnings go to its own log, which a notebook never shows: torch's "Using a target
size that is different to the input size" (an (8, 1) target against an (8, 16) output, which
broadcasts into a different loss) was invisible. Each engine call that trains returns its
warnings (``engine.capture_warnings``); the run driver passes them to :func:`relay_warnings`,
which warns once per rank and message per run.
"""
from __future__ import annotations

import builtins
import warnings


def relay_warnings(results: list[dict], seen: set, stacklevel: int = 4) -> None:
    """Warn in this process for each new ``(rank, message)`` in the engines' ``results``
    (``stacklevel`` 4: the line that called ``lab.run``)."""
    for result in results:
        for category, message in result.get("warnings", ()):
            key = (result.get("rank"), category, message)
            if key in seen:
                continue
            seen.add(key)
            cls = getattr(builtins, category, None)
            if not (isinstance(cls, type) and issubclass(cls, Warning)):
                cls = UserWarning
            warnings.warn(f"rank {result.get('rank')}: {message}", cls, stacklevel=stacklevel)
