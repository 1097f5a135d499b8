"""The nccl-tests-style sweep, the α-β fit, the CLI entry and the compression trade-off."""
from __future__ import annotations

import json
import math

import pytest

import labkit
from labkit import bench
from labkit.cli import build_parser, main


def test_bus_factors_are_nccl_tests():
    assert bench.bus_factor("all_reduce", 4) == 1.5
    assert bench.bus_factor("all_gather", 4) == bench.bus_factor("reduce_scatter", 4) == 0.75
    assert bench.bus_factor("broadcast", 4) == bench.bus_factor("sendrecv", 4) == 1.0
    with pytest.raises(ValueError, match="all_to_all"):
        bench.bus_factor("all_to_all", 4)


def test_alpha_beta_fit_recovers_the_model():
    sizes = [4 ** k for k in range(2, 12)]
    alpha, beta = 5e-5, 2e9
    assert bench.fit_alpha_beta(sizes, [alpha + s / beta for s in sizes]) == pytest.approx((alpha, beta), rel=1e-6)
    a, b = bench.fit_alpha_beta(sizes, [1e-3] * len(sizes))      # flat: latency only
    assert a == pytest.approx(1e-3) and math.isinf(b)


def test_sweep_rows_and_views(lab2):
    sweep = bench.comm_sweep(lab2, sizes=[64, 65536], seconds_per_point=0.002, max_iters=2)
    assert len(sweep.rows) == (len(bench.COLLECTIVES) + 2) * 2           # + ring and ps all-reduce
    assert [a for c, a in sweep.series() if c == "all_reduce"] == ["torch", "ring", "ps"]
    for r in sweep.rows:
        assert r["n"] == 2 and r["time_s"] > 0 and r["iters"] >= 1
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * bench.bus_factor(r["collective"], 2))
    assert set(sweep.fits) == set(sweep.series())
    assert "busbw (GB/s)" in sweep.table()
    assert len(sweep.plot().axes) == 2
    json.dumps(sweep.to_dict())


def test_sweep_refuses_bad_arguments_before_the_engines(lab2):
    with pytest.raises(ValueError, match="sizes"):
        bench.comm_sweep(lab2, sizes=[0])
    with pytest.raises(ValueError, match="algorithm='tree'"):
        bench.comm_sweep(lab2, algorithms=["tree"])


def test_cli_bench_comm_parses_and_checks():
    args = build_parser().parse_args(["bench", "comm", "--engines", "4", "--max-mb", "2"])
    assert args.func.__name__ == "cmd_bench_comm" and args.engines == 4 and args.max_mb == 2
    assert main(["bench", "comm", "--collectives", "gossip"]) == 2       # refused before any engine starts
    assert main(["bench", "comm", "--engines", "1"]) == 2


def test_compression_tradeoff_rows(lab2):
    rows = bench.compression_tradeoff(lab2, configs=(("none", True), ("int8", False)), steps=3)
    none, int8 = rows
    assert none["param_diff"] == 0 and none["loss_gap"] == [0, 0, 0]
    assert 0 < int8["param_diff"] < 1e-2
    assert 0.24 < int8["bytes_per_step"] / none["bytes_per_step"] < 0.3
    assert len(bench.plot_tradeoff(rows).axes) == 3
