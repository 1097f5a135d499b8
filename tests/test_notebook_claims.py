"""Every figure backs its text: on the same execution as ``test_notebooks.py``, each cell
that promises a figure shows one, and the numbers the markdown talks about hold.

A cell promises a figure when it draws (``.plot(``, ``plt.subplots(``, ``plot_…(``). The
claims are read from the notebook's own variables at the end of the run (the probe cell of
``conftest.executed_notebook``), never re-measured here.
"""
from __future__ import annotations

import pathlib
import re
import statistics

import pytest

import labkit
from conftest import executed_notebook

pytestmark = pytest.mark.slow        # it executes the notebooks: engines started

HERE = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
DRAWS = re.compile(r"\.plot\(|plt\.subplots\(|\bplot_\w+\(")
INTERACTIVE = re.compile(r"\binteract(_manual)?\(")


def figure_cells_without_a_figure(nb) -> list[int]:
    """Indexes of code cells that draw but show no image."""
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not DRAWS.search(cell.source):
            continue
        if INTERACTIVE.search(cell.source):
            continue      # drawn into the widget's own output area, kept in widget state, not the cell's
        shown = any(o.get("output_type") in ("display_data", "execute_result")
                    and ("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {}))
                    for o in cell.get("outputs", []))
        if not shown:
            missing.append(i)
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_figure_cell_shows_a_figure(path):
    nb, _ = executed_notebook(path)
    assert figure_cells_without_a_figure(nb) == []


def notebook(stem: str):
    return executed_notebook(HERE / f"{stem}.ipynb")


def test_02_bubble_falls_with_m_and_follows_the_formula():
    """02's text: the schedule's bubble falls with m and stays within −0.05 / +0.10 of
    (p−1)/(m+p−1); the whole measured bubble falls from m = 1 to 4 (beyond, the lab's overhead
    can make it stall or rise: 4 times in 20 from 4 to 16 in bench_claims --load 1).

    The formula holds for stages that cost the same; 02 sweeps a model whose two stages do
    (a thin input layer: with 8 equal layers split by parameters, stage 0's backward is ~0.77
    of stage 1's, since its first layer computes no input gradient). The formula describes the
    schedule's idle time, so the band is checked on ``schedule_bubble_fraction``; the lab's
    per-action overhead is idle time outside the schedule and only adds to ``bubble_fraction``
    (on a loaded CI machine it reached 0.09 at m = 16 while the schedule part read 0.08 against
    0.06). Stalls of one stage that show up as its neighbour's wait land in the schedule part,
    hence the asymmetric band. "Falls" is checked on the schedule part over each quadrupling of
    m (and from 1 to 2), where the formula drops by at least 0.14, so a stall cannot flip it; a schedule
    that serialises the stages (0.5 at every m) or idles far more than the formula fails.
    """
    _, v = notebook("02_pipeline")
    sweep, measured, scheduled, formula = v["sweep"], v["measured"], v["scheduled"], v["formula"]
    assert len(measured) == len(scheduled) == len(sweep) >= 5 and sweep[:3] == [1, 2, 4] and sweep[-1] >= 16
    split = {m: {k: round(r[k], 3) for k in ("schedule_bubble_fraction", "lab_overhead_fraction",
                                             "exposed_comm_fraction")}
             for m, r in v.get("swept.metrics", {}).items()}
    for m, got, total, want in zip(sweep, scheduled, measured, formula):
        assert want - 0.05 <= got <= want + 0.10, \
            f"m={m}: schedule_bubble_fraction {got:.3f}, formula {want:.3f}; {split}"
        assert total >= got - 1e-9, f"m={m}: bubble_fraction {total:.3f} < its schedule part {got:.3f}"
    assert scheduled[1] < scheduled[0] and all(b < a for a, b in zip(scheduled, scheduled[2:])), \
        f"schedule_bubble_fraction not falling with m: {scheduled}"
    assert measured[2] < measured[0], f"bubble_fraction not lower at m=4 than at m=1: {measured}"


def test_02_interleaving_sends_three_times_the_messages_and_is_not_faster_here():
    """02's text: with p = 2, v = 2 a micro-batch crosses ranks vp − 1 = 3 times each way, so
    interleaved sends three times the messages and the bytes of GPipe and 1F1B (counted from the
    schedule and from each run's bytes, which no load moves) and runs twice the compute actions;
    on this machine it comes out slower than GPipe (median of three pairs), and the verdict
    never calls it faster."""
    _, v = notebook("02_pipeline")
    assert v["sends"] == {"gpipe": 4, "1f1b": 4, "interleaved": 12}, v["sends"]
    assert v["computes"] == {"gpipe": 8, "1f1b": 8, "interleaved": 16}, v["computes"]
    kib = v["kib_sent"]
    assert kib["interleaved"] == pytest.approx(3 * kib["gpipe"]) and kib["1f1b"] == pytest.approx(kib["gpipe"]), kib
    res = labkit.Comparison.of(v["step_times"])
    assert res.median("interleaved") > res.median("gpipe") and res.faster in (None, "gpipe"), res.verdict


def test_01_overlap_hides_comm_that_bucketed_exposes():
    """01's text, on the emulated link (comm as long as backward, off the CPU): bucketed reduces
    after backward (no overlap); overlap and ddp launch buckets while backward runs, so their
    comm overlaps compute; overlap's median exposed comm time is below bucketed's (how far below,
    and in how many pairs under three quarters, the notebook prints and its text gives as ranges
    measured by bench_claims --load 1); the exposed-comm verdict never crowns bucketed; one 8 MiB
    bucket overlaps nothing. The step-time verdict is printed by labkit.compare, which
    says "within noise" when the load swings more than overlap saves; bench_claims counts it."""
    _, v = notebook("01_data_parallel")
    m = v["runs.metrics"]
    assert m["bucketed"]["overlap_fraction"] < 0.05
    for mode in ("overlap", "ddp"):
        assert m[mode]["overlap_fraction"] > 0.2, (mode, m[mode]["overlap_fraction"])
    exposed = v["exposed_s"]
    assert len(exposed["bucketed"]) == len(exposed["overlap"]) == 5
    assert v["ahead"] == sum(o < 0.75 * b for b, o in zip(exposed["bucketed"], exposed["overlap"])), exposed
    assert statistics.median(exposed["overlap"]) < statistics.median(exposed["bucketed"]), exposed
    assert labkit.Comparison.of(exposed).faster in ("overlap", None), exposed
    shares = v["under_compute"]
    assert shares["one 8 MiB bucket"] < 0.05 < 0.2 < shares["0.5 MiB buckets"], shares


def test_04_bytes_of_ring_and_parameter_server_as_the_text_says():
    """04's text: the server's busiest rank sends (n−1)·S, growing with n; the ring's
    2(n−1)/n·S < 2·S whatever n. (Times on CPU are explained in the text, not claimed.)"""
    _, v = notebook("04_communication")
    S = v["S"]
    for row in v["rows"]:
        n, busiest = row["n"], max(row["bytes"])
        if row["algorithm"] == "ps":
            assert busiest == pytest.approx((n - 1) * S, rel=0.01)
        else:
            assert busiest == pytest.approx(2 * (n - 1) / n * S, rel=0.01) and busiest < 2 * S


def test_04_on_the_emulated_link_times_follow_the_bytes():
    """04's text: on the emulated link the server takes 2(n−1)·S/β and the ring 2(n−1)/n·S/β, n
    times less, both on their α-β lines (the ring up to a fifth above), and the sendrecv fit over
    large messages finds the link's bandwidth to within a fifth. Raw gloo's rows and the busbw of
    the hand-written all-reduces against torch's are shown, not claimed."""
    _, v = notebook("04_communication")
    rows = [r for r in v["rows"] if r["link"] == "emulated"]
    assert rows, "no emulated rows"
    for r in rows:
        # lower bound: a call never ends before its link allows. Upper: α-β leaves out CPU work
        # (Thakur's γ term: the adds, and here the lab's own work per message); the ring does it
        # in each of its 2(n−1) dependent steps, the server once, and a loaded machine stretches it
        upper = 1.25 if r["algorithm"] == "ring" else 1.10
        assert 0.99 * r["predicted"] <= r["time"] <= upper * r["predicted"], r
    by = {(r["n"], r["algorithm"]): r["time"] for r in rows}
    for n in sorted({r["n"] for r in rows}):
        assert by[n, "ring"] < by[n, "ps"], (n, by)
        assert by[n, "ps"] / by[n, "ring"] >= 0.8 * n, (n, by)
    # the link's β to within a fifth, fitted on 256 KiB – 4 MiB messages (5–84 ms each on the link: a millisecond's stall moves them a few %)
    assert v["fit_beta_emulated"] == pytest.approx(50e6, rel=0.2)


def test_04_incast_lasts_the_busiest_receivers_time_and_only_dp_crosses_nodes():
    """04's text: in the all-to-all into rank 0 every rank, senders included, takes about rank
    0's (n−1)·(α + S/β); on two nodes of two with dp=2 × tp=2, each rank sent exactly its
    parameters' bytes between nodes per step (the gradient all-reduce, n = 2) and the tp
    all-reduces inside."""
    _, v = notebook("04_communication")
    for took in v["incast_seconds"]:
        # lower bound: the link's; upper: one exchange of 240 ms, the barrier's skew and the
        # lab's own per-call time on top (the server's single phase gets 1.10 above)
        assert 0.99 * v["incast_predicted"] <= took <= 1.2 * v["incast_predicted"], v["incast_seconds"]
    if "tiers" in v:              # 4 engines or more
        for rank, (intra, inter) in enumerate(zip(v["tiers"]["intra"], v["tiers"]["inter"])):
            assert inter == v["tier_parameter_bytes"][rank] and intra > 0, v["tiers"]


def test_04_placement_moves_the_bytes_and_hsdp_keeps_the_slow_link_light():
    """04's text: with 2,048 rows tp moves more than dp, so tp across nodes puts its bytes on the
    slow link and takes longer than tp inside; HSDP sends less than a quarter of ZeRO-3's bytes
    between nodes, holds twice the parameters a rank, has the shorter step, and both match one
    process."""
    _, v = notebook("04_communication")
    if "placed" not in v:         # fewer than 4 engines
        return
    inside, across = (v["placed"][w].metrics for w in ("inside", "across"))
    tp_bytes, dp_bytes = inside["bytes_sent_by_tier"]["intra"][0], inside["bytes_sent_by_tier"]["inter"][0]
    assert tp_bytes > 5 * dp_bytes, (tp_bytes, dp_bytes)
    assert across["bytes_sent_by_tier"]["inter"][0] == tp_bytes and across["bytes_sent_by_tier"]["intra"][0] == dp_bytes
    assert across["step_time_s"] > inside["step_time_s"], (across["step_time_s"], inside["step_time_s"])
    zero3, hsdp = (v["sharded"][n] for n in ("ZeRO-3 over 4", "HSDP 2 x 2"))
    assert hsdp.metrics["bytes_sent_by_tier"]["inter"][0] < zero3.metrics["bytes_sent_by_tier"]["inter"][0] / 4
    assert hsdp.metrics["memory_bytes"][0]["params"] == 2 * zero3.metrics["memory_bytes"][0]["params"]
    assert hsdp.metrics["step_time_s"] < zero3.metrics["step_time_s"]
    for run in (zero3, hsdp):
        assert run.max_diff(v["one_process"]) < 1e-5


# -- the claims of notebooks 07, 08, 10 and 11 (each checked on the notebook's own run) ------------
def test_07_tp_pays_in_exposed_comm():
    """07's text: at both widths TP leaves a larger share of its step in exposed comm than PP.
    Its fall with width is theory the text does not claim from the table (it moved by less than
    the noise: 0.701 → 0.704 in one run); which one is faster is printed, not claimed."""
    _, v = notebook("07_tensor_parallel")
    rows = {(w, "tp" if "tp=2" in name else "pp"): exposed for w, name, _, exposed, _ in v["rows"]}
    for width in (64, 256):
        assert rows[width, "tp"] > rows[width, "pp"], rows


def test_08_prefetch_overlaps_more_of_the_gathers():
    """08's text, on the emulated link at batch 1024: prefetch=1 raises the share of ZeRO-3's
    comm that overlaps compute clearly (checked: by more than 0.05; it rose by 0.10–0.26 in twenty
    trials of bench_claims --load 1, about 0.3 on a quiet machine); on raw gloo it rises too.
    Step time is not claimed (it moved either way)."""
    _, v = notebook("08_sharding")
    overlap, raw = v["prefetch_overlap"], v["prefetch_raw"]
    assert overlap["1"] > overlap["0"] + 0.05, overlap
    assert raw["1"] > raw["0"], raw


def test_10_the_curves_learn_and_precision_orders_the_departures():
    """10's text: the reference's loss falls from ~0.46 to ~0.14; every codec but PowerSGD stays
    on it; the parameters' departure follows the precision (deterministic on CPU)."""
    _, v = notebook("10_precision")
    losses, gap = v["curve_losses"], v["curve_gaps"]
    ref = losses["reference"]
    assert ref[-1] < 0.5 * ref[0], ref
    for label in ("fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"):
        assert abs(losses[label][-1] - ref[-1]) < 1e-3, (label, losses[label][-1], ref[-1])
    assert losses["powersgd"][-1] > ref[-1] + 0.02
    assert gap["fp32"] < gap["fp16"] < min(gap["bf16"], gap["int8"])
    assert max(gap["bf16"], gap["int8"]) < gap["fp8_e4m3"] < gap["fp8_e5m2"] < gap["powersgd"], gap


def test_10_int8_pays_below_the_alpha_beta_crossover_of_its_whole_path():
    """10's bandwidth section, on the emulated link: at 3 MB/s int8 cuts the step by more than
    40 %; int8 wins at every swept bandwidth below β*/3 and loses at every one above 3β*, β* from
    int8's whole cost t (a point on each side, so the check cannot pass empty); and the codec's
    time alone puts β* too high (t is more than the codec: by 1.5–3× in the runs behind the
    text, 1.49 in one CI run; the text gives the run's own factor, this checks it is clearly
    above 1)."""
    _, v = notebook("10_precision")
    ms, star = v["bw_ms"], v["beta_star"]
    assert ms["3e+06"]["int8"] < 0.6 * ms["3e+06"]["none"], ms
    wins = [b for b in v["betas"] if b <= star / 3]
    losses = [b for b in v["betas"] if b >= 3 * star]
    assert wins and losses, (star, v["betas"])
    for b in wins:
        assert ms[f"{b:g}"]["int8"] < ms[f"{b:g}"]["none"], (b, star, ms)
    for b in losses:
        assert ms[f"{b:g}"]["int8"] > ms[f"{b:g}"]["none"], (b, star, ms)
    assert v["beta_codec"] > 1.25 * star, (v["beta_codec"], star)


def test_10_planted_faults_are_found_where_the_text_says():
    """10's sections 2 and 3: the skipped write-back is a sync bug at step 2, layer 2, rank 1;
    the wrong factor is found at step 1, layer 0, with the replicas agreeing."""
    nb, _ = notebook("10_precision")
    skip = cell_text(nb, 'SyncFault("skip"')
    assert "step 2, parameter '2.weight', rank 1" in skip and "a sync bug" in skip, skip
    factor = cell_text(nb, 'SyncFault("factor"')
    assert "step 1, parameter '0.weight'" in factor and "math or precision" in factor, factor
    assert not any("labkit.strategies" in c.source for c in nb.cells)


def test_11_zero_bubble_schedules_idle_less_and_zbv_sends_twice_the_bytes():
    """11's text: with this run's own costs and free messages the zero-bubble schedules idle
    less than 1F1B (ZB-V least); ZB-V's two chunks send twice 1F1B's bytes. (That its exposed
    comm is the largest held 9 times in 10: counted by benchmarks/bench_claims.py.)"""
    _, v = notebook("11_bubbles_and_memory")
    sim, m = v["simulated"], v["runs.metrics"]
    assert sim["zbv"] < sim["zb-h1"] < sim["1f1b"], sim
    assert m["zbv"]["bytes_sent"][0] == pytest.approx(2 * m["1f1b"]["bytes_sent"][0], rel=0.01)


def test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says():
    """14's text: the MoE model's active parameters are the dense one's (plus the routers'),
    its total has twice the MLP; its ep=1 all-reduce sends more than the dense one's; each
    dispatch is within 10% of tokens·top_k·hidden·4·(ep−1)/ep and the bytes per rank fall with
    ep; the skewed router sends every token to rank 0, whose group waits longer than it in the
    combine and the dispatch's backward; the balance loss brings the last 15 steps' imbalance
    below 1.3 (from above 1.35); the overlap leaves less of the all-to-all exposed on the
    emulated link (the link's time, waited off the CPU, sets the exchange, not the machine's load)."""
    _, v = notebook("14_experts")
    (dense_total, dense_active), (moe_total, moe_active) = v["params"]["dense"], v["params"]["moe"]
    routers, mlp = 2 * 64 * 4, 2 * 3 * 64 * 256
    assert moe_active - dense_active == routers and moe_total - dense_total == mlp + routers
    assert v["allreduce_bytes"]["moe"] > v["allreduce_bytes"]["dense"]
    measured, formula, sent = v["measured"], v["formula"], v["expert_allreduce"]
    assert measured["1"] == 0
    for ep in ("2", "4"):
        assert 0.9 <= measured[ep] / formula[ep] <= 1.1, (ep, measured, formula)
    assert sent["1"] > sent["2"] > sent["4"], sent
    assert v["per_rank_tokens"] == [512, 0, 0, 0]
    waits = v["waits"]
    assert min(waits[1:]) > waits[0], waits
    late = v["late"]
    assert late["0.0"] > 1.35 and late["0.1"] < 1.3, late
    exposed = v["exposed"]
    assert exposed["microbatch"] < exposed["none"], exposed


def cell_text(nb, marker: str) -> str:
    """The stdout of the code cell whose source contains ``marker``."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_03_who_talks_to_whom_names_peer_ranks():
    """03's text: sends stay inside a pipeline, all-reduces pair rank 0 with 2 and 1 with 3."""
    nb, _ = notebook("03_hybrid")
    text = cell_text(nb, "talks = {}")
    for line in ("rank 0:      send → ranks [1]", "rank 0: allreduce → ranks [2]",
                 "rank 3: allreduce → ranks [1]"):
        assert line in text, text


def test_06_the_straggler_text_names_what_the_report_names():
    """06's text: the report names step 1's start barrier and calls rank 1 a straggler."""
    nb, _ = notebook("06_troubleshooting")
    text = cell_text(nb, "def slow_data")
    assert "start of step 1" in text and "straggler" in text and "rank 1" in text, text


STRAY_REPR = re.compile(r"^(<[\w.]+ (object )?at 0x|<matplotlib|Text\(|\(-?\d+\.\d+, -?\d+\.\d+\)$|\[<matplotlib)")
COURSE = ["00_start_here", "02_pipeline", "03_hybrid", "05_playground", "06_troubleshooting",
          "07_tensor_parallel", "08_sharding", "10_precision", "11_bubbles_and_memory", "13_long_sequences",
          "14_experts", "15_reading_a_big_run", "16_checkpoints"]


@pytest.mark.parametrize("stem", COURSE)
def test_no_cell_shows_a_figure_twice_or_a_stray_repr(stem):
    """A cell shows each figure once (no returned Figure beside the inline one) and no repr of
    a matplotlib artist, an axis limit or a generator left as its last expression."""
    nb, _ = notebook(stem)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        images = sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))
        stray = [o["data"].get("text/plain", "")[:60] for o in cell.get("outputs", [])
                 if o.get("output_type") == "execute_result" and STRAY_REPR.search(o["data"].get("text/plain", ""))]
        assert images <= 1 and not stray, (i, images, stray)


def test_05_run_all_leaves_the_tours_answers_to_the_reader():
    """05: Run All prints no tour verdict, no sweep and no answer; the checks only ask."""
    nb, _ = notebook("05_playground")
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    and ("course.check(" in c.source or "bucket_sweep" in c.source)
                    for o in c.get("outputs", []) if o.get("output_type") == "stream")
    for answer in ("Goal reached", "Right", "bucketed ms", "Overlap stops helping", "GPipe idles"):
        assert answer not in shown, shown
    assert "Make a guess first" in shown and "Put your answer in" in shown


def test_15_the_big_run_is_exact_and_the_planted_straggler_is_named_by_both_lenses():
    """15's text: the 16-rank run is exact; stage 0's replicas enter the all-reduce far apart
    and leave it close together, rank 10 having computed longest; the report names rank 10
    first (compute), a waiter right after it; the profiler's report names ranks 10 and 11; the
    synthetic GPU trace names rank 5 (compute), whose non-compute time is short while the
    others wait."""
    _, g = notebook("15_reading_a_big_run")
    assert g["exact"] < 1e-5
    assert g["exit_spread_ms"] < g["entry_spread_ms"] / 2, (g["exit_spread_ms"], g["entry_spread_ms"])
    assert g["slowest_stage0"] == 10
    assert (g["named"], g["cause"]) == (10, "compute"), (g["found_ranks"], g["found_causes"])
    if 11 in g["found_ranks"]:
        assert g["found_ranks"].index(11) == 1 and g["found_causes"][1] == "waiting on rank 10"
    assert set(g["prof_named"][:2]) == {10, 11}, g["prof_named"]
    assert (g["gpu_named"], g["gpu_cause"]) == (5, "compute")
    waits = {int(r): ms for r, ms in g["wait_ms"].items()}
    assert waits[5] < min(ms for r, ms in waits.items() if r != 5) / 3, waits


def test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula():
    """13's text: memory per rank doubles with the sequence and divides by cp; cp=4 equals one
    process; part of the ring's hop time runs under attention; contiguous, the last rank's
    attention takes at least twice the first's; each mode sends its formula's bytes (ring the
    most, Ulysses the least); the all-gather holds the most, ring and Ulysses within a tenth."""
    _, v = notebook("13_long_sequences")
    memory, seqs = v["memory"], v["SEQS"]
    for cp, by_seq in memory.items():
        for short, long in zip(seqs, seqs[1:]):
            assert by_seq[str(long)] / by_seq[str(short)] == pytest.approx(2, rel=0.05), memory
        for seq in seqs:
            assert by_seq[str(seq)] / memory["1"][str(seq)] == pytest.approx(1 / int(cp), rel=0.1), memory
    assert v["exact"] <= 1e-5
    assert v["hidden_all"] > 0, v["hidden"]
    split = v["split"]
    assert split["balanced"]["pairs"] == [8.0] * 4 and split["contiguous"]["pairs"] == [2.0, 6.0, 10.0, 14.0]
    contiguous = split["contiguous"]["attention_ms"]
    assert contiguous[3] > contiguous[0], contiguous      # the text: longer (its work 7×; measured 1.8–2×+)
    modes = v["modes"]
    for mode, m in modes.items():
        assert m["sent"] == [m["formula"]] * 4, (mode, m)
        assert m["exact"] <= 1e-5, (mode, m)
    assert modes["ring"]["formula"] > modes["allgather"]["formula"] > modes["ulysses"]["formula"]
    peak = {mode: m["peak"] for mode, m in modes.items()}
    assert peak["allgather"] > max(peak["ring"], peak["ulysses"]), peak
    assert peak["ulysses"] == pytest.approx(peak["ring"], rel=0.1), peak


def test_09_cp_divides_activations_and_the_long_context_row_is_predicted():
    """09's text: activations per GPU fall as 1/cp and only cp = 16 fits; the Llama 3 CP16 row is predicted (all-gather cp)
    beside the other published rows, and the notebook ends with its two checked questions."""
    nb, v = notebook("09_plan_at_scale")
    acts = v["activations_gb"]           # JSON keys
    assert acts["1"] / acts["4"] == pytest.approx(4, rel=0.02) and acts["4"] / acts["16"] == pytest.approx(4, rel=0.02)
    assert v["fits"] == {"1": False, "4": False, "16": True}          # only the paper's cp = 16 fits, as it ran
    long = v["long_context"]
    assert long["error"] == long["error"] and long["cp_mode"] == "allgather"      # a number, not NaN
    last = [c.source for c in nb.cells if c.cell_type == "code"][-2]
    assert 'course.check("cp_tokens"' in last and 'course.check("zero3_forward"' in last


def test_09_every_torchtitan_row_is_priced_faster_than_it_ran():
    """09's figure text: the torchtitan rows all sit right of zero (predicted above published)."""
    _, v = notebook("09_plan_at_scale")
    rows = v["row_errors"]
    assert len(rows) == 4 and len(rows["torchtitan FSDP, A100"]) == 8, rows
    assert all(e > 0 for e in rows["torchtitan FSDP, A100"]), rows


def test_09_the_new_axes_are_predicted_beside_their_runs():
    """09's text: each cp mode and ep is predicted beside its run. Which side of its run the MoE
    model's prediction lands is not claimed: it was short on a quiet machine and above on a
    loaded one (the planner's machine numbers are measured on the same busy cores)."""
    _, v = notebook("09_plan_at_scale")
    axes = v["new_axes"]
    assert set(axes) == {"cp=2 ring", "cp=2 allgather", "cp=2 ulysses", "dp=2 ep=2", "Mixtral dp=2 ep=2"}
    assert all(a["predicted_ms"] > 0 and a["measured_ms"] > 0 for a in axes.values()), axes


def test_09_the_predicted_path_crosses_the_stages_and_the_measured_one_is_read_the_same_way():
    """09's text: the predicted 1F1B step's critical path holds compute of both stages (stage 0's
    backward waits on stage 1's gradient). The measured path is not claimed to: on a loaded CI
    machine it began in rank 1's own late start (its untraced host time, 44 % of the path) and
    held none of rank 0's compute. Both verdicts' shares sum to their path."""
    _, v = notebook("09_plan_at_scale")
    paths = v["paths"]
    assert set(paths) == {"predicted", "measured"}
    assert "rank 0's compute" in paths["predicted"] and "rank 1's compute" in paths["predicted"], paths
    for side, shares in paths.items():
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01), (side, shares)
    assert any(what.endswith("compute") for what in paths["measured"]), paths


EXERCISED = ["00_start_here", "01_data_parallel", "02_pipeline", "03_hybrid", "04_communication",
             "06_troubleshooting", "07_tensor_parallel", "08_sharding", "09_plan_at_scale", "10_precision",
             "11_bubbles_and_memory", "12_bring_your_model", "13_long_sequences", "14_experts",
             "15_reading_a_big_run", "16_checkpoints"]


@pytest.mark.parametrize("stem", EXERCISED)
def test_the_closing_exercise_asks_and_holds_its_answer_back(stem):
    """Each of these notebooks ends with exercises checked by labkit.course: Run All prints the
    question, never the verdict or the answer."""
    nb, _ = notebook(stem)
    cells = [c for c in nb.cells if c.cell_type == "code" and "course.check(" in c.source]
    assert cells, f"{stem} has no checked exercise"
    shown = "".join(o.get("text", "") for c in cells for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert shown.count("Put your answer in") == sum(c.source.count("course.check(") for c in cells), shown
    assert "Right" not in shown and "Not yet" not in shown, shown


def test_10_the_link_holds_the_path_and_a_four_times_faster_link_more_than_halves_the_step():
    """10's section 7: on 20 MB/s the buckets' all-reduces hold most of the path; a link four times
    faster makes the step more than twice as fast, replayed and measured alike, and not four times."""
    _, g = notebook("10_precision")
    assert g["why_first"].startswith("the allreduces of ranks"), g["why_first"]
    assert 2.0 < g["predicted_speedup"] < 4.0, g["predicted_speedup"]
    assert 2.0 < g["measured_speedup"] < 4.0, g["measured_speedup"]


def test_15_the_path_runs_through_the_straggler_and_healing_it_shortens_the_step():
    """15: the critical path's compute is rank 10's, straggler_scores ranks it worst, the GPU
    trace's path is rank 5's; the replay without the straggler is much shorter than the step."""
    _, g = notebook("15_reading_a_big_run")
    assert g["bound_rank"] == 10 and g["worst_rank"] == 10
    assert g["gpu_bound_rank"] == 5
    assert g["healed_ms"] < 0.8 * g["slow_ms"], (g["healed_ms"], g["slow_ms"])


def test_16_resumed_runs_are_exact_and_the_weight_is_cut_as_the_text_says():
    """16's text: both resumes equal 5 straight steps; under dp2×tp2 (row-parallel ``down``) each
    rank holds every row and half of the columns, the dp replicas the same half; under dp2×pp2
    the stage of block 0 holds it whole and the other stage none; the plain file loads exactly."""
    _, g = notebook("16_checkpoints")
    assert g["exact"] < 1e-5
    assert g["same"] == 0
    halves = {0: [0, 12], 1: [13, 25]}
    for p in g["tp_pieces"]:
        assert (p["count"], p["rows"], p["cols"]) == (19 * 13, [0, 18], halves[p["rank"] % 2]), p
    counts = sorted(p["count"] for p in g["pp_pieces"])
    assert counts == [0, 0, 19 * 26, 19 * 26], g["pp_pieces"]


# -- every sentence that states a measured outcome is a known claim --------------------------------
# A sentence "states an outcome" when it compares or moves something (faster, falls, within, twice,
# the most, on every run, …). Each such sentence of each notebook is listed below by its opening
# words, with what backs it: the test in this module that checks it on the notebook's own run, or
# one of these kinds, none of which asserts a number of this machine:
KINDS = {
    "verdict": "printed by labkit.compare, which names a winner only when every repeated pair agrees "
               "by more than the spread, and otherwise says 'within noise'",
    "hedged": "says the outcome is not claimed here, or can go either way, and why",
    "method": "what a cell does, or what a setting is; not an outcome",
    "formula": "follows from a formula or the schedule's action lists, not from a measurement",
    "cluster": "what a GPU cluster shows, stated as such (not measured here)",
    "question": "an exercise or try-it question",
    "quoted": "a figure measured outside the notebook, quoted as such with its range",
}
OUTCOME = re.compile(r"\b(under three quarters|in every pair|faster|slower|shorter|longer than|beats?|wins?|loses|"
                     r"falls?|grows?|shrinks?|rises?|halves|doubles|more than|less than|within|run after run|"
                     r"every run|on every run|times (?:more|less|fewer|the|as)|twice|the most|the least|"
                     r"the largest|the smallest|reverses?|flips?)\b", re.I)


def outcome_sentences(nb) -> list[str]:
    """The markdown sentences that state an outcome (tables and headings left out)."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for block in re.split(r"\n\s*\n", cell.source):
            if block.lstrip().startswith(("|", "#")):
                continue
            text = re.sub(r"\s+", " ", block).strip()
            found += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*`(])", text) if OUTCOME.search(s)]
    return found


CLAIMS = {
    "01_data_parallel": [
        ('`labkit.compare` ran the two modes five times ea', 'verdict'),
        ("On the link overlap's median run leaves less co", test_01_overlap_hides_comm_that_bucketed_exposes),
        ('By how much depends on the machine: on a quiet o', 'quoted'),
        ("The link's time does not move with the load, but", 'hedged'),
        ('The step time usually follows, by about what was', 'verdict'),
        ('On a GPU cluster, where a NIC moves the bytes be', 'cluster'),
        ('(One bucket holding everything cannot leave befo', test_01_overlap_hides_comm_that_bucketed_exposes),
        ('A ring all-reduce of the gradients: going from d', 'question'),
    ],
    "02_pipeline": [
        ('1. how the model is split into stages; 2. the th', test_02_bubble_falls_with_m_and_follows_the_formula),
        ('`schedules.simulate` runs those lists with unit', 'method'),
        ('Read the figure: GPipe runs all forwards, then a', test_02_interleaving_sends_three_times_the_messages_and_is_not_faster_here),
        ('With p = 2 and v = 2 chunks a micro-batch crosse', test_02_interleaving_sends_three_times_the_messages_and_is_not_faster_here),
        ('The step-time line compares GPipe and interleave', 'verdict'),
        ("On this machine interleaved's median step is the", test_02_interleaving_sends_three_times_the_messages_and_is_not_faster_here),
        ("Stage 0's input is the data, whose gradient nobo", 'quoted'),
        ("On the left the schedule's lesson holds with num", test_02_bubble_falls_with_m_and_follows_the_formula),
        ('The measured `bubble_fraction` falls from m = 1', test_02_bubble_falls_with_m_and_follows_the_formula),
        ('That **per-action overhead** is paid 2m times a', 'hedged'),
    ],
    "03_hybrid": [
        ('* `Strategy(dp=1, pp=4)` or `Strategy(dp=4, pp=1', 'question'),
    ],
    "04_communication": [
        ('On the emulated link time follows those bytes: t', test_04_on_the_emulated_link_times_follow_the_bytes),
        ('On raw gloo the same runs need not follow the by', 'hedged'),
        ('`labkit.Link(gpus_per_node=2, inter_bandwidth=..', 'method'),
        ('With 2,048 rows it moves about six times more, a', test_04_placement_moves_the_bytes_and_hsdp_keeps_the_slow_link_light),
        ("Across nodes, tp's 3.1 MB per rank take the 20 M", test_04_placement_moves_the_bytes_and_hsdp_keeps_the_slow_link_light),
        ("HSDP sends less than a quarter of ZeRO-3's bytes", test_04_placement_moves_the_bytes_and_hsdp_keeps_the_slow_link_light),
        ('On a cluster the same trade decides `dp_shard`: ', 'cluster'),
        ('`Strategy(compression=...)` shrinks each gradien', 'method'),
        ('Same model, data and seed for every run below; o', 'method'),
        ('On a GPU that is cheap next to a slow network; o', 'hedged'),
        ('* `collectives.demo("ring", numel, repeats=5)` f', 'question'),
    ],
    "05_playground": [
        ("So it holds more than the schedule's idle time:", 'method'),
        ('The sweep says "same" whenever the difference is', 'verdict'),
    ],
    "06_troubleshooting": [
        ('The same report inside `lab.run`: here rank 1 is', 'method'),
        ('Some settings make every run look slow or hide e', 'method'),
    ],
    "07_tensor_parallel": [
        ('Four local CPU engines; every run is checked aga', 'method'),
        ('On 4 engines, `dp=2 × tp=2`: two replicas, each', 'method'),
        ('A blocking all-reduce also ends only when both t', 'hedged'),
        ('Each rank holds less than the whole model (the a', 'method'),
        ('TP sends `4·b·s·h` per layer on the critical pat', 'formula'),
        ('One thing holds on every run: at both widths TP', test_07_tp_pays_in_exposed_comm),
        ('In theory that share falls as the width grows, t', 'hedged'),
        ('Which of the two is *faster* at this size is not', 'hedged'),
    ],
    "08_sharding": [
        ('So this comparison runs a batch of 1024 (32 time', 'method'),
        ('Compare the comm lanes of the two timelines and', test_08_prefetch_overlaps_more_of_the_gathers),
        ('On raw gloo, printed below, it rises too, but th', test_08_prefetch_overlaps_more_of_the_gathers),
        ('ZeRO-3 gathers the parameters twice (forward and', 'formula'),
        ('Large runs combine them: TP within a node, FSDP', 'method'),
    ],
    "09_plan_at_scale": [
        ('`plan.measure(lab)` runs its own micro-benchmarks', 'method'),
        ("What the planner does not follow is the rest of", 'quoted'),
        ('Pick tp, pp, micro-batch size, recomputation and', 'method'),
        ('Activations grow with the sequence.', test_09_cp_divides_activations_and_the_long_context_row_is_predicted),
        ("More pipeline stages do not shrink a layer's act", 'formula'),
        ('Llama 3 405B at 131,072 tokens, 128 sequences a', test_09_cp_divides_activations_and_the_long_context_row_is_predicted),
        ('The torchtitan rows all sit right of zero: the p', test_09_every_torchtitan_row_is_priced_faster_than_it_ran),
        ("On every run the predicted path runs through bot",
         test_09_the_predicted_path_crosses_the_stages_and_the_measured_one_is_read_the_same_way),
        ('Here the "cluster" is this lab\'s two CPU engines', 'method'),
    ],
    "10_precision": [
        ('`Strategy(compression=...)` shrinks every bucket', 'formula'),
        ('The model is small enough to learn the synthetic', test_10_the_curves_learn_and_precision_orders_the_departures),
        ("The model learns: the reference's loss falls fro", test_10_the_curves_learn_and_precision_orders_the_departures),
        ('PowerSGD is the exception: its rank-1 factors of', test_10_the_curves_learn_and_precision_orders_the_departures),
        ('(These runs are deterministic on CPU: the same d', 'method'),
        ("(On GPUs, atomics in some kernels and NCCL's cho", test_10_the_curves_learn_and_precision_orders_the_departures),
        ('Each setting runs twice and the faster run is ke', 'method'),
        ('At 3 MB/s the uncompressed all-reduces take most', test_10_int8_pays_below_the_alpha_beta_crossover_of_its_whole_path),
        ('Away from β* the measurement follows the α-β lin', test_10_int8_pays_below_the_alpha_beta_crossover_of_its_whole_path),
        ('Slide β down and watch exposed comm take over th', 'question'),
        ('So a faster link should help — by how much?', 'question'),
        ("And one on section 7: which rank's compute does", 'question'),
        ('A link four times faster makes the step more tha',
         test_10_the_link_holds_the_path_and_a_four_times_faster_link_more_than_halves_the_step),
    ],
    "11_bubbles_and_memory": [
        ("`full` keeps only each block's input; `selective", 'method'),
        ('Same work on every row, so the rows end where th', 'formula'),
        ('Every run is checked against one process.', 'method'),
        ("* **unequal costs**: on CPU `W` is not `I`'s twi", 'hedged'),
        ("The schedule's claim is the simulated column, wi", test_11_zero_bubble_schedules_idle_less_and_zbv_sends_twice_the_bytes),
        ('**And the step time?** Not reliably shorter here', 'hedged'),
        ('At p = 2 the ideal gain is small (0.111 → 0.040', 'hedged'),
        ('And the split is only free if `I + W = B`: the p', 'quoted'),
        ("The paper's gain assumes GPU matrix multiplies s", 'cluster'),
    ],
    "12_bring_your_model": [
        ('This notebook brings three such models to the la', 'method'),
        ('Data parallelism (gradients averaged while backw', 'method'),
        ('The planner counts what these layers cost at ful', 'formula'),
        ('To bring your own model: `lab.run(strategy, mode', 'method'),
    ],
    "13_long_sequences": [
        ("A transformer's activations grow with the sequen", test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('Straight lines: **doubling the sequence doubles', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('What is left grows with T, and at 128k tokens an', 'formula'),
        ('Every run of the course is checked; here `cp=4`', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('Below them, on the comm lane, the hop `cp kv j`', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('With the sequence cut into contiguous slices, ra', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('Contiguous, the last rank computes attention lon', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('The measured bars are the illustration, and they', 'hedged'),
        ('On a cluster, where each rank has a GPU of its o', 'cluster'),
        ('The ring sends the most (its blocks travel again', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('With 4 key/value heads as many as query heads, U', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
        ('The ring and Ulysses hold about the same (within', test_13_cp_divides_memory_the_ring_overlaps_and_the_modes_send_the_formula),
    ],
    "14_experts": [
        ('The MoE model has 4 experts of width 128 and sen', test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says),
        ('Every run equals one process.', 'method'),
        ('The measured column stays within 10% of the form', test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says),
        ('`KiB sent / rank` counts every byte, all-to-alls', test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says),
        ('One step of `ep=4`: per layer, a small exchange', 'method'),
        ('Without the loss the router keeps its skew (and', test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says),
        ('`ep_overlap="microbatch"` cuts each layer\'s toke', 'method'),
        ('With the overlap the comm lanes carry two exchan', test_14_experts_bytes_straggler_balance_and_overlap_as_the_text_says),
        ('And every exchange also costs the machine a litt', 'hedged'),
    ],
    "15_reading_a_big_run": [
        ('16 engines on a laptop share its cores (labkit w', 'method'),
        ('**These traces are synthetic**: built by `tests/', test_15_the_big_run_is_exact_and_the_planted_straggler_is_named_by_both_lenses),
        ('The replay without the straggler is much shorter',
         test_15_the_path_runs_through_the_straggler_and_healing_it_shortens_the_step),
    ],
    "16_checkpoints": [
        ('Under ZeRO-3 a block is one flat unit of its six', test_16_resumed_runs_are_exact_and_the_weight_is_cut_as_the_text_says),
        ('Now resume the same checkpoint under dp = 2 × tp', test_16_resumed_runs_are_exact_and_the_weight_is_cut_as_the_text_says),
    ],
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_outcome_the_markdown_states_is_a_known_claim(path):
    """A sentence that states an outcome and is not listed in CLAIMS fails here: check it in a
    test of this module (or say what backs it, from KINDS) and list it. A listed sentence that
    is gone fails too, so the list never claims more than the notebook says. Reads the
    notebook's source; nothing is executed."""
    import nbformat

    said = outcome_sentences(nbformat.read(path, as_version=4))
    known = CLAIMS.get(path.stem, [])
    unknown = [s for s in said if not any(s.startswith(opening) for opening, _ in known)]
    assert not unknown, f"{path.stem} states outcomes no test knows; check them and list them in CLAIMS: {unknown}"
    gone = [opening for opening, _ in known if not any(s.startswith(opening) for s in said)]
    assert not gone, f"{path.stem}: CLAIMS lists sentences the notebook no longer says: {gone}"
    for opening, backing in known:
        assert callable(backing) and backing.__name__.startswith("test_") or backing in KINDS, (opening, backing)
