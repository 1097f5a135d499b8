"""The axis registry (labkit.parallel.axes) and the axis that landed through it, HSDP.

Pure: the registry drives Strategy's checks, validate's model checks, the grid's groups and
the CLI's flag sections. Engines: ``Strategy(dp=4, zero=…, dp_shard=2)`` equals one process
(labkit's ZeRO and torch's FSDP2 on a 2-D mesh), each rank holding half the parameters;
with tp and pp on eight engines where the machine has the cores for it.

    python -m pytest tests/test_axes.py
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import labkit
from labkit.cli import build_parser, strategy_from_args, strategy_sections
from labkit.config import strategy_fields
from labkit.grid import ParallelDims
from labkit.parallel import axes
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate

STEPS = 2


# -- the registry drives the rest ------------------------------------------------------------------
def test_every_strategy_field_belongs_to_one_axis_or_to_compute():
    sections = strategy_sections()
    assert [name for name, _ in sections] == [a.NAME for a in axes.AXES] + ["compute", "grid"]
    assert [f.name for f in sections[-1][1]] == ["order"]
    placed = [f.name for _, fs in sections for f in fs]
    assert sorted(placed) == sorted(f.name for f in strategy_fields())      # each once
    for a in axes.AXES:
        assert a.NAME in placed                                             # its degree (or zero's stage)


def test_strategy_checks_are_the_registrys(monkeypatch):
    def refuse(s):
        raise ValueError("Strategy.cp: refused by the registry's cp line")
    monkeypatch.setattr(axes.axis("cp"), "check_strategy", refuse)
    with pytest.raises(ValueError, match="registry's cp line"):
        labkit.Strategy(dp=2)


def test_validate_runs_every_axis_model_check(monkeypatch):
    seen = []
    for a in axes.AXES:
        monkeypatch.setattr(a, "check_model", lambda spec, built, data, name=a.NAME: seen.append(name))
    validate(RunSpec(labkit.Strategy(dp=2), model, data, batch=8), 2)
    assert seen == [a.NAME for a in axes.AXES]


def test_groups_come_from_the_axes():
    kinds = dict(axes.grid_groups(ParallelDims(dp=2, pp=2)))
    assert set(kinds) == {"tp", "pp", "embedding", "dp"}                    # cp = 1 builds no ring
    assert kinds["dp"] == [[0, 2], [1, 3]] and kinds["pp"] == [[0, 1], [2, 3]]
    kinds = dict(axes.grid_groups(ParallelDims(dp=2, cp=2)))
    assert kinds["cp"] == [[0, 1], [2, 3]] and kinds["dp_cp"] == [[0, 1, 2, 3]]
    assert labkit.Strategy(dp=2, tp=2, zero=1).grid() == ParallelDims(dp=2, tp=2)


def test_order_puts_an_axis_where_asked():
    """The default keeps tp fastest (neighbours on a node); 'dp,cp,pp,tp' makes it the slowest."""
    default, across = ParallelDims(dp=2, tp=2, pp=2), ParallelDims(dp=2, tp=2, pp=2, order="dp,cp,pp,tp")
    assert default.tp_groups()[0] == [0, 1] and across.tp_groups()[0] == [0, 4]
    assert across.dp_groups()[0] == [0, 1] and across.pp_groups()[0] == [0, 2]
    for dims in (default, across, ParallelDims(dp=2, cp=2, tp=2, order="pp,dp,tp,cp")):
        seen = sorted(dims.rank_of(d, p, t, c) for d in range(dims.dp) for p in range(dims.pp)
                      for t in range(dims.tp) for c in range(dims.cp))
        assert seen == list(range(dims.world_size))                        # one rank per cell
        assert all(dims.rank_of(*dims.coords(r), dims.cp_index(r)) == r for r in range(dims.world_size))
    assert labkit.Strategy(dp=2, tp=2, order="dp,cp,pp,tp").grid() == ParallelDims(dp=2, tp=2, order="dp,cp,pp,tp")
    with pytest.raises(ValueError, match=r"Strategy\.order='tp,dp'"):
        labkit.Strategy(order="tp,dp")


def test_hsdp_groups_are_runs_and_strides_of_dp():
    dims = ParallelDims(dp=4, tp=2)
    assert dims.dp_runs(2) == [[0, 2], [4, 6], [1, 3], [5, 7]]             # shard groups
    assert dims.dp_strides(2) == [[0, 4], [2, 6], [1, 5], [3, 7]]          # replicate groups
    assert dims.ep_groups(2) == dims.dp_runs(2)


# -- HSDP's rules -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, says", [
    (dict(dp=4, zero=3, dp_shard=3), "must divide dp=4"),
    (dict(dp=4, dp_shard=2), "zero=0 shards nothing"),
    (dict(dp=4, zero=1, dp_shard=1), "≥ 2"),
    (dict(dp=4, zero=1, dp_shard=True), "≥ 2"),
    (dict(dp=4, zero=1, ep=2, dp_shard=2), "ep=2"),
    (dict(dp=2, cp=2, zero=1, dp_shard=2), "cp=2"),
    (dict(dp=4, zero=1, dp_shard=2, zero_mode="fsdp2"), "zero_mode"),      # fsdp2 shards gradients: zero ≥ 2
])
def test_bad_dp_shard_is_refused_naming_the_field(kwargs, says):
    with pytest.raises(ValueError, match=r"Strategy\.(dp_shard|zero_mode)") as err:
        labkit.Strategy(**kwargs)
    assert says in str(err.value)


def test_the_cli_has_dp_shard():
    args = build_parser().parse_args(["run", "--dp", "4", "--zero", "3", "--dp-shard", "2"])
    assert strategy_from_args(args).dp_shard == 2
    assert strategy_from_args(build_parser().parse_args(["run"])).dp_shard is None


# -- HSDP on engines ---------------------------------------------------------------------------------
def model():
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 29), nn.ReLU(), nn.Linear(29, 5))


def data(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(24, 13, generator=g), torch.randn(24, 5, generator=g)


def tp_model():
    """The same shape with a width tp = 2 splits (38), and its Megatron plan (column then row)."""
    net = nn.Sequential(nn.Linear(13, 38), nn.Tanh(), nn.Linear(38, 29), nn.ReLU(), nn.Linear(29, 5))
    net.tp_plan = {"0": "colwise", "2": "rowwise"}
    return net


_refs = {}


def reference(net=model):
    if net not in _refs:
        _refs[net] = labkit.reference(net, data=data, batch=24, steps=STEPS, lr=0.01, seed=3, optimizer="adamw")
    return _refs[net]


def run(lab, net=model, **strategy):
    s = labkit.Strategy(bucket_mb=0.002, **strategy)
    result = lab.run(s, model=net, data=data, batch=24, steps=STEPS, lr=0.01, seed=3, optimizer="adamw")
    assert result.max_diff(reference(net)) <= 1e-5
    assert result.losses == pytest.approx(reference(net).losses, abs=1e-5)
    return result


def test_hsdp_equals_one_process_and_holds_half_the_model(lab4):
    whole = sum(p.numel() * 4 for p in model().parameters())
    for zero_mode in ("labkit", "fsdp2"):
        hsdp = run(lab4, dp=4, zero=3, dp_shard=2, zero_mode=zero_mode)
        held = [m["params"] for m in hsdp.metrics["memory_bytes"]]
        # 1/dp_shard of the model a rank: a run of two ranks holds it all (labkit pads the flat
        # shards evenly, FSDP2 cuts each tensor's rows, 37 = 19 + 18), and a rank about half
        assert held[0] + held[1] >= whole and held[2] + held[3] >= whole, (zero_mode, held, whole)
        assert max(held) <= 0.55 * whole, (zero_mode, held, whole)
    kinds = {e["kind"] for e in hsdp.timeline.events if e["stream"] == "comm"}
    assert {"allgather", "reduce_scatter"} <= kinds


def test_tp_across_the_order_equals_one_process(lab4):
    """tp the slowest axis (ranks 0 and 2 split a layer) computes what one process does."""
    result = run(lab4, tp_model, dp=2, tp=2, order="dp,cp,pp,tp")
    assert result.timeline.grid.tp_groups() == [[0, 2], [1, 3]]


def test_hsdp_zero1_and_zero2_equal_one_process(lab4):
    for zero in (1, 2):
        result = run(lab4, dp=4, zero=zero, dp_shard=2)
    # the replicas' all-reduce runs over the other run's rank: ranks 0 and 2 (runs [0, 1], [2, 3])
    names = {e["name"] for e in result.timeline.events if e["stream"] == "comm" and e["kind"] == "allreduce"}
    assert any("over replicas" in n for n in names)
    run(lab4, dp=4, zero=2, dp_shard=2, zero_mode="fsdp2")


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="eight engines need eight cores to finish in time")
def test_hsdp_with_tp_and_pp_equals_one_process():
    from conftest import lab_with
    lab8 = lab_with(8)
    run(lab8, tp_model, dp=4, tp=2, zero=3, dp_shard=2)
    run(lab8, tp_model, dp=4, tp=2, zero=2, dp_shard=2, zero_mode="fsdp2")
    run(lab8, dp=4, pp=2, zero=1, dp_shard=2, microbatches=2)


def test_hsdp_saves_and_resumes_exactly(lab4, tmp_path):
    """A checkpoint from HSDP's ZeRO-3 resumed under HSDP's ZeRO-1: one step each, two in all."""
    common = dict(model=model, data=data, batch=24, lr=0.01, seed=3, optimizer="adamw")
    lab4.run(labkit.Strategy(dp=4, zero=3, dp_shard=2), steps=1, checkpoint=tmp_path, **common)
    resumed = lab4.run(labkit.Strategy(dp=4, zero=1, dp_shard=2), steps=1, resume=tmp_path, **common)
    assert resumed.first_step == 1
    assert resumed.max_diff(reference()) <= 1e-5
