"""Old flat module paths (``labkit.schedules``, ``labkit.grid``, …) kept working.

The package was one flat folder; its modules now live in subpackages in data-flow order
(docs/design.md, "Layout"). Code and notebooks written against the flat names still import:
each old name resolves to the very same module object as the new one (not a copy), so
``monkeypatch`` and ``isinstance`` behave as before.

>>> import labkit.schedules, labkit.parallel.pipeline.schedules as s
>>> labkit.schedules is s
True
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old name → new name
MOVED = {
    "labkit.lab": "labkit.session.lab",
    "labkit.launchers": "labkit.session.launchers",
    "labkit.placement": "labkit.engine.placement",
    "labkit.grid": "labkit.engine.grid",
    "labkit.job": "labkit.parallel.build",
    "labkit.strategies.data_parallel": "labkit.parallel.data.sync",
    "labkit.strategies.pipeline": "labkit.parallel.pipeline.stages",
    "labkit.schedules": "labkit.parallel.pipeline.schedules",
    "labkit.collectives": "labkit.comm.collectives",
    "labkit.compression": "labkit.comm.compression",
    "labkit.recorder": "labkit.record.recorder",
    "labkit.instrument": "labkit.record.instrument",
    "labkit.runner": "labkit.run.runner",
    "labkit.live": "labkit.run.live",
    "labkit.training": "labkit.models.training",
    "labkit.metrics": "labkit.analysis.metrics",
    "labkit.waits": "labkit.analysis.waits",
    "labkit.diagnose": "labkit.analysis.diagnose",
    "labkit.timeline": "labkit.view.timeline",
    "labkit.report": "labkit.view.report",
    "labkit.widgets": "labkit.view.dashboard",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module that now holds its code."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass                       # the new module is already executed


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def resolve(short: str):
    """``labkit.<short>`` for an old flat name, or None (for ``labkit.__getattr__``)."""
    full = f"labkit.{short}"
    return importlib.import_module(full) if full in MOVED else None
