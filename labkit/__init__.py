"""labkit: an interactive lab for large-model parallel training.

>>> import labkit
>>> with labkit.Lab.start(engines=2) as lab:
...     run = lab.run(labkit.Strategy(dp=2, dp_mode="overlap"), model=labkit.models.mlp(width=256, depth=8))
>>> run.losses, run.metrics["overlap_fraction"]
>>> run.timeline.plot()

The subpackages follow the data flow (docs/design.md): session → engine → parallel → comm →
record → run → analysis → view; models and bench sit beside them.
"""
from . import bench, checkpoint, comm, data, engine, losses, models
from .comm import collectives, compression
from .analysis import diagnose
from .analysis.drift import drift
from .config import Strategy
from .link import Link
from .errors import (CollectiveTimeoutError, ControllerDiedError, EngineDiedError,
                     EngineNotAnsweringError, LabError)
from .analysis.metrics import speedup, step_metrics
from .parallel.pipeline import schedules
from .run.reference import reference
from .run.result import Run, max_abs_diff
from .session.lab import Lab
from .view import report
from .analysis.timeline import Timeline

__all__ = ["Lab", "Link", "Strategy", "Run", "Timeline", "LabError", "CollectiveTimeoutError", "EngineDiedError",
           "ControllerDiedError", "EngineNotAnsweringError",
           "bench", "checkpoint", "collectives", "comm", "compression", "data", "diagnose", "drift", "losses", "models", "reference", "report",
           "schedules",
           "speedup", "step_metrics", "max_abs_diff"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``labkit.widgets``, ``labkit.gpu`` and ``labkit.plan`` on first use (the dashboard needs
    ipywidgets, the GPU checks a GPU, the planner its tables; the engines need none of them)."""
    if name in ("widgets", "gpu", "plan"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
