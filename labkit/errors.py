"""Errors that reach the notebook.

Every failure on an engine comes back as a :class:`LabError` that carries one report per
rank (rank, error type, message, traceback), so a reader sees *which* rank failed *where*,
not ipyparallel's bare ``CompositeError``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankReport:
    """What one rank said when a call failed."""

    rank: int | None
    error: str          # the exception's class name, e.g. "CollectiveTimeout"
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        where = "rank ?" if self.rank is None else f"rank {self.rank}"
        return f"{where}: {self.error}: {self.message}"


class LabError(RuntimeError):
    """A call on the engines failed; ``reports`` holds every failing rank's report."""

    def __init__(self, summary: str, reports: list[RankReport] | None = None):
        self.reports = list(reports or [])
        lines = [summary] + [f"  {r}" for r in self.reports]
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        """The ranks that reported a failure."""
        return sorted(r.rank for r in self.reports if r.rank is not None)

    def traceback(self, rank: int) -> str:
        """The remote traceback of one rank (empty if it sent none)."""
        return next((r.traceback for r in self.reports if r.rank == rank), "")


class CollectiveTimeoutError(LabError):
    """A collective or point-to-point call timed out on at least one rank."""


class EngineDiedError(LabError):
    """An engine process died (killed, crashed, out of memory)."""


class EngineNotAnsweringError(LabError):
    """A rank's engine is alive but does not answer: its process is stopped (SIGSTOP, Ctrl-Z,
    a debugger), or it is still running an earlier call past the call's limit. Unlike a dead
    engine it can come back: the lab goes on by itself once it answers, or ``lab.recover()``
    restarts the engines. ``silent`` names the ranks that do not answer, ``seconds`` how long
    the longest of them has not answered."""

    silent: list[int] = []
    seconds: float = 0.0


class ControllerDiedError(LabError):
    """The ipyparallel controller died: no call reaches the engines until ``lab.recover()``."""


# Errors a rank raises because of a peer (it waited, or its connection went): the echo of a
# failure elsewhere, never its root cause (labkit.run.live.root_cause).
PEER_ERRORS = ("CollectiveTimeout", "CommFailure", "DistBackendError", "DistNetworkError")


# Raised on the engines themselves (they travel back as the remote error's class name).
class CollectiveTimeout(RuntimeError):
    """Engine side: one instrumented call did not complete within the group timeout."""


class CommMismatch(RuntimeError):
    """Engine side: a point-to-point message's shape or dtype differs from what was expected."""


class NonFiniteLoss(FloatingPointError):
    """Engine side: a step's loss is NaN or infinite (a diverging lr, a NaN in the model or data)."""


class CommFailure(RuntimeError):
    """Engine side: an instrumented call failed for a reason other than a timeout (e.g. a peer died)."""
