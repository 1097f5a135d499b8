"""Expert parallelism: the ep axis's checks (before engines), its groups, and on 4 engines a
llama MoE equal to one process for ep=2 and ep=4 beside dp=4, and ep=2 inside each stage of a
pp=2 pipeline, top-1 and top-2, with and without the balance loss and the overlap, over the dp
modes and under full recompute, beside tp and cp, and with ZeRO-1/2 (the experts' AdamW state
cut over their replicas); an expert no token reaches keeps a zero gradient; the all-to-all
bytes recorded equal the rows that left each rank."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import labkit
from labkit.grid import ParallelDims
from labkit.training import build_model
from labkit.parallel.build import RunSpec
from labkit.run.runner import validate

DATA = labkit.data.text(batch=8, block_size=16)
SIZES = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)
KW = dict(data=DATA, loss="cross_entropy", batch=8, steps=3, lr=0.3, seed=0)
TOL = 1e-5           # float32: summation order differs (gates applied after the combine)


def moe(**kwargs):
    return labkit.models.llama(**SIZES, **{"n_experts": 4, "top_k": 2, **kwargs})


# -- checks, in one process -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(dp=4, ep=3), "ep=3 must divide dp=4"),
    (dict(dp=2, ep=2, zero=3), "zero=3"),
    (dict(dp=2, ep=2, zero=2, zero_mode="fsdp2"), "zero_mode='fsdp2'"),
    (dict(dp=2, ep=2, compression="fp16"), "compression"),
    (dict(dp=2, ep=0), "ep=0"),
    (dict(dp=2, ep_overlap="microbatch"), "ep=1 has none"),
    (dict(dp=2, ep=2, ep_overlap="dualpipe"), "ep_overlap='dualpipe' is unknown"),
])
def test_strategy_checks_its_ep_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        labkit.Strategy(**kwargs)


@pytest.mark.parametrize("model, strategy, engines, match", [
    (moe(n_experts=6), labkit.Strategy(dp=4, ep=4), 4, "n_experts=6"),
    (labkit.models.llama(**SIZES), labkit.Strategy(dp=2, ep=2), 2, "no mixture-of-experts"),
])
def test_bad_models_are_refused_before_any_engine(model, strategy, engines, match):
    with pytest.raises(ValueError, match=match):
        validate(RunSpec(strategy, model, DATA, "cross_entropy", batch=8), engines)


def test_active_parameters_count_top_k_of_the_experts():
    dense, sparse = labkit.models.llama(**SIZES), moe(top_k=2)
    expert = 3 * SIZES["n_embd"] * sparse.hidden
    assert dense.active_parameters() == dense.num_parameters()
    assert sparse.active_parameters() == sparse.num_parameters() - SIZES["n_layer"] * (4 - 2) * expert


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k=5"):
        moe(top_k=5)


def test_ep_groups_are_runs_of_consecutive_dp_ranks():
    dims = ParallelDims(dp=4)
    assert dims.ep_groups(2) == [[0, 1], [2, 3]] and dims.expert_dp_groups(2) == [[0, 2], [1, 3]]
    assert dims.ep_groups(4) == [[0, 1, 2, 3]] and dims.expert_dp_groups(4) == [[0], [1], [2], [3]]
    assert labkit.Strategy(dp=4, ep=2).label().startswith("dp=4 ep=2")
    assert ParallelDims(dp=2, cp=2).expert_replica_groups(2) == [[0, 1], [2, 3]]
    assert ParallelDims(dp=4, tp=2).expert_replica_groups(2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert "ep" not in labkit.Strategy(dp=4).label() and labkit.Strategy(dp=4, ep=2).world_size == 4


# -- on engines -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(dp=4, ep=2, dp_mode="naive"), moe(top_k=1, norm_topk_prob=False, aux_loss_coef=0)),
    (labkit.Strategy(dp=4, ep=4), moe(top_k=2, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=4, ep=2, dp_mode="bucketed", microbatches=2), moe(top_k=2, aux_loss_coef=0.05,
                                                                          shared_expert=True)),
    (labkit.Strategy(dp=4, ep=4, dp_mode="ddp"), moe(top_k=1, norm_topk_prob=False, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=4, ep=2, recompute="full"), moe(top_k=2, aux_loss_coef=0.01)),   # all-to-alls again
    (labkit.Strategy(dp=4, ep=2, ep_overlap="microbatch"), moe(top_k=2, aux_loss_coef=0.01, shared_expert=True)),
    (labkit.Strategy(dp=4, ep=4, ep_overlap="microbatch", dp_mode="ddp"), moe(top_k=1, norm_topk_prob=False,
                                                                            aux_loss_coef=0.01)),
    (labkit.Strategy(dp=2, pp=2, ep=2, microbatches=2), moe(top_k=2, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=2, pp=2, ep=2, microbatches=2, ep_overlap="microbatch"),
     moe(top_k=1, norm_topk_prob=False, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=2, pp=2, ep=2, schedule="zbv", chunks=2, microbatches=2), moe(top_k=2, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=2, tp=2, ep=2), moe(top_k=2, aux_loss_coef=0.01)),
    (labkit.Strategy(dp=2, tp=2, ep=2, ep_overlap="microbatch"),
     moe(top_k=1, norm_topk_prob=False, aux_loss_coef=0.01, shared_expert=True)),   # the shared one split by tp
    (labkit.Strategy(dp=2, cp=2, ep=2), moe(top_k=2, aux_loss_coef=0)),   # each cp rank routes its slice
], ids=["ep2-top1-naive", "ep4-top2-aux", "ep2-top2-shared-bucketed-mb2", "ep4-top1-ddp", "ep2-recompute",
        "ep2-top2-shared-overlap", "ep4-top1-overlap-ddp", "ep2-pp2-top2", "ep2-pp2-top1-overlap", "ep2-pp2-zbv", "ep2-tp2-top2",
        "ep2-tp2-top1-shared-overlap", "ep2-cp2-top2"])
def test_expert_parallel_equals_one_process(lab4, strategy, model):
    run, ref = lab4.run(strategy, model=model, **KW), labkit.reference(model, **KW)
    assert set(run.parameters()) == set(ref.parameters())
    if strategy.pp == 1:    # a pipeline reports its last stage's cross-entropy, without the balance loss
        assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) <= TOL
    routed = run.metrics["tokens_per_expert"]      # every layer's tokens counted once (pp: on its stage; tp: once)
    assert all(len(step) == 2 and all(sum(c) == KW["batch"] * 16 * model.top_k for c in step.values())
               for step in routed)


@pytest.mark.parametrize("strategy, optimizer", [
    (labkit.Strategy(dp=4, ep=2, zero=1), "sgd"),
    (labkit.Strategy(dp=4, ep=2, zero=2, microbatches=2), "adamw"),
    (labkit.Strategy(dp=4, ep=4, zero=1), "adamw"),          # one replica per expert: its shard is whole
    (labkit.Strategy(dp=2, cp=2, ep=2, zero=2), "adamw"),    # the experts' copies span cp
    (labkit.Strategy(dp=2, tp=2, ep=2, zero=1), "sgd"),      # and tp
    (labkit.Strategy(dp=2, pp=2, ep=2, zero=1, microbatches=2), "adamw"),   # per stage
], ids=["dp4-ep2-zero1-sgd", "dp4-ep2-zero2-mb2-adamw", "dp4-ep4-zero1-adamw", "dp2-cp2-ep2-zero2-adamw",
        "dp2-tp2-ep2-zero1-sgd", "dp2-pp2-ep2-zero1-adamw"])
def test_zero_shards_the_experts_over_their_replicas(lab4, strategy, optimizer):
    model = moe(top_k=2, aux_loss_coef=0 if strategy.cp > 1 else 0.01)
    # AdamW divides by the root of its second moment, so the float32 summation-order noise of a
    # rarely routed expert's near-zero gradient comes out lr-sized: ep alone, zero=0, is 3e-5
    # off at lr=0.01; at 1e-3 the same noise is under the tolerance
    kw = {**KW, "optimizer": optimizer, "lr": 0.3 if optimizer == "sgd" else 1e-3}
    run, ref = lab4.run(strategy, model=model, **kw), labkit.reference(model, **kw)
    if strategy.pp == 1:    # a pipeline reports its last stage's cross-entropy, without the balance loss
        assert run.losses == pytest.approx(ref.losses, abs=TOL)
    assert run.max_diff(ref) <= TOL
    # two moments of 1/(dp·cp) of the dense parameters and of 1/(dp·cp/ep) of the 1/ep of the experts held
    if optimizer == "adamw" and strategy.pp == 1:
        total = sum(p.numel() for p in build_model(model, KW["seed"]).parameters())
        held = [m["optimizer"] for m in run.metrics["memory_bytes"]]
        assert all(b == pytest.approx(8 * total / (strategy.dp * strategy.cp), rel=0.02) for b in held)


def dead_expert_model():
    """A MoE llama whose routers carry a bias that keeps expert 3 out of every top-2."""
    model = moe(top_k=2, aux_loss_coef=0.01)()
    for layer in model.layers:
        router = layer.mlp.router
        biased = nn.Linear(router.in_features, router.out_features, bias=True)
        biased.weight.data.copy_(router.weight.data)
        biased.bias.data.copy_(torch.tensor([0.0, 0.0, 0.0, -30.0]))
        layer.mlp.router = biased
    return model


@pytest.mark.parametrize("strategy", [labkit.Strategy(dp=4, ep=4), labkit.Strategy(dp=2, pp=2, ep=2, microbatches=2)],
                         ids=["ep4", "ep2-pp2"])
def test_an_expert_without_tokens_keeps_a_zero_gradient(lab4, strategy):
    """ep=4: expert 3 is rank 3's only one, so rank 3 receives no row at all; ep=2 under pp=2:
    each stage's second ep rank holds experts 2 and 3, and only 2 receives rows."""
    run = lab4.run(strategy, model=dead_expert_model, **KW)
    ref = labkit.reference(dead_expert_model, **KW)
    start = build_model(dead_expert_model, KW["seed"]).state_dict()
    params = run.parameters()
    assert run.max_diff(ref) <= TOL
    dead = [k for k in params if ".experts.3." in k]
    assert len(dead) == 6 and all(torch.equal(params[k], start[k]) for k in dead)
    assert not torch.equal(params["layers.0.mlp.experts.0.up_proj.weight"], start["layers.0.mlp.experts.0.up_proj.weight"])


def routed_rows(model, seed: int) -> list[torch.Tensor]:
    """Per MoE layer, the experts chosen for each (row, position) of step 0's global batch."""
    net, chosen = build_model(model, seed), []
    for layer in net.layers:
        layer.mlp.router.register_forward_hook(
            lambda m, i, out: chosen.append(out.float().softmax(-1).topk(2, dim=-1).indices))
    x, _ = DATA(0)
    with torch.no_grad():
        net(x)
    return chosen


def test_all_to_all_bytes_are_the_rows_that_leave_each_rank(lab4):
    model, ep, dp = moe(top_k=2, aux_loss_coef=0), 2, 4
    run = lab4.run(labkit.Strategy(dp=dp, ep=ep), model=model, **{**KW, "steps": 1})
    rows = KW["batch"] // dp
    row_bytes = SIZES["n_embd"] * 4
    for layer, chosen in enumerate(routed_rows(model, KW["seed"])):
        for rank in range(dp):
            mine = chosen[rank * rows:(rank + 1) * rows]               # (rows, T, k): this rank's batch
            home = (mine // (4 // ep)) != rank % ep                     # expert on another rank of the group
            events = {e["name"]: e["bytes"] for e in run.timeline.events
                      if e["rank"] == rank and e["kind"] == "all_to_all" and e["name"].startswith(f"layers.{layer}.")}
            assert events[f"layers.{layer}.mlp dispatch"] == int(home.sum()) * row_bytes
            assert events[f"layers.{layer}.mlp combine backward"] == int(home.sum()) * row_bytes
            assert events[f"layers.{layer}.mlp counts"] == (ep - 1) * (4 // ep) * 8


def test_under_tp_each_tp_rank_dispatches_its_share_of_the_tokens(lab4):
    """dp=2 × tp=2, ep=2 (rank = 2·dp index + tp index): a replica's two tp ranks together send
    the rows of its tokens that leave it, once, each its own half (no duplicate exchange)."""
    model = moe(top_k=2, aux_loss_coef=0)
    run = lab4.run(labkit.Strategy(dp=2, tp=2, ep=2), model=model, **{**KW, "steps": 1})
    for layer, chosen in enumerate(routed_rows(model, KW["seed"])):
        for d in range(2):
            mine = chosen[d * 4:(d + 1) * 4]                 # replica d's 4 rows; it holds experts 2d, 2d+1
            leave = int(((mine // 2) != d).sum()) * SIZES["n_embd"] * 4
            sent = [e["bytes"] for e in run.timeline.events if e["kind"] == "all_to_all"
                    and e["rank"] in (2 * d, 2 * d + 1) and e["name"] == f"layers.{layer}.mlp dispatch"]
            assert len(sent) == 2 and sum(sent) == leave and min(sent) > 0, (layer, d, sent, leave)


# -- routing made visible --------------------------------------------------------------------
def test_router_skew_sends_expert_0_more_tokens():
    """One process: the skewed router's first forward is more uneven than the plain one's."""
    from labkit.parallel.expert import imbalance
    x, _ = DATA(0)
    ratios = {}
    for skew in (0.0, 0.5):
        net = build_model(moe(top_k=2, router_skew=skew), 0)
        with torch.no_grad():
            net(x)
        ratios[skew] = [imbalance(c.tolist()) for c in net.tokens_per_expert]
        top = net.tokens_per_expert.argmax(1).tolist()
    assert all(a > b for a, b in zip(ratios[0.5], ratios[0.0])) and top == [0, 0]
    with pytest.raises(ValueError, match="router_skew"):
        labkit.models.llama(**SIZES, router_skew=1.0)


def test_tokens_per_expert_are_the_global_batch_routing(lab4):
    """ep=2 with the overlap, two micro-batches and full recompute (a forward run twice): the
    metric counts each routed token of the step once, as one process routes it; the plot draws
    it; the overlap's dispatches carry the rows that leave each rank."""
    import matplotlib
    matplotlib.use("Agg")
    model = moe(top_k=2, aux_loss_coef=0, router_skew=0.5)
    strategy = labkit.Strategy(dp=4, ep=2, ep_overlap="microbatch", microbatches=2, recompute="full")
    run = lab4.run(strategy, model=model, **{**KW, "steps": 2})
    steps = run.metrics["tokens_per_expert"]
    assert len(steps) == 2 and all(sum(c) == KW["batch"] * 16 * 2 for s in steps for c in s.values())
    for layer, chosen in enumerate(routed_rows(model, KW["seed"])):
        expected = torch.bincount(chosen.reshape(-1), minlength=4).tolist()
        assert steps[0][f"layers.{layer}.mlp"] == expected
        for rank in range(4):   # the overlap's half-size dispatches carry the rows; recompute sends them twice
            mine = chosen[rank * 2:(rank + 1) * 2]
            sent = sum(e["bytes"] for e in run.timeline.events if e["rank"] == rank and e["step"] == 0
                       and e["name"].startswith(f"layers.{layer}.mlp dispatch mb") and "backward" not in e["name"])
            assert sent == 2 * int(((mine // 2) != rank % 2).sum()) * SIZES["n_embd"] * 4
        ranks = run.metrics["tokens_per_ep_rank"][0][f"layers.{layer}.mlp"]
        assert ranks == [expected[0] + expected[1], expected[2] + expected[3]] and ranks[0] > ranks[1]
    from labkit.view.experts import plot_routing
    axes = plot_routing(run, by="ep_rank")
    assert len(axes) == 2 and axes[0].get_title().startswith("layers.0.mlp: max/mean")


def test_all_to_all_ms_counts_the_waits_compute_does_not_cover():
    """Per rank and step: the all-to-alls' time, or the part of it no compute span covers; step 0
    (warm-up) left out, the median over the rest."""
    from types import SimpleNamespace
    from labkit.view.experts import all_to_all_ms

    def event(rank, step, kind, name, start, end):
        return {"rank": rank, "step": step, "stream": "comm" if kind == "all_to_all" else "compute",
                "kind": kind, "name": name, "start": start, "end": end}
    events = [event(0, 0, "all_to_all", "l combine", 0.0, 0.5)]                  # warm-up: left out
    for step, (a2a, fwd) in enumerate([((0.0, 0.010), (0.005, 0.008)), ((0.0, 0.020), (0.0, 0.002))], start=1):
        events += [event(0, step, "all_to_all", "l combine", *a2a), event(0, step, "fwd", "F0", *fwd),
                   event(0, step, "all_to_all", "l dispatch", 0.030, 0.031)]
    run = SimpleNamespace(timeline=SimpleNamespace(events=events))
    assert all_to_all_ms(run, "combine") == pytest.approx([15.0])                # median of 10 and 20
    assert all_to_all_ms(run, "combine", exposed=True) == pytest.approx([12.5])  # of 7 and 18
    assert all_to_all_ms(run) == pytest.approx([16.0])
