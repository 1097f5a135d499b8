"""The GPT model and the text corpus, in one process (no engines)."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import labkit
from labkit.training import build_model, resolve_loss

SMALL = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40)


def test_blocks_are_embedding_layers_head():
    model = SMALL()
    assert isinstance(model, nn.Sequential) and len(model) == 2 + 2
    assert isinstance(model[0].wte, nn.Embedding) and isinstance(model[0].wpe, nn.Embedding)
    for block in model[1:-1]:
        assert block.attn.qkv.out_features == 3 * 32 and block.mlp.fc.out_features == 4 * 32
        assert not list(block.attn.core.parameters())          # the region selective recompute keeps out
    assert model(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 40)


def test_tied_by_default_one_parameter_in_first_and_last_block():
    model = SMALL()
    assert model[-1].lm_head.weight is model[0].wte.weight
    keys = model.state_dict()
    assert "0.wte.weight" in keys and "3.lm_head.weight" in keys        # both keys, as the reference has
    untied = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40, tie=False)()
    assert untied[-1].lm_head.weight is not untied[0].wte.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters()) == 40 * 32


def test_same_seed_same_weights():
    a, b = build_model(SMALL, 3), build_model(SMALL, 3)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(build_model(SMALL, 4)[1].attn.qkv.weight, a[1].attn.qkv.weight)


def test_attention_is_causal():
    model = build_model(SMALL, 0)
    x = torch.randint(0, 40, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 40
    a, b = model(x), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_heads_are_laid_out_head_by_head():
    """The first rows of qkv (one head's q, k, v) alone decide head 0: a column split gives a
    rank whole heads."""
    torch.manual_seed(0)
    attn = SMALL()[1].attn
    x = torch.randn(2, 5, 32)
    qkv = attn.qkv(x).view(2, 5, 2, 3 * 16)
    q0 = (x @ attn.qkv.weight[:16].T + attn.qkv.bias[:16])
    assert torch.allclose(qkv[:, :, 0, :16], q0, atol=1e-6)


def test_tp_plan_on_model_and_factory_matches_modules():
    from labkit.parallel.tensor import match_plan

    model = SMALL()
    assert SMALL.tp_plan == model.tp_plan
    matched = match_plan(model, model.tp_plan)
    assert matched == {"1.attn.qkv": "colwise", "1.attn.proj": "rowwise", "1.mlp.fc": "colwise",
                       "1.mlp.proj": "rowwise", "2.attn.qkv": "colwise", "2.attn.proj": "rowwise",
                       "2.mlp.fc": "colwise", "2.mlp.proj": "rowwise"}


def test_cross_entropy_on_sequence_logits():
    loss = resolve_loss("cross_entropy")
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    flat = torch.nn.functional.cross_entropy(logits.reshape(10, 7), target.reshape(10))
    assert torch.allclose(loss(logits, target), flat)
    assert torch.allclose(loss(logits[0], target[0]), torch.nn.functional.cross_entropy(logits[0], target[0]))


def test_learns_text_in_a_few_steps():
    data = labkit.data.text(batch=8, block_size=16, seed=1)
    make = labkit.models.gpt(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=data.vocab_size)
    model, loss_fn = build_model(make, 0), resolve_loss("cross_entropy")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        before = loss_fn(model(data.val(0)[0]), data.val(0)[1]).item()
    for step in range(30):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        after = loss_fn(model(data.val(0)[0]), data.val(0)[1]).item()
    assert after < before - 0.5, (before, after)


@pytest.mark.parametrize("field, value", [("n_layer", 0), ("n_head", 3), ("vocab_size", 1.5), ("dropout", 1.0)])
def test_bad_gpt_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        labkit.models.gpt(**{field: value})


def test_sequence_longer_than_block_size():
    with pytest.raises(ValueError, match="block_size=16"):
        SMALL()(torch.zeros(1, 17, dtype=torch.long))


def test_check_data_names_block_size_and_vocab_size():
    labkit.models.gpt(block_size=16).check_data(labkit.data.text(block_size=16))      # fits
    with pytest.raises(ValueError, match="block_size=32"):
        labkit.models.gpt(block_size=16).check_data(labkit.data.text(block_size=32))
    with pytest.raises(ValueError, match="vocab_size=40"):
        SMALL.check_data(labkit.data.text(block_size=16))


# -- the corpus --------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["pydoc", "stdlib"])
def test_text_batches_are_seeded_and_shifted(source):
    data = labkit.data.text(batch=4, block_size=32, seed=2, source=source)
    x, y = data(5)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(data(5)[0], x) and not torch.equal(data(6)[0], x)
    assert 60 < data.vocab_size < 128 and int(x.max()) < data.vocab_size
    assert not torch.equal(labkit.data.text(batch=4, block_size=32, seed=3, source=source)(5)[0], x)


def test_validation_comes_from_the_held_out_split():
    data = labkit.data.text(batch=4, block_size=32)
    corpus = data.corpus
    x, _ = data.val(0)
    text = data.decode(corpus.ids[corpus.val_start:])
    assert all(data.decode(row) in text for row in x)
    assert 0.85 < corpus.val_start / len(corpus.ids) < 0.95


def test_encode_decode_round_trip():
    data = labkit.data.text()
    s = "def f(x):\n    return x + 1  # ok"
    assert data.decode(data.encode(s)) == s
    with pytest.raises(ValueError, match="vocabulary"):
        data.encode("é")


def test_data_pickles_small_corpus_built_lazily():
    data = labkit.data.text(source="stdlib")
    assert len(pickle.dumps(data)) < 500             # the corpus travels as a name, not 12 MB
    assert pickle.loads(pickle.dumps(data)) == data


@pytest.mark.parametrize("kwargs, field", [({"batch": 0}, "batch"), ({"block_size": -1}, "block_size"),
                                           ({"source": "wiki"}, "source"), ({"val_fraction": 0.9}, "val_fraction")])
def test_bad_text_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        labkit.data.text(**kwargs)


# -- through lab.run ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy, tie", [(labkit.Strategy(dp=2), True),
                                           (labkit.Strategy(pp=2, microbatches=2), True)])
def test_trains_on_text_through_lab_run_equal_to_reference(lab2, strategy, tie):
    """dp=2 and pp=2, both with the tied head (across stages, the embedding group sums the
    two copies' gradients)."""
    data = labkit.data.text(batch=8, block_size=16)
    make = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=data.vocab_size, tie=tie)
    kwargs = dict(data=data, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
    run, ref = lab2.run(strategy, model=make, **kwargs), labkit.reference(make, **kwargs)
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)
    assert run.max_diff(ref) <= 1e-5
