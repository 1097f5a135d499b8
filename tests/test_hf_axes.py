"""Hugging Face models as users build them (``Qwen2ForCausalLM(config)`` in their own factory,
random weights, no download) under the axes that reach into a layer: context parallelism
through transformers' attention registry, expert parallelism over a MoE block's fused
experts, tensor parallelism by the model's own plan. Each equals one process (≤ 1e-5 after
3 steps) on configs the other tests do not use."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import labkit  # noqa: E402

DATA = labkit.data.text(batch=8, block_size=16)
KW = dict(data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
TOL = 1e-5
VOCAB = DATA.vocab_size      # read here: a factory reading it would build the corpus while recorded on meta


def qwen2(tie: bool = False):
    """The user's factory: a Qwen2 from a config (6 query heads over 2 key/value heads)."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, rope_theta=500.0, tie_word_embeddings=tie))


def qwen2_tied():
    """Qwen2 with its head tied to its embedding, as Qwen2-0.5B/1.5B are."""
    return qwen2(tie=True)


def llama_odd_scale():
    """A Llama whose attention scales its scores by its own head_dim (12, not hidden / heads = 8)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=VOCAB, max_position_embeddings=32))


def mixtral(router_logits: bool = False):
    """A Mixtral: 4 experts (fused tensors), top-2, attention over 2 key/value heads."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32,
        output_router_logits=router_logits))


def qwen2_moe():
    """A Qwen2-MoE: 4 routed experts beside a gated shared expert."""
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        vocab_size=VOCAB, max_position_embeddings=32))


def equal_to_one_process(lab, strategy, model, **kw):
    kw = {**KW, **kw}
    run, ref = lab.run(strategy, model=model, **kw), labkit.reference(model, **kw)
    assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) < TOL
    return run


# -- context parallelism --------------------------------------------------------------------------
def test_the_registry_route_leaves_one_process_as_it_was():
    from labkit.parallel.context import probe
    from labkit.parallel.context.hf import routed

    torch.manual_seed(0)
    model = qwen2()
    x = torch.randint(0, VOCAB, (2, 16))
    want = model(x).logits
    assert probe(model, x[:1])["attention"] == 0          # its own sdpa: labkit's is not reached unasked
    with routed(model):
        assert torch.equal(model(x).logits, want)         # cp = 1: labkit's attention is torch's sdpa
        assert probe(model, x[:1])["attention"] == 1
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(cp=2, cp_mode="ring"), qwen2),
    (labkit.Strategy(cp=2, cp_mode="ulysses"), qwen2),
    (labkit.Strategy(cp=2, cp_mode="allgather", cp_balance=False), llama_odd_scale),
], ids=["ring", "ulysses", "allgather-contiguous-own-scale"])
def test_context_parallel_on_a_raw_hf_model_equals_one_process(lab2, strategy, model):
    equal_to_one_process(lab2, strategy, model)


def test_pipeline_stages_of_a_raw_hf_model_under_cp_equal_one_process(lab4):
    """Each stage recomputes RoPE from the rank's slice of positions (and no mask)."""
    equal_to_one_process(lab4, labkit.Strategy(pp=2, cp=2, microbatches=2), qwen2)


def test_cp_bytes_per_rank_equal_labkits_llama_of_the_same_shape(lab2):
    """The ring moves K/V blocks of (B, Hkv, T/cp, hd): the same bytes whoever wrote the attention."""
    llama = labkit.models.llama(n_layer=2, n_head=6, n_kv_heads=2, n_embd=48, block_size=16, vocab_size=VOCAB)

    def sent(model):
        run = lab2.run(labkit.Strategy(cp=2), model=model, **{**KW, "steps": 1})
        return [sum(e["bytes"] for e in run.timeline.events if e["rank"] == r and e["name"].startswith("cp "))
                for r in range(2)]
    assert sent(qwen2) == sent(llama) != [0, 0]


class SdpaItself(torch.nn.Module):
    """A model whose attention calls torch's sdpa itself: reachable neither way."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, idx):
        x = self.emb(idx).unsqueeze(1)
        return self.head(torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1))


def test_attention_reachable_neither_way_is_refused_naming_both():
    from labkit.run.runner import validate
    from labkit.parallel.build import RunSpec

    strategy = labkit.Strategy(cp=2)
    with pytest.raises(ValueError, match="labkit.parallel.context.attention.*ALL_ATTENTION_FUNCTIONS"):
        validate(RunSpec(strategy, SdpaItself, DATA, "cross_entropy", batch=8), strategy.world_size)


# -- expert parallelism ---------------------------------------------------------------------------
def test_fused_experts_found_where_the_ep_plan_puts_them_and_refused_when_not_that_shape():
    from labkit.parallel.expert import check_model, fused_experts

    found = fused_experts(mixtral())
    assert [n for n, _ in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert fused_experts(qwen2()) == []
    qwen3 = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=VOCAB))
    qwen3.config.base_model_ep_plan = None                   # found where the family keeps them, by shape
    assert [(n, e.gate_up_proj.shape[0]) for n, e in fused_experts(qwen3)] == [("model.layers.0.mlp.experts", 6)]
    listed = mixtral()
    listed.model.layers[1].mlp.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts is a ModuleList, not a module of the shape"):
        fused_experts(listed)
    with pytest.raises(ValueError, match="n_experts=4, which does not divide over 3 ranks"):
        check_model(labkit.Strategy(dp=3, ep=3), mixtral())
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        check_model(labkit.Strategy(dp=2, ep=2), qwen2())


@pytest.mark.parametrize("strategy, model", [             # plain dp2×ep2 on Mixtral: the bytes test below
    (labkit.Strategy(dp=2, ep=2, ep_overlap="microbatch", zero=1), mixtral),
    (labkit.Strategy(dp=2, ep=2), qwen2_moe),
], ids=["mixtral-overlap-zero1", "qwen2_moe"])
def test_expert_parallel_on_a_raw_hf_moe_equals_one_process(lab2, strategy, model):
    equal_to_one_process(lab2, strategy, model)


def test_dp2_ep2_equals_one_process_and_sends_the_rows_that_leave_each_rank(lab2):
    """Exact, and the bytes are the formula test_expert.py checks on labkit's llama: a rank
    dispatches (and gets back in backward) one row of hidden_size floats per (token, choice)
    whose expert lives on the other rank."""
    from labkit.training import build_model

    run = equal_to_one_process(lab2, labkit.Strategy(dp=2, ep=2), mixtral, steps=1)
    net, chosen = build_model(mixtral, KW["seed"]), []
    for layer in net.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    with torch.no_grad():
        net(DATA(0)[0])
    rows = KW["batch"] // 2 * DATA.block_size
    for layer, picked in enumerate(chosen):
        for rank in range(2):
            away = int(((picked[rank * rows:(rank + 1) * rows] // 2) != rank).sum())
            sent = {e["name"]: e["bytes"] for e in run.timeline.events if e["rank"] == rank
                    and e["kind"] == "all_to_all" and e["name"].startswith(f"model.layers.{layer}.")}
            assert sent[f"model.layers.{layer}.mlp.experts dispatch"] == away * 32 * 4
            assert sent[f"model.layers.{layer}.mlp.experts combine backward"] == away * 32 * 4


def test_ep_keeps_the_router_loss_the_model_computes(lab2):
    """With output_router_logits the model adds its own load-balancing loss from the router's
    logits; ep leaves the router in the block, so dp2×ep2 equals dp2 (a batch-level loss: each
    dp rank computes it over its own rows, under ep as without)."""
    kw = {**KW, "model": lambda: mixtral(router_logits=True)}
    with_ep, without = lab2.run(labkit.Strategy(dp=2, ep=2), **kw), lab2.run(labkit.Strategy(dp=2), **kw)
    assert with_ep.losses == pytest.approx(without.losses, abs=TOL)
    assert with_ep.max_diff(without) < TOL


# -- tensor parallelism ---------------------------------------------------------------------------
def test_a_raw_hf_models_own_plan_in_labkits_styles():
    from labkit.parallel.tensor import check_tensor_parallel

    matched = check_tensor_parallel(2, "megatron", qwen2_tied)
    assert matched["lm_head"] == "colwise_gather_output" and matched["model.embed_tokens"] == "rowwise"
    assert matched["model.layers.1.self_attn.k_proj"] == "colwise"          # 2 K/V heads: one a rank
    assert matched["model.layers.1.mlp.down_proj"] == "rowwise" and len(matched) == 2 + 2 * 7


@pytest.mark.parametrize("args, match", [
    ((4, "megatron", qwen2_tied), "pad the vocabulary.*vocab_size=96, a multiple of 4"),
    ((2, "dtensor", qwen2_tied), "tied to 'lm_head'.*tp_mode='megatron'"),
    ((2, "megatron", qwen2_tied, {"model.embed_tokens": "rowwise"}), "tied to 'lm_head'; split both by vocabulary"),
])
def test_what_tp_cannot_split_of_a_raw_hf_model_is_refused_with_the_fix(args, match):
    from labkit.parallel.tensor import check_tensor_parallel

    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(*args)


@pytest.mark.parametrize("model", [qwen2, qwen2_tied], ids=["untied", "tied-one-vocab-shard"])
def test_tensor_parallel_by_a_raw_hf_models_own_plan_equals_one_process(lab2, model):
    equal_to_one_process(lab2, labkit.Strategy(tp=2), model)
