"""Split pipeline receives into waiting (a bubble) and moving bytes (comm).

docs/design.md: a ``wait`` span is the part of a receive before its sender posted the matching
send. Ranks record their own sends and receives; only once every rank's events are gathered
can a receive be matched with its send and split.

Matching: point-to-point messages between two ranks arrive in the order they were sent
(gloo and NCCL both match a pair's sends and receives in order), so the k-th send from
rank a to rank b, by start time, is the k-th receive on b from a. Times of one step are taken
as one clock: each rank counts from the barrier that starts the step (labkit.engine.run_step).

For a matched pair, with ``send`` posted at s0 and done at s1, ``recv`` posted at r0, done r1:

    wait  [r0, s0]              on the receiver, only when the sender posted later (bubble)
    recv  [max(r0, s0), r1]     the receiver's share of moving the bytes
    send  [max(s0, r0), min(s1, r1)]   bytes move only once both ends are posted (gloo and
                                NCCL send by rendezvous); the sender's handle may be waited
                                for later than it completed, so its end is capped at r1.

A send posted long before its receiver was ready is then not counted as communication time
on the sender (it was only queued), and a rank blocked in one receive is not shown as busy
with an unrelated earlier send.

>>> ev = split_waits(step_events)     # runner.execute does this for every step
"""
from __future__ import annotations

from collections import defaultdict


def split_waits(events: list[dict]) -> list[dict]:
    """Return ``events`` with each matched receive split into ``wait`` + ``recv``.

    Without point-to-point events (data parallelism) the list comes back unchanged.
    Unmatched sends or receives (a step cut short) are left as they are.
    """
    if not any(e["kind"] in ("send", "recv") for e in events):
        return events
    events = [dict(e) for e in events]
    waits: dict[int, dict] = {}                 # id(recv event) → its wait span
    sends, recvs = defaultdict(list), defaultdict(list)
    for e in events:
        if e["kind"] == "send" and e.get("peer") is not None:
            sends[e["step"], e["rank"], e["peer"]].append(e)
        elif e["kind"] == "recv" and e.get("peer") is not None:
            recvs[e["step"], e["peer"], e["rank"]].append(e)
    for key, sent in sends.items():
        received = sorted(recvs.get(key, []), key=lambda e: e["start"])
        for send, recv in zip(sorted(sent, key=lambda e: e["start"]), received):
            wait = _split(send, recv)
            if wait is not None:
                waits[id(recv)] = wait
    out = []
    for e in events:
        if id(e) in waits:
            out.append(waits[id(e)])
        out.append(e)
    return out


def _split(send: dict, recv: dict) -> dict | None:
    """Trim ``send`` and ``recv`` in place to the time both were posted; return the wait, if any."""
    s0, s1, r0, r1 = send["start"], send["end"], recv["start"], recv["end"]
    both = max(s0, r0)
    send["start"] = min(both, s1)
    if send["start"] > s0:
        send["posted"] = s0          # when the sender posted it: the step graph's replay needs it
    send["end"] = max(send["start"], min(s1, r1))
    if s0 <= r0:
        return None
    recv["start"] = min(s0, r1)
    return dict(recv, kind="wait", start=r0, end=recv["start"], bytes=0)
