"""labkit.models.from_hf: Hugging Face causal LMs from a config, with random weights, in one process."""
from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

import labkit  # noqa: E402

CONFIGS = pathlib.Path(__file__).parent / "data" / "hf"
ATTENTION = {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {
    "model.layers.*.self_attn.o_proj": "rowwise"}
MLP = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
       "model.layers.*.mlp.down_proj": "rowwise"}
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def train(make, steps: int = 25) -> list[float]:
    """labkit.reference on labkit.data.text: ``model(x).logits`` against the shifted ``y``."""
    data = labkit.data.text(batch=8, block_size=32)
    make.check_data(data)
    return labkit.reference(make, data=data, loss="cross_entropy", batch=8, steps=steps, lr=3e-3,
                            optimizer="adamw").losses


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_loss_falls_on_text(family):
    losses = train(labkit.models.from_hf(CONFIGS / f"{family}.json"))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe"])
def test_factory_pickles_and_draws_the_same_weights_under_a_seed(family):
    make = pickle.loads(pickle.dumps(labkit.models.from_hf(CONFIGS / f"{family}.json")))
    torch.manual_seed(5)
    a = make()
    torch.manual_seed(5)
    b = make().state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.state_dict().items())
    assert (a.n_head, a.n_kv_heads, make.n_head, make.n_kv_heads) == (4, 2, 4, 2)
    assert a.tp_plan == make.tp_plan
    assert getattr(a.config, "output_router_logits", False) is False       # the batch-level router loss is off
    out = a(torch.randint(0, 94, (2, 16)))
    assert out.logits.shape == (2, 16, 128)


FAMILY_FIELDS = {"qwen3": dict(head_dim=8), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
                 "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64),
                 "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8)}


@pytest.mark.parametrize("family", labkit.models.hf.SUPPORTED)
def test_every_supported_family_builds_from_a_config_object(family):
    config = transformers.AutoConfig.for_model(family, **TINY, **FAMILY_FIELDS.get(family, {}))
    make = labkit.models.from_hf(config)
    model = make()
    assert model.config.model_type == family and model.tp_plan == make.tp_plan
    assert model(torch.randint(0, 128, (2, 16))).logits.shape == (2, 16, 128)


def test_tp_plans_translated_per_family():
    from labkit.parallel.tensor import match_plan

    llama = labkit.models.from_hf(CONFIGS / "llama.json")
    assert llama.tp_plan == ATTENTION | MLP and llama.dropped == {}
    assert len(match_plan(llama(), llama.tp_plan)) == 2 * 7
    assert labkit.models.from_hf(CONFIGS / "mixtral.json").tp_plan == ATTENTION      # transformers splits attention only
    moe = labkit.models.from_hf(transformers.Qwen2MoeConfig(**TINY, num_experts=4, moe_intermediate_size=32,
                                                            shared_expert_intermediate_size=64))
    assert moe.tp_plan == ATTENTION and moe.dropped.keys() == MLP.keys()            # no dense MLP in an all-MoE model
    qwen3 = labkit.models.from_hf(transformers.Qwen3Config(**TINY, head_dim=8))
    assert qwen3.tp_plan == MLP                                                      # q/k norms: attention stays whole
    assert "replicated_with_grad_allreduce" in qwen3.dropped["model.layers.*.self_attn.q_norm"]


def test_a_config_object_a_folder_and_a_file_give_the_same_model(tmp_path):
    fields = json.loads((CONFIGS / "llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    makes = [labkit.models.from_hf(c) for c in (config, tmp_path, CONFIGS / "llama.json")]
    states = []
    for make in makes:
        torch.manual_seed(0)
        states.append(make().state_dict())
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])


def test_sample_from_a_hf_model():
    from labkit.models.sample import generate

    data = labkit.data.text(block_size=32)
    model = labkit.models.from_hf(CONFIGS / "llama.json", attn_implementation="eager")()
    ids = generate(model, data.encode("def "), 20)
    assert ids.shape == (24,) and ids[:4].tolist() == data.encode("def ").tolist() and ids.max() < 128


@pytest.mark.parametrize("config, match", [
    ("no/such/config.json", "is not a file"),
    (dict(model_type="llama"), "transformers config object"),
    (transformers.GPT2Config(), "model_type='gpt2' is not supported; use a config of one of llama"),
])
def test_bad_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        labkit.models.from_hf(config)


# -- through lab.run on two engines, against labkit.reference ------------------------------------
@pytest.mark.parametrize("family, strategy", [
    ("llama", dict(tp=2)), ("mixtral", dict(tp=2, tp_mode="dtensor")), ("qwen3_moe", dict(dp=2, zero=3)),
], ids=str)
def test_lab_run_equals_one_process(lab2, family, strategy):
    make = labkit.models.from_hf(CONFIGS / f"{family}.json")
    kw = dict(data=labkit.data.text(batch=8, block_size=16), loss="cross_entropy", batch=8, steps=3, lr=0.3)
    run, ref = lab2.run(labkit.Strategy(**strategy), model=make, **kw), labkit.reference(make, **kw)
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)
    assert run.max_diff(ref) < 1e-5
