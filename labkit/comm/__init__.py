"""The instrumented collectives and point-to-point calls every strategy uses.

This module is the only place that talks to ``torch.distributed`` during a step and the
only place that records comm events, so no strategy can forget to. Each call

* gets a sequence number in a small flight recorder (op, group, shape, dtype, peer, step,
  state), so a hang can be explained afterwards from every rank's log;
* is timed from issue to completion (CPU: host clock, completion seen by the work's
  future; GPU: CUDA events on a dedicated comm stream);
* turns torch's terse failures into errors that name the rank, the operation and the step;
* with an emulated link (``lab.link``, :class:`labkit.Link`), completes no earlier than the
  link's α-β time allows, waiting off the CPU (:mod:`.emulate`).

The engine's state (:mod:`.state`), an issued call's handle (:mod:`.handles`), the calls
themselves (:mod:`.calls`) and the point-to-point header (:mod:`.p2p`) are modules of their
own; this package names them.

>>> labkit.comm.all_reduce(t, name="grad 0")              # on an engine, inside lab.apply
>>> h = labkit.comm.all_reduce(t, async_op=True); ...; h.wait()
"""
from .calls import (OPS, all_gather, all_reduce, all_reduce_future, all_to_all_single, barrier,  # noqa: F401
                    broadcast, irecv, isend, recv, reduce_scatter, send, wire_bytes)
from .handles import BLOCKED_S, Handle  # noqa: F401
from .p2p import DTYPES, HEADER_LEN, MAX_DIMS, describable, header, read_header  # noqa: F401
from .state import (CommContext, bind, context, flight_log, rank, set_link, set_p2p_check,  # noqa: F401
                    span)
