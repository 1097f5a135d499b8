"""The engine side: what each ipyparallel engine holds between notebook cells.

The notebook calls these plain functions through ``lab.view.apply`` (they travel by
reference): :mod:`.state` holds the engine's session, :mod:`.world` the world group and the
grid's groups, :mod:`.steps` a run's job and steps, :mod:`.reports` what comes back.
"""
from .reports import flight_log, parameter_copy, parameters, tensor_digest
from .state import EngineSession, assign_rank, describe, drop_job, session
from .steps import capture_warnings, finish_profile, plant_straggler, run_step, setup_run, traced
from .world import ensure_groups, init_distributed, open_store, set_link, shutdown

__all__ = ["EngineSession", "assign_rank", "capture_warnings", "describe", "drop_job", "ensure_groups",
           "finish_profile", "flight_log", "init_distributed", "open_store", "parameter_copy", "parameters",
           "plant_straggler", "run_step", "session", "set_link", "setup_run", "shutdown", "tensor_digest",
           "traced"]
