"""Sharding (labkit.parallel.zero): every stage equals one process; the rules; memory per stage.

The multi-process cases share one model with uneven sizes (13·37 + 37 parameters does not
divide by 2 or 4: padding is exercised) and run each strategy for 3 steps.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.zero import model_state_bytes, optimizer_state_factor
from labkit.run.runner import validate
from labkit.parallel.build import RunSpec

STEPS = 3
LR = {"sgd": 0.05, "adamw": 0.01}


def odd_model():
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 29), nn.ReLU(), nn.LayerNorm(29),
                         nn.Linear(29, 5))


def odd_data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(24, 13, generator=g), torch.randn(24, 5, generator=g)


_refs = {}


def reference(optimizer):
    if optimizer not in _refs:
        _refs[optimizer] = labkit.reference(odd_model, data=odd_data, batch=24, steps=STEPS, lr=LR[optimizer],
                                            seed=5, optimizer=optimizer)
    return _refs[optimizer]


def run(lab, optimizer="sgd", **strategy):
    s = labkit.Strategy(dp=lab.world_size, bucket_mb=0.002, **strategy)
    return lab.run(s, model=odd_model, data=odd_data, batch=24, steps=STEPS, lr=LR[optimizer], seed=5,
                   optimizer=optimizer)


def check(result, optimizer):
    ref = reference(optimizer)
    assert set(result.parameters()) == set(ref.parameters())
    assert result.max_diff(ref) <= 1e-5
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)


# -- every stage, prefetch on and off, by hand and torch's, SGD and AdamW (dp=2) -----------------
CASES = [dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=3, prefetch=1), dict(zero=3, prefetch=2),
         dict(zero=3, zero_mode="fsdp2"), dict(zero=3, zero_mode="fsdp2", prefetch=1), dict(zero=2, zero_mode="fsdp2")]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_stage_equals_one_process_dp2(lab2, optimizer):
    for case in CASES:
        check(run(lab2, optimizer, **case), optimizer)


def test_timeline_and_memory_show_the_stages(lab2):
    by_stage = {z: run(lab2, "adamw", zero=z) for z in (0, 1, 2, 3)}
    kinds = {z: {e["kind"] for e in r.timeline.events if e["stream"] == "comm"} for z, r in by_stage.items()}
    assert "allreduce" in kinds[0] and "reduce_scatter" not in kinds[0]
    assert {"reduce_scatter", "allgather"} <= kinds[1] and "allreduce" not in kinds[1]
    assert {"reduce_scatter", "allgather"} <= kinds[3]
    mem = {z: r.metrics["memory_bytes"][0] for z, r in by_stage.items()}
    full = mem[0]["params"]
    # stage by stage, one more kind of state shrinks to about 1/dp (padding keeps it a bit above)
    assert mem[1]["optimizer"] < 0.6 * mem[0]["optimizer"] and mem[1]["params"] >= full
    assert mem[2]["grads"] < 0.6 * mem[1]["grads"]
    assert mem[3]["params"] < 0.6 * full < mem[3]["params_peak"]
    # zero=3 sends 1.5× plain DP: two gathers and a reduce-scatter against an all-reduce
    sent = {z: r.metrics["bytes_sent"] for z, r in by_stage.items()}
    assert sent[3][0] / sent[0][0] == pytest.approx(1.5, rel=0.1)


def test_sharded_with_microbatches_and_dp4(lab4):
    check(run(lab4, "adamw", zero=3, prefetch=1, microbatches=2), "adamw")
    check(run(lab4, "sgd", zero=2, microbatches=3), "sgd")
    check(run(lab4, "adamw", zero=3, zero_mode="fsdp2", prefetch=1), "adamw")


def test_zero1_composes_with_a_pipeline(lab4):
    s = labkit.Strategy(dp=2, pp=2, zero=1, microbatches=2)
    result = lab4.run(s, model=odd_model, data=odd_data, batch=24, steps=STEPS, lr=LR["adamw"], seed=5,
                      optimizer="adamw")
    check(result, "adamw")


# -- pure: rules before engines, the formula ------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(zero=1), "zero"),                                   # dp = 1
    (dict(dp=2, pp=2, zero=2), "zero"),                       # zero > 1 with a pipeline
    (dict(dp=2, zero=2, prefetch=1), "prefetch"),             # prefetch without zero=3
    (dict(dp=2, prefetch=1), "prefetch"),
    (dict(dp=2, zero=5), "zero"),
    (dict(dp=2, zero=3, prefetch=3), "prefetch"),
    (dict(dp=2, zero=1, zero_mode="fsdp2"), "zero_mode"),
    (dict(dp=2, zero=3, zero_mode="deepspeed"), "zero_mode"),
    (dict(dp=2, zero=2, compression="fp16"), "compression"),
])
def test_impossible_sharding_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Strategy\.{field}"):
        labkit.Strategy(**kwargs)


@pytest.mark.parametrize("kwargs, label", [
    (dict(zero=3, zero_mode="fsdp2"), "dp=2 zero=3 fsdp2 mb=1"),      # torch's sync: no dp mode, no buckets
    (dict(zero=2, zero_mode="fsdp2"), "dp=2 zero=2 fsdp2 mb=1"),
    (dict(zero=3), "dp=2 zero=3 mb=1"),                               # a unit per block, not buckets
    (dict(zero=2, bucket_mb=0.5), "dp=2 zero=2 mb=1 0.5 MiB"),        # ZeRO-2's buckets, no dp mode
])
def test_a_sharded_run_is_labelled_by_what_averaged_its_gradients(kwargs, label):
    assert labkit.Strategy(dp=2, **kwargs).label() == label


def test_unknown_optimizer_is_refused_before_engines():
    spec = RunSpec(labkit.Strategy(dp=2, zero=1), odd_model, odd_data, batch=24, optimizer="lamb")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        validate(spec, 2)
    with pytest.raises(ValueError, match="momentum"):
        validate(RunSpec(labkit.Strategy(), odd_model, odd_data, batch=24, momentum=0.9, optimizer="adamw"), 1)


def test_reference_adamw_is_torch_adamw():
    ref = labkit.reference(odd_model, data=odd_data, batch=24, steps=2, lr=0.01, seed=5, optimizer="adamw")
    torch.manual_seed(5)
    net = odd_model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for step in range(2):
        x, y = odd_data(step)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in net.state_dict().items():
        assert torch.equal(v, ref.parameters()[k])


def test_formula_is_figure_1_for_fp32():
    psi, n = 7.5e9, 64                   # the paper's example size, its N_d
    base = model_state_bytes(psi, n, 0, k=8)["total"]
    assert base == 16 * psi
    assert model_state_bytes(psi, n, 1, k=8)["total"] == pytest.approx((4 + 4 + 8 / n) * psi)
    assert model_state_bytes(psi, n, 2, k=8)["total"] == pytest.approx((4 + 12 / n) * psi)
    assert model_state_bytes(psi, n, 3, k=8)["total"] == pytest.approx(16 * psi / n)
    assert optimizer_state_factor("adamw") == 8 and optimizer_state_factor("sgd") == 0


def test_memory_table_and_bars_from_runs():
    from types import SimpleNamespace
    from labkit.view.memory import memory_table, plot_memory

    def fake(stage, scale):
        held = {"params": 400 // scale[0], "grads": 400 // scale[1], "optimizer": 800 // scale[2],
                "activations_peak": 50, "params_peak": 400, "grads_peak": 400, "optimizer_peak": 800}
        return SimpleNamespace(parameters=lambda: {"w": torch.zeros(100)}, strategy=labkit.Strategy(dp=2),
                               metrics={"memory_bytes": [held, held]})
    runs = {0: fake(0, (1, 1, 1)), 3: fake(3, (2, 2, 2))}
    rows = memory_table(runs, optimizer="adamw")
    assert [(r["stage"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (3, 0), (3, 1)]
    assert rows[0]["formula"] == rows[0]["measured"] == 1600 and rows[2]["formula"] == rows[2]["measured"] == 800
    assert memory_table(runs, optimizer="adamw", peak=True)[2]["measured"] == 1600
    assert len(plot_memory(runs, optimizer="adamw").patches) == 4 * 4


@pytest.mark.parametrize("kwargs", [dict(dp=2, zero=3), dict(dp=2, zero=2, zero_mode="fsdp2"),
                                    dict(dp=2, pp=2, zero=1, microbatches=2)])
def test_a_tied_weight_with_sharding_is_refused_before_engines(kwargs):
    data = labkit.data.text(batch=8, block_size=16)
    tied = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=data.vocab_size)
    spec = RunSpec(labkit.Strategy(**kwargs), tied, data, "cross_entropy", batch=8)
    with pytest.raises(ValueError, match=r"Strategy\.zero=.*tie=False"):
        validate(spec, labkit.Strategy(**kwargs).world_size)
    validate(RunSpec(labkit.Strategy(dp=2, zero=2), tied, data, "cross_entropy", batch=8), 2)   # pp=1: fine


def test_zero_shards_the_local_tensor_parallel_parameters(lab4):
    """The zero syncs shard whatever a stage holds: dp=2 × tp=2 equals one process."""
    data = labkit.data.text(batch=8, block_size=16)
    gpt = labkit.models.gpt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=data.vocab_size, tie=False)
    kw = dict(data=data, loss="cross_entropy", batch=8, steps=STEPS, lr=0.3, seed=0)
    result = lab4.run(labkit.Strategy(dp=2, tp=2, zero=3, prefetch=1), model=gpt, **kw)
    check_against = labkit.reference(gpt, **kw)
    assert result.max_diff(check_against) <= 1e-5
    assert result.losses == pytest.approx(check_against.losses, abs=1e-5)
