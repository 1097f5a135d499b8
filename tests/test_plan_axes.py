"""The local planner's context and expert parallelism: what it refuses, and on 4 engines each
rank's bytes sent in a step and its span kinds equal a run's first step of the same strategy
(the experts' exchanges follow the routing of the first step's tokens; no timing is asserted),
for labkit's models and a transformers Llama under every axis the planner prices."""
from __future__ import annotations

import pathlib

import pytest

import labkit
from labkit import plan
from labkit.plan.local.machine import FAMILIES, Machine

DATA = labkit.data.text(batch=8, block_size=16)
SIZES = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size, n_kv_heads=2)
MOE = labkit.models.llama(**SIZES, n_experts=4, top_k=2, aux_loss_coef=0)
KW = dict(data=DATA, loss="cross_entropy", batch=8)
GPT = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=DATA.vocab_size)     # its head the embedding's weight
HF = pathlib.Path(__file__).parent / "data" / "hf"
HF_LLAMA = labkit.models.from_hf(HF / "llama.json")    # its own attention
HF_MIXTRAL, HF_QWEN3_MOE = labkit.models.from_hf(HF / "mixtral.json"), labkit.models.from_hf(HF / "qwen3_moe.json")
HF_QWEN2_MOE = labkit.models.from_hf(HF / "qwen2_moe.json")      # a shared expert beside the routed ones

SENT = {"send", "allreduce", "allgather", "reduce_scatter", "all_to_all"}


def _machine() -> Machine:
    return Machine.of(cores=2.0, matmul=((1e5, 2e9), (1e8, 2e10)), dram_Bps=1e10, action_s=1e-4,
                   comm={f: (20e-6, 1e9) for f in FAMILIES}, engines=4)


def per_rank(events, world: int) -> list[tuple[int, set]]:
    """(bytes sent, span kinds but ``wait``, a timing accident) of each rank; a pipeline's
    first step also sends each activation's shape once, which no later step does."""
    return [(sum(e["bytes"] for e in events if e["rank"] == r and e["kind"] in SENT
                 and not str(e.get("name", "")).endswith(" shape")),
             {e["kind"] for e in events if e["rank"] == r} - {"wait"}) for r in range(world)]


@pytest.mark.parametrize("kw, match", [
    (dict(cp=2, pp=2), "pp=1 and tp=1"),
    (dict(cp=2, tp=2), "pp=1 and tp=1"),
    (dict(dp=2, pp=2, ep=2), "beside dp only"),
    (dict(dp=2, ep=2, zero=1), "zero=0"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        plan.simulate(labkit.Strategy(**kw), _machine(), model=MOE, **KW)


def test_a_model_the_lab_refuses_under_cp_is_refused_by_the_lab_s_own_check():
    with pytest.raises(ValueError, match="never calls labkit.parallel.context.attention"):
        plan.simulate(labkit.Strategy(cp=2), _machine(), model=labkit.models.mlp(width=16, depth=2), batch=8)


def test_ring_rounds_follow_the_causal_split():
    """Contiguous split: cp rank i computes i + 1 rounds of pairs, the balanced split cp on every rank."""
    model = labkit.models.llama(**SIZES)
    for balance in (True, False):
        pred = plan.simulate(labkit.Strategy(cp=4, cp_balance=balance), _machine(), model=model, **KW)
        slow = [sum(e["end"] - e["start"] for e in pred.timeline.events
                    if e["rank"] == r and e["kind"] == "attention") for r in range(4)]
        if balance:
            assert max(slow) == pytest.approx(min(slow))
        else:
            assert slow == sorted(slow) and slow[3] > 2 * slow[0]


@pytest.mark.parametrize("strategy, model", [
    (labkit.Strategy(dp=2, cp=2), labkit.models.llama(**SIZES)),
    (labkit.Strategy(cp=4, cp_mode="allgather"), labkit.models.llama(**SIZES)),
    (labkit.Strategy(cp=4, cp_balance=False, dp_mode="bucketed"), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=2, cp=2, cp_mode="allgather", zero=1), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=2, cp=2, cp_mode="ulysses"), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=4, ep=2), MOE),
    (labkit.Strategy(dp=4, ep=2, ep_overlap="microbatch"), MOE),
    (labkit.Strategy(dp=4, ep=4, microbatches=2, dp_mode="bucketed"), MOE),
    (labkit.Strategy(dp=2, tp=2), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=2, pp=2, microbatches=2), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=4, zero=3), labkit.models.llama(**SIZES)),
    (labkit.Strategy(dp=2, pp=2, microbatches=2), labkit.models.gpt(**GPT)),
    (labkit.Strategy(pp=4, microbatches=4), labkit.models.llama(**SIZES, tie=True)),
    (labkit.Strategy(dp=4, ep=2), HF_MIXTRAL),
    (labkit.Strategy(dp=4, ep=4, ep_overlap="microbatch"), HF_QWEN3_MOE),
    (labkit.Strategy(dp=4, ep=2), HF_QWEN2_MOE),
    (labkit.Strategy(dp=2, cp=2), HF_LLAMA),
    (labkit.Strategy(dp=2, cp=2, cp_mode="ulysses"), HF_LLAMA),
    (labkit.Strategy(dp=2, tp=2), HF_LLAMA),
    (labkit.Strategy(dp=2, pp=2, microbatches=2), HF_LLAMA),
    (labkit.Strategy(dp=4, zero=3), HF_LLAMA),
], ids=["dp2cp2-ring", "cp4-allgather", "cp4-ring-contiguous", "dp2cp2-allgather-zero1", "dp2cp2-ulysses", "dp4ep2",
        "dp4ep2-overlap", "dp4ep4-m2", "dp2tp2", "dp2pp2-m2", "dp4zero3", "gpt-tied-dp2pp2", "llama-tied-pp4-embedding-and-head-alone", "hf-mixtral-dp4ep2",
        "hf-qwen3moe-dp4ep4-overlap", "hf-qwen2moe-shared-expert-dp4ep2", "hf-dp2cp2-ring", "hf-dp2cp2-ulysses",
        "hf-dp2tp2", "hf-dp2pp2-m2", "hf-dp4zero3"])
def test_bytes_and_span_kinds_per_rank_equal_a_runs(lab4, strategy, model):
    pred = plan.simulate(strategy, _machine(), model=model, steps=1, lr=0.3, **KW)
    run = lab4.run(strategy, model=model, steps=1, lr=0.3, **KW)
    assert per_rank(pred.timeline.events, 4) == per_rank(run.timeline.events, 4)


def test_buckets_fill_in_the_model_s_own_order_the_head_s_gradient_first(lab4):
    """Small buckets over a transformers Llama: each bucket's bytes, in the order they go out,
    are the run's (the head's and final norm's gradients come first, the embedding's last)."""
    strategy = labkit.Strategy(dp=4, dp_mode="bucketed", bucket_mb=0.02)
    pred = plan.simulate(strategy, _machine(), model=HF_LLAMA, steps=1, **KW)
    run = lab4.run(strategy, model=HF_LLAMA, steps=1, **KW)
    buckets = [[e["bytes"] for e in sorted(t.events, key=lambda e: e["start"]) if e["rank"] == 0
                and e["kind"] == "allreduce"] for t in (pred.timeline, run.timeline)]
    assert len(buckets[1]) > 3 and buckets[0] == buckets[1]


@pytest.mark.parametrize("model", [MOE, HF_MIXTRAL], ids=["labkit-moe", "hf-mixtral"])
def test_an_ep_prediction_routes_each_measured_step_as_the_trained_router_does(lab4, model):
    """The router trains, so later steps route unevenly: the bytes each rank sends, per step
    the run's metrics count (its first left out), are the run's own, not the first step's."""
    strategy = labkit.Strategy(dp=4, ep=4)
    run = lab4.run(strategy, model=model, steps=4, lr=0.5, **KW)
    pred = plan.simulate(strategy, _machine(), model=model, steps=4, lr=0.5, **KW)
    first = plan.simulate(strategy, _machine(), model=model, steps=1, lr=0.5, **KW)
    assert list(pred.metrics["bytes_sent"]) == list(run.metrics["bytes_sent"])
    assert list(first.metrics["bytes_sent"]) != list(run.metrics["bytes_sent"])
    steps = sorted({e["step"] for e in pred.timeline.events})
    assert len(steps) == 1        # the timeline: one step, the median one


def test_an_all_to_all_is_priced_by_its_busiest_member_sent_or_received():
    """A link is shared on both sides (labkit.Link): three ranks each sending 10 kB to one that
    sends nothing take as long as that rank's 30 kB coming in, not one sender's 10 kB."""
    from types import SimpleNamespace

    from labkit.plan.local.programs.expert import ExpertPrograms
    builder = SimpleNamespace(m=_machine())
    group = (0, 1, 2, 3)
    incast = ExpertPrograms.a2a(builder, "k", group, [1e4, 1e4, 1e4, 0], 0, "x", 0, received=[0, 0, 0, 3e4])
    even = ExpertPrograms.a2a(builder, "k", group, [3e4] * 4, 0, "x", 0)
    alone = ExpertPrograms.a2a(builder, "k", group, [1e4, 1e4, 1e4, 0], 0, "x", 0)
    assert (incast.seconds, incast.link) == (even.seconds, even.link)
    assert incast.seconds > alone.seconds and incast.bytes == 1e4


@pytest.mark.parametrize("order", ["tp,cp,pp,dp", "dp,cp,pp,tp"])
def test_the_planner_places_the_axes_in_the_strategy_s_order(order):
    """Strategy.order moves tp across the ranks as the lab does: the predicted tp all-reduces run
    in the grid's tp groups ((0, 1), (2, 3) by default; (0, 2), (1, 3) with dp fastest)."""
    from labkit.grid import ParallelDims

    mlp = labkit.models.mlp(width=32, depth=4)
    plan_ = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
    pred = plan.simulate(labkit.Strategy(dp=2, tp=2, order=order), _machine(), model=mlp, batch=8, tp_plan=plan_)
    tp = {tuple(map(int, e["group"].split(","))) for e in pred.timeline.events
          if e["kind"] == "allreduce" and e["name"].startswith("tp")}
    assert tp == {tuple(g) for g in ParallelDims(dp=2, tp=2, order=order).tp_groups()}


def test_an_ep_rank_s_own_parts_are_timed_as_routed_ops_counts_them(monkeypatch):
    """routed_seconds times the same three parts routed_ops counts (sorting the rank's tokens, its
    experts on what arrives, weighting back), forward and backward; simulate uses them when the
    model's pieces are timed, the counted prices when not."""
    import torch

    from labkit.plan.local.expert_work import exchange, routed_ops, routed_seconds
    from labkit.training import build_model
    from labkit.parallel.expert import moe_layers

    moe = moe_layers(build_model(MOE, 0))[0][1]
    chosen = [torch.randint(0, 4, (16, 2)) for _ in range(2)]
    _, counts = exchange(chosen, 4, 2)
    timed, counted = routed_seconds(moe, chosen[0], counts[0], repeats=2), routed_ops(moe, chosen[0], counts[0])
    assert set(timed) == set(counted) == {"pre", "experts", "post"}
    assert all(f > 0 and b > 0 for f, b in timed.values())
    # simulate takes them: a second a part makes a step of seconds (2 layers × 3 parts × 2 passes)
    import labkit.plan.local.expert_work as expert_work
    monkeypatch.setattr(expert_work, "routed_seconds", lambda *a, **k: {p: (1.0, 1.0) for p in timed})
    s, machine = labkit.Strategy(dp=2, ep=2), Machine.of(**{**_machine().numbers(), "engines": 2})
    assert plan.simulate(s, machine, model=MOE, **KW).metrics["step_time_s"] >= 12.0
    assert plan.simulate(s, machine, model=MOE, profile=False, **KW).metrics["step_time_s"] < 1.0


@pytest.mark.parametrize("model", [MOE, HF_MIXTRAL], ids=["labkit-moe", "hf-mixtral"])
def test_an_ep_rank_s_experts_touch_their_weights_so_what_the_cache_lost_is_paid(monkeypatch, model):
    """Under ep the experts' weights leave their block's piece; the span that runs a rank's
    experts touches them (and their gradients backward), the rank's 1/ep of every expert's
    bytes, so ``refetch`` prices them after a wait as any piece's bytes."""
    from labkit.parallel.expert import fused_experts, moe_layers
    from labkit.plan.local import price
    from labkit.training import build_model

    seen, step_events = [], price.step_events
    monkeypatch.setattr(price, "step_events", lambda programs, m: seen.append(programs) or step_events(programs, m))
    machine = Machine.of(**{**_machine().numbers(), "engines": 2, "refetch": ((1e-6, 0.0), (1.0, 1e-9))})
    plan.simulate(labkit.Strategy(dp=2, ep=2), machine, model=model, profile=False, **KW)
    net = build_model(model, 0)
    experts = [m.experts for _, m in moe_layers(net)] + [e for _, e in fused_experts(net)]
    every = sum(p.numel() * p.element_size() for p in experts[0].parameters())
    touched = {}
    for item in (x for prog in seen[0] for x in prog):
        for key, nbytes, _ in getattr(item, "touches", ()):
            if isinstance(key, tuple) and key[0] in ("experts", "experts' gradients"):
                touched.setdefault(key, set()).add(nbytes)
    assert sorted({k[0] for k in touched}) == ["experts", "experts' gradients"] and len(touched) == 4    # 2 layers
    assert all(v == {every // 2} for v in touched.values())


@pytest.mark.parametrize("model", [MOE, HF_MIXTRAL], ids=["labkit-moe", "hf-mixtral"])
def test_the_profile_times_the_routed_experts_inside_their_block_and_ep_prices_the_block_without_them(model):
    """MoE._routed, or a transformers block's fused experts (what ep moves off the block), is
    timed inside its block's piece; under ep the block costs what it took less them, without
    the counted prices deciding the share."""
    from labkit.plan.local import price
    from labkit.plan.local.profile import profile, timed
    from labkit.plan.local.work import count

    seconds = profile(model, 4, DATA, "cross_entropy", repeats=3)
    for i in range(2):
        for phase in ("fwd", "bwd"):
            assert 0 < seconds[("routed", i), phase] < seconds[i, phase]
    machine = _machine()
    work = timed(count(model, 4, DATA, "cross_entropy", ep=2), seconds, machine,
                 count(model, 4, DATA, "cross_entropy", ep=2, marked=False))
    for i, block in enumerate(work.blocks):
        assert [o.name for o in block.fwd.ops].count("experts") == 1      # where the experts ran, marked
        for phase, ops in (("fwd", block.fwd), ("bwd", block.bwd)):
            assert price.seconds(machine, ops.ops) == pytest.approx(seconds[i, phase] - seconds[("routed", i), phase])
    whole = timed(count(model, 4, DATA, "cross_entropy"), seconds, machine)      # no ep: the block as it took
    assert price.seconds(machine, whole.blocks[0].fwd.ops) == pytest.approx(seconds[0, "fwd"])


def test_a_tensor_plan_the_planner_would_price_unsharded_is_refused():
    """A vocabulary-parallel embedding is split by the lab, not by the planner's programs."""
    gpt = labkit.models.gpt(**GPT, tie=False)
    assert plan.simulate(labkit.Strategy(dp=2, tp=2), _machine(), model=gpt, **KW).metrics["step_time_s"] > 0
    with pytest.raises(ValueError, match="'0.wte': 'rowwise'"):
        plan.simulate(labkit.Strategy(dp=2, tp=2), _machine(), model=gpt, tp_plan={**gpt.tp_plan, "0.wte": "rowwise"},
                      **KW)


def test_a_pipeline_the_lab_refuses_is_refused_by_the_lab_s_own_check():
    """A GPT of 4 layers has 6 units (embedding, layers, head): not 4 equal interleaved stages."""
    with pytest.raises(ValueError, match="interleaved splits the model's 6 blocks"):
        plan.simulate(labkit.Strategy(pp=2, microbatches=4, schedule="interleaved", chunks=2), _machine(),
                      model=labkit.models.gpt(**{**GPT, "n_layer": 4}), **KW)


def test_a_transformers_ep_rank_s_experts_are_counted_as_the_products_they_are():
    """A fused experts module runs every expert in one ``_grouped_mm``, which torch's
    flop_registry lacks; and the ep rank's slice, copied from a count that marked the experts,
    must compute with its own rows, not the count's stand-in: 2·rows·H·2I + 2·rows·I·H forward
    (gate-up, then down), twice that backward."""
    import torch

    from labkit.plan.local.expert_work import routed_ops
    from labkit.plan.local.work import count

    data = labkit.data.text(batch=8, block_size=16)
    work = count(HF_MIXTRAL, 4, data, "cross_entropy", ep=2)
    _, experts = work.blocks[0].moe[0]
    counts = torch.tensor([[30, 34], [20, 44]])             # rows arriving: [sender, local expert]
    fwd, bwd = routed_ops(experts, torch.randint(0, 4, (64, 2)), counts)["experts"]
    rows, h, i = int(counts.sum()), 64, 128
    assert fwd.flops == 2 * rows * h * 2 * i + 2 * rows * i * h
    assert bwd.flops == 2 * fwd.flops
