"""Split backward (I then W) against the fused backward, in one process."""
import gc
import weakref

import pytest
import torch
from torch import nn

from labkit.parallel.pipeline.split_backward import backward_input, backward_weight


def mlp_stage():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))


def norm_stage():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8),
                         nn.LayerNorm(8))


class Tied(nn.Module):
    """One weight used twice in a stage: its two branches off the input path meet."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x)))


def fused(make, x, grad_out, microbatches=1):
    torch.manual_seed(0)
    stage = make()
    grads_in = []
    for i in range(microbatches):
        inp = x[i].detach().clone().requires_grad_(x.requires_grad)
        stage(inp).backward(grad_out[i])
        grads_in.append(inp.grad)
    return stage, grads_in


def split(make, x, grad_out, microbatches=1):
    torch.manual_seed(0)
    stage = make()
    grads_in, kept = [], []
    for i in range(microbatches):          # all I's first, the W's later, as a ZB schedule may
        inp = x[i].detach().clone().requires_grad_(x.requires_grad)
        g, state = backward_input(stage(inp), grad_out[i], inp, stage)
        assert all(p.grad is None for p in stage.parameters())   # I touches no weight
        grads_in.append(g)
        kept.append(state)
    for state in kept:    # W's in micro-batch order (as ZB-H1 and ZB-V run them): the same
        backward_weight(state)   # sums in the same order, so bitwise equal
    return stage, grads_in


@pytest.mark.parametrize("make", [mlp_stage, norm_stage, Tied], ids=["mlp", "layernorm_gelu", "tied"])
@pytest.mark.parametrize("needs_input_grad", [True, False], ids=["middle", "first"])
def test_input_then_weight_equals_fused_backward(make, needs_input_grad):
    torch.manual_seed(1)
    x = torch.randn(3, 4, 8).requires_grad_(needs_input_grad)
    grad_out = torch.randn(3, 4, 8)
    ref, ref_in = fused(make, x, grad_out, 3)
    mine, my_in = split(make, x, grad_out, 3)
    exact = make is not Tied      # a weight used twice sums its two parts in another order
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        if exact:
            assert torch.equal(a.grad, b.grad), (name, (a.grad - b.grad).abs().max())
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    for a, b in zip(ref_in, my_in):
        assert (b is None) if not needs_input_grad else torch.equal(a, b)


def test_last_stage_loss_and_accumulation_into_existing_grads():
    torch.manual_seed(2)
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    ref = mlp_stage()
    mine = mlp_stage()
    mine.load_state_dict(ref.state_dict())
    for stage in (ref, mine):
        for p in stage.parameters():
            p.grad = torch.ones_like(p)          # earlier micro-batches' gradients
    xr = x.detach().clone().requires_grad_()
    nn.functional.mse_loss(ref(xr), y).backward()
    xm = x.detach().clone().requires_grad_()
    grad_in, state = backward_input(nn.functional.mse_loss(mine(xm), y), None, xm, mine)
    backward_weight(state)
    assert torch.equal(grad_in, xr.grad)
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_graph_kept_until_w_and_released_after():
    stage = norm_stage()
    saved = []

    def pack(t):
        if all(t is not p for p in stage.parameters()):
            saved.append(weakref.ref(t))
        return t

    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    _, state = backward_input(out, torch.randn_like(out), x, stage)
    del out
    gc.collect()
    alive = [r for r in saved if r() is not None and r() is not x]
    assert alive, "W needs the saved activations: I must not free them"
    backward_weight(state)
    gc.collect()
    assert [r for r in saved if r() is not None and r() is not x] == []
    assert state.groups == [] and state.captured == {}


def test_weight_pass_does_not_redo_the_input_path():
    # W recomputes only the branches to the weights: no node on the input path runs again.
    stage = mlp_stage()
    x = torch.randn(4, 8, requires_grad=True)
    out = stage(x)
    ran = []
    gelu = next(n for n in _walk(out.grad_fn) if "Gelu" in type(n).__name__)
    gelu.register_prehook(lambda g: ran.append("gelu"))
    grad_in, state = backward_input(out, torch.ones_like(out), x, stage)
    assert ran == ["gelu"]
    backward_weight(state)
    assert ran == ["gelu"]


def _walk(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        yield n
        stack += [c for c, _ in n.next_functions]


def test_gradient_hooks_fire_in_w_not_in_i():
    # W fills .grad through autograd's AccumulateGrad: post-accumulate hooks (labkit's overlap
    # buckets, backward spans) and DDP's reducer see it as in a fused backward.
    stage = norm_stage()
    fired = []
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))
    x = torch.randn(4, 8, requires_grad=True)
    out = stage(x)
    _, state = backward_input(out, torch.ones_like(out), x, stage)
    assert fired == []
    backward_weight(state)
    assert sorted(fired) == sorted(name for name, _ in stage.named_parameters())
