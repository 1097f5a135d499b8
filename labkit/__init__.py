"""labkit: an interactive lab for large-model parallel training.

>>> import labkit
>>> with labkit.Lab.start(engines=2) as lab:
...     run = lab.run(labkit.Strategy(dp=2, dp_mode="overlap"), model=labkit.models.mlp(width=256, depth=8))
>>> run.losses, run.metrics["overlap_fraction"]
>>> run.timeline.plot()
"""
from . import bench, collectives, comm, compression, engine, models, report
from .config import Strategy
from .errors import CollectiveTimeoutError, EngineDiedError, LabError
from .lab import Lab
from .metrics import speedup, step_metrics
from .reference import reference
from .run import Run, max_abs_diff
from .timeline import Timeline

__all__ = ["Lab", "Strategy", "Run", "Timeline", "LabError", "CollectiveTimeoutError", "EngineDiedError",
           "bench", "collectives", "comm", "compression", "models", "reference", "speedup", "step_metrics", "max_abs_diff"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``labkit.widgets`` (and ``labkit.plan``) on first use: the dashboard needs ipywidgets, the engines do not."""
    if name in ("widgets", "live", "plan"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
