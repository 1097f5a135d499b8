"""The communication sweep, measured the way nccl-tests measures them.

    >>> sweep = labkit.bench.comm_sweep(lab)                  # a few seconds on local CPU engines
    >>> print(sweep.table()); sweep.fit(); sweep.plot()
    $ labkit bench comm --engines 4 --max-mb 16 --plot comm.png

For each collective and algorithm and each size S (bytes of the whole buffer, as nccl-tests'
"size" column: the full gathered output for all-gather, the full input for reduce-scatter):

    time    t     seconds per call: the slowest rank's mean over the timed iterations
    algbw   S/t
    busbw   algbw · k, with k = 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
            reduce-scatter, 1 for broadcast and send/recv (nccl-tests, doc/PERFORMANCE.md)

busbw is the rate at which one link moves bytes for a ring algorithm, so it is comparable
across collectives and rank counts, and with the hardware's link bandwidth. The α-β model
fits t = α + S·k/β per series: α the fixed cost of a call (latency), β the bus bandwidth.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..comm import collectives as algos
from .. import comm

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
BUS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}
DEFAULT_SIZES = tuple(4 ** k for k in range(1, 14))              # 4 B … 64 MiB, ×4 apart
DEFAULT_MAX_BYTES = 16 * 2 ** 20


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for ``n`` ranks."""
    if collective not in BUS_FACTORS:
        raise ValueError(f"collective={collective!r} is unknown; use one of {', '.join(COLLECTIVES)}")
    return BUS_FACTORS[collective](n)


# -- on the engines -----------------------------------------------------------------------
def _operation(collective: str, algorithm: str, nbytes: int, n: int, me: int):
    """A zero-argument call doing one ``collective`` of ``nbytes`` (float32) on this rank."""
    numel = max(n, nbytes // 4 // n * n) if collective in ("all_gather", "reduce_scatter") else max(1, nbytes // 4)
    if collective == "all_reduce":
        x = torch.zeros(numel)
        return lambda: algos.all_reduce(x, algorithm, name=algorithm), numel
    if collective == "all_gather":
        out, x = torch.zeros(numel), torch.zeros(numel // n)
        return lambda: comm.all_gather(out, x), numel
    if collective == "reduce_scatter":
        x, out = torch.zeros(numel), torch.zeros(numel // n)
        return lambda: comm.reduce_scatter(out, x), numel
    if collective == "broadcast":
        x = torch.zeros(numel)
        return lambda: comm.broadcast(x, src=0), numel
    if collective == "sendrecv":          # every rank sends to its right and receives from its left
        x, y = torch.zeros(numel), torch.zeros(numel)
        return lambda: algos._exchange(x, (me + 1) % n, y, (me - 1) % n, None, "sendrecv"), numel
    raise ValueError(f"collective={collective!r} is unknown; use one of {', '.join(COLLECTIVES)}")


def _agree(value: float) -> float:
    """The largest ``value`` over all ranks (so every rank runs the same number of iterations)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, op="max", name="bench: agree")
    return float(t)


def sweep_on_engine(series: list[tuple[str, str]], sizes: list[int], seconds_per_point: float = 0.05,
                    max_iters: int = 50) -> list[dict]:
    """This rank's timings for every (collective, algorithm) in ``series`` and size (through lab.apply).

    One warm-up call per point (its time sets the iteration count, agreed over ranks), then
    the timed iterations back to back between two barriers. Recording and the point-to-point
    header check are off meanwhile, as nccl-tests measures the bare transport.
    """
    import torch.distributed as dist

    from ..engine import session

    n, me = dist.get_world_size(), dist.get_rank()
    rec, ctx = session().recorder, comm.context()
    was_recording, was_checking = rec.enabled, ctx.check_p2p
    rec.enabled, ctx.check_p2p = False, False
    rows = []
    try:
        for collective, algorithm in series:
            for nbytes in sizes:
                call, numel = _operation(collective, algorithm, nbytes, n, me)
                t0 = time.perf_counter()
                call()
                warm = _agree(time.perf_counter() - t0)
                iters = max(1, min(max_iters, int(seconds_per_point / max(warm, 1e-6))))
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                rows.append({"collective": collective, "algorithm": algorithm, "n": n, "bytes": numel * 4,
                             "iters": iters, "time_s": (time.perf_counter() - t0) / iters})
    finally:
        rec.enabled, ctx.check_p2p = was_recording, was_checking
    return rows


# -- in the notebook ----------------------------------------------------------------------
@dataclass
class Sweep:
    """Rows of a bandwidth sweep: collective, algorithm, n, bytes, iters, time_s, algbw, busbw (B/s)."""

    rows: list[dict]
    fits: dict = field(default_factory=dict)

    def series(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys((r["collective"], r["algorithm"]) for r in self.rows))

    def select(self, collective: str, algorithm: str = "torch") -> list[dict]:
        return [r for r in self.rows if r["collective"] == collective and r["algorithm"] == algorithm]

    def at(self, collective: str, algorithm: str, nbytes: int) -> dict:
        """The row of ``collective``/``algorithm`` whose size is closest to ``nbytes``."""
        return min(self.select(collective, algorithm), key=lambda r: abs(r["bytes"] - nbytes))

    def fit(self) -> dict:
        """α (s) and β (B/s) per series, fitting t = α + S·k/β; stored in ``fits`` and returned."""
        self.fits = {}
        for key in self.series():
            rows = self.select(*key)
            self.fits[key] = fit_alpha_beta([r["bytes"] * bus_factor(key[0], r["n"]) for r in rows],
                                            [r["time_s"] for r in rows])
        return self.fits

    def table(self) -> str:
        """An nccl-tests-like table: one line per series and size."""
        head = f"{'collective':>14} {'algorithm':>9} {'n':>2} {'size (B)':>10} {'time (us)':>11} " \
               f"{'algbw (GB/s)':>12} {'busbw (GB/s)':>12}"
        lines = [head]
        for r in self.rows:
            lines.append(f"{r['collective']:>14} {r['algorithm']:>9} {r['n']:>2} {r['bytes']:>10} "
                         f"{1e6 * r['time_s']:>11.1f} {r['algbw'] / 1e9:>12.3f} {r['busbw'] / 1e9:>12.3f}")
        for (c, a), (alpha, beta) in (self.fits or self.fit()).items():
            lines.append(f"fit {c}/{a}: alpha = {1e6 * alpha:.1f} us, beta = {beta / 1e9:.3f} GB/s")
        return "\n".join(lines)

    def plot(self, collectives: list[str] | None = None):
        """Time against size (measured points, α-β fit as a line) and busbw against size."""
        import matplotlib.pyplot as plt

        fits = self.fits or self.fit()
        fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
        for i, (c, a) in enumerate(self.series()):
            if collectives and c not in collectives:
                continue
            rows, color, label = self.select(c, a), f"C{i % 10}", f"{c}/{a}"
            sizes = [r["bytes"] for r in rows]
            ax_t.loglog(sizes, [r["time_s"] for r in rows], "o", color=color, ms=4, label=label)
            alpha, beta = fits[(c, a)]
            grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (j / 50) for j in range(51)]
            k = bus_factor(c, rows[0]["n"])
            ax_t.loglog(grid, [alpha + s * k / beta for s in grid], "-", color=color, lw=1, alpha=0.7)
            ax_bw.semilogx(sizes, [r["busbw"] / 1e9 for r in rows], "o-", color=color, ms=4, label=label)
        n = self.rows[0]["n"] if self.rows else 0
        ax_t.set(xlabel="size S (bytes)", ylabel="time per call (s)", title=f"measured (dots) vs α + S·k/β, n={n}")
        ax_bw.set(xlabel="size S (bytes)", ylabel="busbw (GB/s)", title="bus bandwidth (nccl-tests)")
        ax_t.legend(fontsize="x-small")
        ax_bw.legend(fontsize="x-small")
        fig.tight_layout()
        return fig

    def to_dict(self) -> dict:
        return {"rows": self.rows, "fits": {f"{c}/{a}": {"alpha_s": al, "beta_Bps": be}
                                            for (c, a), (al, be) in (self.fits or self.fit()).items()}}


def fit_alpha_beta(bus_bytes: list[float], times: list[float]) -> tuple[float, float]:
    """Least squares for t = α + x/β, weighted by 1/t² (relative error, so small sizes count).

    Returns (α seconds, β bytes/s); α ≥ 0, and β = inf when time does not grow with size.
    """
    if not times:
        return 0.0, math.inf
    w = [1 / t ** 2 for t in times]
    sw = sum(w)
    sx, st = sum(wi * x for wi, x in zip(w, bus_bytes)), sum(wi * t for wi, t in zip(w, times))
    sxx = sum(wi * x * x for wi, x in zip(w, bus_bytes))
    sxt = sum(wi * x * t for wi, x, t in zip(w, bus_bytes, times))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    alpha = (st - slope * sx) / sw
    if alpha < 0:                           # refit through the origin
        alpha, slope = 0.0, (sxt / sxx if sxx > 0 else 0.0)
    return alpha, (1 / slope if slope > 0 else math.inf)


def comm_sweep(lab, sizes=None, collectives=COLLECTIVES, algorithms=("ring", "ps"),
               max_bytes: int = DEFAULT_MAX_BYTES, seconds_per_point: float = 0.05, max_iters: int = 50) -> Sweep:
    """Time every collective in ``collectives`` (torch's) and all-reduce by each of ``algorithms``.

    ``sizes`` defaults to 4 B … ``max_bytes`` in steps of ×4. With the defaults a sweep on 2
    to 4 local CPU engines takes a few seconds.
    """
    sizes = list(sizes) if sizes is not None else [s for s in DEFAULT_SIZES if s <= max_bytes]
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes={sizes!r} must be whole numbers of bytes ≥ 1")
    for c in collectives:
        bus_factor(c, 2)
    for a in algorithms:
        if a not in algos.ALGORITHMS:
            raise ValueError(f"algorithm={a!r} is unknown; use one of {', '.join(algos.ALGORITHMS)}")
    series = []
    for c in collectives:
        series.append((c, "torch"))
        if c == "all_reduce":
            series += [(c, a) for a in algorithms if a != "torch"]
    per_rank = lab.apply(sweep_on_engine, series, sizes, seconds_per_point, max_iters)
    rows = []
    for i, row in enumerate(per_rank[0]):
        row = dict(row, time_s=max(rank_rows[i]["time_s"] for rank_rows in per_rank))
        row["algbw"] = row["bytes"] / row["time_s"]
        row["busbw"] = row["algbw"] * bus_factor(row["collective"], row["n"])
        rows.append(row)
    sweep = Sweep(rows)
    sweep.fit()
    return sweep
