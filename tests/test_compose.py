"""The axes compose through the one builder: dp × tp, pp × tp and dp × zero-bubble pp on four
engines, each equal to the same steps in one process.

    python -m pytest tests/test_compose.py
"""
from __future__ import annotations

import pytest

import labkit

DATA = labkit.data.text(batch=8, block_size=16, seed=1)
GPT = labkit.models.gpt(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)
UNTIED = labkit.models.gpt(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size, tie=False)
MLP = labkit.models.mlp(width=24, depth=4)


@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(dp=2, tp=2, dp_mode="overlap", bucket_mb=0.01), GPT),     # tp shards, each dp-reduced
    (labkit.Strategy(pp=2, tp=2, microbatches=2), UNTIED),                     # split layers inside stages
], ids=["dp2-tp2", "pp2-tp2"])
def test_tensor_parallel_composes_with_dp_and_pp(lab4, strategy, model):
    run = lab4.run(strategy, model=model, data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.1)
    ref = labkit.reference(model, data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.1)
    assert run.max_diff(ref) < 1e-5
    assert set(run.parameters()) == set(ref.parameters())       # whole tensors, the model's own keys
    names = {e["name"] for e in run.timeline.events if e["kind"] == "allreduce"}
    assert names, "the tp all-reduces (Megatron's f and g) are on the timeline"


def test_zero_bubble_with_overlapped_data_parallel_buckets(lab4):
    """W fills the gradients in an order of its own: the overlap mode still launches its
    buckets in bucket order on every rank (a mismatched order summed wrong buckets)."""
    s = labkit.Strategy(dp=2, pp=2, schedule="zb-h1", microbatches=2, dp_mode="overlap", bucket_mb=0.001)
    run = lab4.run(s, model=MLP, batch=16, steps=3, seed=4)
    assert run.max_diff(labkit.reference(MLP, batch=16, steps=3, seed=4)) < 1e-5


def test_ddp_with_a_split_backward_is_refused_before_the_engines():
    with pytest.raises(ValueError, match="dp_mode='ddp'"):
        labkit.Strategy(dp=2, pp=2, schedule="zb-h1", dp_mode="ddp")
