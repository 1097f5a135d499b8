"""``Lab.start``'s arguments, checked before a process is started.

A misspelt keyword (``engine=4``, ``timout=3``) used to reach ``ipyparallel.Cluster``, which
ignores what it does not know: the lab started with its defaults and nobody noticed. Here
every keyword is either one of ``Lab.start``'s own or a setting of ``ipyparallel.Cluster``.
"""
from __future__ import annotations

import difflib
import math
import os
import warnings

from ipyparallel import Cluster

START_KEYWORDS = ("engines", "timeout", "launcher", "progress", "start_timeout", "debug")
# Cluster settings the lab sets itself (n, log_level, controller_ip) or that are not settings.
NOT_CLUSTER_KEYWORDS = {"n", "engines", "log", "log_level", "parent", "controller_ip", "config"}
# Measured here: 64 local CPU engines took 19.4 GiB (torch imported on each), ~0.3 GiB apiece.
ENGINE_BYTES = int(0.3 * 2 ** 30)


def cluster_keywords() -> list[str]:
    """The ``ipyparallel.Cluster`` settings a local lab passes through."""
    return sorted(set(Cluster.class_trait_names()) - NOT_CLUSTER_KEYWORDS)


def check_start(engines, timeout, launcher: str, cluster_kwargs: dict) -> None:
    """Raise ValueError naming the keyword and the fix; warn when the machine looks too small."""
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ValueError(f"engines={engines!r} must be a whole number ≥ 1")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0 (the collective "
                         "timeout, e.g. timeout=60)")
    if launcher == "local":
        allowed = cluster_keywords()
        unknown = sorted(set(cluster_kwargs) - set(allowed))
        if unknown:
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name) for name in unknown
                     for close in [difflib.get_close_matches(name, START_KEYWORDS + tuple(allowed), 1)]]
            raise ValueError(f"Lab.start got unknown keyword(s) {', '.join(hints)}; it takes "
                             f"{', '.join(START_KEYWORDS)}, and ipyparallel.Cluster's {', '.join(allowed)}")
        check_capacity(engines)


def check_capacity(engines: int, cpus: int | None = None, memory_bytes: int | None = None) -> None:
    """Warn when ``engines`` local engines exceed this machine's memory or (by far) its cores."""
    cpus = cpus or os.cpu_count() or 1
    memory_bytes = memory_bytes if memory_bytes is not None else _available_memory()
    if memory_bytes and engines * ENGINE_BYTES > 0.8 * memory_bytes:
        warnings.warn(f"{engines} engines need about {engines * ENGINE_BYTES / 2 ** 30:.1f} GiB of memory "
                      f"(~{ENGINE_BYTES / 2 ** 30:.1f} GiB each with torch) and this machine has "
                      f"{memory_bytes / 2 ** 30:.1f} GiB available; start fewer engines", UserWarning, stacklevel=3)
    elif engines > 4 * cpus:
        warnings.warn(f"{engines} engines on {cpus} cores: each gets a sliver of a core and starting them "
                      f"takes minutes; start at most {4 * cpus}", UserWarning, stacklevel=3)


def _available_memory() -> int | None:
    """Memory free now (labkit.parallel.materialize.available_bytes), None where it cannot be read."""
    from ..parallel.materialize import available_bytes
    try:
        return available_bytes()
    except (ValueError, OSError, AttributeError):
        return None
