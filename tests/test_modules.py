"""Any nn.Module through lab.run: a plain transformer written the way a user writes one (its own
forward, a position table on the root, its blocks in an nn.ModuleList, a tp_plan attribute)
equals one process under every strategy that keeps the model whole (pp = 1), keyed like its
own state_dict; its output reaches the loss as a tensor, a tuple or an object with .logits;
bad models are refused before any engine, naming the fix."""
from __future__ import annotations

import itertools
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import labkit
from labkit.training import LOSSES
from labkit.parallel.blocks import find_blocks
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate

DATA = labkit.data.text(batch=8, block_size=16)
TOL = 1e-5           # float32: every strategy below against labkit.reference, after 3 steps
BF16_TOL = 2e-2      # bf16 autocast: as tests/test_precision.py allows for a 3-step run


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # -1: the heads this rank holds (a tensor-parallel rank holds n_head / tp of them)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, n_head)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    tp_plan = {"layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise", "layers.*.attn.wv": "colwise",
               "layers.*.attn.wo": "rowwise", "layers.*.mlp.w1": "colwise", "layers.*.mlp.w2": "rowwise"}

    def __init__(self, vocab: int = DATA.vocab_size, dim: int = 32, n_head: int = 2, n_layer: int = 2,
                 block_size: int = 16):
        super().__init__()
        self.n_head = n_head
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(block_size, dim) * 0.02)      # on the root, not a child
        self.layers = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class TupleNet(Net):
    def forward(self, idx):
        return super().forward(idx), None


@dataclass
class Output:
    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None


class LogitsNet(Net):
    """An output object with .logits and, as a mixture-of-experts model gives, an aux_loss."""

    def forward(self, idx):
        logits = super().forward(idx)
        return Output(logits, 0.01 * self.pos.pow(2).mean())


class DeltaBlock(Block):
    def forward(self, x):                # the update only: the caller adds the residual
        h = self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(x + h))


class KeywordNet(Net):
    """Blocks called with keywords, the residual added outside them: no block's input is the
    output of the one before, which ZeRO-3's backward gathers must not rely on."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DeltaBlock(32, 2) for _ in range(2))

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = x + layer(x=x)
        return self.head(self.norm(x))


class SplitHeadNet(Net):
    """Hugging Face's plan names for the embedding and a head whose output is gathered."""

    tp_plan = {**Net.tp_plan, "tok_emb": "embedding_rowwise", "head": "colwise_gather_output"}

    def __init__(self):
        super().__init__(vocab=DATA.vocab_size + DATA.vocab_size % 2)     # a vocabulary tp=2 divides


KW = dict(data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
_refs = {}


def reference(model=Net):
    if model not in _refs:
        _refs[model] = labkit.reference(model, **KW)
    return _refs[model]


def check(run, model=Net, tol=TOL):
    ref = reference(model)
    assert sorted(run.parameters()) == sorted(model().state_dict())     # the model's own keys, "pos" included
    assert run.max_diff(ref) < tol
    assert run.losses == pytest.approx(ref.losses, abs=tol * 10)


# -- every whole-model strategy on 2 engines --------------------------------------------------------
CASES = [dict(tp=2), dict(dp=2, dp_mode="naive"), dict(dp=2, dp_mode="overlap", bucket_mb=0.01), dict(dp=2, dp_mode="ddp"),
         dict(dp=2, dp_mode="bucketed", compression="fp16"),
         dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3), dict(dp=2, zero=3, prefetch=1),
         dict(dp=2, zero=3, zero_mode="fsdp2"), dict(dp=2, microbatches=2, recompute="full"),
         dict(tp=2, tp_mode="dtensor")]     # after fsdp2: a mesh on the same ranks (fresh_dtensor_caches)


@pytest.mark.parametrize("strategy", CASES, ids=lambda s: labkit.Strategy(**s).label())
def test_a_plain_transformer_equals_one_process(lab2, strategy):
    s = labkit.Strategy(**strategy)
    tol = 2e-3 if s.compression != "none" else TOL   # fp16 messages: the rounding of 3 steps' gradients
    check(lab2.run(s, model=Net, **KW), tol=tol)


@pytest.mark.parametrize("tp_mode", ["megatron", "dtensor"])
def test_hugging_face_plan_styles_split_the_embedding_and_head(lab2, tp_mode):
    check(lab2.run(labkit.Strategy(tp=2, tp_mode=tp_mode), model=SplitHeadNet, **KW), model=SplitHeadNet)


def test_bf16_within_its_tolerance(lab2):
    check(lab2.run(labkit.Strategy(dp=2, precision="bf16"), model=Net, **KW), tol=BF16_TOL)


@pytest.mark.parametrize("model, strategy", [(TupleNet, dict(dp=2, zero=3)), (LogitsNet, dict(dp=2, microbatches=2)),
                                             (KeywordNet, dict(dp=2, zero=3, prefetch=1, microbatches=2))])
def test_a_tuple_or_an_output_object_reaches_the_loss(lab2, model, strategy):
    check(lab2.run(labkit.Strategy(**strategy), model=model, blocks="layers", **KW), model=model)


def test_zero3_times_the_blocks_and_the_modules_around_them(lab2):
    run = lab2.run(labkit.Strategy(dp=2, zero=3), model=Net, **KW)
    spans = sorted((e for e in run.timeline.events if e["rank"] == 0 and e["step"] == 2 and e["kind"] in ("fwd", "bwd")),
                   key=lambda e: e["start"])
    # a span the rank spent part of waiting (a reduce-scatter collected between blocks) is cut in pieces
    names = [k for k, _ in itertools.groupby((e["kind"], e["name"]) for e in spans)]
    assert names == [("fwd", "F tok_emb"), ("fwd", "F block layers.0"), ("fwd", "F block layers.1"),
                     ("fwd", "F norm"), ("fwd", "F head"), ("bwd", "Linear head"), ("bwd", "LayerNorm norm"),
                     ("bwd", "Block layers.1"), ("bwd", "Block layers.0"), ("bwd", "Embedding tok_emb")]


def test_drift_snapshots_name_the_modules_parameters(lab2):
    net = Net()                          # an instance: copied as it is, on every rank and here
    run = lab2.run(labkit.Strategy(dp=2, dp_mode="overlap"), model=net, snapshots=True, **KW)
    ref = labkit.reference(net, snapshots=True, **KW)
    assert labkit.drift(run, ref, tol=TOL) is None
    assert set(run.snapshots[-1][1]["params"]) == set(Net().state_dict())


def test_a_model_from_a_file_next_to_the_notebook_travels(lab2, tmp_path, monkeypatch):
    (tmp_path / "usermodel_x35.py").write_text(textwrap.dedent("""
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
                self.out = nn.Linear(6, 3)

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x).tanh()
                return self.out(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from usermodel_x35 import Tiny
    try:
        for model in (lambda: Tiny(), Tiny, Tiny()):      # a factory naming it, a class, an instance
            run = lab2.run(labkit.Strategy(dp=2, zero=3), model=model, batch=8, steps=2, lr=0.1)
            assert run.max_diff(labkit.reference(model, batch=8, steps=2, lr=0.1)) < TOL
    finally:
        sys.modules.pop("usermodel_x35", None)


# -- in one process: losses, blocks, refusals before any engine ------------------------------------
def test_built_in_losses_read_every_output_and_add_aux_loss():
    logits, y = torch.randn(2, 4, 5), torch.randint(0, 5, (2, 4))
    ce = LOSSES["cross_entropy"]
    plain = ce(logits, y)
    assert ce((logits, None), y) == plain
    assert ce(Output(logits), y) == plain
    assert torch.allclose(ce(Output(logits, torch.tensor(0.5)), y), plain + 0.5)
    assert torch.allclose(LOSSES["mse"](Output(logits, torch.tensor(1.0)), logits), torch.tensor(1.0))


def test_blocks_found_as_fsdp_users_find_them():
    assert [n for n, _ in find_blocks(Net())] == ["layers.0", "layers.1"]
    assert [n for n, _ in find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))] == ["0", "1"]

    class Experts(nn.Module):            # a longer list inside each layer is not the model's blocks
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"e": nn.ModuleList(nn.Linear(2, 2) for _ in range(8))})
                                        for _ in range(2))
    assert [n for n, _ in find_blocks(Experts())] == ["layers.0", "layers.1"]
    assert [n for n, _ in find_blocks(Net(), "layers")] == ["layers.0", "layers.1"]


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


class Empty(nn.Module):
    def forward(self, x):
        return x


def spec(model, blocks=None, tp_plan=None, **strategy):
    s = labkit.Strategy(**strategy)
    return RunSpec(s, model, DATA if model not in (Flat, Empty) else None,
                   "cross_entropy" if model not in (Flat, Empty) else "mse",
                   batch=8, steps=2, tp_plan=tp_plan, blocks=blocks)


class Heads3(Net):
    def __init__(self):
        super().__init__(dim=48, n_head=3)


@pytest.mark.parametrize("run_spec, error, match", [
    (spec(Empty, dp=2), ValueError, "no trainable parameters"),
    (spec(Flat, dp=2, zero=3), ValueError, "blocks="),
    (spec(Flat, dp=2, zero=2, zero_mode="fsdp2"), ValueError, "blocks="),
    (spec(Net, dp=2, zero=3, blocks="head"), ValueError, "blocks='head'"),
    (spec(Net, tp=2, tp_plan={"blocks.*.fc": "colwise"}), ValueError, "names no module"),
    (spec(Heads3, tp=2, tp_plan={"layers.*.attn.wq": "colwise"}), ValueError, "n_head=3"),
    (spec(lambda: Net, dp=2), TypeError, "factory returned a factory"),
    (spec(lambda: 3, dp=2), TypeError, "returned a int"),
    (spec(Net, pp=2), ValueError, "nn.Sequential"),
    (RunSpec(labkit.Strategy(dp=2), Net, None, "cross_entropy", batch=8, steps=2), ValueError, "data="),
])
def test_bad_models_fail_before_engines(run_spec, error, match):
    with pytest.raises(error, match=match):
        validate(run_spec, 2)


def test_kv_heads_of_a_hugging_face_style_config_are_checked():
    class Config:
        num_attention_heads, num_key_value_heads = 4, 1

    class HF(Net):
        def __init__(self):
            super().__init__()
            self.config = Config()
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        validate(spec(HF, tp=2), 2)


class Huge(nn.Module):
    """17 GB of float32 weights: checked on the meta device, never built here."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(65536, 65536) for _ in range(1))
        self.tok_emb = nn.Embedding(8, 65536)

    def forward(self, idx):
        return self.layers[0](self.tok_emb(idx))


def test_the_checks_read_a_factory_built_on_the_meta_device():
    validate(RunSpec(labkit.Strategy(dp=2, zero=3), Huge, DATA, "cross_entropy", batch=8, steps=1), 2)
    with pytest.raises(ValueError, match="no trainable parameters"):      # still read from the meta model
        validate(RunSpec(labkit.Strategy(dp=2), lambda: Huge().requires_grad_(False), DATA, batch=8), 2)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=DATA.vocab_size + DATA.vocab_size % 2, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("strategy", [dict(dp=2, zero=3), dict(tp=2)], ids=["zero3", "tp2"])
def test_a_hugging_face_model_as_users_bring_it(lab2, strategy):
    """model.model.layers found as its blocks, its own tp_plan (embedding_rowwise, colwise_gather_output),
    its CausalLMOutputWithPast read for .logits."""
    pytest.importorskip("transformers")
    run = lab2.run(labkit.Strategy(**strategy), model=hf_llama, **KW)
    ref = reference(hf_llama)
    assert sorted(run.parameters()) == sorted(ref.parameters())
    assert run.max_diff(ref) < TOL
