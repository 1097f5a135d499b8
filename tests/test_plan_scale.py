"""The planner at scale: memory by hand on a small case, every published run fits, the count
against torchtitan's published peaks, one strategy vocabulary, HSDP priced per tier (no engines)."""
from __future__ import annotations

import pytest

from labkit.plan import Cluster, ClusterStrategy, Decoder, predict
from labkit.plan.scale.memory import memory_breakdown, rank_memory
from labkit.plan.scale.published import compare, compare_llama, compare_memory, _model


def test_memory_is_the_hand_count_on_a_small_decoder():
    model = Decoder(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=512, vocab=1000, seq=128)
    s = ClusterStrategy(dp=2, pp=2, tp=2, zero=1, sequence_parallel=True)
    layer = (2 * 256 * 256 + 2 * 256 * 128 + 2 * 256) + 3 * 256 * 512    # q, o; k, v; two norms; gate, up, down
    embedding, head = 1000 * 256, 256 + 1000 * 256                       # the last stage: final norm, output layer
    params = [(2 * layer + embedding) / 2, (2 * layer + head) / 2]        # per tp shard, pp rank 0 and 1
    # per layer and micro-batch, sequence parallel: two norm outputs, q k v o, gate up product, all / t
    per_layer = 128 * 256 / 2 * (4 + (4 * 256 + 4 * 128) / 256 + 6 * 512 / 256)
    in_flight = [2, 1]                                                    # 1F1B on 2 ranks, 4 micro-batches
    loss = 128 * (4 * 256 + 12 * 1000) / 2                                # final norm out; 12 bytes a logit
    totals = [2 * n + 2 * n + 12 * n / 2 + in_flight[r] * 2 * per_layer + (loss if r == 1 else 0)
              for r, n in enumerate(params)]                              # bf16 w, g; optimizer over dp=2
    ranks = rank_memory(model, s, global_batch=8)
    assert [r["total"] for r in ranks] == pytest.approx(totals)
    mem = memory_breakdown(model, s, global_batch=8)
    assert totals[1] > totals[0] and mem["total"] == pytest.approx(totals[1])         # the last rank: its loss
    assert mem["optimizer"] == pytest.approx(12 * params[1] / 2)


def test_a_gpt_layers_memory_bound_work_moves_the_attention_scores_a_decoders_flash_kernel_does_not():
    from labkit.plan import ModelShape
    from labkit.plan.scale.memory import layer_activation_bytes, layer_written_bytes

    gpt = ModelShape(layers=2, hidden=256, heads=4, seq=512)
    s = ClusterStrategy(dp=1, tp=2, microbatch_size=3)
    kept = 3 * 512 * 256 * (10 + 24 / 2 + 5 * 4 * 512 / 256 / 2)          # Korthikanti's count at t=2
    assert layer_activation_bytes(gpt, s) == pytest.approx(kept)
    scores = 2 * 4 * 512 ** 2 * 3 / 2                                     # QKᵀ's output, a/t heads, fp16
    assert layer_written_bytes(gpt, s) == pytest.approx(kept + scores)
    # Megatron's selective recomputation runs the core again: its GEMMs and its s×s tensors
    from labkit.plan.scale.memory import core_written_bytes
    from labkit.plan.scale.step import attention_times, layer_times

    cluster = Cluster.of(8, "a100")
    selective = ClusterStrategy(dp=1, tp=2, microbatch_size=3, recompute="selective")
    again = layer_times(gpt, cluster, selective, "dense", 0.0)[1] - layer_times(gpt, cluster, s, "dense", 0.0)[1]
    assert core_written_bytes(gpt, s) == pytest.approx(7 / 2 * scores)
    assert again == pytest.approx(attention_times(gpt, cluster, s)[0] + 2 * 7 / 2 * scores / 2.0e12)
    # FlashAttention keeps the scores on chip: a Decoder's bytes grow with s, not s²
    llama = [Decoder(layers=2, hidden=256, heads=4, ffn_hidden=512, vocab=1000, seq=n) for n in (512, 1024)]
    assert layer_written_bytes(llama[1], s) == pytest.approx(2 * layer_written_bytes(llama[0], s))


def test_every_published_run_fits():
    assert all(r["prediction"] is not None and r["prediction"].fits for r in compare())          # SC21 Table 1
    rows = compare_llama()
    assert len(rows) == 11 and all(r["prediction"].fits for r in rows)    # Llama 3 Table 4, torchtitan's A100 table
    assert all(r["prediction"].strategy.recompute == "none" for r in rows[:3])     # as Meta ran: no checkpointing


def test_the_count_is_below_torchtitans_reserved_peaks_by_the_allocators_cache():
    rows = compare_memory()
    assert all(0.8 <= r["ratio"] <= 1.0 for r in rows)                   # live tensors ≤ reserved
    # what 120 more FSDP ranks shard away: the model states, measured and counted
    published = rows[0]["published_gib"] - rows[1]["published_gib"]
    assert rows[0]["predicted_gib"] - rows[1]["predicted_gib"] == pytest.approx(published, rel=0.15)


def test_torchtitans_70b_runs_out_of_memory_at_batch_2_with_selective_checkpointing():
    # docs/performance.md @0413364, footnote 1: batch 2 with selective AC is an OOM, batch 1 ran
    model, cluster = _model("llama2-70b", 4096), Cluster.of(64, "a100")
    fits = [predict(model, cluster, 64 * b, ClusterStrategy(dp=64, zero=3, microbatch_size=b, recompute="selective",
                                                             dp_mode="overlap")).fits for b in (1, 2)]
    assert fits == [True, False]


# -- one vocabulary: Strategy's names and choices ------------------------------------------------

def test_cluster_strategy_speaks_strategys_names_and_refuses_what_it_does_not_price():
    import dataclasses

    import labkit
    from labkit.plan.scale.layout import PRICED, strategy_choices

    shared = {f.name for f in dataclasses.fields(labkit.Strategy)} & {f.name for f in dataclasses.fields(ClusterStrategy)}
    assert {"dp_mode", "ep_overlap", "schedule", "cp_mode", "recompute", "chunks", "sequence_parallel"} <= shared
    assert all(set(priced) <= set(strategy_choices(name)) for name, priced in PRICED.items())
    for field, value in (("schedule", "zbv"), ("cp_mode", "ulysses"), ("dp_mode", "naive")):
        with pytest.raises(ValueError, match=f"{field}='{value}' runs on the lab .* not priced at scale"):
            ClusterStrategy(**{field: value})
    with pytest.raises(ValueError, match="dp_mode='sometimes' is unknown"):
        ClusterStrategy(dp_mode="sometimes")
    # every shared field goes across as it is, the micro-batch count follows from the batch
    s = ClusterStrategy(dp=2, pp=2, cp=2, tp=2, ep=2, ep_overlap="microbatch", cp_mode="allgather", zero=1,
                        microbatch_size=2, recompute="full", dp_mode="ddp")
    lab = s.to_strategy(global_batch=16)
    assert all(getattr(lab, n) == getattr(s, n) for n in shared) and lab.microbatches == 4


def test_the_boolean_spellings_warn_and_mean_the_same():
    with pytest.warns(FutureWarning, match="dp_mode='overlap'"):
        old = ClusterStrategy(dp=8, dp_overlap=True)
    assert old == ClusterStrategy(dp=8, dp_mode="overlap") and old.overlaps_dp
    with pytest.warns(FutureWarning, match="ep_overlap='microbatch'"):
        assert ClusterStrategy(dp=8, ep=2, ep_overlap=True).ep_overlap == "microbatch"


# -- HSDP: ZeRO inside a shard group, all-reduce across its replicas, bytes per tier --------------

def test_hsdp_shards_model_states_over_its_group_and_prices_each_tier():
    from labkit.plan import ModelShape
    from labkit.plan.wire import bus_factor
    from labkit.plan.scale.step import stage_costs

    model, cluster = ModelShape(layers=24, hidden=2048, heads=16), Cluster(nodes=4)      # 32 A100s
    n = model.rank_params(1)[0]                                                         # pp=1, tp=1
    hsdp = ClusterStrategy(dp=32, zero=3, dp_shard=8, recompute="full")
    mem, flat = memory_breakdown(model, hsdp, 32), memory_breakdown(model, ClusterStrategy(dp=32, zero=3), 32)
    assert mem["optimizer"] == pytest.approx(12 * n / 8) and flat["optimizer"] == pytest.approx(12 * n / 32)
    # reduce-scatter and two all-gathers of 2n inside the node (NVLink), the shard's all-reduce across
    hw = cluster.hardware
    inside = 2 * n * 7 / 8 / hw.nvlink.beta + hw.nvlink.alpha
    across = 2 * (2 * n / 8) * 3 / 4 / hw.ib.beta + hw.ib.alpha
    assert stage_costs(model, cluster, hsdp).dp_sync == pytest.approx(3 * inside + across)
    tiers = predict(model, cluster, 32, hsdp).parts["bytes_by_tier"]
    assert tiers["intra"] == pytest.approx(3 * bus_factor("all_gather", 8) * 2 * n)
    assert tiers["inter"] == pytest.approx(bus_factor("all_reduce", 4) * 2 * n / 8)     # ring: 2(n−1)/n·S
    flat_tiers = predict(model, cluster, 32, ClusterStrategy(dp=32, zero=3)).parts["bytes_by_tier"]
    assert flat_tiers == pytest.approx({"intra": 0.0, "inter": 3 * bus_factor("all_gather", 32) * 2 * n})
    with pytest.raises(ValueError, match="dp_shard=3 .* must divide dp=32"):
        ClusterStrategy(dp=32, zero=3, dp_shard=3)


def test_tp_bytes_stay_inside_a_node_and_pp_bytes_cross_it():
    from labkit.plan import ModelShape
    from labkit.plan.wire import bus_factor

    model = ModelShape(layers=8, hidden=2048, heads=16, seq=1024)
    act = 2 * 1024 * 2048                                                # bf16 b·s·h, one micro-batch
    one = predict(model, Cluster(nodes=1), 8, ClusterStrategy(dp=1, tp=8)).parts["bytes_by_tier"]
    assert one == pytest.approx({"intra": 4 * 8 * 8 * bus_factor("all_reduce", 8) * act, "inter": 0.0})
    # tp=4 inside each 4-GPU node, pp=2 across the two: 8 micro-batches, 4 layers a rank
    two = predict(model, Cluster(nodes=2, gpus_per_node=4), 8, ClusterStrategy(pp=2, tp=4)).parts["bytes_by_tier"]
    assert two == pytest.approx({"intra": 4 * 4 * 8 * bus_factor("all_reduce", 4) * act, "inter": 2 * 8 * act / 4})


def test_the_search_tries_hsdp_beside_zero3_across_nodes_and_hsdp_crosses_them_a_tenth_as_much():
    """HSDP keeps ZeRO-3's three passes inside a node and sends only the shard's all-reduce
    across; flat ZeRO-3 sends every pass across, on all eight NICs of a node at once. Which is
    faster is a matter of the NICs against NVLink (on A100 presets flat ZeRO-3 at 64 GPUs; the
    test above prices each), what HSDP always buys is the inter-node bytes, at the states' memory."""
    from labkit.plan import search

    model, cluster = _model("llama3-8b", 8192), Cluster.of(64, "a100")
    ranked = search(model, cluster, 64, tp=1, pp=1, zero=(3,), recompute=("full",), microbatch_sizes=(1,),
                    dp_mode="bucketed").ranked
    assert sorted(p.strategy.dp_shard or 0 for p in ranked) == [0, 8]     # a node's 8 GPUs shard, 8 replicas
    hsdp, flat = sorted(ranked, key=lambda p: p.strategy.dp_shard is None)
    assert hsdp.parts["bytes_by_tier"]["inter"] < flat.parts["bytes_by_tier"]["inter"] / 10
    assert hsdp.memory["total"] > flat.memory["total"]                   # the price: states over 8, not 64
    assert ranked[0].step_time_s <= ranked[1].step_time_s


# -- attention at its kernel's measured rate ------------------------------------------------------

def test_attention_is_the_flash_kernels_causal_half_at_its_measured_rate_on_h100():
    import dataclasses

    from labkit.plan.scale.step import attention_times, layer_times

    model = Decoder(layers=2, hidden=4096, heads=32, kv_heads=8, ffn_hidden=8192, vocab=1000, seq=32768)
    s = ClusterStrategy(tp=8, cp=4, cp_mode="allgather", sequence_parallel=True)
    full = 4 * (32768 // 4) * 32768 * 4096 / 8              # QKᵀ and PV over the full square, one tp rank
    h100 = Cluster.of(64, "h100")
    forward, backward = h100.hardware.attention_flops
    assert attention_times(model, h100, s) == pytest.approx((full / 2 / forward, 2.5 * full / 2 / backward))
    # without a measured kernel: the full square as GEMMs, backward twice forward (SC21's A100 runs)
    a100 = Cluster.of(64, "a100")
    t = full / (a100.hardware.peak_flops * a100.hardware.efficiency(512))
    assert attention_times(model, a100, s) == pytest.approx((t, 2 * t))
    # the layer carries exactly that core: twice the kernel's rate takes half of it off the layer
    fast = dataclasses.replace(h100, hardware=dataclasses.replace(h100.hardware, attention_flops=(2 * forward,
                                                                                                    2 * backward)))
    (f, b, *_), (f2, b2, *_) = layer_times(model, h100, s, "dense", 0.0), layer_times(model, fast, s, "dense", 0.0)
    core_f, core_b = attention_times(model, h100, s)
    assert (f - f2, b - b2) == pytest.approx((core_f / 2, core_b / 2))


def test_a_ring_across_nodes_runs_on_every_nic_its_group_has_there_and_an_all_to_all_on_one():
    """A DGX has a NIC per GPU and NCCL a ring per NIC: a group with k GPUs of each node moves its
    ring's bytes on k NICs at once (192 GB/s all-reduce busbw on 8 HDR NICs, NVIDIA/nccl#812),
    bounded by NVLink; one GPU a node has one NIC; an all-to-all cannot spread (nccl-tests#267)."""
    from dataclasses import replace

    from labkit.plan import AlphaBeta, ModelShape

    cluster, S = Cluster(nodes=4), 1e9                                  # 32 A100s, 8 a node
    hw = cluster.hardware
    assert cluster.seconds("all_reduce", S, 32, 32) == pytest.approx(hw.ib.alpha + 2 * 31 / 32 * S / (8 * hw.ib.beta))
    assert cluster.seconds("all_gather", S, 16, 32) == pytest.approx(hw.ib.alpha + 15 / 16 * S / (4 * hw.ib.beta))
    assert cluster.seconds("all_reduce", S, 4, 32) == pytest.approx(hw.ib.alpha + 2 * 3 / 4 * S / hw.ib.beta)
    assert cluster.seconds("all_to_all", S, 32, 32) == pytest.approx(hw.ib.alpha + 3 / 4 * S / hw.ib.beta)
    assert cluster.seconds("send", S, 2, 16) == pytest.approx(hw.ib.alpha + S / hw.ib.beta)
    assert cluster.seconds("all_reduce", S, 8, 8) == pytest.approx(hw.nvlink.seconds("all_reduce", S, 8))
    fast = Cluster(nodes=4, hardware=replace(hw, ib=AlphaBeta(beta=100e9, alpha=20e-6)))     # 800 GB/s of NICs a node
    assert fast.seconds("all_reduce", S, 32, 32) == pytest.approx(hw.nvlink.seconds("all_reduce", S, 32))
    # FSDP over 64 A100s: the weights' gathers ride all eight NICs, so ZeRO-3 is no longer 8× the all-reduce's time
    from labkit.plan.scale.step import stage_costs

    model = ModelShape(layers=24, hidden=2048, heads=16)
    n = model.rank_params(1)[0]
    gather = hw.ib.alpha + 63 / 64 * 2 * n / (8 * hw.ib.beta)           # all-gather ×2, reduce-scatter
    assert stage_costs(model, Cluster(nodes=8), ClusterStrategy(dp=64, zero=3)).dp_sync == pytest.approx(3 * gather)
