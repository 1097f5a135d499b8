"""A big run on this machine: dp × pp on 16 local engines, exact against one process, drawn
in the aggregated view and zoomed, a planted straggler named; and the same straggler at 8.

    python -m pytest tests/test_scale.py        # ~1.5 min on 2 cores (16 engines start in ~25 s)
"""
import warnings

import pytest

import labkit
from conftest import lab_with

pytestmark = pytest.mark.slow           # starts 16, then 8 engines of its own
KW = dict(model=labkit.models.mlp(width=16, depth=4), batch=32, steps=3, lr=0.1, seed=0)
SLEEP_S = 0.02                          # per forward of a layer with weights on the planted rank


def started(engines: int):
    with warnings.catch_warnings():     # "16 engines on 2 cores": known, and the point here
        warnings.filterwarnings("ignore", message=r".*engines on \d+ cores")
        return lab_with(engines)


def test_sixteen_engines_dp_pp_exact_aggregated_and_a_planted_straggler_named():
    lab = started(16)
    s = labkit.Strategy(dp=8, pp=2, microbatches=2)
    run = lab.run(s, **KW)
    assert run.max_diff(labkit.reference(**KW)) < 1e-5

    # rank 10 = dp 5, stage 0: its forwards are slow; its stage-1 partner (rank 11) waits for
    # them, so it is late too, but the report names the rank it waited on first
    with lab.straggler(rank=10, seconds=SLEEP_S):
        slow = lab.run(s, **KW)
    found = slow.timeline.stragglers()
    assert found[0].rank == 10 and found[0].cause == "compute", repr(found)
    assert found[0].coords == {"dp": 5, "pp": 0, "tp": 0}
    if 11 in found.ranks():
        assert found.ranks().index(11) == 1 and found[1].cause == "waiting on rank 10", repr(found)
    assert found.plot() is not None

    fig = slow.timeline.plot(aggregate=True)            # per stage: slowest, median, fastest + heatmap
    lanes, heat = fig.axes[:2]
    names = [t.get_text() for t in lanes.get_yticklabels()]
    assert len(names) == 2 * 3 * 2                        # 2 stages × 3 replicas × 2 streams
    assert any("rank 10 " in n for n in names)            # the slow replica of stage 0 is shown
    assert heat.images and heat.images[0].get_array().shape[0] == 16     # a row per rank
    zoom = slow.timeline.plot(stage=0)
    assert len(zoom.axes[0].get_yticklabels()) == 8 * 2   # stage 0's replicas, every lane


def test_eight_engines_name_the_planted_straggler():
    lab = started(8)
    with pytest.raises(ValueError, match=r"rank=8\): give a rank from 0 to 7"):
        with lab.straggler(rank=8, seconds=SLEEP_S):
            pass
    with pytest.raises(ValueError, match=r"seconds=-1\): give the extra seconds"):
        with lab.straggler(rank=0, seconds=-1):
            pass
    with lab.straggler(rank=5, seconds=SLEEP_S):
        run = lab.run(labkit.Strategy(dp=8), **KW)
    found = run.timeline.stragglers()
    assert found.ranks()[:1] == [5] and found[0].cause == "compute", repr(found)
    assert found[0].coords == {"dp": 5, "pp": 0, "tp": 0}
