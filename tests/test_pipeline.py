"""Pipeline parallelism through the real Lab: every schedule equals the single-process run.

Pure tests of the stage split and of bad input come first (no engines); then gpipe, 1f1b and
interleaved at pp=2 and pp=4, and dp=2 × pp=2 with every gradient-sync mode.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.errors import LabError
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate
from labkit.parallel.pipeline.stages import check_split, split_blocks, stage_blocks

STEPS = 5
MLP = labkit.models.mlp(width=24, depth=4)          # 7 blocks: Linear, GELU, ..., Linear


def eight_blocks():
    """8 blocks of unequal sizes (interleaved needs a block count divisible by pp·chunks)."""
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 16), nn.Tanh(),
                         nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 8), nn.Tanh())


def eight_data(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 8, generator=g)


@pytest.fixture(scope="module")
def mlp_ref():
    return labkit.reference(MLP, batch=16, steps=STEPS, lr=0.1, seed=4)


@pytest.fixture(scope="module")
def eight_ref():
    return labkit.reference(eight_blocks, data=eight_data, batch=16, steps=STEPS, lr=0.05, seed=6)


def _check(run, ref):
    assert set(run.parameters()) == set(ref.parameters())
    assert run.max_diff(ref) <= 1e-5
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)


# -- the stage split (no engines) ---------------------------------------------------------------
def test_split_balances_parameters_and_keeps_stages_contiguous():
    assert split_blocks([4, 0, 4, 0, 8], 2) == [range(0, 3), range(3, 5)]
    assert split_blocks([1, 1, 1, 100], 2) == [range(0, 3), range(3, 4)]    # uneven is fine
    assert split_blocks([0, 0, 0, 0], 4) == [range(i, i + 1) for i in range(4)]
    assert split_blocks([5] * 8, 4, equal=True) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_blocks([5] * 7, 3, split_at=(1, 5)) == [range(0, 1), range(1, 5), range(5, 7)]
    stages = stage_blocks(MLP(), labkit.Strategy(pp=2))
    assert [len(s) for s in stages] in ([4, 3], [3, 4])


@pytest.mark.parametrize("strategy,engines,batch,message", [
    (labkit.Strategy(pp=2, microbatches=3), 2, 16, "does not divide into microbatches=3"),
    (labkit.Strategy(pp=8), 8, 16, "7 top-level blocks but pp\\*chunks = 8"),
    (labkit.Strategy(pp=2, schedule="interleaved", chunks=2, microbatches=2), 2, 16,
     "multiple of 4"),
    (labkit.Strategy(dp=2, pp=2), 2, 16, "start the lab with engines=4"),
    (labkit.Strategy(pp=2, split_at=(9,)), 2, 16, "every boundary must be < 7"),
])
def test_bad_input_is_a_value_error_before_any_engine(strategy, engines, batch, message):
    with pytest.raises(ValueError, match=message):
        validate(RunSpec(strategy, MLP, batch=batch), engines)


def test_bad_strategy_fields_name_the_fix():
    with pytest.raises(ValueError, match="need 1"):
        labkit.Strategy(pp=2, split_at=(2, 4))
    with pytest.raises(ValueError, match="increasing"):
        labkit.Strategy(pp=3, split_at=(4, 2))
    check_split(labkit.Strategy(pp=2, schedule="interleaved", chunks=2, microbatches=2, split_at=(1, 2, 5)), 7)


# -- equivalence through the real Lab -----------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_match_reference_pp2(lab2, schedule, mlp_ref):
    run = lab2.run(labkit.Strategy(pp=2, schedule=schedule, microbatches=4), model=MLP, batch=16,
                   steps=STEPS, seed=4)
    _check(run, mlp_ref)
    step = [e for e in run.timeline.events if e["step"] == STEPS - 1]
    for rank in (0, 1):
        fwd = sorted(e["microbatch"] for e in step if e["rank"] == rank and e["kind"] == "fwd")
        assert fwd == [0, 1, 2, 3]
        assert {e["name"] for e in step if e["rank"] == rank and e["kind"] == "bwd"} == {"B0", "B1", "B2", "B3"}
    sends = [e for e in step if e["kind"] == "send"]
    assert {(e["rank"], e["peer"]) for e in sends} == {(0, 1), (1, 0)} and len(sends) == 8
    assert all(e["stream"] == "comm" for e in step if e["kind"] in ("send", "recv", "wait"))
    assert any(e["kind"] == "wait" for e in step)      # stage 1 waits for stage 0's first forward
    from labkit.analysis.metrics import step_metrics                 # kept per step, the same as from every event
    measured = [e for e in run.timeline.events if e["step"] >= 1]
    whole = step_metrics(measured, 2, 16, peak_activation_bytes=run.metrics["peak_activation_bytes"])
    assert {k: run.metrics[k] for k in whole} == whole


def test_interleaved_matches_reference_pp2(lab2, eight_ref):
    run = lab2.run(labkit.Strategy(pp=2, schedule="interleaved", chunks=2, microbatches=4),
                   model=eight_blocks, data=eight_data, batch=16, steps=STEPS, lr=0.05, seed=6)
    _check(run, eight_ref)
    names = {e["name"] for e in run.timeline.events if e["kind"] == "fwd" and e["rank"] == 0}
    assert {"F0 c0", "F0 c1", "F3 c1"} <= names


def test_user_boundaries_and_activation_memory(lab2, mlp_ref):
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        run = lab2.run(labkit.Strategy(pp=2, schedule=schedule, microbatches=8, split_at=(2,)),
                       model=MLP, batch=16, steps=STEPS, seed=4)
        _check(run, mlp_ref)
        peaks[schedule] = run.metrics["peak_activation_bytes"]
    # m = 8 ≥ 2p: 1F1B holds at most p − r micro-batches, GPipe all 8
    assert all(0 < one < g for one, g in zip(peaks["1f1b"], peaks["gpipe"]))


class ShrinksOnThirdCall(nn.Module):
    """A block whose output loses a row from its third call on: a data-dependent shape."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x if self.calls < 3 else x[:-1]


def shrinking_model():
    return nn.Sequential(nn.Linear(24, 24), ShrinksOnThirdCall(), nn.Linear(24, 24))


def test_a_changing_shape_is_a_clear_error_not_a_dead_engine(lab2, mlp_ref):
    shared = lab2.timeout
    lab2.timeout = 5                  # the receiver waits this long for what never comes
    try:
        with pytest.raises(LabError) as info:
            lab2.run(labkit.Strategy(pp=2, schedule="gpipe", microbatches=4, split_at=(2,)),
                     model=shrinking_model, batch=16, steps=1)
    finally:
        lab2.timeout = shared
    text = " ".join(r.message for r in info.value.reports)
    assert "must keep one output shape" in text and "(3, 24)" in text   # the sender says why
    assert info.value.ranks == [0]              # the receiver was waiting, not killed by gloo
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4), model=MLP, batch=16, steps=STEPS, seed=4)
    _check(run, mlp_ref)                                  # both engines alive and in step


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_match_reference_pp4(lab4, schedule, mlp_ref):
    run = lab4.run(labkit.Strategy(pp=4, schedule=schedule, microbatches=4), model=MLP, batch=16,
                   steps=STEPS, seed=4)
    _check(run, mlp_ref)
    assert run.metrics["bubble_fraction"] > 0


def test_interleaved_matches_reference_pp4(lab4, eight_ref):
    run = lab4.run(labkit.Strategy(pp=4, schedule="interleaved", chunks=2, microbatches=4),
                   model=eight_blocks, data=eight_data, batch=16, steps=STEPS, lr=0.05, seed=6)
    _check(run, eight_ref)


@pytest.mark.parametrize("mode", ["naive", "bucketed", "overlap", "ddp"])
def test_dp2_pp2_matches_reference(lab4, mode, mlp_ref):
    run = lab4.run(labkit.Strategy(dp=2, pp=2, microbatches=2, dp_mode=mode, bucket_mb=0.001),
                   model=MLP, batch=16, steps=STEPS, seed=4)
    _check(run, mlp_ref)
    step = [e for e in run.timeline.events if e["step"] == STEPS - 1]
    reduced = {e["rank"] for e in step if e["kind"] == "allreduce"}
    assert reduced == {0, 1, 2, 3}                    # every stage reduced over its dp group
    pairs = {(e["rank"], e["peer"]) for e in step if e["kind"] == "send"}
    assert pairs == {(0, 1), (1, 0), (2, 3), (3, 2)}  # two pipelines, no cross traffic


@pytest.mark.parametrize("mode", ["overlap", "ddp"])
def test_gradients_leave_only_with_the_last_microbatch(lab4, mode, mlp_ref):
    # GPipe runs B0 right after F3: DDP must not reduce there, only in B3 (and overlap alike)
    run = lab4.run(labkit.Strategy(dp=2, pp=2, microbatches=4, schedule="gpipe", dp_mode=mode,
                                   bucket_mb=0.001), model=MLP, batch=16, steps=STEPS, seed=4)
    _check(run, mlp_ref)
    step = [e for e in run.timeline.events if e["step"] == STEPS - 1 and e["rank"] == 0]
    last_bwd = next(e for e in step if e["kind"] == "bwd" and e["microbatch"] == 3)
    first_reduce = min(e["start"] for e in step if e["kind"] == "allreduce")
    assert first_reduce >= last_bwd["start"]


def test_dp2_pp2_carries_gradient_compression(lab4, mlp_ref):
    plain = lab4.run(labkit.Strategy(dp=2, pp=2, microbatches=2, dp_mode="bucketed", bucket_mb=0.001),
                     model=MLP, batch=16, steps=STEPS, seed=4)
    half = lab4.run(labkit.Strategy(dp=2, pp=2, microbatches=2, dp_mode="bucketed", bucket_mb=0.001,
                                    compression="fp16"), model=MLP, batch=16, steps=STEPS, seed=4)
    assert half.max_diff(mlp_ref) < 1e-2                     # close, not exact: fp16 on the wire
    sent = lambda run: sum(e["bytes"] for e in run.timeline.events if e["kind"] == "allreduce")
    assert sent(half) == pytest.approx(sent(plain) / 2, rel=0.01)


def test_ddp_wait_is_not_counted_as_backward_compute(lab4, mlp_ref):
    # DDP waits for its all-reduces inside backward(); the chunk's backward span must end when
    # its gradients exist, so the last all-reduce finishes after it instead of inside it.
    run = lab4.run(labkit.Strategy(dp=2, pp=2, microbatches=2, schedule="gpipe", dp_mode="ddp",
                                   bucket_mb=0.001), model=MLP, batch=16, steps=STEPS, seed=4)
    _check(run, mlp_ref)

    def reduce_ends_after_backward(rank, k):
        step = [e for e in run.timeline.events if e["step"] == k and e["rank"] == rank]
        last_bwd = max(e["end"] for e in step if e["kind"] == "bwd")
        return max(e["end"] for e in step if e["kind"] == "allreduce") > last_bwd

    # counted inside backward, every all-reduce would end before it, in every step; the last
    # (tiny) bucket, launched as the last gradient appears, can end before the hook that closes
    # the span runs when its peer launched it first, so one step of them may show it
    for rank in range(4):
        assert any(reduce_ends_after_backward(rank, k) for k in range(1, STEPS)), rank


@pytest.mark.parametrize("schedule, chunks", [("zb-h1", 1), ("zbv", 2)])
def test_zero_bubble_schedules_run_on_the_engines_and_equal_one_process(lab2, schedule, chunks):
    """I and W run as the executor's own actions (split backward), ZB-V's local turn hands
    over without a message; the result equals the single-process run."""
    s = labkit.Strategy(pp=2, schedule=schedule, chunks=chunks, microbatches=4)
    run = lab2.run(s, model=MLP, batch=16, steps=STEPS, seed=4)
    ref = labkit.reference(MLP, batch=16, steps=STEPS, seed=4)
    assert run.max_diff(ref) < 1e-5
    kinds = {e["kind"] for e in run.timeline.events}
    assert {"bwd_input", "bwd_weight"} <= kinds and "bwd" not in kinds


def _fails_on_rank_one():
    """Builds in the notebook; raises on rank 1 when the engines build their part."""
    import os
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one refuses on purpose")
    return MLP()


def test_a_build_that_failed_on_one_rank_leaves_the_next_pipeline_matched(lab2):
    """Point-to-point tags come from the run id, the same on every rank: a build that failed on
    one rank only must not leave the ranks' tags apart (the next pipeline would hang)."""
    with pytest.raises(LabError, match="refuses on purpose"):
        lab2.run(labkit.Strategy(dp=2), model=_fails_on_rank_one, batch=16, steps=1)
    run = lab2.run(labkit.Strategy(pp=2, microbatches=2), model=MLP, batch=16, steps=STEPS, seed=4)
    assert run.max_diff(labkit.reference(MLP, batch=16, steps=STEPS, seed=4)) < 1e-5


@pytest.mark.parametrize("schedule, chunks", [("zb-h1", 1), ("zbv", 2)])
def test_zero_bubble_schedules_at_pp4_equal_one_process(lab4, schedule, chunks):
    """Four stages (ZB-V: eight chunks in a V) through the executor, against one process."""
    model = labkit.models.mlp(width=32, depth=8)
    s = labkit.Strategy(pp=4, schedule=schedule, chunks=chunks, microbatches=8)
    run = lab4.run(s, model=model, batch=32, steps=STEPS, seed=5)
    assert run.max_diff(labkit.reference(model, batch=32, steps=STEPS, seed=5)) < 1e-5
