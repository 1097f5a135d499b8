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


def qwen2():
    """The user's factory: a Qwen2 from a config (6 query heads over 2 key/value heads)."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, rope_theta=500.0))


def llama_odd_scale():
    """A Llama whose attention scales its scores by its own head_dim (12, not hidden / heads = 8)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=VOCAB, max_position_embeddings=32))


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
