"""Calls into the engines, and the triage when one fails: which rank, what it said, why.

``Lab.apply`` sends one call to every rank and waits here. Once one rank fails, the others
get :data:`GRACE_S` to finish or fail too, so a dead engine or a timed-out collective is
reported within seconds even while other ranks are still blocked (the lab frees those before
its next call). The error that reaches the notebook is a :class:`~labkit.errors.LabError`
carrying every failing rank's report, classified (a dead engine, a timed-out collective, a
mismatched message), with the hang explained from the ranks' flight logs.

A rank that is alive but silent (its process stopped: SIGSTOP, Ctrl-Z, a debugger) is neither
dead nor timed out: :func:`not_answering` names it, its process and how long it has been
silent, and says what brings it back. torch's store errors are put in words (the raw text
stays in the report's traceback), and replies that arrive after the lab gave up on a call are
dropped quietly (:func:`quiet_stale_results`).

>>> failed, pending = wait_for_ranks(futures, limit=60)
>>> raise triage(reports_of(failed, targets), "run_step", rank_of, busy, 60, flight_logs)
"""
from __future__ import annotations

import re
import time
from concurrent import futures
from typing import Callable

import ipyparallel as ipp

from ..analysis import diagnose
from ..errors import CollectiveTimeoutError, EngineDiedError, EngineNotAnsweringError, LabError, RankReport

TIMEOUT_ERRORS = ("CollectiveTimeout",)
COMM_ERRORS = ("CollectiveTimeout", "CommFailure", "CommMismatch", "DistBackendError", "DistNetworkError")
# Once one rank has failed, how long the others get to finish or fail before the lab reports.
GRACE_S = 2.0
# How often a waiting call checks that the engines can still answer (a local controller alive,
# no local engine stopped).
POLL_S = 1.0


def error_of(future) -> Exception | None:
    """The error a finished per-engine future carries (ipyparallel returns remote errors as values)."""
    exc = future.exception()
    if exc is not None:
        return exc
    result = future.result()
    return result if isinstance(result, Exception) else None


def wait_for_ranks(children: list, limit: float, still_there: Callable[[set], None] | None = None) -> set:
    """Wait until every future is done, or ``limit`` s pass, or GRACE_S after the first failure;
    return the futures still pending. ``still_there(pending)`` runs every POLL_S s in which
    nothing finished, and raises to stop waiting (the lab's dead-controller and stopped-rank
    checks)."""
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
            still_there(pending)
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


def in_words(report: RankReport, what: str, waited_for: list[int]) -> RankReport:
    """The report with torch's store error put in words: ``DistStoreError: wait timeout after
    10000ms, keys: /0//1//cpu//0/1`` is a rank that waited in the rendezvous store for peers
    that never wrote their key (a rank that is stopped, dead or still busy elsewhere). The raw
    text moves to the report's traceback."""
    if report.error != "DistStoreError":
        return report
    ms = re.search(r"after (\d+)\s*ms", report.message)
    waited = f" {int(ms.group(1)) / 1000:g} s" if ms else ""
    peers = f"rank(s) {waited_for}" if waited_for else "the other ranks"
    message = f"waited{waited} in the rendezvous store for {peers} to join ({what}), then gave up"
    raw = f"{report.error}: {report.message}\n{report.traceback}".strip()
    return RankReport(report.rank, report.error, message, raw)


def not_answering(what: str, silent: dict[int, dict], peers: list[RankReport], dropped: bool = False
                  ) -> EngineNotAnsweringError:
    """The error for ranks that are alive but silent. ``silent``: rank → {"state", "pid",
    "host", "seconds"}; ``peers``: what the other ranks said meanwhile (in words);
    ``dropped``: the controller has unregistered them (too many missed heartbeats), so no call
    reaches them again and only lab.recover() helps."""
    ranks = sorted(silent)
    reports = [RankReport(r, "NotAnswering", _silence(silent[r], dropped)) for r in ranks]
    pids = " ".join(str(silent[r]["pid"]) for r in ranks if silent[r].get("state") == "stopped")
    if dropped:
        then = "lab.recover() restarts the engines (the lab keeps its settings)"
    else:
        resume = f" (kill -CONT {pids})" if pids else ""
        then = (f"once it answers again{resume} the next call goes on by itself; or lab.recover() restarts "
                f"the engines (the lab keeps its settings)")
    head = f"{what}: rank(s) {ranks} not answering (alive, not dead)\n  {then}"
    error = EngineNotAnsweringError(head, reports + [p for p in peers if p.rank not in silent])
    error.silent = ranks
    error.seconds = max((silent[r]["seconds"] or 0.0) for r in ranks)
    error.hang, error.flight_logs, error.busy, error.dead = None, {}, ranks, []
    return error


def _silence(info: dict, dropped: bool) -> str:
    """One silent rank in words: where its process is, why it is silent, since when."""
    where = f"pid {info['pid']} on {info['host']}: " if info.get("pid") else ""
    why = {"stopped": "its process is stopped (SIGSTOP, Ctrl-Z or a debugger)",
           "running": "its process is alive"}.get(info.get("state"), "alive as far as the controller knows")
    seconds = info.get("seconds")
    since = f"; silent for {seconds:.0f} s" if seconds is not None and seconds >= 1 else ""
    gone = ("; the controller unregistered it after its heartbeats stopped (~30 s), so no call reaches it again"
            if dropped else "")
    return f"{where}{why}{since}{gone}"


def quiet_stale_results(client) -> None:
    """Drop, without a word, a reply to a call the client has already closed.

    An engine the controller unregistered while it was silent (a stopped process misses its
    heartbeats) still sends the reply of its last call once it runs again; ipyparallel's client
    prints such a "stale result" with the whole message to stdout, into the notebook. The lab
    reported that call already, so the reply has nowhere to go.
    """
    handlers = client._queue_handlers          # ipyparallel 9: msg_type → bound handler
    for kind in ("apply_reply", "execute_reply"):
        handle = handlers.get(kind)
        if handle is None or getattr(handle, "_labkit_quiet", False):
            continue

        def quiet(msg, handle=handle):
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent not in client.outstanding and parent in client.history:
                return
            handle(msg)

        quiet._labkit_quiet = True
        handlers[kind] = quiet


def died_or_frozen(dead: list[int], remote) -> str:
    """What else a 'dead' remote engine may be: alive but silent past the controller's patience."""
    return ", or stopped answering the controller's heartbeats" if set(dead) & set(remote) else ""


def triage(reports: list[RankReport], what: str, busy: list[int], timeout: float,
           flight_logs: Callable[[list[int]], dict], remote: tuple = ()) -> LabError:
    """The LabError for these reports: its class, a headline naming the ranks, the hang if any.
    ``remote``: ranks on other machines, whose engine is known dead only through the
    controller, which also unregisters an engine that stopped answering its heartbeats."""
    reports = [in_words(r, what, busy) for r in reports]
    names = {r.error for r in reports}
    failed = sorted(r.rank for r in reports if r.rank is not None)
    dead = sorted(r.rank for r in reports if r.error == "EngineError" and r.rank is not None)
    if dead:
        cls, head = EngineDiedError, (f"the engine of rank(s) {dead} died (killed, crashed or out of memory"
                                      f"{died_or_frozen(dead, remote)}); lab.recover() restarts the engines")
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
