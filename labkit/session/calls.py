"""Calls into the engines, and the triage when one fails: which rank, what it said, why.

``Lab.apply`` sends one call to every rank and waits here. Once one rank fails, the others
get :data:`GRACE_S` to finish or fail too, so a dead engine or a timed-out collective is
reported within seconds even while other ranks are still blocked (the lab frees those before
its next call). The error that reaches the notebook is a :class:`~labkit.errors.LabError`
carrying every failing rank's report, classified (a dead engine, a timed-out collective, a
mismatched message), with the hang explained from the ranks' flight logs.

>>> failed, pending = wait_for_ranks(futures, limit=60)
>>> raise triage(reports_of(failed, targets), "run_step", rank_of, busy, 60, flight_logs)
"""
from __future__ import annotations

import time
from concurrent import futures
from typing import Callable

import ipyparallel as ipp

from ..analysis import diagnose
from ..errors import CollectiveTimeoutError, EngineDiedError, LabError, RankReport

TIMEOUT_ERRORS = ("CollectiveTimeout",)
COMM_ERRORS = ("CollectiveTimeout", "CommFailure", "CommMismatch", "DistBackendError", "DistNetworkError")
# Once one rank has failed, how long the others get to finish or fail before the lab reports.
GRACE_S = 2.0
# How often a waiting call checks that the engines can still answer (a local controller alive).
POLL_S = 1.0


def error_of(future) -> Exception | None:
    """The error a finished per-engine future carries (ipyparallel returns remote errors as values)."""
    exc = future.exception()
    if exc is not None:
        return exc
    result = future.result()
    return result if isinstance(result, Exception) else None


def wait_for_ranks(children: list, limit: float, still_there: Callable[[], None] | None = None) -> set:
    """Wait until every future is done, or ``limit`` s pass, or GRACE_S after the first failure;
    return the futures still pending. ``still_there()`` runs every POLL_S s in which nothing
    finished, and raises to stop waiting (the lab's dead-controller check)."""
    deadline, first_failure, pending = time.monotonic() + limit, None, set(children)
    while pending:
        until = deadline if first_failure is None else min(deadline, first_failure + GRACE_S)
        if time.monotonic() >= until:
            break
        done, pending = futures.wait(pending, timeout=min(until - time.monotonic(), POLL_S),
                                     return_when=futures.FIRST_COMPLETED)
        if first_failure is None and any(error_of(f) for f in done):
            first_failure = time.monotonic()
        if not done and pending and still_there is not None:
            still_there()
    return pending


def reports_of(failed: list[tuple[int, Exception]], rank_of: dict[int, int]) -> list[RankReport]:
    """One report per failed (engine id, error): rank, error class name, message, traceback."""
    reports = []
    for target, exc in failed:
        if isinstance(exc, ipp.error.RemoteError):
            info = exc.engine_info or {}
            rank = rank_of.get(info.get("engine_id", target))
            reports.append(RankReport(rank, exc.ename, str(exc.evalue).strip(), exc.traceback or ""))
        else:
            reports.append(RankReport(rank_of.get(target), type(exc).__name__, str(exc).strip(), ""))
    return reports


def triage(reports: list[RankReport], what: str, busy: list[int], timeout: float,
           flight_logs: Callable[[list[int]], dict]) -> LabError:
    """The LabError for these reports: its class, a headline naming the ranks, the hang if any."""
    names = {r.error for r in reports}
    failed = sorted(r.rank for r in reports if r.rank is not None)
    dead = sorted(r.rank for r in reports if r.error == "EngineError" and r.rank is not None)
    if dead:
        cls, head = EngineDiedError, (f"the engine of rank(s) {dead} died (killed, crashed or out of memory); "
                                      f"lab.recover() restarts the engines")
    elif names & set(TIMEOUT_ERRORS):
        cls, head = CollectiveTimeoutError, f"a collective timed out on rank(s) {failed}"
    elif "CommMismatch" in names:
        cls, head = LabError, (f"a message's shape or dtype differs from what rank(s) {failed} expected "
                               f"(nothing was corrupted; the engines are alive)")
    else:
        cls, head = LabError, f"failed on rank(s) {failed}"
    lines = [f"{what}: {head}"]
    if busy:
        lines.append(f"  rank(s) {busy} still busy after the others failed (blocked in the same step); "
                     f"the lab frees them before the next call")
    logs, hang = {}, None
    if not dead and (names & set(COMM_ERRORS) or busy):
        logs = flight_logs(busy)
        hang = diagnose.explain_hang(logs, {r: "still busy" for r in busy}, timeout)
        if hang is not None and hang.not_reached:
            lines.append("  " + str(hang).replace("\n", "\n  "))
    error = cls("\n".join(lines), reports)
    error.hang, error.flight_logs, error.busy, error.dead = hang, logs, busy, dead
    return error
