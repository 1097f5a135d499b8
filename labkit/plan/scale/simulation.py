"""The timeline of one predicted step at cluster scale, run on the planner's one simulator.

``Prediction.timeline()`` (:mod:`labkit.plan.scale.step`) draws one pipeline (its pp ranks; dp
replicas are alike): the schedule's action lists (:func:`build_schedule`) priced by the stage
costs it hands over (:class:`labkit.plan.scale.step.StageCosts`: FLOPs and α-β), each message taking the
point-to-point time, and the dp gradient all-reduce as one call, issued before the rank's last
backward when ``overlaps_dp`` (dp_mode "overlap" or "ddp": so it runs beside it) or after the schedule without.
"""
from __future__ import annotations

from ...analysis.timeline import Timeline
from ...parallel.pipeline import SPLIT_BACKWARD
from ...parallel.pipeline.schedules import build_schedule
from ...analysis.des import Compute, Issue, Sim, Wait

KINDS = {"F": "fwd", "B": "bwd", "I": "bwd_input", "W": "bwd_weight"}


def simulate_scale(prediction, c, max_microbatches: int | None = None) -> Timeline:
    """The timeline of ``prediction``'s step priced by its stage costs ``c`` (see the module
    docstring). The costs come in as data, so this module needs nothing of :mod:`.step`."""
    s, m = prediction.strategy, prediction.strategy.microbatches(prediction.global_batch)
    if max_microbatches is not None and m > max_microbatches:
        raise ValueError(f"{m} micro-batches would draw {m * s.pp * 4} spans; pass max_microbatches={m} "
                         "to draw them all")
    split = s.schedule in SPLIT_BACKWARD
    seconds = {"F": c.fwd, "B": c.bwd, "I": c.bwd_input if split else c.bwd, "W": c.bwd_weight if split else c.bwd}
    programs = []
    for r, actions in enumerate(build_schedule(s.schedule, s.pp, m, s.chunks)):
        backwards = [k for k, a in enumerate(actions) if a.op in ("B", "W")]
        sync = Issue(("dp", r), (r,), c.dp_sync, "allreduce", f"gradients (dp={s.dp})") if s.dp > 1 else None
        prog = []
        for k, a in enumerate(actions):
            if sync and s.overlaps_dp and backwards and k == backwards[-1]:
                prog.append(sync)
            if a.op in KINDS:
                prog.append(Compute(seconds[a.op][a.stage], KINDS[a.op], str(a), a.microbatch))
            elif a.op.startswith("SEND"):
                key = (a.op[-1], a.stage, a.microbatch)
                prog.append(Issue(key, (r, a.peer), c.p2p, "send", str(a), peer=a.peer, microbatch=a.microbatch,
                                  ordered=False))
            else:
                key = (a.op[-1], a.stage - 1 if a.op.endswith("F") else a.stage + 1, a.microbatch)
                prog += [Issue(key, (a.peer, r), c.p2p, "recv", str(a), peer=a.peer, microbatch=a.microbatch,
                               ordered=False), Wait(key)]
        if sync:
            prog += ([] if s.overlaps_dp else [sync]) + [Wait(("dp", r))]
        prog.append(Compute(c.optimizer, "optimizer", "optimizer"))
        programs.append(prog)
    events = Sim(programs, cores=float(s.pp)).run()
    return Timeline(events, s.pp, title=f"{prediction.model.layers}-layer GPT, {s.label()}")
