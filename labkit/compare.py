"""Verdicts that know their noise: two setups timed in turn, several times, and a verdict only
when the difference is larger than the machine's run-to-run wobble.

>>> res = labkit.compare(lab, {"bucketed": labkit.Strategy(dp=2, dp_mode="bucketed"),
...                            "overlap": labkit.Strategy(dp=2, dp_mode="overlap")},
...                      repeats=5, model=labkit.models.mlp(width=256, depth=8), batch=1024, steps=4)
>>> res.significant, res.faster, res.verdict
(True, 'overlap', 'overlap 21 % faster than bucketed, 5/5 runs (41.2 ± 0.8 vs 52.3 ± 1.1 ms)')

A laptop that also runs a browser and a video call moves one run's step time by tens of
percent; a single pair of runs can then print either order. Here the two sides run in turn
(a b b a a b …) so that both see the same slow drift of the machine's load, each pair is one
vote, and the verdict says how many votes agreed.

The rule (``Comparison.significant``), for k repeats of each side:

* every one of the k pairs agrees on which side is faster. With no real difference each
  pair's order is a coin toss, so all k agree by chance with probability 2^(1−k): 25 % at
  k = 3, 6 % at k = 5, 0.2 % at k = 10 (the sign test);
* and the medians differ by more than the larger of the two sides' spreads, the spread being
  the median absolute deviation from the side's median (robust to the one run that a
  background job stretched). A difference that every pair shows but that is smaller than
  the machine's typical wobble is real and not worth a lesson.

Both must hold, and k ≥ 3. Otherwise the verdict says "within noise on this machine" with the
vote count, and ``faster`` is None.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Mapping, Sequence

from .analysis.metrics import speedup as _speedup_of
from .config import Strategy

MIN_REPEATS = 3


@dataclass(frozen=True)
class Comparison:
    """Two sides' values (seconds of ``metric`` unless said otherwise), run ``i`` of each side
    taken back to back with the other's run ``i``; ``runs`` keeps what produced them."""

    times: dict[str, list[float]]
    metric: str = "step_time_s"
    runs: dict[str, list] | None = None

    def __post_init__(self):
        if len(self.times) != 2:
            raise ValueError(f"compare: two sides to compare, got {len(self.times)} ({list(self.times)}); "
                             "compare two at a time, e.g. {'bucketed': s1, 'overlap': s2}")
        a, b = (list(v) for v in self.times.values())
        if len(a) != len(b) or not a:
            raise ValueError(f"compare: each side needs the same number of runs (≥ 1), got {len(a)} and {len(b)}")

    @classmethod
    def of(cls, times: Mapping[str, Sequence[float]], metric: str = "step_time_s") -> "Comparison":
        """The verdict on values already measured, e.g. ``{"a": [0.041, ...], "b": [0.052, ...]}``
        with run i of each side taken one after the other."""
        return cls({name: [float(t) for t in values] for name, values in times.items()}, metric)

    @property
    def names(self) -> tuple[str, str]:
        a, b = self.times
        return a, b

    @property
    def repeats(self) -> int:
        return len(next(iter(self.times.values())))

    def median(self, name: str) -> float:
        return median(self.times[name])

    def spread(self, name: str) -> float:
        """Median absolute deviation from the side's median."""
        m = self.median(name)
        return median(abs(t - m) for t in self.times[name])

    def typical(self, name: str):
        """The run of side ``name`` whose value is nearest the side's median: the one to show."""
        values, m = self.times[name], self.median(name)
        i = min(range(len(values)), key=lambda j: abs(values[j] - m))
        return (self.runs or self.times)[name][i]

    @property
    def votes(self) -> dict[str, int]:
        """For each side, the number of pairs in which it was strictly lower (ties count for neither)."""
        a, b = self.names
        pairs = list(zip(self.times[a], self.times[b]))
        return {a: sum(x < y for x, y in pairs), b: sum(y < x for x, y in pairs)}

    @property
    def leader(self) -> str:
        """The side with the lower median (the first named on a tie)."""
        a, b = self.names
        return b if self.median(b) < self.median(a) else a

    @property
    def significant(self) -> bool:
        """Every pair agrees, and the medians differ by more than the larger spread (module docstring)."""
        a, b = self.names
        gap = abs(self.median(a) - self.median(b))
        return (self.repeats >= MIN_REPEATS and self.votes[self.leader] == self.repeats
                and gap > max(self.spread(a), self.spread(b)))

    @property
    def faster(self) -> str | None:
        """The side with the lower value when the difference is significant, else None."""
        return self.leader if self.significant else None

    @property
    def saving(self) -> float:
        """1 − lower median / higher median: the share of the slower side's time the faster saves."""
        slow = max(self.median(n) for n in self.names)
        return 1 - min(self.median(n) for n in self.names) / slow if slow > 0 else 0.0

    @property
    def verdict(self) -> str:
        """One printable line: who is faster (or lower in the metric), by how much and in how
        many runs, or "within noise"."""
        lead = self.leader
        other = next(n for n in self.names if n != lead)
        votes = f"{self.votes[lead]}/{self.repeats}"
        scale, unit = (1e3, " ms") if self.metric.endswith("_s") else (1.0, "")
        numbers = f"({self._shown(lead, scale)} vs {self._shown(other, scale)}{unit})"
        if self.significant:
            return f"{lead} {100 * self.saving:.0f} % {self._better} than {other}, {votes} runs {numbers}"
        return f"within noise on this machine: {lead} ahead in {votes} runs {numbers}"

    @property
    def _better(self) -> str:
        """ "faster" for the step time; "less exposed comm" for a metric "exposed_comm_s"."""
        if self.metric == "step_time_s":
            return "faster"
        return "less " + self.metric.removesuffix("_s").replace("_", " ")

    def _shown(self, name: str, scale: float) -> str:
        return f"{scale * self.median(name):.1f} ± {scale * self.spread(name):.1f}"

    def __repr__(self) -> str:
        return f"Comparison({self.verdict})"


def compare(lab, sides: Mapping[str, object], repeats: int = 5, metric: str = "step_time_s",
            **run_kwargs) -> Comparison:
    """Run two sides ``repeats`` times each, in turn, and judge the difference against the noise.

    ``sides``: ``{"name": side, "other": side}``. A side is a ``labkit.Strategy`` (run with
    ``lab.run(side, **run_kwargs)``: model, batch, steps, …) or a zero-argument callable
    returning a Run, a ``labkit.reference`` result or a number (another link, a one-engine
    baseline, a fabricated time in a test). ``metric``: the ``run.metrics`` key compared, lower
    being better (``step_time_s``: the median over the run's steps of the slowest rank's).

    The order is a b, b a, a b, …: each side goes first as often as the other, so that neither
    gains from what the previous run left warm, and a slow drift of the machine's load touches
    both sides of each pair alike.
    """
    if repeats < 1:
        raise ValueError(f"compare: repeats={repeats}; use repeats ≥ {MIN_REPEATS} (5 is a good default)")
    for name, side in sides.items():
        if not (isinstance(side, Strategy) or callable(side)):
            raise TypeError(f"compare: side {name!r} is a {type(side).__name__}; pass a labkit.Strategy or a "
                            "zero-argument callable returning a run or a number")
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    runs: dict[str, list] = {n: [] for n in names}
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            result = _run_side(lab, sides[name], run_kwargs)
            runs[name].append(result)
            times[name].append(_value(result, metric, name))
    return Comparison(times, metric, runs)


def _run_side(lab, side, run_kwargs):
    if isinstance(side, Strategy):
        if lab is None:
            raise ValueError("compare: a Strategy side needs a lab: labkit.compare(lab, {...})")
        return lab.run(side, **run_kwargs)
    return side()


def _value(result, metric: str, name: str) -> float:
    """The compared number of one run: a number as is, a Run's metric, a reference's step time."""
    if isinstance(result, (int, float)):
        return float(result)
    metrics = getattr(result, "metrics", None)
    if metrics is not None and metric in metrics:
        return float(metrics[metric])
    if metric == "step_time_s" and hasattr(result, "step_time_s"):
        return float(result.step_time_s)
    raise ValueError(f"compare: side {name!r} returned a {type(result).__name__} without {metric!r}; "
                     "return a run, a number, or pass metric= one of run.metrics' keys")


def speedup(baseline: float | Sequence[float] | Comparison, step_time_n: float | Sequence[float] | None = None,
            n: int = 2) -> dict:
    """Strong-scaling speed-up from a repeated one-engine baseline: the ratio of the medians,
    with the lowest and highest ratio over the pairs (run i of each side) beside it.

    ``speedup([t1, t1', t1''], [tn, tn', tn''], n=2)``, or ``speedup(res, n=2)`` on a
    Comparison whose first side is the one-engine run. One timing of each side, which an
    earlier version took, printed a 6.47× speed-up on 2 engines when a background job slowed
    the baseline; the median of several does not move with one such run. The formula is
    labkit.analysis.metrics.speedup's; single numbers are accepted as one run each.
    """
    if isinstance(baseline, Comparison):
        one_name, n_name = baseline.names
        ones, many = baseline.times[one_name], baseline.times[n_name]
    else:
        ones, many = _as_list(baseline), _as_list(step_time_n)
    out = _speedup_of(median(ones), median(many), n)
    ratios = [a / b for a, b in zip(ones, many) if b > 0] or [out["speedup"]]
    return {**out, "low": min(ratios), "high": max(ratios), "runs": min(len(ones), len(many))}


def _as_list(value) -> list[float]:
    if value is None:
        raise ValueError("speedup: pass the n-engine step times too: speedup(one_engine_times, n_engine_times, n=2)")
    return [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]
