"""The public API and the CLI as a careless or hostile user drives them, with no engines.

Every case here is checked before an engine is touched: a bad value raises ValueError (or
TypeError for a wrong kind of object) naming the field and the fix, a misspelt keyword is
refused with the valid ones, a closed lab says so, the caller's RNG is left alone. Hypothesis
draws hostile values (bools, NaN, infinities, huge and tiny numbers, strings, numpy arrays)
for every field; the engine-side sweep is in ``test_sweep.py``. The last section runs, on one
two-engine lab, what used to train a different model with no word (padded tokens, a summed
loss, buffers a forward writes): each is now exact, a warning or an error, checked against
``labkit.reference``.

    python -m pytest -q tests/test_hostile.py
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings

import cloudpickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import labkit
from labkit import cli
from labkit.config import COMPRESSIONS, DP_MODES, SCHEDULES, Strategy
from labkit.parallel.build import RunSpec
from labkit.run.runner import execute, validate

cloudpickle.register_pickle_by_value(sys.modules[__name__])      # engines cannot import this file


class Touched(Exception):
    """Validation passed and something reached for the engines (or started processes)."""


class FakeLab:
    """Looks like a Lab to the run driver; raises Touched at the first engine call."""

    def __init__(self, engines: int = 2):
        self.world_size = engines
        self.ranks = [{"rank": r, "host": "here", "device": "cpu"} for r in range(engines)]
        self._interrupt = False
        self.client = object()

    def apply(self, fn, *args, **kwargs):
        raise Touched(getattr(fn, "__name__", "call"))

    @contextlib.contextmanager
    def hold(self, what):
        yield self

    def ensure_groups(self, *grid):
        raise Touched("ensure_groups")

    def _ready(self):
        pass


HOSTILE = [0, -1, 1, 2, 3, True, False, None, 1.5, math.nan, math.inf, -math.inf, 2 ** 70, 1e-9,
           "2", "1f1b", "overlap", np.array([1, 2]), np.array(["ddp"]), np.int64(2), [1], (1,), object()]
FIELDS = ("dp", "pp", "tp", "zero", "schedule", "microbatches", "chunks", "dp_mode", "bucket_mb",
          "compression", "error_feedback", "split_at")
plain = {"dp": st.sampled_from([1, 2]), "pp": st.sampled_from([1, 2]), "chunks": st.sampled_from([1, 2]),
         "schedule": st.sampled_from(SCHEDULES), "dp_mode": st.sampled_from(DP_MODES),
         "compression": st.sampled_from(COMPRESSIONS), "microbatches": st.sampled_from([1, 2, 4]),
         "bucket_mb": st.sampled_from([0.25, 1.0, 4.0])}
hostile_kwargs = st.fixed_dictionaries({}, optional={
    f: st.one_of(st.sampled_from(HOSTILE), plain.get(f, st.sampled_from(HOSTILE))) for f in FIELDS})


def _assert_sane(s: Strategy) -> None:
    """What an accepted strategy must look like to the engines."""
    for f in ("dp", "pp", "tp", "microbatches", "chunks"):
        value = getattr(s, f)
        assert type(value) is int and value >= 1, (f, value)
    assert type(s.zero) is int
    assert all(type(getattr(s, f)) is str for f in ("schedule", "dp_mode", "compression"))
    assert type(s.bucket_mb) in (int, float) and math.isfinite(s.bucket_mb) and 2 ** -10 <= s.bucket_mb <= 2 ** 20
    if s.pp == 1:
        assert s.chunks == 1 and s.split_at == (), "pipeline settings with pp=1 would be ignored"


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_kwargs)
def test_a_strategy_is_sane_or_a_value_error_names_the_field(kwargs):
    try:
        s = Strategy(**kwargs)
    except ValueError as exc:
        named = [f for f in kwargs if f"Strategy.{f}" in str(exc)]
        assert named, f"{kwargs} → {exc!r} names none of the fields given"
        return
    _assert_sane(s)


@pytest.mark.parametrize("kwargs, field", [
    ({"bucket_mb": math.inf}, "bucket_mb"), ({"bucket_mb": 2 ** 70}, "bucket_mb"),
    ({"bucket_mb": True}, "bucket_mb"), ({"bucket_mb": 1e-9}, "bucket_mb"), ({"zero": False}, "zero"),
    ({"chunks": 2, "schedule": "interleaved"}, "chunks"), ({"split_at": (1,), "chunks": 2, "schedule":
                                                           "interleaved"}, "chunks|split_at"),
    ({"dp_mode": np.array(["ddp"])}, "dp_mode"), ({"schedule": np.array([1, 2])}, "schedule"),
])
def test_the_sweeps_wrong_values_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"Strategy.({field})"):
        Strategy(**kwargs)


# -- run arguments, models, data ----------------------------------------------------------------
def _spec(**kw) -> RunSpec:
    base = dict(strategy=Strategy(dp=2), model=labkit.models.mlp(width=8, depth=2), batch=8, steps=2)
    base.update(kw)
    return RunSpec(**base)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(HOSTILE + [0.1, 1e-3]), st.sampled_from(HOSTILE + [0.0, 0.9]))
def test_lr_and_momentum_are_finite_numbers_or_refused(lr, momentum):
    try:
        execute(FakeLab(), _spec(lr=lr, momentum=momentum))
    except ValueError as exc:
        assert "lr=" in str(exc) or "momentum=" in str(exc), exc
        return
    except Touched:
        pass
    assert type(lr) in (int, float) and math.isfinite(lr) and lr > 0
    assert type(momentum) in (int, float) and math.isfinite(momentum) and momentum >= 0


def test_a_model_without_parameters_is_refused_in_the_notebook():
    for s in (Strategy(dp=2, dp_mode="ddp"), Strategy(dp=2), Strategy(pp=2)):
        with pytest.raises(ValueError, match="no trainable parameters"):
            execute(FakeLab(), _spec(strategy=s, model=lambda: nn.Sequential(nn.ReLU(), nn.Tanh())))


def _bn_model():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))


def test_batch_norm_under_data_parallelism_warns_and_names_the_setting():
    with pytest.warns(UserWarning, match="sync_batchnorm=True"):
        validate(_spec(model=_bn_model), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(_spec(model=_bn_model, strategy=Strategy(dp=2, sync_batchnorm=True)), 2)
        validate(_spec(model=_bn_model, strategy=Strategy(pp=2)), 2)            # one replica: exact
    assert not [w for w in caught if "BatchNorm" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(UserWarning, match="micro-batch"):     # statistics per micro-batch, even synced
        validate(_spec(model=_bn_model, strategy=Strategy(dp=2, sync_batchnorm=True, microbatches=2)), 2)
    with pytest.raises(ValueError, match="Strategy.sync_batchnorm"):
        Strategy(dp=2, sync_batchnorm="yes")


def test_a_run_leaves_the_callers_random_state_alone():
    def draw_after(fn):
        torch.manual_seed(1234)
        fn()
        return torch.rand(4)

    untouched = draw_after(lambda: None)
    assert torch.equal(draw_after(lambda: pytest.raises(Touched, execute, FakeLab(), _spec())), untouched)
    assert torch.equal(draw_after(lambda: labkit.reference(labkit.models.mlp(width=8, depth=2), batch=8,
                                                           steps=1)), untouched)


# -- the lab itself -------------------------------------------------------------------------------
@pytest.fixture
def no_cluster(monkeypatch):
    """Lab.start may check its arguments, but must not start anything."""
    import ipyparallel
    from labkit.session import lab as lab_module

    def refuse(*a, **k):
        raise Touched("a cluster was started")
    monkeypatch.setattr(lab_module.ipp, "Cluster", refuse)
    monkeypatch.setattr(ipyparallel, "Cluster", refuse)


@pytest.mark.parametrize("kwargs, words", [
    ({"engine": 4}, ["engine", "engines"]), ({"timout": 3}, ["timout", "timeout"]),
    ({"engines": True}, ["engines"]), ({"engines": 0}, ["engines"]), ({"engines": 2.0}, ["engines"]),
    ({"timeout": 0}, ["timeout"]), ({"timeout": -1}, ["timeout"]), ({"timeout": math.nan}, ["timeout"]),
    ({"timeout": math.inf}, ["timeout"]), ({"timeout": "3"}, ["timeout"]), ({"timeout": True}, ["timeout"]),
])
def test_lab_start_refuses_bad_keywords_before_starting_anything(no_cluster, kwargs, words):
    with pytest.raises(ValueError) as caught:
        labkit.Lab.start(**kwargs)
    for word in words:
        assert word in str(caught.value)


def test_lab_start_accepts_real_cluster_settings(no_cluster):
    with pytest.raises(Touched):           # got as far as starting the cluster
        labkit.Lab.start(engines=2, timeout=5, delay=0)


def test_more_engines_than_the_machine_holds_warns():
    from labkit.session.checks import check_capacity

    with pytest.warns(UserWarning, match="memory"):
        check_capacity(64, cpus=2, memory_bytes=8 * 2 ** 30)
    with pytest.warns(UserWarning, match="cores"):
        check_capacity(64, cpus=2, memory_bytes=2 ** 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_capacity(2, cpus=2, memory_bytes=8 * 2 ** 30)
    assert not caught


@pytest.mark.parametrize("method, args", [("run", (Strategy(dp=2),)), ("apply", (print,)),
                                          ("trace", (print,)), ("recover", ())])
def test_a_closed_lab_says_so(method, args):
    lab = labkit.Lab(None, None, 5.0)
    lab.ranks = [{"rank": 0}, {"rank": 1}]
    kwargs = {"model": labkit.models.mlp(width=8, depth=2), "batch": 8} if method == "run" else {}
    with pytest.raises(labkit.LabError, match="the lab is closed"):
        getattr(lab, method)(*args, **kwargs)


# -- the command line -----------------------------------------------------------------------------
@pytest.fixture
def no_lab(monkeypatch):
    def refuse(*a, **k):
        raise Touched("Lab.start")
    monkeypatch.setattr(labkit.Lab, "start", refuse)


@pytest.mark.parametrize("argv, word", [
    (["--engines", "0"], "--engines"), (["--engines", "-2"], "--engines"),
    (["--json", "/nonexistent/dir/run.json"], "--json"), (["--trace", "/nonexistent/t.json"], "--trace"),
    (["--plot", "/"], "--plot"), (["--bucket-mb", "inf"], "bucket_mb"), (["--timeout", "0"], "--timeout"),
])
def test_cli_checks_everything_before_the_run(no_lab, capsys, argv, word):
    assert cli.main(["run", "--dp", "2", "--width", "8", "--depth", "2", "--batch", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err


def test_cli_reports_a_lab_error_as_one_message(monkeypatch, capsys):
    def fail(*a, **k):
        raise labkit.LabError("run_step: failed on rank(s) [1]")
    monkeypatch.setattr(labkit.Lab, "start", fail)
    assert cli.main(["run", "--dp", "2", "--width", "8", "--depth", "2", "--batch", "8"]) == 1
    err = capsys.readouterr().err
    assert "failed on rank(s) [1]" in err and "Traceback" not in err


def test_cli_ctrl_c_prints_one_line(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(labkit.Lab, "start", interrupted)
    assert cli.main(["run", "--dp", "2", "--width", "8", "--depth", "2", "--batch", "8"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err


# -- the dashboard ----------------------------------------------------------------------------------
def test_dashboard_set_with_a_value_the_control_does_not_offer():
    from labkit.widgets import Dashboard

    class NoEngines:
        world_size, ranks = 2, []

    dash = Dashboard(NoEngines(), model=labkit.models.mlp(width=8, depth=2), batch=8, auto=False, plot="image")
    with pytest.raises(ValueError, match=r"dp=3.*1, 2"):
        dash.set(dp=3)
    with pytest.raises(ValueError, match="microbatches=100"):
        dash.set(microbatches=100)               # a slider would clamp it silently to its maximum
    with pytest.raises(ValueError, match="dp_mode='fast'"):
        dash.set(dp_mode="fast")
    assert dash.controls["dp"].value == 2 and dash.controls["microbatches"].value == 1
    dash.close()


# -- random bad models and data (pure: the checks that run before or at the first step) ---------
BAD_MODELS = {
    "no parameters": lambda: nn.Sequential(nn.ReLU()),
    "frozen": lambda: nn.Sequential(nn.Linear(8, 8).requires_grad_(False)),
    "not a Sequential": lambda: nn.Linear(8, 8),     # any nn.Module runs with pp=1; pipelines refuse it
    "batch norm": _bn_model,
    "returns None": lambda: None,
    "fine": labkit.models.mlp(width=8, depth=4),
}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(BAD_MODELS)), st.sampled_from([Strategy(dp=2), Strategy(pp=2),
                                                            Strategy(dp=2, dp_mode="ddp", microbatches=2)]))
def test_a_bad_model_is_refused_by_name_or_runs(name, strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate(_spec(model=BAD_MODELS[name], strategy=strategy), 2)
        except (ValueError, TypeError) as exc:
            assert name != "fine", exc
            assert "model" in str(exc), exc
            return
    assert name in ("fine", "batch norm") or (name == "not a Sequential" and strategy.pp == 1)


def _t(*shape):
    return torch.zeros(*shape)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.sampled_from([(_t(8, 4), _t(8, 4)), (_t(7, 4), _t(7, 4)), (_t(8, 4), _t(7, 4)), (_t(0, 4), _t(0, 4)),
                        _t(8, 4), [_t(8, 4)], (_t(8, 4), _t(8, 4), _t(8, 4)), None, (1, 2), ([0.0] * 8, _t(8)),
                        (_t(8), _t(8)), (torch.tensor(1.0), torch.tensor(1.0))]), st.integers(0, 3))
def test_data_gives_the_whole_batch_or_a_value_error_naming_the_step(out, step):
    from labkit.parallel.build import global_batch

    try:
        x, y = global_batch(lambda s: out, step, 8)
    except ValueError as exc:
        assert f"step {step}" in str(exc) and "batch" in str(exc), exc
        return
    assert x.shape[0] == 8 and y.shape[0] == 8


# -- the loss contract, checked in the notebook ---------------------------------------------------
def _pairs(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    return x, x.flip(1)


@pytest.mark.parametrize("loss, error, words", [
    (lambda o, y: ((o - y) ** 2).sum(), ValueError, [".mean()", 'reduction="mean"', "SUM"]),
    (lambda o, y: nn.functional.mse_loss(o, y, reduction="sum"), ValueError, [".mean()"]),
    (lambda o, y: float(((o - y) ** 2).mean()), TypeError, ["float", "scalar tensor"]),
    (lambda o, y: ((o - y) ** 2).mean(1), TypeError, ["shape (2,)", ".mean()"]),
])
def test_a_loss_that_is_not_a_mean_over_the_rows_is_refused_before_the_engines(loss, error, words):
    with pytest.raises(error) as caught:
        execute(FakeLab(), _spec(model=lambda: nn.Linear(8, 8), data=_pairs, loss=loss))
    for word in words:
        assert word in str(caught.value), caught.value
    with pytest.raises(Touched):            # a mean (and the built-ins) pass
        execute(FakeLab(), _spec(model=lambda: nn.Linear(8, 8), data=_pairs, loss=lambda o, y: ((o - y) ** 2).mean()))
    # a tuple or a Hugging Face-like dict output is checked too (its tensors made on the meta device)
    with pytest.raises(error):
        execute(FakeLab(), _spec(model=lambda: Wrapped(tuple), data=_pairs, loss=lambda o, y: loss(o[0], y)))
    with pytest.raises(error):
        execute(FakeLab(), _spec(model=lambda: Wrapped(dict), data=_pairs, loss=lambda o, y: loss(o["logits"], y)))


class Wrapped(nn.Module):
    """A Linear whose output comes in a tuple or a dict (``logits``, a scalar ``aux_loss``)."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(8, 8), kind

    def forward(self, x):
        out = self.lin(x)
        return (out, out.sum()) if self.kind is tuple else {"logits": out, "aux_loss": out.sum() * 0}


def test_dropout_under_a_split_run_is_warned_about():
    drop = lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8))     # noqa: E731
    with pytest.warns(UserWarning, match=r"dropout layer\(s\) with p > 0 \(1\).*own masks"):
        validate(_spec(model=drop), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(_spec(model=lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0))), 2)
    assert not [w for w in caught if "dropout" in str(w.message)]


def test_a_generator_as_data_is_a_type_error_naming_the_fix():
    with pytest.raises(TypeError, match=r"callable data\(step\) -> \(x, y\), got a generator.*batches"):
        execute(FakeLab(), _spec(data=(_pairs(i) for i in range(3))))


def test_tp_without_a_plan_suggests_the_models_own_layers(no_lab, capsys):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.head = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.head(self.down(torch.relu(self.up(x))))

    with pytest.raises(ValueError, match=r"'up': 'colwise', 'down': 'rowwise'") as caught:
        validate(_spec(model=Net, strategy=Strategy(tp=2)), 2)
    assert "blocks" not in str(caught.value)
    # the command line's MLP gets the plan built from its layers: validation passes, the lab is next
    with pytest.raises(Touched):
        cli.main(["run", "--tp", "2", "--width", "8", "--depth", "4", "--batch", "8"])
    assert cli.main(["run", "--tp", "2", "--width", "8", "--depth", "1", "--batch", "8"]) == 2
    assert "--depth 2 or more" in capsys.readouterr().err


# -- what used to depart from one process with no word, on two engines ---------------------------
V, T = 11, 6


def padded(step):
    """Token ids with padding (-100) spread unevenly: rows 0–2 all padding (replica 0 mostly
    padding; with 4 micro-batches of the 8 rows, micro-batch 0 is all padding), row 3 half."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, V, (8, T), generator=g), torch.randint(0, V, (8, T), generator=g)
    y[:3] = -100
    y[3, :4] = -100
    return x, y


class EMA(nn.Module):
    """Subtracts a running mean of its hidden layer that forward updates (a buffer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        h = self.lin(x)
        self.avg.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h - self.avg


class Counter(nn.Module):
    """Scales by how many forwards it has seen."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.lin(x) * self.n


class Pair(nn.Module):
    """Returns a tuple; its forward reads a value, so the notebook's check (on the meta device)
    cannot run it and the loss contract is left to labkit.drift."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) if float(x.abs().max()) < 1e9 else x,)


class Keywords(nn.Module):
    """Takes a dict of inputs, as Hugging Face models take keyword tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, batch):
        return self.lin(batch["a"]) + batch["b"]


def _keywords(step):
    x, y = _pairs(step)
    return {"a": x, "b": y}, y


def _run(lab, strategy, model, **kw):
    kw = {"batch": 8, "steps": 2, "lr": 0.3, **kw}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = lab.run(strategy, model=model, **kw)
    ref = labkit.reference(model, **{k: v for k, v in kw.items() if k != "tp_plan"})
    return run, ref, [str(w.message) for w in caught]


def test_padded_tokens_are_normalised_by_the_global_count(lab2):
    gpt = labkit.models.gpt(vocab_size=V, n_embd=16, n_layer=2, n_head=2, block_size=T, tie=False)
    moe = labkit.models.llama(n_layer=2, n_head=2, n_embd=16, block_size=T, vocab_size=V, n_experts=2, top_k=1)
    for strategy, model in [(Strategy(dp=2), gpt), (Strategy(pp=2, microbatches=4), gpt), (Strategy(tp=2), gpt),
                            (Strategy(dp=2, zero=3), gpt), (Strategy(dp=2, ep=2, microbatches=2), moe)]:
        run, ref, _ = _run(lab2, strategy, model, data=padded, loss="cross_entropy")
        assert run.max_diff(ref) < 1e-5, (strategy, run.max_diff(ref))
        assert all(math.isfinite(v) for v in run.losses), run.losses        # an all-padding micro-batch: 0
        assert run.losses == pytest.approx(ref.losses, rel=1e-5), (strategy, run.losses, ref.losses)
    # a custom token loss opts in the same way
    loss = labkit.losses.token_loss(lambda p, y: nn.functional.cross_entropy(
        p.flatten(0, 1), y.flatten(), reduction="sum"))
    run, ref, _ = _run(lab2, Strategy(dp=2), gpt, data=padded, loss=loss)
    assert run.max_diff(ref) < 1e-5


def test_buffers_a_forward_writes_are_warned_about_and_named_by_drift(lab2):
    run, ref, said = _run(lab2, Strategy(dp=2), EMA, data=_pairs, snapshots=True)
    assert run.max_diff(ref) > 1e-3                  # the departure is real (9e-2 measured) …
    assert any("writes 1 buffer(s) (avg)" in w and "dp=2" in w for w in said), said      # … and said
    assert "replicas' buffers differ" in str(labkit.drift(run, ref))
    run, ref, said = _run(lab2, Strategy(dp=2, microbatches=2), Counter, data=_pairs, snapshots=True)
    assert any("once per micro-batch" in w for w in said), said
    assert "the buffer 'n'" in str(labkit.drift(run, ref))
    run, ref, said = _run(lab2, Strategy(dp=2), lambda: nn.Linear(8, 8), data=_pairs)     # no buffer: exact
    assert run.max_diff(ref) < 1e-5 and not [w for w in said if "buffer" in w]


def test_a_summed_loss_the_notebook_cannot_check_is_named_by_drift(lab2):
    summed = lambda o, y: ((o[0] - y) ** 2).sum()                      # noqa: E731
    run, ref, _ = _run(lab2, Strategy(dp=2), Pair, data=_pairs, loss=summed, lr=0.01, snapshots=True)
    found = labkit.drift(run, ref)
    assert found.kind == "reduction" and "0.5×" in str(found) and ".mean()" in str(found), found
    with pytest.raises(labkit.LabError, match=r"step 0: the loss returned a float.*\.mean\(\)"):
        lab2.run(Strategy(dp=2), model=Pair, data=_pairs, batch=8, steps=1,
                 loss=lambda o, y: float(((o[0] - y) ** 2).mean()))


def test_dict_inputs_and_the_mlps_own_tp_plan_equal_one_process(lab2):
    for strategy in (Strategy(dp=2), Strategy(dp=2, microbatches=2)):
        run, ref, _ = _run(lab2, strategy, Keywords, data=_keywords)
        assert run.max_diff(ref) < 1e-5
    from labkit.parallel.tensor.plan import suggest_plan
    mlp = labkit.models.mlp(width=8, depth=4)
    run, ref, _ = _run(lab2, Strategy(tp=2), mlp, tp_plan=suggest_plan(mlp()))
    assert run.max_diff(ref) < 1e-5
