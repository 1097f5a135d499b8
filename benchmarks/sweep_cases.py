"""The hostile sweep's targeted cases on two local engines: outcome, seconds, and whether the
lab still works afterwards (a plain dp=2 run matching the single-process reference).

    OMP_NUM_THREADS=1 python benchmarks/sweep_cases.py          # prints a markdown table

The same cases are tests (tests/test_hostile.py, tests/test_sweep.py, tests/test_lifetime.py);
this script only measures and prints them.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings

import cloudpickle
import torch
from torch import nn

import labkit
from labkit import Strategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])
BATCH = 8


def mlp():
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def rows(n):
    def data(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)
    return data


def narrow(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 1, generator=g)


class Poison(nn.Module):
    def forward(self, x):
        return x * float("nan")


class Pair(nn.Module):
    def forward(self, x):
        return x, x


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x)


def bn_model():
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16))


def sleepy(seconds):
    if int(os.environ["RANK"]) == 1:
        time.sleep(seconds)
    return "awake"


def cases(lab):
    ref = lambda model: labkit.reference(model, batch=BATCH, steps=3)          # noqa: E731
    run = lambda s, model=mlp, **kw: lab.run(s, model=model, batch=BATCH, steps=3, **kw)   # noqa: E731
    dp2 = Strategy(dp=2)

    def stuck():
        with lab.limit(1):
            try:
                lab.apply(sleepy, 4)
            except labkit.LabError:
                pass
        try:
            lab.apply(os.getpid)
        finally:
            time.sleep(4)

    return {
        "data gives 7 rows for batch=8, dp=2": lambda: run(dp2, data=rows(7)),
        "data gives 1 row for batch=8, dp=2": lambda: run(dp2, data=rows(1)),
        "model outputs NaN": lambda: run(dp2, model=lambda: nn.Sequential(nn.Linear(16, 16), Poison()),
                                         data=rows(BATCH)),
        "lr=inf": lambda: run(dp2, lr=math.inf),
        "lr='0.1'": lambda: run(dp2, lr="0.1"),
        "unused parameter, overlap": lambda: f"max_diff {run(Strategy(dp=2, bucket_mb=0.001), model=lambda: nn.Sequential(nn.Linear(16, 16), Branches())).max_diff(ref(lambda: nn.Sequential(nn.Linear(16, 16), Branches()))):.1e}",
        "model without parameters, ddp": lambda: run(Strategy(dp=2, dp_mode="ddp"), model=lambda: nn.Sequential(nn.ReLU())),
        "pipeline stage returns a tuple": lambda: run(Strategy(pp=2, split_at=(2,)),
                                                      model=lambda: nn.Sequential(nn.Linear(16, 16), Pair(), nn.Linear(16, 16))),
        "BatchNorm, dp=2": lambda: f"max_diff {run(dp2, model=bn_model).max_diff(ref(bn_model)):.1e}",
        "BatchNorm, dp=2, sync_batchnorm": lambda: f"max_diff {run(Strategy(dp=2, sync_batchnorm=True), model=bn_model).max_diff(ref(bn_model)):.1e}",
        "(8,1) target vs (8,16) output": lambda: run(dp2, data=narrow),
        "apply(fn, timeout=7)": lambda: lab.apply(lambda timeout: timeout, timeout=7),
        "rank stuck past lab.limit(1), next call": stuck,
        "Strategy(bucket_mb=inf)": lambda: Strategy(bucket_mb=math.inf),
        "Strategy(zero=False)": lambda: Strategy(zero=False),
        "Strategy(chunks=2, schedule='interleaved'), pp=1": lambda: Strategy(chunks=2, schedule="interleaved"),
        "Strategy(dp_mode=np.array(['ddp']))": lambda: Strategy(dp_mode=__import__("numpy").array(["ddp"])),
        "Lab.start(engine=4)": lambda: labkit.Lab.start(engine=4),
        "Lab.start(timeout=0)": lambda: labkit.Lab.start(timeout=0),
        "cli --json /nonexistent/x.json": lambda: labkit.cli.main(["run", "--dp", "2", "--json", "/nonexistent/x.json"]),
    }


def outcome(fn) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
        except Exception as exc:         # the point: which error, how clearly
            text = str(exc).strip().splitlines()
            detail = next((line.strip() for line in text[1:] if line.strip()), "")
            return f"{type(exc).__name__}: {text[0][:90]}" + (f" / {detail[:90]}" if detail else "")
    said = [str(w.message).splitlines()[0][:90] for w in caught]
    shown = value if isinstance(value, (str, int)) else type(value).__name__
    return f"ok ({shown})" + (f"; warns: {said[0]}" if said else "")


def works(lab) -> str:
    try:
        diff = lab.run(Strategy(dp=2), model=mlp, batch=BATCH, steps=2).max_diff(
            labkit.reference(mlp, batch=BATCH, steps=2))
        return "yes" if diff < 1e-5 else f"NO (max_diff {diff:.1e})"
    except Exception as exc:
        return f"NO ({type(exc).__name__})"


def main() -> None:
    import labkit.cli  # noqa: F401

    with labkit.Lab.start(engines=2, timeout=10, progress=False) as lab:
        print("| case | outcome | s | lab works after |\n| --- | --- | --- | --- |")
        for name, fn in cases(lab).items():
            t0 = time.monotonic()
            result = outcome(fn)
            seconds = time.monotonic() - t0
            print(f"| {name} | {result.replace('|', '/')} | {seconds:.2f} | {works(lab)} |", flush=True)


if __name__ == "__main__":
    main()
