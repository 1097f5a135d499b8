"""Tensor parallelism through lab.run: the tp axis's checks (before engines), the embedding
group, the recorder's cut around blocking calls, bytes against Megatron's formula, and GPT
on text equal to one process for tp=2 (both modes), pp=2 with the tied head, dp×tp and pp×tp
on 4 engines, and dp×pp×tp = 2×2×2 on 8 engines once."""
from __future__ import annotations

import pytest
from torch import nn

import labkit
from labkit.analysis.tensor_bytes import megatron_tp_bytes
from labkit.grid import ParallelDims
from labkit.parallel.build import RunSpec
from labkit.parallel.pipeline.tied import tied_across_stages
from labkit.record.recorder import Recorder
from labkit.run.runner import validate

DATA = labkit.data.text(batch=8, block_size=16)
GPT = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)
KW = dict(data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)


def spec(strategy, model=GPT, data=DATA, tp_plan=None):
    return RunSpec(strategy, model, data, "cross_entropy", batch=8, steps=3, tp_plan=tp_plan)


# -- checks, in one process -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=2, tp_mode="horovod"), "tp_mode"),
    (dict(tp=2, tp_mode="dtensor", sequence_parallel=True), "sequence_parallel"),
    (dict(tp=2, dp=2, tp_mode="dtensor"), "tp_mode='dtensor' with dp > 1"),
])
def test_strategy_checks_its_tp_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        labkit.Strategy(**kwargs)


@pytest.mark.parametrize("run_spec, engines, match", [
    (spec(labkit.Strategy(tp=2), labkit.models.gpt(n_head=3, n_embd=96, vocab_size=DATA.vocab_size)), 2,
     "n_head=3"),
    (spec(labkit.Strategy(tp=2), tp_plan={"blocks.*.fc": "colwise"}), 2, "names no module"),
    (spec(labkit.Strategy(tp=2), tp_plan={"*.ln_1": "colwise"}), 2, "LayerNorm"),
    (spec(labkit.Strategy(tp=2, pp=2)), 2, "dp\\*pp\\*tp"),
    (spec(labkit.Strategy(tp=2), labkit.models.gpt(block_size=8, vocab_size=DATA.vocab_size)), 2,
     "block_size"),
    (spec(labkit.Strategy(pp=2, schedule="zbv", chunks=2)), 2, "tie=False"),
    (spec(labkit.Strategy(tp=3), labkit.models.gpt(n_embd=32, vocab_size=DATA.vocab_size),
          tp_plan={"*.mlp.fc": "colwise", "*.mlp.proj": "rowwise"}), 3, "out_features=128"),
])
def test_bad_tp_runs_fail_before_engines(run_spec, engines, match):
    with pytest.raises(ValueError, match=match):
        validate(run_spec, engines)


def test_tp_fields_reach_flags_and_labels():
    from labkit.cli import build_parser

    args = build_parser().parse_args(["run", "--tp", "2", "--tp-mode", "dtensor", "--model", "gpt"])
    assert (args.tp, args.tp_mode, args.model) == (2, "dtensor", "gpt")
    assert labkit.Strategy(dp=2, tp=2).label() == "dp=2 tp=2 megatron mb=1 overlap 1 MiB"
    assert "sp" in labkit.Strategy(tp=2, sequence_parallel=True).label().split()


def test_embedding_group_is_first_and_last_stage_of_each_pipeline():
    assert ParallelDims(2, 2, 2).embedding_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ParallelDims(1, 4, 1).embedding_groups() == [[0, 3]]
    assert ParallelDims(2, 1, 2).embedding_groups() == []


def test_tied_weight_found_between_first_and_last_stage():
    model = GPT()
    assert tied_across_stages(model, [range(0, 2), range(2, 4)]) == ["0.wte.weight"]
    assert tied_across_stages(model, [range(0, 4)]) == []
    untied = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, vocab_size=50, tie=False)()
    assert tied_across_stages(untied, [range(0, 2), range(2, 4)]) == []


def test_compute_span_is_cut_around_a_blocking_call():
    rec = Recorder(0)
    rec.start_step(0)
    rec.blocked(0.2, 0.3)
    rec.blocked(0.5, 0.6)
    rec.add("fwd", "F0", 0.1, 0.7)
    rec.add("allreduce", "tp g", 0.2, 0.3)
    spans = [(e["start"], e["end"]) for e in rec.drain() if e["stream"] == "compute"]
    assert spans == [(0.1, 0.2), (0.3, 0.5), (0.6, 0.7)]


def test_compute_span_is_cut_around_a_wait_on_an_async_call_that_blocks():
    """A ZeRO-2 bucket collected during backward: the rank waits, and computes nothing then."""
    import time

    from labkit.comm import CommContext, Handle

    class Slow:                  # a torch work that takes 30 ms to complete
        def wait(self):
            time.sleep(0.03)

    class Done:
        def wait(self):
            pass
    rec = Recorder(0)
    rec.start_step(0)
    ctx = CommContext(rank=0, recorder=rec, timeout_s=5.0)
    entry = {"op": "reduce_scatter", "kind": "reduce_scatter", "name": "bucket 0", "microbatch": None,
             "bytes": 0, "peer": None, "state": "issued"}
    t0 = rec.now()
    Handle(ctx, dict(entry), Slow(), t0, watch=False, thread=True).wait()
    Handle(ctx, dict(entry), Done(), rec.now(), watch=False, thread=True).wait()    # done already: no cut
    rec.add("bwd", "B0", t0 - 0.01, rec.now() + 0.01)
    spans = [(e["start"], e["end"]) for e in rec.drain() if e["stream"] == "compute"]
    assert len(spans) == 2 and spans[1][0] - spans[0][1] >= 0.025, spans


def test_megatron_formula():
    # per layer 4 all-reduces of b·s·h fp32 values, ring factor 2(t−1)/t = 1 at t=2
    assert megatron_tp_bytes(2, 8, 16, 32, 2) == 2 * 4 * 8 * 16 * 32 * 4
    assert megatron_tp_bytes(1, 1, 1, 1, 4) == 4 * 4 * 1.5
    assert megatron_tp_bytes(3, 8, 16, 32, 1) == 0


def test_grid_draws_the_tp_groups():
    from matplotlib.patches import FancyBboxPatch
    from labkit.view.grid import draw_grid

    ax = draw_grid(ParallelDims(2, 2, 2)).axes[0]
    frames = [p for p in ax.patches if isinstance(p, FancyBboxPatch) and p.get_facecolor()[3] == 0]
    assert len(frames) == 4 and "tp=2" in ax.get_title()


# -- on engines -----------------------------------------------------------------------------
def check_equal(run, ref):
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)
    assert run.max_diff(ref) <= 1e-5


@pytest.mark.slow
def test_tp2_both_modes_and_the_tied_pipeline_equal_one_process(lab2):
    ref = labkit.reference(GPT, **KW)
    megatron = lab2.run(labkit.Strategy(tp=2), model=GPT, **KW)
    check_equal(megatron, ref)
    check_equal(lab2.run(labkit.Strategy(tp=2, tp_mode="dtensor"), model=GPT, **KW), ref)
    pipeline = lab2.run(labkit.Strategy(pp=2, microbatches=2), model=GPT, **KW)      # tie=True
    check_equal(pipeline, ref)
    sums = [e for e in pipeline.timeline.events if e["name"].startswith("embedding grad")]
    assert {e["rank"] for e in sums} == {0, 1} and all(e["kind"] == "allreduce" for e in sums)
    # measured: f/g bytes equal Megatron's formula; each rank holds less than the whole model
    for row in megatron.tp_bytes(n_embd=32, seq=16):
        assert row["layers"] == GPT.n_layer and row["measured_bytes"] == row["formula_bytes"]
    whole = sum(p.numel() * 4 for p in GPT().parameters())
    assert all(b < whole for b in megatron.parameter_bytes)
    assert megatron.metrics["exposed_comm_fraction"] > 0          # f and g block the compute lane


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [labkit.Strategy(dp=2, tp=2),
                                      labkit.Strategy(pp=2, tp=2, microbatches=2)])
def test_dp_or_pp_times_tp_equal_one_process(lab4, strategy):
    run = lab4.run(strategy, model=GPT, **KW)
    check_equal(run, labkit.reference(GPT, **KW))
    for row in run.tp_bytes(n_embd=32, seq=16):
        assert row["measured_bytes"] == pytest.approx(row["formula_bytes"])


@pytest.mark.slow
def test_3d_on_eight_engines_equals_one_process():
    """2×2×2, once (8 engines on 2 cores start slowly). SGD only: this version's run has no
    optimizer choice."""
    from conftest import release_labs

    release_labs()
    big = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)
    with labkit.Lab.start(engines=8, timeout=60, progress=False) as lab:
        run = lab.run(labkit.Strategy(dp=2, pp=2, tp=2, microbatches=2), model=big, **KW)
    check_equal(run, labkit.reference(big, **KW))


def test_dashboard_has_tp_controls_and_a_model_choice():
    from labkit.widgets import Dashboard

    class NoEngines:
        world_size, ranks = 2, []

        @property
        def view(self):
            raise AssertionError("the dashboard reached the engines")

    dash = Dashboard(NoEngines(), model="gpt", batch=8, auto=False, plot="image")
    assert {"tp", "tp_mode", "sequence_parallel"} <= set(dash.controls)
    assert list(dash.controls["model"].options) == ["gpt", "mlp"]
    dash.set(dp=1, tp=2, tp_mode="dtensor")
    assert not dash.run_button.disabled and dash.spec().loss == "cross_entropy"
    dash.set(model="mlp")                    # the MLP has no tensor-parallel plan: tp's ranks go to dp
    c = dash.controls
    assert (c["tp"].value, c["dp"].value) == (1, 2) and c["tp"].disabled and not dash.run_button.disabled
    assert any("tp_plan" in note.value for note in dash.notes.values())
    with pytest.raises(ValueError, match="tp_plan"):
        dash.set(tp=2)
    dash.close()
