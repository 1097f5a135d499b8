"""The event and its kinds, defined once: recorder, simulator, metrics, plots and traces read them.

An event is one span on one rank's lane (docs/design.md, "Events")::

    {"rank", "stream": "compute"|"comm", "kind", "name", "step", "microbatch",
     "start", "end", "bytes", "peer"}

times in seconds from the step's start, aligned across ranks. Events stay plain dicts (they
travel from the engines by pickle and into JSON files unchanged); :class:`Event` types them.

Each kind is one row of :data:`KINDS`: its stream, its colour on the timeline, whether its
``bytes`` left the rank (metrics count those as sent), and for comm kinds the
:mod:`labkit.comm` call that records it. The call is spelled as torch spells it
(``all_reduce``), the kind once, as the timeline shows it (``allreduce``). A new kind is one
row here, and every view picks it up.

>>> KINDS["allreduce"].moves_bytes, KINDS["wait"].moves_bytes
(True, False)
>>> kind_of_call("all_gather")
'allgather'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict

STREAMS = ("compute", "comm")
"""The lanes drawn per rank. A checkpoint's spans are on stream ``io``, drawn on the comm lane
and counted as neither compute nor comm: time the loop spends saving is the step's, not its
work's."""


class Event(TypedDict):
    """One span of one rank; see the module docstring."""

    rank: int
    stream: str
    kind: str
    name: str
    step: int
    microbatch: int | None
    start: float
    end: float
    bytes: int
    peer: int | None
    group: NotRequired[str]
    """A collective's ranks, "0,2" (:func:`group_key`): what joins its members across ranks."""
    waited: NotRequired[float]
    """When the caller waited on an asynchronous call (seconds on the step's clock): where the
    rank consumed its result, the edge a replay keeps (labkit.analysis.whatif)."""
    moved: NotRequired[float]
    """On an emulated link: when gloo itself had moved a collective's bytes, before the link's
    wait (a replay on a faster link needs gloo's own time)."""
    posted: NotRequired[float]
    """When a send was posted, where its span starts later (its receiver came later:
    labkit.analysis.waits trims the span to the time both ends were there)."""


@dataclass(frozen=True)
class Kind:
    """One row of the kind table."""

    name: str
    stream: str
    color: str
    moves_bytes: bool = False
    """Its ``bytes`` left this rank (a recv's bytes count on the sender's side; wait moves none)."""
    call: str | None = None
    """The labkit.comm function that records it (comm kinds)."""
    description: str = ""
    waits: bool = False
    """Time spent waiting for a peer: schedule bubble in the metrics, never comm."""


# Colours: Okabe & Ito (2008), colour-blind safe, topped up from Paul Tol's muted scheme.
# Compute is blue-green, collectives warm, point-to-point wine/teal; wait is grey (hatched).
_ROWS = (
    Kind("fwd", "compute", "#56B4E9", description="forward of a micro-batch (or a block)"),
    Kind("bwd", "compute", "#0072B2", description="backward of a micro-batch (or a block)"),
    Kind("bwd_input", "compute", "#3B8BC2", description="split backward: input gradient only (I)"),
    Kind("bwd_weight", "compute", "#1F4E79", description="split backward: weight gradient only (W)"),
    Kind("attention", "compute", "#117733",
         description="one round of ring attention (context parallelism), inside a forward or backward"),
    Kind("optimizer", "compute", "#009E73", description="the optimizer step"),
    Kind("allreduce", "comm", "#D55E00", True, "all_reduce"),
    Kind("reduce_scatter", "comm", "#E69F00", True, "reduce_scatter"),
    Kind("allgather", "comm", "#CC79A7", True, "all_gather"),
    Kind("broadcast", "comm", "#F0E442", True, "broadcast"),
    Kind("all_to_all", "comm", "#332288", True, "all_to_all",
         description="tokens to their experts' ranks and back (expert parallelism)"),
    Kind("send", "comm", "#882255", True, "send"),
    Kind("recv", "comm", "#44AA99", False, "recv"),
    Kind("wait", "comm", "#BBBBBB", False, description="a receive before its sender posted (bubble)",
         waits=True),
    Kind("compress", "compute", "#999933", description="shrinking a bucket before it is sent"),
    Kind("decompress", "compute", "#DDCC77", description="restoring a received bucket"),
    Kind("checkpoint", "io", "#AA4499",
         description="a checkpoint: its save or staging and the wait for its writer after a step, "
                     "the writing thread under the steps it ran beside (labkit.parallel.saving)"),
)
KINDS: dict[str, Kind] = {k.name: k for k in _ROWS}
OTHER_COLOR = "#666666"      # a kind outside the table (user code): drawn, never dropped

# Kinds whose bytes left this rank (metrics' bytes_sent); kinds that wait for a peer (bubble).
SEND_KINDS = frozenset(k.name for k in _ROWS if k.moves_bytes)
WAIT_KINDS = frozenset(k.name for k in _ROWS if k.waits)
_BY_CALL = {k.call: k.name for k in _ROWS if k.call}


def kind_of_call(call: str) -> str:
    """The event kind a labkit.comm call records ("all_reduce" → "allreduce")."""
    return _BY_CALL.get(call, call)


def color_of(kind: str) -> str:
    row = KINDS.get(kind)
    return row.color if row else OTHER_COLOR


def stream_of(kind: str) -> str:
    row = KINDS.get(kind)
    return row.stream if row else "compute"


def make_event(rank: int, kind: str, name: str, step: int, start, end, microbatch=None,
               nbytes: int = 0, peer=None, stream: str | None = None, group=None) -> Event:
    """An event; the stream comes from the kind table unless given; ``group``: a collective's
    ranks (any iterable of ints)."""
    event = {"rank": rank, "stream": stream or stream_of(kind), "kind": kind, "name": name, "step": step,
             "microbatch": microbatch, "start": start, "end": end, "bytes": int(nbytes), "peer": peer}
    if group is not None:
        event["group"] = group_key(group)
    return event


def group_key(ranks) -> str:
    """A collective's ranks as events write them: sorted, comma-joined ("0,2")."""
    return ",".join(str(int(r)) for r in sorted(ranks))


def group_ranks(key: str) -> tuple[int, ...]:
    """The ranks of a ``group`` value ("0,2" → (0, 2); "" → ())."""
    return tuple(int(r) for r in key.split(",")) if key else ()
