"""labkit: an interactive lab for large-model parallel training.

>>> import labkit
>>> with labkit.Lab.start(engines=2) as lab:
...     run = lab.run(labkit.Strategy(dp=2, dp_mode="overlap"), model=labkit.models.mlp(width=256, depth=8))
>>> run.losses, run.metrics["overlap_fraction"]
>>> run.timeline.plot()

The subpackages follow the data flow (docs/design.md): session → engine → parallel → comm →
record → run → analysis → view; models and bench sit beside them.
"""
from . import _moved

_moved.install()     # old flat paths (labkit.schedules, labkit.grid, ...) keep importing

from . import bench, comm, data, engine, models  # noqa: E402
from .comm import collectives, compression  # noqa: E402
from .analysis.drift import drift  # noqa: E402
from .config import Strategy  # noqa: E402
from .link import Link  # noqa: E402
from .errors import (CollectiveTimeoutError, ControllerDiedError, EngineDiedError,  # noqa: E402
                     EngineNotAnsweringError, LabError)
from .analysis.metrics import speedup, step_metrics  # noqa: E402
from .parallel.pipeline import schedules  # noqa: E402
from .run.reference import reference  # noqa: E402
from .run.result import Run, max_abs_diff  # noqa: E402
from .session.lab import Lab  # noqa: E402
from .view import report  # noqa: E402
from .analysis.timeline import Timeline  # noqa: E402

__all__ = ["Lab", "Link", "Strategy", "Run", "Timeline", "LabError", "CollectiveTimeoutError", "EngineDiedError",
           "ControllerDiedError", "EngineNotAnsweringError",
           "bench", "collectives", "comm", "compression", "data", "drift", "models", "reference", "report", "schedules",
           "speedup", "step_metrics", "max_abs_diff"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``labkit.widgets``, ``labkit.gpu`` and ``labkit.plan`` on first use (the dashboard needs
    ipywidgets, the GPU checks a GPU, the planner its tables; the engines need none of them), and
    the old flat module names (``labkit.grid``, ``labkit.diagnose``, ...)."""
    if name in ("gpu", "plan"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    module = _moved.resolve(name)
    if module is None:
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    return module
