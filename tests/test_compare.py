"""labkit.compare: the verdict rule on fabricated timings (no timing asserted), the run order,
what a side may be, and one small real comparison on two engines."""
from __future__ import annotations

import pytest

import labkit
from labkit.compare import Comparison

CLEAR = {"bucketed": [0.052, 0.051, 0.055, 0.053, 0.052], "overlap": [0.041, 0.042, 0.040, 0.043, 0.041]}


def test_a_difference_every_pair_shows_and_larger_than_the_spread_is_a_verdict():
    res = Comparison.of(CLEAR)
    assert res.significant and res.faster == "overlap"
    assert res.votes == {"bucketed": 0, "overlap": 5}
    assert res.median("overlap") == pytest.approx(0.041) and res.spread("overlap") == pytest.approx(0.001)
    assert res.saving == pytest.approx(1 - 0.041 / 0.052)
    assert res.verdict == "overlap 21 % faster than bucketed, 5/5 runs (41.0 ± 1.0 vs 52.0 ± 1.0 ms)"


def test_pairs_that_disagree_are_within_noise():
    res = Comparison.of({"a": [0.052, 0.041, 0.055, 0.043, 0.052], "b": [0.041, 0.052, 0.040, 0.053, 0.041]})
    assert not res.significant and res.faster is None
    assert res.votes == {"a": 2, "b": 3}
    assert res.verdict.startswith("within noise on this machine: b ahead in 3/5 runs")


def test_every_pair_agreeing_on_a_gap_smaller_than_the_wobble_is_within_noise():
    """b is lower in each pair, by 1 ms, while each side wanders by 10 ms from run to run."""
    a = [0.050, 0.070, 0.040, 0.060, 0.080]
    res = Comparison.of({"a": a, "b": [t - 0.001 for t in a]})
    assert res.votes["b"] == 5 and res.spread("a") == pytest.approx(0.010)
    assert not res.significant and res.faster is None


def test_one_outlier_does_not_decide_the_spread():
    """A background job stretching one run moves the range, not the median absolute deviation."""
    res = Comparison.of({"a": [0.052, 0.051, 0.200, 0.053, 0.052], "b": [0.041, 0.042, 0.040, 0.043, 0.041]})
    assert res.spread("a") == pytest.approx(0.001) and res.faster == "b"


@pytest.mark.parametrize("k", [1, 2])
def test_fewer_than_three_pairs_never_give_a_verdict(k):
    res = Comparison.of({name: t[:k] for name, t in CLEAR.items()})
    assert res.votes["overlap"] == k and not res.significant


def test_sides_run_in_turn_each_going_first_as_often():
    order = []

    def side(name, t):
        def run():
            order.append(name)
            return t
        return run
    res = labkit.compare(None, {"a": side("a", 2.0), "b": side("b", 1.0)}, repeats=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert res.times == {"a": [2.0] * 4, "b": [1.0] * 4} and res.runs["a"] == [2.0] * 4
    assert res.faster == "b"


def test_a_side_may_return_a_run_a_reference_or_a_number():
    class FakeRun:
        def __init__(self, t):
            self.metrics = {"step_time_s": t, "bubble_fraction": t / 10}

    class FakeReference:
        step_time_s = 0.5
    res = labkit.compare(None, {"run": lambda: FakeRun(0.2), "ref": FakeReference}, repeats=3)
    assert res.times == {"run": [0.2] * 3, "ref": [0.5] * 3}
    res = labkit.compare(None, {"x": lambda: FakeRun(0.2), "y": lambda: FakeRun(0.3)}, repeats=3,
                         metric="bubble_fraction")
    assert res.times["x"] == [pytest.approx(0.02)] * 3 and "ms" not in res.verdict
    assert res.verdict.startswith("x 33 % less bubble fraction than y, 3/3 runs")


def test_bad_sides_are_named_with_the_fix():
    with pytest.raises(ValueError, match="two sides"):
        Comparison.of({"a": [1.0], "b": [1.0], "c": [1.0]})
    with pytest.raises(TypeError, match="side 'b' is a str"):
        labkit.compare(None, {"a": lambda: 1.0, "b": "overlap"})
    with pytest.raises(ValueError, match="needs a lab"):
        labkit.compare(None, {"a": labkit.Strategy(dp=2), "b": lambda: 1.0})
    with pytest.raises(ValueError, match="without 'nope'"):
        labkit.compare(None, {"a": lambda: 1.0, "b": object}, metric="nope")
    with pytest.raises(ValueError, match="repeats"):
        labkit.compare(None, {"a": lambda: 1.0, "b": lambda: 1.0}, repeats=0)


def test_speedup_takes_the_median_of_a_repeated_baseline():
    """One stretched baseline run (what printed 6.47× on 2 engines) does not move the median."""
    s = labkit.speedup([1.0, 3.2, 1.0, 1.1, 0.9], [0.5, 0.5, 0.55, 0.5, 0.45], n=2)
    assert s["speedup"] == pytest.approx(2.0) and s["scaling_efficiency"] == pytest.approx(1.0)
    assert s["low"] == pytest.approx(1.0 / 0.55) and s["high"] == pytest.approx(6.4) and s["runs"] == 5
    res = Comparison.of({"1 engine": [1.0, 1.2, 1.1], "dp=2": [0.6, 0.6, 0.55]})
    assert labkit.speedup(res, n=2)["speedup"] == pytest.approx(1.1 / 0.6)
    assert labkit.speedup(8.0, 2.5, n=4)["speedup"] == pytest.approx(3.2)


def test_a_real_comparison_on_two_engines(lab2):
    """Two strategies, three runs each, on the lab: every run is kept, the values are the
    runs' own step times, and the verdict is consistent with itself (which side wins is not
    asserted: that is timing)."""
    model = labkit.models.mlp(width=32, depth=2)
    res = labkit.compare(lab2, {"naive": labkit.Strategy(dp=2, dp_mode="naive"),
                                "bucketed": labkit.Strategy(dp=2, dp_mode="bucketed")},
                         repeats=3, model=model, batch=32, steps=3)
    assert [len(res.runs[n]) for n in res.names] == [3, 3]
    for name in res.names:
        assert res.times[name] == [r.metrics["step_time_s"] for r in res.runs[name]]
        assert all(r.strategy.dp_mode == name for r in res.runs[name])
    assert res.faster in (None, *res.names) and (res.faster is not None) == res.significant
    assert res.verdict.startswith(f"{res.faster} ") if res.significant else "within noise" in res.verdict
    ref = labkit.reference(model, batch=32, steps=3)
    assert max(r.max_diff(ref) for rs in res.runs.values() for r in rs) < 1e-5


def test_the_typical_run_is_the_one_nearest_the_median():
    runs = iter(["slow", "fast", "middle", "x", "y", "z"])
    values = iter([3.0, 9.0, 1.0, 9.0, 2.0, 5.0])

    class R:
        def __init__(self):
            self.name, self.metrics = next(runs), {"step_time_s": next(values)}
    res = labkit.compare(None, {"a": R, "b": R}, repeats=3)
    assert [r.name for r in res.runs["a"]] == ["slow", "x", "y"]        # a b, b a, a b
    assert res.typical("a").name == "slow" and res.typical("b").name == "z" and Comparison.of({"a": [3, 1, 2], "b": [1, 1, 1]}).typical("a") == 2.0
