"""Trace files in: labkit's own, and torch profiler (Kineto) Chrome traces, one per rank."""
from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_json(path) -> dict:
    """A trace file's JSON, plain or gzipped; a ValueError naming the file when it is not JSON
    (a truncated file: the profiler was stopped while writing)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (json.JSONDecodeError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as err:
        raise ValueError(f"{path}: not a complete JSON trace ({err}); was the profiler stopped "
                         "before it finished writing?") from None
