"""No silent wrong results: the exactness check reads every rank's copy, and a model a user
writes that labkit would train differently from one process is made exact, refused before the
engines with the fix, or warned about."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import labkit
from labkit.parallel.build import RunSpec
from labkit.parallel.data import SyncFault, sync_fault
from labkit.run.runner import validate

SETUP = dict(batch=16, steps=4, lr=0.1, seed=0)


# -- 1. the check reads every replica ------------------------------------------------------------
@pytest.mark.slow
def test_max_diff_reads_every_replica_and_names_the_one_that_departs(lab2):
    model = labkit.models.mlp(width=48, depth=3)
    bucketed = labkit.Strategy(dp=2, dp_mode="bucketed", bucket_mb=0.004)
    ref = labkit.reference(model, **SETUP)
    with sync_fault(lab2, SyncFault("skip", bucket=0, rank=1, from_step=2)):
        broken = lab2.run(bucketed, model=model, **SETUP)
    diff = broken.max_diff(ref)
    assert diff > 1e-5 and diff.rank == 1 and diff.parameter in ("4.weight", "4.bias")
    assert "rank 1 departs" in repr(diff)
    assert set(broken.copies) == {1}
    healthy = lab2.run(bucketed, model=model, **SETUP)
    assert healthy.max_diff(ref) < 1e-5 and healthy.copies == {}
    assert repr(healthy.max_diff(ref)) == repr(float(healthy.max_diff(ref)))


@pytest.mark.slow
def test_drift_reads_every_rank_copy_under_zero_and_pipelines(lab2):
    model = labkit.models.mlp(width=16, depth=4)
    kw = dict(batch=16, steps=2, lr=0.1, seed=0, snapshots=True)
    ref = labkit.reference(model, **kw)
    for s in (labkit.Strategy(dp=2, zero=1), labkit.Strategy(dp=2, zero=3), labkit.Strategy(pp=2)):
        run = lab2.run(s, model=model, **kw)
        assert labkit.drift(run, ref) is None, s.label()
        held = {rank: set(snap["params"]) for rank, snap in run.snapshots[-1].items()}
        if s.zero:              # every replica's whole copy, its shards gathered
            assert held[0] == held[1] == set(ref.snapshots[-1][0]["params"])
        else:                   # each stage's own
            assert held[0] | held[1] == set(ref.snapshots[-1][0]["params"]) and not held[0] & held[1]


# -- the tolerance: float32 noise, measured against the same run in float64 --------------------------
@pytest.mark.slow
def test_cp_with_adamw_differs_from_one_process_by_float32_noise_alone(lab2):
    """AdamW divides a gradient below its eps by eps: rounding comes out lr-sized. One process in
    float32 is itself that far from float64, and cp no farther; a 10 % change of lr is not noise."""
    data = labkit.data.text(batch=8, block_size=16)
    model = labkit.models.llama(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=data.vocab_size,
                                n_kv_heads=2)
    kw = dict(data=data, loss="cross_entropy", batch=8, steps=2, lr=0.01, seed=0, optimizer="adamw")
    ref = labkit.reference(model, **kw)
    assert ref.float_noise() > 1e-5 and ref.tolerance == 2 * ref.float_noise()
    assert lab2.run(labkit.Strategy(cp=2), model=model, **kw).max_diff(ref) <= ref.tolerance
    nudged = labkit.reference(model, **{**kw, "lr": 0.011}).parameters()
    assert max((nudged[k] - v).abs().max().item() for k, v in ref.parameters().items()) > ref.tolerance


def test_with_sgd_the_tolerance_stays_the_float32_one():
    ref = labkit.reference(labkit.models.mlp(width=16, depth=3), **SETUP)
    assert ref.float_noise() < 1e-6 and ref.tolerance == 1e-5
    assert torch.get_default_dtype() == torch.float32          # the float64 twin leaves it as it was


def refused(strategy, model, data=None, loss="mse", match="", batch=8, **extra):
    """``lab.run``'s checks, as they run before any engine is called."""
    with pytest.raises((ValueError, TypeError), match=match):
        validate(RunSpec(strategy, model, data, loss, batch=batch, extra=extra), strategy.world_size)


# -- 2. cp, unbalanced, on a sequence 2·cp does not divide ---------------------------------------
@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_unbalanced_cp_on_a_sequence_that_leaves_tokens_out_is_refused(mode):
    data = labkit.data.text(batch=8, block_size=6)
    model = labkit.models.llama(n_layer=1, n_head=2, n_kv_heads=2, n_embd=16, block_size=6, vocab_size=data.vocab_size)
    refused(labkit.Strategy(cp=2, cp_mode=mode, cp_balance=False), model, data, "cross_entropy",
            match="6 tokens does not cut into cp = 2 slices of two equal chunks .* multiple of 4")


# -- 3. pp > 1 and arithmetic in a user's forward --------------------------------------------------
class ScaledEmbedding(nn.Module):
    """Gemma's embedding ×√d, written in forward between modules."""

    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.d = d

    def forward(self, x):
        h = self.emb(x) * self.d ** 0.5
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class SoftCapped(ScaledEmbedding):
    """Gemma 2's logits soft-capped in forward."""

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return 5.0 * torch.tanh(self.head(h) / 5.0)


class Chain(ScaledEmbedding):
    """The same modules called in order: what the stages compute."""

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Pooled(nn.Module):
    """A classifier that mean-pools the sequence before its head."""

    def __init__(self, vocab=32, d=16, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h.mean(dim=1))


def tokens(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 32, (8, 6), generator=g)
    return x, torch.roll(x, 1, dims=1)


def classes(step):
    x, _ = tokens(step)
    return x, x[:, 0] % 3


@pytest.mark.parametrize("model, data, match", [
    (ScaledEmbedding, tokens, "differs from ScaledEmbedding.forward by"),
    (SoftCapped, tokens, "differs from SoftCapped.forward by"),
    (Pooled, classes, "gives shape \\(1, 6, 3\\) on the first batch where Pooled.forward gives \\(1, 3\\)"),
])
def test_pp_refuses_a_forward_that_computes_between_its_modules(model, data, match):
    refused(labkit.Strategy(pp=2), model, data, "cross_entropy", match=match + ".*pp_plan")


@pytest.mark.slow
def test_pp_runs_a_forward_that_is_the_chain_exactly(lab2):
    kw = dict(data=tokens, loss="cross_entropy", batch=8, steps=2, lr=0.1, seed=0)
    run = lab2.run(labkit.Strategy(pp=2, microbatches=2), model=Chain, **kw)
    assert run.max_diff(labkit.reference(Chain, **kw)) < 1e-5


# -- 4. AdamW and a parameter that got no gradient -------------------------------------------------
class Routed(nn.Module):
    """Rows flagged in their last feature go through ``b`` (only some steps, only some rows);
    ``spare`` is never called: one process's AdamW skips them when backward does not reach them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h, flagged = x[:, :8], x[:, 8] > 0
        out = self.a(h)
        if flagged.any():
            out = out.index_put((flagged.nonzero(as_tuple=True)[0],), self.b(h[flagged]))
        return self.head(torch.tanh(out))


def routed_data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.cat([torch.randn(16, 8, generator=g), torch.zeros(16, 1)], dim=1)
    if step % 2:
        x[:4, 8] = 1.0               # odd steps: the first rows only (one replica's share)
    return x, torch.randn(16, 2, generator=g)


def routed_everywhere(step):
    x, y = routed_data(step)
    x[::2, 8] = float(step % 2)      # odd steps: rows on every replica
    return x, y


class RoutedStack(Routed):
    """Routed with repeated blocks, for ZeRO-3 (which shards block by block)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h, flagged = x[:, :8], x[:, 8] > 0
        for block in self.blocks:
            h = block(h)
        if flagged.any():
            h = h.index_put((flagged.nonzero(as_tuple=True)[0],), self.b(h[flagged]))
        return self.head(torch.tanh(self.a(h)))


@pytest.mark.slow
def test_adamw_skips_what_backward_never_reached_in_every_dp_mode_and_zero(lab2):
    kw = dict(data=routed_data, batch=16, steps=4, lr=0.05, seed=0, optimizer="adamw")
    ref = labkit.reference(Routed, **kw)
    torch.manual_seed(0)
    start = Routed()
    assert torch.equal(ref.parameters()["spare.weight"], start.spare.weight)     # one process: never moved
    for s in (labkit.Strategy(dp=2, dp_mode="naive"), labkit.Strategy(dp=2, dp_mode="overlap"),
              labkit.Strategy(dp=2, zero=2)):
        run = lab2.run(s, model=Routed, **kw)
        assert run.max_diff(ref) < 1e-5, s.label()
    stacked = labkit.reference(RoutedStack, **kw)
    assert lab2.run(labkit.Strategy(dp=2, zero=3), model=RoutedStack, **kw).max_diff(stacked) < 1e-5
    # FSDP2 (torch's): every replica must reach the same parameters (it reduce-scatters only
    # those); then one it drops the gradient of between steps is skipped as one process skips it
    everywhere = dict(kw, data=routed_everywhere)
    run = lab2.run(labkit.Strategy(dp=2, zero=3, zero_mode="fsdp2"), model=RoutedStack, **everywhere)
    assert run.max_diff(labkit.reference(RoutedStack, **everywhere)) < 1e-5
    # one replica reaching what another does not: named (rank, step, unit, fix), engines kept
    with pytest.raises(labkit.LabError, match=r"rank 1, step 1: reduce_scatter 'fsdp2 reduce-scatter' of the "
                                              r"root unit \(a\.weight.*rank\(s\) \[1\] got none.*zero_mode='labkit'"):
        lab2.run(labkit.Strategy(dp=2, zero=3, zero_mode="fsdp2"), model=RoutedStack, **kw)
    momentum = dict(kw, optimizer="sgd", momentum=0.9)
    assert lab2.run(labkit.Strategy(dp=2), model=Routed, **momentum).max_diff(
        labkit.reference(Routed, **momentum)) < 1e-5


# -- 5. warnings where a run departs on purpose, and token ids with the default loss ------------
class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


class FunctionalDropout(TinyLM):
    def forward(self, x):
        return self.head(torch.nn.functional.dropout(torch.tanh(self.emb(x)), 0.1, self.training))


def padded(step):
    x, y = tokens(step)
    y[4:, 3:] = -100                 # the second half of the rows is mostly padding
    return x, y


def validated(strategy, model, data, loss):
    validate(RunSpec(strategy, model, data, loss, batch=8), strategy.world_size)


def test_token_ids_with_the_default_loss_are_refused_naming_cross_entropy():
    refused(labkit.Strategy(dp=2), TinyLM, tokens, "mse", match="targets are token ids .*pass loss='cross_entropy'")


def test_padding_with_a_callable_loss_warns_naming_token_loss():
    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)
    with pytest.warns(UserWarning, match="hold -100 .*labkit.losses.token_loss"):
        validated(labkit.Strategy(dp=2), TinyLM, padded, loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validated(labkit.Strategy(dp=2), TinyLM, padded, labkit.losses.token_loss(
            lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")))
        validated(labkit.Strategy(dp=2), TinyLM, tokens, loss)


@pytest.mark.slow
def test_a_shard_of_padding_alone_names_token_loss_not_the_lr(lab2):
    def all_padding_on_one_replica(step):
        x, y = tokens(step)
        y[4:] = -100
        return x, y

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)
    with pytest.warns(UserWarning, match="token_loss"), pytest.raises(labkit.LabError, match="all padding: use "
                                                                                              "labkit.losses.token_loss"):
        lab2.run(labkit.Strategy(dp=2), model=TinyLM, data=all_padding_on_one_replica, loss=loss, batch=8, steps=1)


def test_functional_dropout_in_forward_warns_and_a_plain_forward_does_not():
    with pytest.warns(UserWarning, match="draws random numbers .*F.dropout"):
        validated(labkit.Strategy(dp=2), FunctionalDropout, tokens, "cross_entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validated(labkit.Strategy(dp=2), TinyLM, tokens, "cross_entropy")
        validated(labkit.Strategy(dp=1), FunctionalDropout, tokens, "cross_entropy")     # not split: one process


def test_a_raw_hf_moe_with_its_router_loss_on_warns():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
                                        max_position_embeddings=16, output_router_logits=True)
    with pytest.warns(UserWarning, match="output_router_logits=True"):
        validated(labkit.Strategy(dp=2), lambda: transformers.MixtralForCausalLM(config), tokens, "cross_entropy")


# -- 7. unclear errors made clear ----------------------------------------------------------------------
def test_infinite_fault_factor_and_router_skew_are_refused():
    with pytest.raises(ValueError, match="factor=inf must be a finite number"):
        SyncFault("factor", bucket=0, factor=float("inf"))
    with pytest.raises(ValueError, match="router_skew=inf must be a finite number"):
        labkit.models.llama(n_experts=4, router_skew=float("inf"))
    with pytest.raises(ValueError, match="aux_loss_coef=inf must be a finite number"):
        labkit.models.llama(n_experts=4, aux_loss_coef=float("inf"))


def test_an_unwritable_profile_folder_is_refused_before_the_run(tmp_path):
    import os
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    refused(labkit.Strategy(dp=2), nn.Linear(8, 8), match="notes.txt cannot be written",
            profile=str(tmp_path / "notes.txt" / "traces"))
    validate(RunSpec(labkit.Strategy(dp=2), nn.Linear(8, 8), None, "mse", batch=8,
                     extra={"profile": str(tmp_path / "new" / "traces")}), 2)      # made after the run: fine
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):                 # (root writes anywhere)
        refused(labkit.Strategy(dp=2), nn.Linear(8, 8), match="cannot be written", profile=str(locked / "traces"))


class MaskedLM(nn.Module):
    """Takes keyword tensors, as a Hugging Face model does."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        return self.head(torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1))


def keyword_batches(step):
    x, y = tokens(step)
    mask = torch.ones_like(x, dtype=torch.float32)
    mask[:, -1] = 0.0
    return {"input_ids": x, "attention_mask": mask}, y


@pytest.mark.slow
def test_dict_inputs_reach_forward_as_keyword_tensors(lab2):
    kw = dict(data=keyword_batches, loss="cross_entropy", batch=8, steps=2, lr=0.1, seed=0)
    for s in (labkit.Strategy(dp=2), labkit.Strategy(dp=2, microbatches=2, dp_mode="overlap")):
        assert lab2.run(s, model=MaskedLM, **kw).max_diff(labkit.reference(MaskedLM, **kw)) < 1e-5


class KeywordBlocks(MaskedLM):
    """MaskedLM with layers between, so the planner has blocks to price."""

    def __init__(self, vocab=32, d=16):
        super().__init__(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2))

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_the_planner_prices_a_model_that_takes_keyword_tensors():
    machine = labkit.plan.Machine.of(cores=2.0, engines=2)
    for s in (labkit.Strategy(dp=2), labkit.Strategy(dp=2, microbatches=2)):
        pred = labkit.plan.simulate(s, machine, model=KeywordBlocks, batch=8, data=keyword_batches,
                                    loss="cross_entropy")
        assert pred.metrics["step_time_s"] > 0


@pytest.mark.slow
def test_ddp_with_a_parameter_used_on_some_steps_names_it_and_the_modes_that_work(lab2):
    with pytest.raises(labkit.LabError, match=r"dp_mode='ddp': parameter\(s\) \['b.weight', 'b.bias', "
                                              r"'spare.weight', 'spare.bias'\] got no gradient.*'bucketed'"):
        lab2.run(labkit.Strategy(dp=2, dp_mode="ddp"), model=Routed, data=routed_data, batch=16, steps=2)


def test_from_profiler_reads_a_folder_of_traces_and_skips_an_event_without_a_start(tmp_path):
    from test_traces import kineto, write

    folder = tmp_path / "tb"
    folder.mkdir()
    for r in (0, 1):
        trace = kineto(r)
        if r == 1:
            trace["traceEvents"].append({"ph": "X", "name": "aten::mm", "dur": 10, "tid": 1})     # no "ts"
        write(folder / f"worker{r}.1700000000.pt.trace.json", trace)
    whole = labkit.Timeline.from_profiler(folder)
    files = labkit.Timeline.from_profiler(sorted(folder.iterdir()))
    assert whole.world_size == 2 and len(whole.events) == len(files.events) > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="a folder with no .json or .json.gz trace"):
        labkit.Timeline.from_profiler(empty)


@pytest.mark.slow
def test_a_tied_embedding_and_head_under_fsdp2_equals_one_process(lab2):
    class TiedLM(nn.Module):
        def __init__(self, vocab=32, d=16):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2))
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    kw = dict(data=tokens, loss="cross_entropy", batch=8, steps=2, lr=0.1, seed=0)
    run = lab2.run(labkit.Strategy(dp=2, zero=3, zero_mode="fsdp2"), model=TiedLM, **kw)
    assert run.max_diff(labkit.reference(TiedLM, **kw)) < 1e-5


# -- 6. closing the lab from another thread mid-run (last here: it starts and closes its own lab) ---
def slow_data(step):
    import time
    time.sleep(0.5)
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)


@pytest.mark.slow
def test_closing_the_lab_from_another_thread_ends_the_run_with_an_error():
    import threading
    import time

    from conftest import release_labs

    release_labs()                         # one lab at a time on this machine
    lab = labkit.Lab.start(engines=2, timeout=30, progress=False)
    outcome = {}

    def train():
        try:
            lab.run(labkit.Strategy(dp=2), model=nn.Linear(8, 8), data=slow_data, batch=16, steps=400)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=train, daemon=True)
    try:
        thread.start()
        time.sleep(3)                      # well inside the run (400 steps of ≥ 0.5 s)
        lab.close()
        closed_at = time.monotonic()
        thread.join(timeout=60)
        assert not thread.is_alive() and time.monotonic() - closed_at < 30
    finally:
        lab.close()
    assert isinstance(outcome.get("error"), labkit.LabError) and "closed" in str(outcome["error"])
