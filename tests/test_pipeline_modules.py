"""Pipelines for decoders that are not an nn.Sequential: llama and Hugging Face models cut along
their chain of layers (labkit.parallel.pipeline.modules), every schedule equal to one process.

Pure tests of the chain and of bad input first (no engines); then one 2-engine lab for the
schedules, MoE, a tied head and a Hugging Face llama; then dp×pp and pp×tp on 4 engines.
"""
from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.build import RunSpec
from labkit.parallel.pipeline.modules import PipelineStage, merge_stages, pipeline_units
from labkit.parallel.pipeline.stages import stage_blocks
from labkit.run.runner import validate

HF = pathlib.Path(__file__).parent / "data" / "hf"
SIZES = dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=94, n_kv_heads=2)
DENSE = labkit.models.llama(**SIZES)
MOE = labkit.models.llama(**SIZES, n_experts=4, top_k=2, aux_loss_coef=0.05)
TIED = labkit.models.llama(**SIZES, tie=True)
STEPS = 3


def kw():
    # SGD: AdamW divides by √v, which turns float32 rounding of tiny gradients into ~1e-5
    # differences (dp=2 alone, no pipeline, measured 9e-6 on the tied llama here)
    return dict(data=labkit.data.text(batch=8, block_size=16), loss="cross_entropy", batch=8, steps=STEPS,
                lr=0.1, seed=5)


class Planned(nn.Module):
    """A hand-written model whose chain is its pp_plan (a ModuleList between two Linears)."""

    pp_plan = ("inp", "hidden", "out")

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 4)                  # registered first: the plan, not the order, rules
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)


def planned_data(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


class Plain(nn.Module):
    """Two linear layers with no layer list: nothing to cut without a pp_plan."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x).relu())


# -- the chain, one process --------------------------------------------------------------------
@pytest.mark.parametrize("make", [DENSE, MOE, TIED], ids=["dense", "moe", "tied"])
def test_stages_chain_to_the_models_forward_with_its_own_keys(make):
    torch.manual_seed(0)
    model = make()
    units = pipeline_units(model)
    assert [u.path for u in units] == ["tok_emb", *(f"layers.{i}" for i in range(4)), "norm", "head"]
    stages = [PipelineStage(model, [units[i] for i in r]) for r in stage_blocks(model, labkit.Strategy(pp=2))]
    x = torch.randint(0, 94, (2, 16))
    out = model(x)
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, getattr(out, "logits", out))
    assert set(merge_stages(stages).state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe"])
def test_hugging_face_stages_chain_to_its_forward(family):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = labkit.models.from_hf(HF / f"{family}.json")()
    units = pipeline_units(model)
    assert [u.path for u in units] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                       "lm_head"]
    stages = [PipelineStage(model, [units[i] for i in r]) for r in stage_blocks(model, labkit.Strategy(pp=2))]
    x = torch.randint(0, 64, (2, 16))
    h = x
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(x).logits)
    assert set(merge_stages(stages).state_dict()) == set(model.state_dict())


def test_a_pp_plan_attribute_names_the_chain():
    model = Plain()
    model.pp_plan = ["a", "b"]
    assert [u.path for u in pipeline_units(model)] == ["a", "b"]
    model.pp_plan = ["a", "c"]
    with pytest.raises(ValueError, match="pp_plan names 'c'"):
        pipeline_units(model)


def test_no_chain_under_pp_is_refused_naming_the_fix():
    spec = RunSpec(labkit.Strategy(pp=2, microbatches=2), Plain, batch=8)
    with pytest.raises(ValueError, match="pp_plan"):
        validate(spec, 2)


def test_a_chain_that_leaves_parameters_out_is_refused():
    model = Planned()
    model.scale = nn.Parameter(torch.ones(4))            # on the root: no unit holds it
    with pytest.raises(ValueError, match=r"leaves out parameters \['scale'\]"):
        pipeline_units(model)


def test_fp16_with_a_balance_loss_under_pp_is_refused():
    spec = RunSpec(labkit.Strategy(pp=2, microbatches=2, precision="fp16"), MOE, batch=8, **{
        k: v for k, v in kw().items() if k not in ("batch",)})
    with pytest.raises(ValueError, match="fp16"):
        validate(spec, 2)


def test_zbv_with_a_head_tied_across_stages_is_refused():
    spec = RunSpec(labkit.Strategy(pp=2, microbatches=4, schedule="zbv", chunks=2), TIED,
                   **{k: v for k, v in kw().items()})
    with pytest.raises(ValueError, match="zbv"):
        validate(spec, 2)


def test_interleaved_shares_the_layers_out_evenly_and_split_at_names_units():
    model = DENSE()
    # units: tok_emb 0, layers 1..4, norm 5, head 6
    assert stage_blocks(model, labkit.Strategy(pp=2, chunks=2, schedule="interleaved", microbatches=4)) == \
        [range(0, 2), range(2, 3), range(3, 4), range(4, 7)]
    assert stage_blocks(model, labkit.Strategy(pp=2, split_at=(3,))) == [range(0, 3), range(3, 7)]


# -- exact on engines ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refs():
    return {}


def reference(refs, make):
    if make not in refs:
        refs[make] = labkit.reference(make, **kw())
    return refs[make]


SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "interleaved": dict(schedule="interleaved", chunks=2),
    "zb-h1": dict(schedule="zb-h1"),
    "zbv": dict(schedule="zbv", chunks=2),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_llama_every_schedule_equals_one_process(lab2, refs, name):
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4, **SCHEDULES[name]), model=DENSE, **kw())
    ref = reference(refs, DENSE)
    assert set(run.parameters()) == set(DENSE().state_dict())
    assert run.max_diff(ref) < 1e-5
    assert max(abs(a - b) for a, b in zip(run.losses, ref.losses)) < 1e-5


@pytest.mark.parametrize("make", [MOE, TIED], ids=["moe", "tied"])
def test_llama_moe_and_tied_equal_one_process(lab2, refs, make):
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4, schedule="1f1b"), model=make, **kw())
    assert set(run.parameters()) == set(make().state_dict())
    assert run.max_diff(reference(refs, make)) < 1e-5


def test_moe_balance_loss_reaches_the_routers_of_the_first_stage(lab2, refs):
    """Without its balance loss the first stage's routers would train differently: the run
    must differ from one process trained with aux_loss_coef=0."""
    without = labkit.models.llama(**SIZES, n_experts=4, top_k=2, aux_loss_coef=0.0)
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4, schedule="zb-h1"), model=MOE, **kw())
    exact, missing = run.max_diff(reference(refs, MOE)), run.max_diff(reference(refs, without))
    assert exact < 1e-5 and missing > 100 * max(exact, 1e-8), (exact, missing)


def test_a_pp_plan_model_equals_one_process(lab2):
    args = dict(data=planned_data, batch=8, steps=STEPS, lr=0.1, seed=3)
    run = lab2.run(labkit.Strategy(pp=2, microbatches=2, schedule="1f1b"), model=Planned, **args)
    assert set(run.parameters()) == set(Planned().state_dict())
    assert run.max_diff(labkit.reference(Planned, **args)) < 1e-6


def test_recompute_full_on_the_stages_layers(lab2, refs):
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4, schedule="1f1b", recompute="full"), model=DENSE, **kw())
    assert run.max_diff(reference(refs, DENSE)) < 1e-5


def test_hugging_face_llama_pp2(lab2):
    pytest.importorskip("transformers")
    make = labkit.models.from_hf(HF / "llama.json")
    args = dict(kw(), data=labkit.data.text(batch=8, block_size=16))
    run = lab2.run(labkit.Strategy(pp=2, microbatches=4, schedule="1f1b"), model=make, **args)
    assert set(run.parameters()) == set(make().state_dict())
    assert run.max_diff(labkit.reference(make, **args)) < 1e-5


@pytest.mark.parametrize("degrees", [dict(dp=2, pp=2), dict(pp=2, tp=2)], ids=["dp2pp2", "pp2tp2"])
def test_llama_dp_pp_and_pp_tp_equal_one_process(lab4, refs, degrees):
    run = lab4.run(labkit.Strategy(**degrees, microbatches=2, schedule="1f1b"), model=DENSE, **kw())
    assert run.max_diff(reference(refs, DENSE)) < 1e-5
