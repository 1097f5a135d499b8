"""This engine's state for :mod:`labkit.comm`: who it is, where its events go, how long a
call may wait, the flight log and the emulated link. The engine session binds it
(:func:`bind`); every call reads it through :func:`context`.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from ..record.recorder import Recorder
from .emulate import LinkClock


@dataclass
class CommContext:
    """Per-engine state of this module: who we are, where events go, how long to wait."""

    rank: int
    recorder: Recorder
    timeout_s: float
    flight: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    seq: itertools.count = field(default_factory=itertools.count)
    comm_stream: object = None      # torch.cuda.Stream on GPU engines
    calls: collections.Counter = field(default_factory=collections.Counter)   # channel → calls made
    check_p2p: bool = True          # receives check shape and dtype in a small header first
    link: LinkClock | None = None   # an emulated link's clocks (CPU only); None: gloo's own speed


_ctx: CommContext | None = None


def bind(ctx: CommContext | None) -> None:
    """Install this engine's context (done by the engine session)."""
    global _ctx
    _ctx = ctx


def context() -> CommContext:
    if _ctx is None:
        raise RuntimeError("labkit.comm is used outside a lab engine; call it through lab.apply or lab.run")
    return _ctx


def rank() -> int:
    """This engine's rank (inside ``lab.apply`` or a run), from the launcher's environment."""
    return context().rank


def span(kind: str, name: str = "", **kwargs):
    """Record user code as one span on this rank's timeline (``lab.trace``)::

        with labkit.comm.span("fwd", "some compute"):
            y = x @ w
    """
    return context().recorder.span(kind, name, **kwargs)


def flight_log() -> list[dict]:
    """The last calls this rank made, oldest first (each a dict; ``state`` says how it ended).

    ``channel`` and ``call`` line calls up across ranks: the n-th call on a group (or the n-th
    message from one rank to another) has the same ``call`` number on every rank that made it.
    """
    return [{k: v for k, v in entry.items() if not k.startswith("_")} for entry in context().flight]


def set_link(link) -> None:
    """Emulate ``link`` (a :class:`labkit.Link`) on this rank from the next call; None: raw gloo.

    Every rank of the lab must set the same link: a message's departure time travels ahead
    of it only when both ends emulate. The lab does this (``lab.link = ...``).
    """
    ctx = context()
    if link is not None and ctx.comm_stream is not None:
        raise ValueError("an emulated link is for CPU engines (gloo); a GPU lab has its own interconnect: "
                         "leave lab.link = None")
    ctx.link = LinkClock(link, ctx.rank) if link is not None else None


def set_p2p_check(on: bool) -> None:
    """Switch the shape/dtype header of point-to-point messages on or off (on every rank alike).

    On (the default), each message is preceded by a small header, so a receive whose tensor
    does not match what was sent raises :class:`CommMismatch` naming both ranks instead of
    killing the receiving process (gloo aborts on a size mismatch). Off saves one small
    message per send.
    """
    context().check_p2p = bool(on)
