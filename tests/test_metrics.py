"""Metric maths on hand-made events with answers worked out by hand (labkit.analysis.metrics)."""

import pytest

from labkit.analysis import metrics
from labkit.analysis.metrics import per_rank_metrics, speedup, step_metrics

DESIGN_KEYS = {"step_time_s", "throughput_samples_s", "comm_fraction", "exposed_comm_fraction",
               "overlap_fraction", "bubble_fraction", "bytes_sent", "peak_activation_bytes"}


def ev(rank, stream, kind, start, end, step=0, microbatch=None, nbytes=0, peer=None):
    return {"rank": rank, "stream": stream, "kind": kind, "name": kind, "step": step,
            "microbatch": microbatch, "start": float(start), "end": float(end),
            "bytes": nbytes, "peer": peer}


def gpipe_events(p, m):
    """GPipe with unit-cost fwd and bwd, free comm and explicit waits for the previous stage.

    Stage s runs F_i at s + i and B_i at (m + p − 1) + (p − 1 − s) + i; the step lasts
    2(m + p − 1) and every stage is busy 2m of it.
    """
    events = []
    for s in range(p):
        for i in range(m):
            f, b = s + i, (m + p - 1) + (p - 1 - s) + i
            events += [ev(s, "compute", "fwd", f, f + 1, microbatch=i),
                       ev(s, "compute", "bwd", b, b + 1, microbatch=i)]
            if s + 1 < p:  # free comm: a zero-length send of the activation
                events.append(ev(s, "comm", "send", f + 1, f + 1, nbytes=8, peer=s + 1))
        if s > 0:  # waiting for the first activation from the stage before
            events.append(ev(s, "comm", "wait", 0, s, peer=s - 1))
    return events


# --- interval helpers -----------------------------------------------------------------------

def test_union_merges_overlapping_and_touching_spans():
    assert metrics.union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]


def test_total_intersection_and_difference():
    a, b = [(0, 2), (1, 3), (5, 6)], [(2.5, 5.5)]
    assert metrics.total(a) == pytest.approx(4.0)
    assert metrics.intersection_length(a, b) == pytest.approx(1.0)
    assert metrics.difference_length(a, b) == pytest.approx(3.0)
    assert metrics.intersection_length(a, []) == 0.0


# --- step metrics ---------------------------------------------------------------------------

def test_keys_are_the_design_table_plus_bytes_total_and_the_idle_split():
    m = step_metrics([ev(0, "compute", "fwd", 0, 1)], world_size=1, global_batch=8)
    assert set(m) == DESIGN_KEYS | {"bytes_sent_total", "schedule_bubble_fraction", "lab_overhead_fraction"}


def test_fully_overlapped_comm():
    events = [ev(0, "compute", "bwd", 0, 1), ev(0, "comm", "allreduce", 0, 1)]
    m = step_metrics(events, world_size=1, global_batch=8)
    assert m["overlap_fraction"] == pytest.approx(1.0)
    assert m["exposed_comm_fraction"] == pytest.approx(0.0)
    assert m["comm_fraction"] == pytest.approx(1.0)
    assert m["bubble_fraction"] == pytest.approx(0.0)


def test_comm_after_compute_is_all_exposed():
    events = [ev(0, "compute", "bwd", 0, 2), ev(0, "comm", "allreduce", 2, 3)]
    m = step_metrics(events, world_size=1, global_batch=6)
    assert m["step_time_s"] == pytest.approx(3.0)
    assert m["throughput_samples_s"] == pytest.approx(2.0)
    assert m["overlap_fraction"] == pytest.approx(0.0)
    assert m["exposed_comm_fraction"] == pytest.approx(1 / 3)
    assert m["comm_fraction"] == pytest.approx(1 / 3)
    assert m["bubble_fraction"] == pytest.approx(0.0)


def test_partial_overlap():
    events = [ev(0, "compute", "bwd", 0, 2), ev(0, "comm", "allreduce", 1, 3)]
    m = step_metrics(events, world_size=1, global_batch=1)
    assert m["overlap_fraction"] == pytest.approx(0.5)
    assert m["exposed_comm_fraction"] == pytest.approx(1 / 3)
    assert m["comm_fraction"] == pytest.approx(2 / 3)


def test_gpipe_bubble_p2_m2_is_one_third():
    m = step_metrics(gpipe_events(2, 2), world_size=2, global_batch=4)
    assert m["step_time_s"] == pytest.approx(6.0)
    assert m["bubble_fraction"] == pytest.approx(1 / 3)
    assert m["comm_fraction"] == pytest.approx(0.0)  # free comm, and waits are not comm


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 1)])
def test_gpipe_bubble_formula(p, m):
    got = step_metrics(gpipe_events(p, m), world_size=p, global_batch=m)["bubble_fraction"]
    assert got == pytest.approx((p - 1) / (m + p - 1))


def test_wait_is_bubble_not_comm():
    events = [ev(0, "compute", "fwd", 0, 1), ev(0, "comm", "wait", 1, 3, peer=1),
              ev(0, "comm", "recv", 3, 3, peer=1), ev(0, "compute", "fwd", 3, 4)]
    m = step_metrics(events, world_size=1, global_batch=1)
    assert m["comm_fraction"] == pytest.approx(0.0)
    assert m["exposed_comm_fraction"] == pytest.approx(0.0)
    assert m["bubble_fraction"] == pytest.approx(0.5)


def test_no_comm_means_zero_overlap():
    m = step_metrics([ev(0, "compute", "fwd", 0, 1)], world_size=1, global_batch=1)
    assert m["overlap_fraction"] == 0.0
    assert m["comm_fraction"] == 0.0


def test_step_time_is_median_of_slowest_rank():
    # Step durations 1, 5, 2 (set by the slower rank in step 1) → median 2.
    events = [ev(0, "compute", "fwd", 0, 1, step=0),
              ev(0, "compute", "fwd", 0, 3, step=1), ev(1, "compute", "fwd", 0, 5, step=1),
              ev(1, "compute", "fwd", 0, 2, step=2)]
    m = step_metrics(events, world_size=2, global_batch=10)
    assert m["step_time_s"] == pytest.approx(2.0)
    assert m["throughput_samples_s"] == pytest.approx(5.0)


def test_fractions_are_averaged_over_steps_then_ranks():
    events = [ev(0, "compute", "fwd", 0, 1, step=0), ev(0, "comm", "allreduce", 1, 2, step=0),
              ev(0, "compute", "fwd", 0, 2, step=1)]
    m = step_metrics(events, world_size=1, global_batch=1)
    assert m["comm_fraction"] == pytest.approx((0.5 + 0.0) / 2)
    # A second rank that did nothing was idle for the whole step.
    m2 = step_metrics(events, world_size=2, global_batch=1)
    assert m2["bubble_fraction"] == pytest.approx((0.0 + 1.0) / 2)


def test_bytes_sent_counts_sending_kinds_only():
    events = []
    for step, extra in ((0, 0), (1, 100)):
        events += [ev(0, "comm", "allreduce", 0, 1, step, nbytes=100 + extra),
                   ev(0, "comm", "send", 1, 2, step, nbytes=50, peer=1),
                   ev(0, "comm", "recv", 1, 2, step, nbytes=70, peer=1),
                   ev(0, "compute", "compress", 0, 1, step, nbytes=30),
                   ev(0, "comm", "wait", 2, 3, step, nbytes=999),
                   ev(1, "comm", "reduce_scatter", 0, 1, step, nbytes=10)]
    m = step_metrics(events, world_size=2, global_batch=1)
    assert m["bytes_sent"] == pytest.approx([200.0, 10.0])
    assert m["bytes_sent_total"] == pytest.approx(210.0)


def test_peak_activation_bytes_passes_through():
    events = [ev(0, "compute", "fwd", 0, 1)]
    assert step_metrics(events, 2, 1)["peak_activation_bytes"] == [0, 0]
    passed = step_metrics(events, 2, 1, peak_activation_bytes=[5, 7])
    assert passed["peak_activation_bytes"] == [5, 7]


def test_per_rank_metrics_uses_the_step_duration():
    events = gpipe_events(2, 2) + [ev(0, "compute", "fwd", 0, 9, step=1)]
    r1 = per_rank_metrics(events, rank=1, step=0)
    assert r1["step_time_s"] == pytest.approx(6.0)  # rank 1 ends at 5; the step at 6
    assert r1["bubble_fraction"] == pytest.approx(2 / 6)
    assert r1["bytes_sent"] == 0
    assert per_rank_metrics(events, rank=0, step=0)["bytes_sent"] == 16


def test_empty_events():
    m = step_metrics([], world_size=2, global_batch=4)
    assert m["step_time_s"] == 0.0 and m["throughput_samples_s"] == 0.0
    assert m["bytes_sent"] == [0.0, 0.0]


def test_speedup():
    s = speedup(step_time_1=8.0, step_time_n=2.5, n=4)
    assert s["speedup"] == pytest.approx(3.2)
    assert s["scaling_efficiency"] == pytest.approx(0.8)


# --- idle time split three ways: schedule bubble, exposed comm, lab overhead ----------------

def test_idle_splits_into_schedule_bubble_exposed_comm_and_lab_overhead():
    # One rank, T = 10: compute 0–2 and 5–7, a gap 2–3 (overhead), a wait for a peer 3–4,
    # a receive 4–5 (comm, exposed), the optimizer 7–8, then done until the step ends at 10
    # (another rank ends then): tail 8–10.
    events = [ev(0, "compute", "fwd", 0, 2), ev(0, "comm", "wait", 3, 4, peer=1),
              ev(0, "comm", "recv", 4, 5, peer=1), ev(0, "compute", "bwd", 5, 7),
              ev(0, "compute", "optimizer", 7, 8), ev(1, "compute", "fwd", 0, 10)]
    r0 = per_rank_metrics(events, rank=0, step=0)
    assert r0["exposed_comm_fraction"] == pytest.approx(0.1)
    assert r0["schedule_bubble_fraction"] == pytest.approx(0.3)    # wait 3–4 and tail 8–10
    assert r0["lab_overhead_fraction"] == pytest.approx(0.1)       # the gap 2–3
    assert r0["bubble_fraction"] == pytest.approx(0.4)             # bubble + overhead, as before
    busy_compute = 5 / 10
    assert (busy_compute + r0["exposed_comm_fraction"] + r0["schedule_bubble_fraction"]
            + r0["lab_overhead_fraction"]) == pytest.approx(1.0)


def test_comm_inside_a_wait_or_the_tail_is_comm_not_bubble():
    # A late send completing (comm, 6–8) after the rank's compute and a wait overlapping compute.
    events = [ev(0, "compute", "fwd", 0, 6), ev(0, "comm", "wait", 5, 7, peer=1),
              ev(0, "comm", "send", 6, 8, peer=1), ev(1, "compute", "fwd", 0, 10)]
    r0 = per_rank_metrics(events, rank=0, step=0)
    assert r0["exposed_comm_fraction"] == pytest.approx(0.2)
    assert r0["schedule_bubble_fraction"] == pytest.approx(0.2)    # tail 8–10 only
    assert r0["lab_overhead_fraction"] == pytest.approx(0.0)


def test_gpipe_with_per_action_overhead_counts_it_apart_from_the_bubble():
    # GPipe p=2 m=2 (unit forwards, backward 1), every action followed by 0.5 of harness
    # work: the schedule bubble stays where the waits put it, the rest is overhead.
    events = gpipe_events(2, 2)
    # each unit of schedule time before an action adds 0.5 of overhead; spans keep their length
    shifted = [dict(e, start=1.5 * e["start"], end=1.5 * e["start"] + e["end"] - e["start"]) for e in events]
    m = step_metrics(shifted, world_size=2, global_batch=4)
    assert m["step_time_s"] == pytest.approx(8.5)                  # last B of stage 0 starts at 5·1.5
    assert m["bubble_fraction"] == pytest.approx(m["schedule_bubble_fraction"] + m["lab_overhead_fraction"])
    assert m["lab_overhead_fraction"] > 0.1
    assert m["schedule_bubble_fraction"] < m["bubble_fraction"]


def test_a_rank_with_no_events_waited_the_whole_step():
    events = [ev(0, "compute", "fwd", 0, 4)]
    m = step_metrics(events, world_size=2, global_batch=1)
    assert m["schedule_bubble_fraction"] == pytest.approx(0.5)
    assert m["lab_overhead_fraction"] == pytest.approx(0.0)


def test_metrics_combined_from_each_steps_part_equal_the_metrics_of_all_events():
    """A run keeps one part per step (step_entry) and combines them after each step, instead of
    going over every event of the run again: the same numbers."""
    from labkit.analysis.metrics import combine_steps, step_entry

    events = []
    for step in range(3):
        events += [e | {"step": step} for e in gpipe_events(2, 2 + step)]
        events.append(ev(1, "comm", "allreduce", 1, 2 + step, step=step, nbytes=100 * (step + 1)))
    for world in (2, 3):
        parts = [step_entry([e for e in events if e["step"] == s], world) for s in range(3)]
        combined = combine_steps(parts, world, global_batch=8, peak_activation_bytes=[1] * world)
        assert combined == step_metrics(events, world, global_batch=8, peak_activation_bytes=[1] * world)


def _reference_fractions(events, rank, duration):
    """The module docstring's set algebra, span by span with the pure helpers (no numpy)."""
    mine = [e for e in events if e["rank"] == rank]
    c = [(e["start"], e["end"]) for e in mine if e["stream"] == "compute"]
    x = [(e["start"], e["end"]) for e in mine if e["stream"] == "comm" and e["kind"] != "wait"]
    w = [(e["start"], e["end"]) for e in mine if e["kind"] == "wait"]
    w.append((max((e["end"] for e in mine), default=0.0), duration))
    busy = metrics.total(c + x)
    return {"comm_fraction": metrics.total(x) / duration,
            "exposed_comm_fraction": metrics.difference_length(x, c) / duration,
            "overlap_fraction": metrics.intersection_length(x, c) / metrics.total(x) if metrics.total(x) else 0.0,
            "bubble_fraction": (duration - busy) / duration,
            "schedule_bubble_fraction": metrics.difference_length(w, c + x) / duration}


def test_vectorised_metrics_equal_the_set_algebra_span_by_span():
    import random

    rng = random.Random(3)
    kinds = [("fwd", "compute"), ("bwd", "compute"), ("allreduce", "comm"), ("send", "comm"), ("wait", "comm")]
    for _ in range(40):
        world = rng.randint(1, 4)
        events = []
        for _ in range(rng.randint(1, 25)):
            kind, stream = rng.choice(kinds)
            start = rng.random() * 0.01
            events.append(ev(rng.randrange(world), stream, kind, start, start + rng.random() * 0.004 * rng.randint(0, 1)))
        duration = max(e["end"] for e in events)
        if duration == 0:
            continue
        for rank in range(world):
            got = per_rank_metrics(events, rank, 0)
            for key, want in _reference_fractions(events, rank, duration).items():
                assert got[key] == pytest.approx(want, abs=1e-12), (key, rank, events)
