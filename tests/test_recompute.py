"""Activation recomputation: same gradients as without, less activation memory held."""
import copy

import pytest
import torch
from torch import nn

from labkit.record.instrument import ActivationMeter
from labkit.parallel.recompute import apply_recompute, held_activation_bytes


def block_mlp():
    """Top-level blocks of several ops each (where per-block recompute pays off)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                           for _ in range(4)])


class Core(nn.Module):
    """Attention's parameter-free middle: scores, softmax, dropout, weighted sum."""

    def __init__(self, heads):
        super().__init__()
        self.heads, self.drop = heads, nn.Dropout(0.1)

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        return self.drop(att.softmax(-1)) @ v


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out, self.core = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), Core(heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        return x + self.out(self.core(q, k, v).transpose(1, 2).reshape(b, t, d))


def attention_model():
    torch.manual_seed(0)
    blocks = [nn.Sequential() for _ in range(2)]
    for b in blocks:
        b.add_module("attn", Attention())
    return nn.Sequential(*blocks)


def grads_after(model, x, mode, steps=2):
    model = apply_recompute(copy.deepcopy(model), mode)
    torch.manual_seed(1)                       # the same dropout masks for every mode
    for _ in range(steps):
        model(x).square().mean().backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("make,mode", [(block_mlp, "full"), (attention_model, "full"),
                                       (attention_model, "selective")])
def test_gradients_equal_no_recompute_exactly(make, mode):
    model = make().train()
    x = torch.randn(2, 16, 32)
    ref, mine = grads_after(model, x, "none"), grads_after(model, x, mode)
    assert ref.keys() == mine.keys()
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k


def test_full_recompute_holds_less_activation_memory():
    model, x = block_mlp(), torch.randn(64, 32, requires_grad=True)
    none = held_activation_bytes(model, x)
    full = held_activation_bytes(apply_recompute(copy.deepcopy(model), "full"), x)
    # none keeps 3 tensors per block (128+128+32 wide); full keeps each block's 32-wide output
    assert full * 4 < none
    # labkit's own meter (saved tensors) agrees on the direction
    assert meter_bytes(apply_recompute(copy.deepcopy(model), "full"), x) * 4 < meter_bytes(model, x)


def test_selective_recompute_drops_the_softmax_region():
    model, x = attention_model(), torch.randn(2, 64, 32)   # 64 tokens: scores are 64×64 per head
    none = held_activation_bytes(model, x)
    selective = held_activation_bytes(apply_recompute(copy.deepcopy(model), "selective"), x)
    full = held_activation_bytes(apply_recompute(copy.deepcopy(model), "full"), x)
    scores = 2 * 4 * 64 * 64 * 4       # one (b, heads, t, t) float32 tensor per block
    assert none - selective >= 2 * 2 * scores     # at least scores + softmax out, 2 blocks
    assert full < selective < none


def test_none_undoes_an_earlier_mode_and_keys_stay():
    model, x = block_mlp(), torch.randn(64, 32)
    keys = list(model.state_dict())
    apply_recompute(model, "full")
    assert list(model.state_dict()) == keys
    assert "forward" in model[0].__dict__
    apply_recompute(model, "none")
    assert all("forward" not in m.__dict__ for m in model.modules())
    copied = copy.deepcopy(apply_recompute(model, "full"))
    assert copied[0].forward.__self__ is copied[0]        # a copy checkpoints itself


class ListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(block_mlp())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_full_finds_blocks_kept_in_a_module_list():
    model, x = ListModel(), torch.randn(64, 32)
    apply_recompute(model, "full")
    # the repeated blocks, as torchtitan checkpoints each of model.layers; the head is left alone
    assert all("forward" in b.__dict__ for b in model.blocks) and "forward" not in model.head.__dict__
    assert held_activation_bytes(model, x) * 4 < held_activation_bytes(apply_recompute(model, "none"), x)


def test_bad_modes_name_the_fix():
    with pytest.raises(ValueError, match="choose one of none, full, selective"):
        apply_recompute(block_mlp(), "some")
    with pytest.raises(ValueError, match="submodule named 'core'.*or use recompute='full'"):
        apply_recompute(block_mlp(), "selective")


def meter_bytes(model, x):
    meter = ActivationMeter(list(model.parameters()))
    with meter.forward("mb", x) as kept:
        kept.append(model(x))
    return meter.peak


def test_meter_counts_what_recompute_saves_on_the_gpt():
    """labkit's meter (saved tensors + stage input/output) against torch's profiler (the
    forward's net allocations), per mode: the meter must see what recompute frees."""
    import labkit
    model = labkit.models.gpt(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=64)()
    x = torch.randint(0, 64, (8, 64))
    for mode in ("none", "full", "selective"):
        m = apply_recompute(copy.deepcopy(model), mode)
        assert meter_bytes(m, x) == pytest.approx(held_activation_bytes(m, x), rel=0.1), mode


def test_strategy_field_and_its_checks():
    import labkit
    assert labkit.Strategy(recompute="full").label() == "dp=1 mb=1 recompute=full"
    with pytest.raises(ValueError, match="Strategy.recompute='some'.*'none', 'full', 'selective'"):
        labkit.Strategy(recompute="some")


# -- through lab.run ---------------------------------------------------------------------
GPT_RUN = dict(loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)


def _gpt():
    import labkit
    data = labkit.data.text(batch=8, block_size=32)
    return labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=data.vocab_size,
                             tie=False), data


@pytest.mark.parametrize("base", [dict(dp=2), dict(pp=2, microbatches=2), dict(pp=2, microbatches=2,
                                                                                schedule="zb-h1")])
def test_recompute_is_exact_and_holds_less(lab2, base):
    import labkit
    make, data = _gpt()
    ref = labkit.reference(make, data=data, **GPT_RUN)
    peaks = {}
    for mode in ("none", "full", "selective"):
        run = lab2.run(labkit.Strategy(recompute=mode, **base), model=make, data=data, **GPT_RUN)
        assert run.max_diff(ref) <= 1e-5, mode
        peaks[mode] = max(run.metrics["peak_activation_bytes"])
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def test_selective_on_a_model_without_core_fails_before_the_engines(lab2):
    import labkit
    with pytest.raises(ValueError, match="or use recompute='full'"):
        lab2.run(labkit.Strategy(dp=2, recompute="selective"), model=block_mlp, steps=1)
