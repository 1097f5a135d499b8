"""labkit.models.llama: a Llama-family decoder, dense and mixture-of-experts, in one process."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import labkit
from labkit.models.llama import Attention
from labkit.models.moe import MoE
from labkit.models.sample import generate, validation_loss
from labkit.training import cross_entropy

SIZES = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=94)      # labkit.data.text().vocab_size
CONFIGS = {
    "dense": dict(),
    "gqa": dict(n_kv_heads=2),
    "moe_top1": dict(n_kv_heads=2, n_experts=4, top_k=1, norm_topk_prob=False),
    "moe_top2": dict(n_experts=4, top_k=2),
    "moe_shared": dict(n_kv_heads=1, n_experts=4, top_k=2, shared_expert=True),
    "tied": dict(tie=True),
}


def train(make, steps: int = 25) -> list[float]:
    """labkit.reference on labkit.data.text: AdamW, cross-entropy plus the model's balance loss."""
    data = labkit.data.text(batch=8, block_size=32)
    return labkit.reference(make, data=data, loss="cross_entropy", batch=8, steps=steps, lr=3e-3,
                            optimizer="adamw").losses


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_falls_on_text(name):
    losses = train(labkit.models.llama(**SIZES, **CONFIGS[name]))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_an_ordinary_module_with_a_layer_list_and_only_parameters_in_its_state():
    model = labkit.models.llama(**SIZES, n_kv_heads=2)()
    assert not isinstance(model, nn.Sequential)
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 2
    assert (model.n_head, model.n_kv_heads) == (4, 2)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert model.layers[0].attn.k_proj.out_features == 2 * 16
    assert model.layers[0].mlp.gate_proj.out_features == 192      # ceil(8/3·64 / 64)·64


def test_same_seed_same_weights_and_factory_pickles():
    make = pickle.loads(pickle.dumps(labkit.models.llama(**SIZES, n_experts=4)))
    torch.manual_seed(3)
    a = make().state_dict()
    torch.manual_seed(3)
    b = make().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_head_is_the_embedding():
    model = labkit.models.llama(**SIZES, tie=True)()
    assert model.head.weight is model.tok_emb.weight


def test_attention_is_causal():
    model = labkit.models.llama(**SIZES, n_kv_heads=2)()
    x = torch.randint(0, 94, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 94
    assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:], atol=1e-4)


def test_output_is_logits_without_a_balance_loss_and_an_object_with_one():
    x = torch.zeros(2, 8, dtype=torch.long)
    assert isinstance(labkit.models.llama(**SIZES, n_experts=4, aux_loss_coef=0)()(x), torch.Tensor)
    out = labkit.models.llama(**SIZES, n_experts=4, aux_loss_coef=0.01)()(x)
    assert out.logits.shape == (2, 8, 94) and out.aux_loss.shape == ()


def test_moe_equals_every_expert_on_every_token_weighted_by_its_gate():
    """The routed sum, computed expert by expert on the routed tokens only, equals a dense
    computation: all experts on all tokens, times a gate matrix that is 0 off the top-k."""
    torch.manual_seed(0)
    moe = MoE(n_embd=16, hidden=32, n_experts=5, top_k=2, shared=True, aux_loss_coef=0.0)
    x = torch.randn(3, 7, 16)
    out, aux = moe(x), moe.pop_aux_loss()
    probs = moe.router(x).softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
    every = torch.stack([expert(x) for expert in moe.experts], dim=-2)     # (B, T, E, C)
    dense = (gates.unsqueeze(-1) * every).sum(-2) + moe.shared(x)
    assert aux is None
    assert torch.allclose(out, dense, atol=1e-6)
    assert moe.tokens_per_expert.sum().item() == 3 * 7 * 2
    model = labkit.models.llama(**SIZES, n_experts=4)()
    assert model.tokens_per_expert is None
    model(torch.zeros(2, 8, dtype=torch.long))
    assert model.tokens_per_expert.shape == (2, 4) and model.tokens_per_expert.sum(1).tolist() == [32.0, 32.0]


def test_balance_loss_is_a_mean_over_rows():
    """Sequence-wise: the loss of a batch is the mean of its halves' losses, so data-parallel
    shards and micro-batches reproduce it (and its gradient) exactly."""
    torch.manual_seed(0)
    moe = MoE(n_embd=16, hidden=32, n_experts=4, top_k=2, shared=False, aux_loss_coef=0.1)
    x = torch.randn(6, 9, 16)
    whole = (moe(x), moe.pop_aux_loss())[1]
    halves = ((moe(x[:3]), moe.pop_aux_loss())[1] + (moe(x[3:]), moe.pop_aux_loss())[1]) / 2
    assert torch.allclose(whole, halves, atol=1e-7)


@pytest.mark.parametrize("name", ["moe_top1", "moe_shared"])
def test_two_half_batches_give_the_whole_batch_gradient(name):
    """What data parallelism (dp=2) and two micro-batches compute, in one process: the mean of
    the halves' gradients (cross-entropy plus balance loss) equals the whole batch's."""
    data = labkit.data.text(batch=8, block_size=32)
    x, y = data(0)
    torch.manual_seed(0)
    model = labkit.models.llama(**SIZES, **CONFIGS[name], aux_loss_coef=0.1)()

    def grads(rows, scale):
        model.zero_grad()
        out = model(x[rows])
        (scale * (cross_entropy(out.logits, y[rows]) + out.aux_loss)).backward()
        return [p.grad.clone() for p in model.parameters()]

    whole = grads(slice(None), 1.0)
    halves = [a + b for a, b in zip(grads(slice(0, 4), 0.5), grads(slice(4, 8), 0.5))]
    assert max((a - b).abs().max().item() for a, b in zip(whole, halves)) < 1e-6


def test_balance_loss_is_its_weight_when_the_router_is_uniform():
    """Uniform probabilities 1/E: Σ_i f_i·P_i = (1/E)·Σ_i f_i = 1 whatever was chosen, so the
    loss is aux_loss_coef per layer."""
    model = labkit.models.llama(**SIZES, n_experts=4, top_k=2, aux_loss_coef=0.05)()
    for layer in model.layers:
        nn.init.zeros_(layer.mlp.router.weight)
    out = model(torch.randint(0, 94, (3, 16)))
    assert out.aux_loss.item() == pytest.approx(2 * 0.05, rel=1e-6)


def test_attention_split_over_two_ranks_by_hand_equals_whole():
    """The tp_plan's split done by hand: q/k/v by output rows, o by input columns; each
    "rank" views its own heads, and the two partial outputs sum to the whole (GQA, 4 q heads
    over 2 kv heads)."""
    torch.manual_seed(0)
    whole = Attention(n_embd=32, n_head=4, n_kv_heads=2)
    x = torch.randn(2, 8, 32)
    parts = []
    for rank in range(2):
        part = Attention(n_embd=32, n_head=4, n_kv_heads=2)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(part, name).weight = nn.Parameter(getattr(whole, name).weight.chunk(2, dim=0)[rank])
        part.o_proj.weight = nn.Parameter(whole.o_proj.weight.chunk(2, dim=1)[rank])
        parts.append(part(x))
    assert torch.allclose(parts[0] + parts[1], whole(x), atol=1e-6)


def test_fewer_kv_heads_than_tp_ranks_is_refused():
    make = labkit.models.llama(**SIZES, n_kv_heads=1)
    make.check_tp(1)
    with pytest.raises(ValueError, match="n_kv_heads=1 does not divide by Strategy.tp=2"):
        make.check_tp(2)
    attn = Attention(n_embd=32, n_head=4, n_kv_heads=1)     # a split handing a rank half a k/v head
    attn.k_proj.weight = nn.Parameter(attn.k_proj.weight[:4])
    attn.v_proj.weight = nn.Parameter(attn.v_proj.weight[:4])
    with pytest.raises(ValueError, match="not whole heads"):
        attn(torch.randn(1, 4, 32))


def test_tp_plan_names_the_split_modules():
    from labkit.parallel.tensor import match_plan

    dense = labkit.models.llama(**SIZES)
    assert dense().tp_plan == dense.tp_plan
    matched = match_plan(dense(), dense.tp_plan)
    assert matched["layers.1.attn.k_proj"] == "colwise" and matched["layers.0.mlp.down_proj"] == "rowwise"
    assert len(matched) == 2 * 7
    moe = labkit.models.llama(**SIZES, n_experts=4, shared_expert=True)
    assert match_plan(moe(), moe.tp_plan)["layers.0.mlp.shared.up_proj"] == "colwise"
    assert not any("experts" in key for key in moe.tp_plan)      # routed experts are replicated
    assert moe.sp_plan is None and not hasattr(moe(), "sp_plan")   # routing needs whole sequences
    assert match_plan(dense(), dense.sp_plan)["layers.1.mlp_norm"] == "sequence"


@pytest.mark.parametrize("kwargs, field", [
    (dict(n_embd=60), "n_embd"), (dict(n_kv_heads=3), "n_kv_heads"), (dict(n_experts=2, top_k=3), "top_k"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"), (dict(n_layer=0), "n_layer"), (dict(n_experts=-1), "n_experts"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        labkit.models.llama(**{**SIZES, **kwargs})


def test_check_data_and_a_too_long_sequence():
    make = labkit.models.llama(**SIZES)
    with pytest.raises(ValueError, match="block_size"):
        make.check_data(labkit.data.text(block_size=64))
    with pytest.raises(ValueError, match="vocab_size"):
        labkit.models.llama(**{**SIZES, "vocab_size": 50}).check_data(labkit.data.text(block_size=32))
    with pytest.raises(ValueError, match="block_size=32"):
        make()(torch.zeros(1, 33, dtype=torch.long))


def test_sample_and_validation_loss_from_a_moe_model():
    data = labkit.data.text(batch=4, block_size=32)
    model = labkit.models.llama(**SIZES, n_experts=4)()
    ids = generate(model, data.encode("def "), 40)
    assert ids.shape == (44,) and data.decode(ids).startswith("def ")
    assert validation_loss(model, data, batches=1) > 0




# -- through lab.run on two engines, against labkit.reference ------------------------------------
ENGINE_DATA = labkit.data.text(batch=8, block_size=16)
ENGINE_KW = dict(data=ENGINE_DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
ENGINE_MODELS = {
    "moe": labkit.models.llama(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=94, n_kv_heads=2,
                               n_experts=4, top_k=2, shared_expert=True, aux_loss_coef=0.1),
    "gqa_tied": labkit.models.llama(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=94, n_kv_heads=2,
                                    tie=True),
}
_refs = {}


@pytest.mark.parametrize("model, strategy", [
    ("moe", dict(dp=2)), ("moe", dict(dp=2, zero=3)), ("moe", dict(tp=2)),
    ("gqa_tied", dict(tp=2, tp_mode="dtensor")), ("gqa_tied", dict(dp=2, zero=3, zero_mode="fsdp2")),
    ("gqa_tied", dict(tp=2, sequence_parallel=True)), ("moe", dict(dp=2, microbatches=2, recompute="selective")),
], ids=str)
def test_lab_run_equals_one_process(lab2, model, strategy):
    make = ENGINE_MODELS[model]
    if model not in _refs:
        _refs[model] = labkit.reference(make, **ENGINE_KW)
    run = lab2.run(labkit.Strategy(**strategy), model=make, **ENGINE_KW)
    assert run.losses == pytest.approx(_refs[model].losses, abs=1e-5)
    assert run.max_diff(_refs[model]) < 1e-5


def test_fewer_kv_heads_than_tp_ranks_is_refused_before_the_engines(lab2):
    make = labkit.models.llama(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=94, n_kv_heads=1)
    with pytest.raises(ValueError, match="n_kv_heads=1"):
        lab2.run(labkit.Strategy(tp=2), model=make, **ENGINE_KW)
