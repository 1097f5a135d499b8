"""``lab.run(..., profile=True)``: a torch profiler trace per engine, saved, read back by
``run.profile`` into the same metrics, plots and straggler report as the run's own timeline.

    python -m pytest tests/test_profile.py
"""
import gzip
import json

import pytest

import labkit

MODEL = labkit.models.mlp(width=32, depth=4)
KW = dict(model=MODEL, batch=16, lr=0.1, seed=0)


def test_a_profiled_dp_run_saves_a_trace_per_rank_and_reads_back(lab2, tmp_path):
    run = lab2.run(labkit.Strategy(dp=2, dp_mode="overlap", bucket_mb=0.001), steps=3, profile=tmp_path, **KW)
    assert run.max_diff(labkit.reference(steps=3, **KW)) < 1e-5         # profiling changes no number
    assert run.profile_paths == [str(tmp_path / f"rank{r}.json.gz") for r in (0, 1)]
    with gzip.open(run.profile_paths[1], "rt") as f:
        trace = json.load(f)
    assert trace["distributedInfo"]["rank"] == 1 and trace["distributedInfo"]["world_size"] == 2

    tl = run.profile
    assert tl is run.profile                                            # read once
    assert tl.world_size == 2 and tl.steps == [0, 1, 2] == run.timeline.steps
    assert tl.coords(1) == {"dp": 1, "pp": 0, "tp": 0}                  # the run's grid
    for rank in (0, 1):
        kinds = {e["kind"] for e in tl.events if e["rank"] == rank}
        assert {"compute", "allreduce"} <= kinds
        # collection is off between steps: the step's own barrier and the next batch stay out
        assert "barrier" not in kinds
    names = {e["name"] for e in tl.events}
    assert "aten::linear" in names and "gloo:all_reduce" in names
    durations = tl.step_durations()
    assert all(0 <= e["start"] <= e["end"] <= durations[e["step"]] for e in tl.events)
    m = tl.metrics(global_batch=16)
    assert m["step_time_s"] > 0 and 0 < m["comm_fraction"] <= 1 and 0 <= m["overlap_fraction"] <= 1
    assert set(tl.stragglers().scores) == {0, 1}
    assert tl.plot() is not None


def test_a_profiled_pipeline_run_has_its_sends_and_receives(lab2):
    run = lab2.run(labkit.Strategy(pp=2, microbatches=2), steps=2, profile=True, **KW)
    tl = run.profile
    assert tl.steps == [0, 1]
    first, last = ({e["kind"] for e in tl.events if e["rank"] == r} for r in (0, 1))
    assert {"compute", "send"} <= first and {"compute", "recv"} <= last


def test_profile_is_checked_before_any_engine_and_an_unprofiled_run_says_so(lab2, tmp_path):
    with pytest.raises(TypeError, match="profile=3 must be True, False or a folder"):
        lab2.run(labkit.Strategy(dp=2), steps=1, profile=3, **KW)
    a_file = tmp_path / "x.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="is a file; name a folder"):
        lab2.run(labkit.Strategy(dp=2), steps=1, profile=str(a_file), **KW)
    run = lab2.run(labkit.Strategy(dp=2), steps=1, **KW)
    with pytest.raises(ValueError, match=r"not profiled; run it with lab.run\(\.\.\., profile=True\)"):
        run.profile
