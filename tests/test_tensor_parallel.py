"""Tensor parallelism: plan checks in one process, then megatron and dtensor on 2 real engines,
each equal to the same 3 steps in one process (SGD and AdamW), and the f/g all-reduces on
the timeline."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.tensor import check_tensor_parallel
from labkit.training import build_model, resolve_loss

DATA = labkit.data.text(batch=4, block_size=16, seed=1)
GPT = labkit.models.gpt(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)
UNTIED = labkit.models.gpt(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=DATA.vocab_size, tie=False)
VOCAB_PLAN = {**GPT.tp_plan, "0.wte": "rowwise"}
MLP_PLAN = {"0": "colwise", "2": "rowwise", "3": "colwise", "5": "rowwise"}
STEPS = 3


def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 12), nn.Linear(12, 16), nn.Tanh(),
                         nn.Linear(16, 12))


def mlp_data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)


CASES = {"gpt": (GPT, None, DATA, "cross_entropy"),
         "gpt vocab-parallel": (UNTIED, VOCAB_PLAN, DATA, "cross_entropy"),
         "gpt sequence-parallel": (GPT, None, DATA, "cross_entropy"),
         "mlp": (mlp, MLP_PLAN, mlp_data, "mse")}
RUNS = [(case, mode) for case in CASES for mode in ("megatron", "dtensor")
        if not (case == "gpt sequence-parallel" and mode == "dtensor")]      # SP: megatron only


def train(model, data, loss, optimizer, steps=STEPS):
    """The same few steps everywhere: on each tp rank and in one process."""
    loss_fn = resolve_loss(loss)
    opt = (torch.optim.SGD(model.parameters(), lr=0.3) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(steps):
        x, y = data(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def train_tensor_parallel(case, tp_mode, optimizer):
    """On every rank of the lab (world group = tp group): seed, split, train, gather."""
    from labkit.engine import session
    from labkit.parallel.tensor import build_tensor_parallel, full_state_dict

    s = session()
    make, plan, data, loss = CASES[case]
    model = build_tensor_parallel(build_model(make, 0), tp_mode, None, s.rank, s.world_size, plan,
                                  sequence_parallel="sequence" in case)
    return full_state_dict(train(model, data, loss, optimizer))


def reference(case, optimizer):
    make, _, data, loss = CASES[case]
    return train(build_model(make, 0), data, loss, optimizer).state_dict()


# -- checks, in one process -----------------------------------------------------------------
def test_checks_pass_for_the_shipped_plan():
    assert len(check_tensor_parallel(2, "megatron", GPT)) == 8
    assert check_tensor_parallel(1, "megatron", GPT) == {}
    assert check_tensor_parallel(2, "dtensor", mlp, MLP_PLAN) == MLP_PLAN
    assert check_tensor_parallel(3, "megatron", labkit.models.gpt(n_head=6, n_embd=96))    # 2 heads a rank


@pytest.mark.parametrize("args, match", [
    ((2, "horovod", GPT), "tp_mode"),
    ((2, "megatron", labkit.models.gpt(n_head=3, n_embd=96)), "n_head=3"),
    ((2, "megatron", mlp, {"blocks.*.fc": "colwise"}), "names no module"),
    ((2, "megatron", mlp, {"1": "colwise"}), "GELU"),
    ((2, "megatron", mlp, {"0": "diagonal"}), "'colwise' or 'rowwise'"),
    ((3, "dtensor", mlp, {"0": "colwise"}), "out_features=32"),
    ((3, "dtensor", mlp, {"2": "rowwise"}), "in_features=32"),
    ((2, "megatron", mlp), "no tensor-parallel plan"),
    ((2, "dtensor", GPT, None, True), "megatron"),
    ((2, "megatron", mlp, MLP_PLAN, True), "no sp_plan"),
    ((2, "megatron", UNTIED, VOCAB_PLAN, True), "vocab-parallel"),
    ((4, "megatron", GPT, None, True, 18), "block_size=18"),
    ((2, "megatron", GPT, {"*.lm_head": "colwise"}), "tied"),
    ((2, "dtensor", UNTIED, {"0.wte": "colwise"}), "vocab"),
    ((4, "megatron", UNTIED, {"0.wte": "rowwise"}), f"num_embeddings={DATA.vocab_size}"),
])
def test_bad_plans_name_the_field_and_fix(args, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(*args)


def test_a_star_matches_one_level_of_names():
    from labkit.parallel.tensor import match_plan

    model = GPT()
    assert match_plan(model, {"*.fc": "colwise"}) == {}
    assert match_plan(model, {"1.mlp.fc": "colwise"}) == {"1.mlp.fc": "colwise"}
    assert list(match_plan(model, {"*.*.proj": "rowwise"})) == ["1.attn.proj", "1.mlp.proj", "2.attn.proj",
                                                                "2.mlp.proj"]


def test_check_leaves_the_callers_random_state_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_tensor_parallel(2, "megatron", GPT)
    assert torch.equal(torch.rand(3), expected)


# -- on engines -----------------------------------------------------------------------------
@pytest.fixture
def tp2(lab2):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # engines cannot import this file
    return lab2


@pytest.mark.slow
@pytest.mark.parametrize("case, tp_mode", RUNS)
def test_equals_one_process_sgd_and_adamw(tp2, case, tp_mode):
    for optimizer in ("sgd", "adamw"):
        ref = reference(case, optimizer)
        for state in tp2.apply(train_tensor_parallel, case, tp_mode, optimizer):
            assert set(state) == set(ref)
            diff = max(float((state[k] - ref[k]).abs().max()) for k in ref)
            assert diff <= 1e-5, (case, tp_mode, optimizer, diff)


def one_megatron_step():
    from labkit.engine import session
    from labkit.parallel.tensor import build_tensor_parallel

    s = session()
    model = build_tensor_parallel(build_model(GPT, 0), "megatron", None, s.rank, s.world_size)
    x, y = DATA(0)
    resolve_loss("cross_entropy")(model(x), y).backward()


@pytest.mark.slow
def test_f_and_g_all_reduces_are_on_the_timeline(tp2):
    _, timeline = tp2.trace(one_megatron_step)
    for rank in range(2):
        reduces = [e for e in timeline.events if e["rank"] == rank and e["kind"] == "allreduce"]
        g = [e for e in reduces if e["name"].startswith("tp g")]
        f = [e for e in reduces if e["name"].startswith("tp f")]
        # per layer: g after attention and after the MLP forward, f for both in backward
        assert len(g) == len(f) == 2 * GPT.n_layer, [e["name"] for e in reduces]
        b, t, h = DATA.batch, DATA.block_size, GPT.n_embd
        assert all(e["bytes"] == labkit.comm.wire_bytes("allreduce", 4 * b * t * h, 2) for e in reduces)
        assert all(e["stream"] == "comm" and e["end"] >= e["start"] for e in reduces)


def one_sequence_parallel_step():
    from labkit.engine import session
    from labkit.parallel.tensor import build_tensor_parallel

    s = session()
    model = build_tensor_parallel(build_model(GPT, 0), "megatron", None, s.rank, s.world_size,
                                  sequence_parallel=True)
    x, y = DATA(0)
    resolve_loss("cross_entropy")(model(x), y).backward()


@pytest.mark.slow
def test_sequence_parallel_gathers_and_reduce_scatters_instead_of_all_reduces(tp2):
    _, timeline = tp2.trace(one_sequence_parallel_step)
    layers, full = GPT.n_layer, 4 * DATA.batch * DATA.block_size * GPT.n_embd      # bytes of b·s·h fp32
    for rank in range(2):
        events = [e for e in timeline.events if e["rank"] == rank and e["stream"] == "comm"]
        gathers = [e for e in events if e["kind"] == "allgather"]
        scatters = [e for e in events if e["kind"] == "reduce_scatter"]
        # per layer 2 gathers + 2 reduce-scatters forward, the same backward; the embedding's
        # cut gathers its gradient and the head's join gathers the sequence once more
        assert len(gathers) == 4 * layers + 2 and len(scatters) == 4 * layers, [e["name"] for e in events]
        assert all(e["bytes"] == full // 2 for e in gathers + scatters)           # (t−1)/t of b·s·h
        grads = [e for e in events if e["kind"] == "allreduce"]
        assert all(e["name"].startswith("sp grad") for e in grads)                # LayerNorm and bias grads
        assert len(grads) == layers * 6 + 2
