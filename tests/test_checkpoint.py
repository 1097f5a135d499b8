"""Checkpoints (labkit.checkpoint, labkit.parallel.state): saved under one strategy, resumed under
another, equal to one process trained straight through; torch's own files; bad folders named.

The model is written as a user writes one (its own forward, odd widths: nothing divides evenly
by 2, so ZeRO pads and FSDP2 cuts unevenly), with a tp plan of its own.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate

LR = 0.01
BATCH = 12


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, hidden), nn.Linear(hidden, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    """An input layer, three blocks, a head: a chain the pipeline cuts by its children."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, width: int = 19, hidden: int = 26, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(11, width)
        self.blocks = nn.ModuleList([Block(width, hidden) for _ in range(depth)])
        self.out = nn.Linear(width, 7)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def data(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 7, generator=g)


def train(lab, strategy, steps, optimizer="adamw", momentum=0.0, model=Net, data=data, **kw):
    return lab.run(strategy, model=model, data=data, batch=BATCH, steps=steps, lr=LR, seed=7,
                   optimizer=optimizer, momentum=momentum, **kw)


def reference(steps, optimizer="adamw", momentum=0.0):
    return labkit.reference(Net, data=data, batch=BATCH, steps=steps, lr=LR, seed=7, optimizer=optimizer,
                            momentum=momentum)


def test_adamw_resumes_exactly_across_zero1_pipeline_megatron_and_zero3(lab2, tmp_path):
    S = labkit.Strategy
    a = train(lab2, S(dp=2, zero=1, bucket_mb=0.001), 2, checkpoint=tmp_path / "a")
    b = train(lab2, S(pp=2, schedule="1f1b", microbatches=2), 2, resume=tmp_path / "a", checkpoint=tmp_path / "b")
    c = train(lab2, S(tp=2, tp_mode="megatron"), 1, resume=tmp_path / "b", checkpoint=tmp_path / "c",
              tp_plan=Net.tp_plan)
    d = train(lab2, S(dp=2, zero=3), 1, resume=tmp_path / "c")
    assert [r.first_step for r in (a, b, c, d)] == [0, 2, 4, 5]
    ref = reference(6)
    assert d.max_diff(ref) <= 1e-5
    assert a.losses + b.losses + c.losses + d.losses == pytest.approx(ref.losses, abs=1e-5)
    assert [os.path.basename(p) for p in a.checkpoints + b.checkpoints] == ["step_000002", "step_000004"]


def test_sgd_momentum_resumes_from_fsdp2_into_ddp_and_interleaved(lab2, tmp_path):
    S = labkit.Strategy
    train(lab2, S(dp=2, zero=3, zero_mode="fsdp2"), 2, "sgd", 0.9, checkpoint=tmp_path / "a")
    b = train(lab2, S(dp=2, dp_mode="ddp"), 1, "sgd", 0.9, resume=tmp_path / "a", checkpoint=tmp_path / "b")
    c = train(lab2, S(pp=2, schedule="interleaved", chunks=2, microbatches=2, split_at=(1, 2, 4)), 1, "sgd", 0.9,
              resume=tmp_path / "b")
    ref = reference(4, "sgd", 0.9)
    assert b.max_diff(reference(3, "sgd", 0.9)) <= 1e-5
    assert c.max_diff(ref) <= 1e-5


def test_plain_sgd_keeps_no_optimizer_state_and_resumes(lab2, tmp_path):
    train(lab2, labkit.Strategy(dp=2, zero=1), 2, "sgd", checkpoint=tmp_path)
    assert labkit.checkpoint.load(tmp_path, optimizer=True)["optim"] == {}
    run = train(lab2, labkit.Strategy(pp=2, microbatches=2), 1, "sgd", resume=tmp_path)
    assert run.max_diff(reference(3, "sgd")) <= 1e-5


def test_asynchronous_saves_are_written_behind_the_steps_and_resume_exactly(lab2, tmp_path):
    run = train(lab2, labkit.Strategy(dp=2, zero=1), 3, checkpoint=tmp_path, checkpoint_every=1,
                checkpoint_async=True)
    assert [os.path.basename(p) for p in run.checkpoints] == ["step_000001", "step_000002", "step_000003"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]      # every save completed
    for ranks in run.checkpoint_io["save"].values():
        assert all(0 <= r["waited_s"] <= r["write_s"] and r["file_bytes"] > 0 for r in ranks)
    spans = [e for e in run.timeline.events if e["kind"] == "checkpoint"]
    length = run.timeline.step_durations()
    for rank in (0, 1):
        mine = [e for e in spans if e["rank"] == rank]
        staged = [e for e in mine if e["name"] == "checkpoint staging"]
        assert [e["step"] for e in staged] == [0, 1, 2]          # after each step, on its clock
        for e in staged:
            work = [w["end"] for w in run.timeline.events if w["rank"] == rank and w["step"] == e["step"]
                    and w["kind"] != "checkpoint"]
            assert e["start"] >= max(work)                     # after the step's own spans
        hidden = [e for e in mine if e["name"] == "checkpoint writing"]
        assert all(0 <= e["start"] < e["end"] <= length[e["step"]] for e in hidden)     # under a later step
        assert {e["step"] for e in hidden} <= {1, 2} and all(e["stream"] == "io" for e in mine)
    resumed = train(lab2, labkit.Strategy(pp=2, microbatches=2), 1, resume=tmp_path)
    assert resumed.max_diff(reference(4)) <= 1e-5


@pytest.fixture(scope="module")
def at_step_2(tmp_path_factory):
    """Two AdamW steps under FSDP2's zero=2, saved: the start every layout below resumes from."""
    from conftest import lab_with
    root = tmp_path_factory.mktemp("at_step_2")
    train(lab_with(2), labkit.Strategy(dp=2, zero=2, zero_mode="fsdp2"), 2, checkpoint=root)
    return root


@pytest.mark.parametrize("strategy", [
    dict(tp=2, tp_mode="dtensor"), dict(pp=2, schedule="gpipe", microbatches=2),
    dict(pp=2, schedule="zb-h1", microbatches=2), dict(pp=2, schedule="zbv", chunks=2, microbatches=2),
    dict(dp=2, dp_mode="bucketed", bucket_mb=0.001), dict(dp=2, zero=2), dict(dp=2, zero=3, zero_mode="fsdp2")],
    ids=str)
def test_any_layout_resumes_exactly(lab2, at_step_2, strategy):
    run = train(lab2, labkit.Strategy(**strategy), 1, resume=at_step_2)
    assert run.first_step == 2
    assert run.max_diff(reference(3)) <= 1e-5


def test_files_are_torchs_and_load_describe_read_them(lab2, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = train(lab2, labkit.Strategy(dp=2, zero=2), 3, checkpoint=tmp_path, checkpoint_every=2)
    assert [os.path.basename(p) for p in run.checkpoints] == ["step_000002", "step_000003"]
    last = run.checkpoints[-1]
    assert sorted(n for n in os.listdir(last) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = labkit.checkpoint.load(tmp_path)                 # the folder: its last complete checkpoint
    assert labkit.max_abs_diff(state, run.parameters()) == 0
    dcp_to_torch_save(last, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt")
    model = Net()
    model.load_state_dict(plain["model"])                  # no labkit needed
    assert labkit.max_abs_diff(model.state_dict(), run.parameters()) == 0
    assert set(plain["optim"]["inp.weight"]) == {"exp_avg", "exp_avg_sq", "step"}     # torch's AdamW state
    d = labkit.checkpoint.describe(tmp_path)
    assert (d.step, d.optimizer) == (3, "adamw")
    assert d.tensors == len(state) + 3 * sum(1 for _ in Net().parameters())
    assert set(d.files) == {"__0_0.distcp", "__1_0.distcp"} and all(v > 0 for v in d.files.values())
    offered = [r["offered_bytes"] for r in run.checkpoint_io["save"][3]]
    assert sum(offered) == d.tensor_bytes and max(offered) < 0.6 * sum(offered)       # each entry once, by one rank
    assert "step 3, saved under dp=2 zero=2" in repr(d)


def test_a_failed_run_resumes_from_its_last_complete_checkpoint(lab2, tmp_path):
    def failing(step):
        if step == 3:
            raise RuntimeError("the data source went away")
        return data(step)

    with pytest.raises(labkit.LabError, match="went away"):
        lab2.run(labkit.Strategy(dp=2), model=Net, data=failing, batch=BATCH, steps=5, lr=LR, seed=7,
                 optimizer="adamw", checkpoint=tmp_path, checkpoint_every=2)
    os.makedirs(tmp_path / ".step_000004.tmp-crashed")       # a save that died half-way: not a checkpoint
    assert labkit.checkpoint.describe(tmp_path).step == 2
    run = train(lab2, labkit.Strategy(pp=2, microbatches=2), 3, resume=tmp_path)
    assert run.first_step == 2
    assert run.max_diff(reference(5)) <= 1e-5
    whole = labkit.checkpoint.describe(tmp_path / "step_000002").tensor_bytes
    assert all(r["read_bytes"] < 0.75 * whole for r in run.checkpoint_io["load"])    # each stage reads its own


# -- experts over ranks (ep) and mixed precision --------------------------------------------------
class MoENet(nn.Module):
    """A user's MoE: labkit's MoE layer between two projections, odd widths, a plain loss."""

    def __init__(self, width: int = 13, depth: int = 2):
        super().__init__()
        from labkit.models.moe import MoE
        self.inp, self.out = nn.Linear(11, width), nn.Linear(width, 7)
        self.blocks = nn.ModuleList([MoE(width, 17, n_experts=4, top_k=2, shared=False, aux_loss_coef=0)
                                     for _ in range(depth)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def sequences(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 5, 11, generator=g), torch.randn(BATCH, 5, 7, generator=g)


def test_experts_over_ranks_resume_across_strategies_exactly(lab2, tmp_path):
    """dp2×ep2 with ZeRO-1 (each rank 2 of a layer's 4 experts, their AdamW state cut over their
    replicas) → dp2 with every expert on every rank → ep again: equal to one process."""
    S, kw = labkit.Strategy, dict(model=MoENet, data=sequences)
    train(lab2, S(dp=2, ep=2, zero=1), 2, checkpoint=tmp_path / "a", **kw)
    b = train(lab2, S(dp=2), 1, resume=tmp_path / "a", checkpoint=tmp_path / "b", **kw)
    c = train(lab2, S(dp=2, ep=2), 1, resume=tmp_path / "b", **kw)
    ref = labkit.reference(MoENet, data=sequences, batch=BATCH, steps=4, lr=LR, seed=7, optimizer="adamw")
    assert c.max_diff(ref) <= 1e-5 and b.losses + c.losses == pytest.approx(ref.losses[2:], abs=1e-5)
    assert labkit.checkpoint.load(tmp_path / "a").keys() == MoENet().state_dict().keys()


VOCAB = labkit.data.text(batch=8, block_size=16).vocab_size
LLAMA = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB)


def mixtral():
    """A transformers Mixtral: each layer's 4 experts as fused tensors (experts.gate_up_proj …)."""
    import transformers
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32))


@pytest.mark.parametrize("model, optimizer, momentum, lr", [
    (labkit.models.llama(**LLAMA, n_experts=4, top_k=2), "sgd", 0.9, LR), (mixtral, "adamw", 0.0, 1e-3)],
    ids=["labkit-llama-sgd", "mixtral-adamw"])
def test_moe_models_resume_from_ep_into_a_pipeline_and_back(lab2, tmp_path, model, optimizer, momentum, lr):
    """AdamW at its usual 1e-3: it moves a weight whose gradient nearly cancels by about lr
    whichever way the last bits fall, so ep's other summation order alone (no checkpoint, dp=2
    ep=2 straight through) departs by 1.5e-3·lr; a lost moment departs by ~lr."""
    S = labkit.Strategy
    kw = dict(model=model, data=labkit.data.text(batch=8, block_size=16), loss="cross_entropy", batch=8,
              lr=lr, seed=0, optimizer=optimizer, momentum=momentum)
    lab2.run(S(dp=2, ep=2), steps=1, checkpoint=tmp_path / "a", **kw)
    lab2.run(S(pp=2, microbatches=2), steps=1, resume=tmp_path / "a", checkpoint=tmp_path / "b", **kw)
    c = lab2.run(S(dp=2, ep=2), steps=1, resume=tmp_path / "b", **kw)
    assert c.max_diff(labkit.reference(steps=3, **kw)) <= 1e-5


def test_a_tied_weight_is_saved_under_both_names_and_resumes(lab2, tmp_path):
    """labkit's GPT ties its head to the token embedding: one parameter, two state_dict names,
    both in the file (a plain load_state_dict needs both); resumed under a pipeline, whose
    first and last stages each hold a copy."""
    S = labkit.Strategy
    kw = dict(model=labkit.models.gpt(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=VOCAB),
              data=labkit.data.text(batch=8, block_size=16), loss="cross_entropy", batch=8, lr=LR, seed=0,
              optimizer="adamw")
    lab2.run(S(dp=2, zero=1), steps=1, checkpoint=tmp_path, **kw)
    state = labkit.checkpoint.load(tmp_path)
    tied = [k for k in state if k.endswith("lm_head.weight")]
    assert tied == ["3.lm_head.weight"] and torch.equal(state["3.lm_head.weight"], state["0.wte.weight"])
    run = lab2.run(S(pp=2, microbatches=2), steps=1, resume=tmp_path, **kw)
    assert run.max_diff(labkit.reference(steps=2, **kw)) <= 1e-5


def huge_targets(step):
    """Targets of 6: fp16's first scaled gradients overflow (steps 0 and 1 skipped)."""
    x, _ = data(step)
    return x, torch.full((BATCH, 7), 6.0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resumes_its_master_weights_and_loss_scale(lab2, tmp_path, precision):
    """Saved after three steps of dp2 ZeRO-1, resumed under dp2 for two: the fp32 master weights,
    AdamW's moments and step counts (fp16 skipped two: the count is 1, not 3) and fp16's loss
    scale (a fresh one would skip two more) carry over; equal to the run trained straight through."""
    S, kw = labkit.Strategy, dict(data=huge_targets)
    straight = train(lab2, S(dp=2, precision=precision), 5, **kw)
    train(lab2, S(dp=2, zero=1, precision=precision), 3, checkpoint=tmp_path, **kw)
    resumed = train(lab2, S(dp=2, precision=precision), 2, resume=tmp_path, **kw)
    assert labkit.max_abs_diff(resumed.parameters(), straight.parameters()) <= 1e-5
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-5)
    saved = labkit.checkpoint.load(tmp_path, optimizer=True)
    assert all(v.dtype == torch.float32 for v in saved["model"].values())
    if precision == "fp16":
        assert straight.skipped_steps == [0, 1] and resumed.skipped_steps == []
        assert float(saved["scaler"]["scale"]) == 16384.0 and float(saved["optim"]["inp.weight"]["step"]) == 1
        assert resumed.metrics["loss_scale"] == straight.metrics["loss_scale"]


def test_a_bf16_model_is_saved_in_bf16_and_resumes_as_it_was(lab2, tmp_path):
    S, bf16 = labkit.Strategy, lambda: Net().to(torch.bfloat16)
    straight = train(lab2, S(dp=2), 3, model=bf16, data=lambda step: tuple(t.bfloat16() for t in data(step)))
    train(lab2, S(pp=2, microbatches=2), 2, model=bf16, checkpoint=tmp_path,
          data=lambda step: tuple(t.bfloat16() for t in data(step)))
    resumed = train(lab2, S(dp=2), 1, model=bf16, resume=tmp_path,
                    data=lambda step: tuple(t.bfloat16() for t in data(step)))
    saved = labkit.checkpoint.load(tmp_path, optimizer=True)
    assert {v.dtype for v in saved["model"].values()} == {torch.bfloat16}
    assert {v.dtype for d in saved["optim"].values() for k, v in d.items() if k != "step"} == {torch.bfloat16}
    assert labkit.max_abs_diff(resumed.parameters(), straight.parameters()) == 0


# -- bad input, named before any engine trains ------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from conftest import lab_with
    root = tmp_path_factory.mktemp("saved")
    train(lab_with(2), labkit.Strategy(dp=2), 1, checkpoint=root)
    return root


def check(resume, model=Net, optimizer="adamw", momentum=0.0):
    validate(RunSpec(labkit.Strategy(dp=2), model, data, batch=BATCH, steps=1, lr=LR, optimizer=optimizer,
                     momentum=momentum, extra={"resume": resume}), 2)


def test_bad_folders_are_named_with_the_fix(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        check(tmp_path)
    folder = labkit.checkpoint.find(saved)
    with pytest.raises(ValueError, match=r"has no parameter 'blocks.3.up.weight' of this model \(and 5 more\)"):
        check(saved, model=lambda: Net(depth=4))
    with pytest.raises(ValueError, match=r"'blocks.0.up.weight' has shape \[26, 19\] there and \[30, 19\]"):
        check(saved, model=lambda: Net(hidden=30))
    with pytest.raises(ValueError, match=r"holds parameter 'out.bias', which this model lacks"):
        check(saved, model=lambda: Slim())
    with pytest.raises(ValueError, match=r"optimizer='adamw'.*asks for optimizer='sgd'"):
        check(saved, optimizer="sgd")
    shard = os.path.join(folder, "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match=r"__1_0.distcp' is truncated"):
        check(saved)
    with pytest.raises(ValueError, match=r"parameter 'scale' is torch.int64"):
        validate(RunSpec(labkit.Strategy(dp=2), IntScaled, data, batch=BATCH, steps=1,
                         extra={"checkpoint": tmp_path}), 2)
    with pytest.raises(ValueError, match=r"checkpoint_every=0"):
        validate(RunSpec(labkit.Strategy(dp=2), Net, data, batch=BATCH, steps=1,
                         extra={"checkpoint": tmp_path, "checkpoint_every": 0}), 2)


class IntScaled(Net):
    """Net with an integer parameter (frozen: an integer cannot have a gradient)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.long), requires_grad=False)


class Slim(Net):
    """Net whose head has no bias: one parameter fewer than the checkpoint."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(19, 7, bias=False)


def test_the_cli_refuses_a_missing_resume_folder_before_starting_engines(tmp_path, capsys):
    from labkit import cli
    argv = ["run", "--dp", "2", "--width", "8", "--depth", "2", "--batch", "8", "--resume", str(tmp_path / "none")]
    assert cli.main(argv) == 2
    assert "does not exist" in capsys.readouterr().err
