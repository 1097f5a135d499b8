"""The run driver: validate, build, step, gather; the result a notebook gets; the one-process reference."""
from .result import Run, max_abs_diff

__all__ = ["Run", "max_abs_diff"]
