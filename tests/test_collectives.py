"""The teaching all-reduces (ring, parameter server) against torch's, on real engines."""
from __future__ import annotations

import pytest
import torch

from labkit import collectives

SIZES = (1, 5, 1001)          # fewer elements than ranks, and sizes no rank count divides


@pytest.mark.parametrize("algorithm", collectives.ALGORITHMS)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_exact_on_integers_and_close_on_floats(lab4, algorithm, ranks):
    for numel in SIZES:
        results = [r for r in lab4.apply(collectives.demo, algorithm, numel, ranks) if r["member"]]
        assert len(results) == ranks
        assert all(r["equal_to_torch"] for r in results), (numel, results)
        assert [r["bytes"] for r in results] == collectives.bytes_per_rank(algorithm, numel, ranks)
    floats = [r for r in lab4.apply(collectives.demo, algorithm, 1001, ranks, values="float") if r["member"]]
    assert max(r["max_diff_vs_torch"] for r in floats) <= 1e-5 * ranks


def test_each_step_is_on_the_timeline(lab4):
    ring = lab4.apply(collectives.demo, "ring", 1001, 4, check=False)
    for r in ring:
        sends = [e for e in r["events"] if e["kind"] == "send"]
        assert len(sends) == 2 * (4 - 1)                          # 3 reduce-scatter + 3 all-gather steps
        assert {e["peer"] for e in sends} == {(r["rank"] + 1) % 4}
        assert sum(e["name"].startswith("ring RS") for e in sends) == 3
    ps = lab4.apply(collectives.demo, "ps", 1001, 4, check=False)
    server_sends = [e for e in ps[0]["events"] if e["kind"] == "send"]
    assert sorted(e["peer"] for e in server_sends) == [1, 2, 3]
    assert all(len([e for e in r["events"] if e["kind"] == "send"]) == 1 for r in ps[1:])


def test_bytes_per_rank_model():
    s = 1000
    assert sum(collectives.bytes_per_rank("ring", s, 4)) == 2 * 3 * s * 4      # each chunk: 2(n-1) hops
    assert collectives.bytes_per_rank("ps", s, 4) == [3 * 4 * s, 4 * s, 4 * s, 4 * s]
    assert collectives.predict("ps", 1e6, 4, 0.0, 1e9) > collectives.predict("ring", 1e6, 4, 0.0, 1e9)
    assert collectives.predict("ring", 1e6, 2, 1e-4, 1e9) == pytest.approx(2e-4 + 1e-3)


def test_chunk_bounds_cover_uneven_sizes():
    assert collectives.chunk_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert collectives.chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("algorithm", ["ring", "ps", "torch"])
def test_bad_tensors_are_refused_before_any_message(algorithm):
    with pytest.raises(ValueError, match="non-empty"):
        collectives.all_reduce(torch.empty(0), algorithm)
    with pytest.raises(ValueError, match="contiguous"):
        collectives.all_reduce(torch.zeros(4, 3).t(), algorithm)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="'ring', 'ps', 'torch'"):
        collectives.all_reduce(torch.zeros(3), "tree")


def test_gather_and_scatter_use_torchs_current_names(lab2):
    """torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor with a FutureWarning
    per call: a learner sees none from labkit's own calls."""
    def gather_and_scatter():
        import warnings

        import torch
        import labkit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rank = labkit.engine.session().rank
            gathered = torch.zeros(4)
            labkit.comm.all_gather(gathered, torch.full((2,), float(rank)))
            scattered = torch.zeros(2)
            labkit.comm.reduce_scatter(scattered, torch.arange(4.0))
        return gathered.tolist(), scattered.tolist(), [str(w.message) for w in caught
                                                        if issubclass(w.category, FutureWarning)]

    for rank, (gathered, scattered, warned) in enumerate(lab2.apply(gather_and_scatter)):
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert scattered == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert warned == []
