"""Exercises at the end of each notebook, checked here, with answers held back until asked.

A tour or exercise asks a question ("where does overlap stop helping?"); Run All must not print
the answer before the reader has tried. ``check`` reads the reader's own settings or answer and
says whether it holds, with a hint, never the answer itself; ``answer`` says it outright.

>>> from labkit import course
>>> course.check("bubble", dash)            # is the dashboard's last run past the formula's 20%?
>>> course.check("bucket", dash, answer=1)  # "overlap stops helping from 1 MiB buckets"?
>>> course.check("busbw", answer=1.75)      # a notebook's closing exercise: a number to work out
>>> course.answer("busbw")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MiB = 1024 * 1024


@dataclass(frozen=True)
class Exercise:
    """A question with one numeric (or ranks) answer: ``expected()`` computes it, never stored."""

    prompt: str
    expected: Callable[[], object]
    why: str                     # the answer's reasoning, shown by ``answer``
    hint: str                    # shown with a wrong answer: where to look, not the value
    rel: float = 0.02            # relative tolerance of a numeric answer
    also: Callable[[], object] | None = None     # another reading of the question, accepted too


def _ideal(schedule: str, p: int, m: int, v: int = 1) -> float:
    from .parallel.pipeline.schedules import ideal_bubble
    return ideal_bubble(schedule, p, m, v)


def _shard_overlap(sizes: list[int], dp: int, rank: int, member: int) -> int:
    """Elements of tensor ``member`` in ``rank``'s shard of a flat unit (labkit.parallel.zero.shard:
    the tensors end to end, padded to a multiple of dp, cut in dp equal shards)."""
    shard = -(-sum(sizes) // dp)
    start = sum(sizes[:member])
    lo, hi = rank * shard, (rank + 1) * shard
    return max(0, min(hi, start + sizes[member]) - max(lo, start))


def _megatron_dp_group(rank: int, tp: int, dp: int, pp: int) -> list[int]:
    """Megatron's default order tp-cp-ep-dp-pp (cp = ep = 1): tp fastest, then dp, then pp."""
    tp_i, pp_i = rank % tp, rank // (tp * dp)
    return [tp_i + tp * d + tp * dp * pp_i for d in range(dp)]


EXERCISES = {
    "dp_traffic": Exercise(
        "A ring all-reduce of the gradients: going from dp = 2 to dp = 4, by what factor does the "
        "number of bytes each rank sends per step grow?",
        lambda: (2 * (4 - 1) / 4) / (2 * (2 - 1) / 2),
        "Each rank sends 2(n−1)/n of the gradient bytes: 1·S at n = 2, 1.5·S at n = 4, so 1.5×; "
        "it never passes 2·S however many ranks join, which is why data parallelism scales.",
        "the ring's share per rank is 2(n−1)/n of S (notebook 00's busbw factor)."),
    "bucketed_ms": Exercise(
        "2 MiB of gradients (2,097,152 bytes), dp = 2, bucketed, on a link of 100 MB/s (10⁸ bytes/s) "
        "each way with α negligible: how many milliseconds of comm does each step add after backward?",
        lambda: 1e3 * 2 * (2 - 1) / 2 * 2 * MiB / 1e8,
        "2(n−1)/n · S/β = 1 · 2,097,152 / 10⁸ s ≈ 21 ms, all of it exposed in bucketed mode; overlap can "
        "hide what runs beside backward.",
        "a ring all-reduce puts 2(n−1)/n · S on each rank's link; divide by β."),
    "ps_ring": Exercise(
        "n = 8 ranks all-reduce S = 8 MiB over links of bandwidth β (α ignored): how many times longer "
        "does the parameter server take than the ring?",
        lambda: (2 * (8 - 1)) / (2 * (8 - 1) / 8),
        "The server's link carries 2(n−1)·S (every push, then every pull), the ring's 2(n−1)/n·S: "
        "the ratio is n = 8.",
        "notebook 04's table: the bandwidth terms of both rows, divided."),
    "sendrecv_ms": Exercise(
        "On notebook 04's emulated link (α = 100 µs, β = 50 MB/s each way), how many milliseconds does "
        "one message of 10 kB (10⁴ bytes) take?",
        lambda: 1e3 * (100e-6 + 1e4 / 50e6),
        "α + S/β = 0.1 ms + 0.2 ms = 0.3 ms: at this size latency is a third of the time; at 1 MB it "
        "would be half a percent (0.1 ms of 20.1).",
        "the α-β model: t = α + S/β, in seconds, then in milliseconds."),
    "hsdp_inter": Exercise(
        "A model of S = 1 MB trained with ZeRO-3 over 4 ranks on 2 nodes of 2: each rank sends "
        "3 · (n−1)/n · S = 2.25 MB a step between nodes (two all-gathers and a reduce-scatter over all "
        "4). Under HSDP (dp_shard=2, each shard group inside one node), how many MB does each rank "
        "send between nodes a step?",
        lambda: 2 * (2 - 1) / 2 * (1.0 / 2),
        "The gathers and the reduce-scatter stay inside the node; between nodes goes only the all-reduce "
        "of each rank's shard, S/2, over the 2 replicas: 2(n−1)/n · S/2 = 0.5 MB, a 4.5× cut, for "
        "twice the parameters a rank holds (S/2 instead of S/4).",
        "which collective's group spans the two nodes under HSDP, and over how many bytes?"),
    "moe_active": Exercise(
        "A mixture-of-experts layer with 8 experts and top_k = 2 (Mixtral's): what fraction of the "
        "layer's expert parameters does one token use?",
        lambda: 2 / 8,
        "Each token goes through top_k of the n_experts expert MLPs: 2/8 = 0.25. The layer holds 8 "
        "experts' parameters but computes like a dense MLP of 2 (the planner's active_params).",
        "how many experts does the router send each token to, out of how many?"),
    "gqa_kv": Exercise(
        "Grouped-query attention with hidden size 4096, 32 query heads and 8 key/value heads (head size "
        "128), no biases: how many parameters do the K and V projections hold together?",
        lambda: 2 * 4096 * 8 * 128,
        "K and V each map 4096 → 8·128 = 1024: 2 · 4096 · 1024 = 8,388,608, a quarter of multi-head "
        "attention's 2 · 4096 · 4096 (Llama-2 70B and Mixtral use 8 key/value heads).",
        "each of K and V is a 4096 × (kv_heads · head size) matrix."),
    "busbw": Exercise(
        "An all-reduce over n = 8 ranks: by what factor is its bus bandwidth above its algorithm bandwidth?",
        lambda: 2 * (8 - 1) / 8,
        "busbw = algbw · 2(n−1)/n: each rank sends and receives 2(n−1)/n of the payload in a ring; "
        "for n = 8 that is 1.75.",
        "the factor is the share of the payload a ring puts on each rank's wire (notebook 00, nccl-tests)."),
    "gpipe_p4": Exercise(
        "GPipe with p = 4 stages: how many micro-batches make the ideal bubble exactly 20% of the step?",
        lambda: 12,
        "(p−1)/(m+p−1) = 3/(m+3) = 0.2 gives m = 12.",
        "solve (p−1)/(m+p−1) = 0.2 for m.", rel=0.0),
    "interleaved": Exercise(
        "p = 4 stages, m = 8 micro-batches, interleaved with v = 2 chunks per rank: the ideal bubble, "
        "as a fraction of the step?",
        lambda: _ideal("interleaved", 4, 8, 2),
        "(p−1)/(v·m+p−1) = 3/19 ≈ 0.158 (Megatron-LM 2021), against GPipe's and 1F1B's 3/11 ≈ 0.27 "
        "at the same p and m: each chunk is half a stage, so the fill and drain are half as long.",
        "the interleaved formula multiplies m by the chunks per rank.", rel=0.03),
    "megatron_dp": Exercise(
        "8 ranks, tp = 2, dp = 2, pp = 2, in Megatron's default order (tp fastest, then dp, then pp): "
        "which ranks are in rank 0's data-parallel group, the ranks that average their gradients "
        "together? (a list; with or without rank 0 itself)",
        lambda: _megatron_dp_group(0, tp=2, dp=2, pp=2),
        "rank = tp_index + 2·dp_index + 4·pp_index, so rank 0's dp group is [0, 2]: rank 0 averages "
        "with rank 2. In labkit's layout (tp, then pp, then dp) it would be [0, 4].",
        "write the rank as tp_index + tp·dp_index + tp·dp·pp_index and vary dp_index alone.",
        also=lambda: [r for r in _megatron_dp_group(0, tp=2, dp=2, pp=2) if r != 0]),
    "straggler_wait": Exercise(
        "8 dp ranks: rank 5 computes 30 ms a step, the other seven 20 ms, and the gradient all-reduce "
        "takes 5 ms once every rank has joined. How many ms per step do the other seven spend, "
        "together, waiting for rank 5?",
        lambda: 7 * (30 - 20),
        "Each of the seven enters the all-reduce 10 ms before rank 5 and waits inside it: 7 × 10 = "
        "70 ms a step. Every rank's step is 35 ms, so step times alone cannot tell who was slow; "
        "the entry times can (timeline.stragglers()).",
        "a synchronous all-reduce ends for everyone together; who waits, and how long, before it starts?"),
    "whatif_link": Exercise(
        "dp = 2 on an emulated link, bucketed (the all-reduce after backward): rank 0 computes 30 ms a "
        "step, rank 1 40 ms, and the gradients' all-reduce takes 40 ms once both have joined. The critical "
        "path runs through which rank's compute, and how many ms does a step take on a link 4× faster "
        "(latency negligible, everything else as measured)?",
        lambda: 40 + 40 / 4,
        "The path is rank 1's compute (40 ms: rank 0 waits for it inside the all-reduce), then the "
        "all-reduce (40 ms): 80 ms. A 4× link shortens only the all-reduce: 40 + 10 = 50 ms, a 1.6× "
        "speed-up, not 4× — the part of the path that is not on the link does not move. "
        "run.whatif(link=…) replays a measured step exactly this way.",
        "find what the path runs through (timeline.bound_by()), then shorten only the link's part of it."),
    "timeout": Exercise(
        "Notebook 06's straggler is late by 6.5 s at step 1; the lab's collective timeout is 5 s. "
        "How many seconds does rank 0 wait for rank 1 before it gives up?",
        lambda: 5.0,
        "Rank 0 waits the timeout, 5 s, then reports; it never learns how late rank 1 would have "
        "been. Any timeout above 6.5 s would have let the run go on (in practice leave minutes).",
        "rank 0 cannot know when rank 1 will come; what bounds its wait?", rel=0.05),
    "tp_bytes": Exercise(
        "Megatron TP on t = 2 ranks, L = 4 layers, b = 8 rows, s = 32 tokens, h = 64, fp32: how many "
        "bytes does each rank put on the wire per step for f and g?",
        lambda: 4 * 4 * 8 * 32 * 64 * 4 * 2 * (2 - 1) / 2,
        "L · 4 all-reduces · b·s·h values · 4 bytes · 2(t−1)/t = 4·4·8·32·64·4·1 = 1 MiB.",
        "4 all-reduces per layer (2 forward, 2 backward), each of b·s·h values; a ring moves 2(t−1)/t of it."),
    "zero3_bytes": Exercise(
        "ZeRO-3, fp32 with AdamW (K = 8), Ψ = 10⁶ parameters, dp = 4: bytes of model state per rank?",
        lambda: (4 + 4 + 8) * 1e6 / 4,
        "(4 + 4 + K)·Ψ / N_d = 16·10⁶ / 4 = 4·10⁶ bytes: stage 3 divides every term by dp.",
        "the paper's (4 + 4 + K)·Ψ, and which terms stage 3 divides by N_d (notebook 08)."),
    "zbv_p4": Exercise(
        "p = 4 stages, m = 8 micro-batches: the ideal bubble of ZB-V (2 chunks per rank), as a fraction?",
        lambda: _ideal("zbv", 4, 8, 2),
        "(p−1)/(6m+p−1) = 3/51 ≈ 0.059, against 1F1B's 3/11 ≈ 0.27 at the same p and m.",
        "notebook 11: ZB-V's formula has 6m where 1F1B's has m.", rel=0.03),
    "cp_ring_blocks": Exercise(
        "Ring attention with cp = 8: in one training step, how many key/value blocks (each the size of "
        "one rank's K/V) does each rank send per layer, forward and backward together?",
        lambda: 3 * 8 - 2,
        "forward: cp − 1 = 7 hops of K/V; backward: the K/V go round again (7 hops) and beside them their "
        "gradient, which travels cp = 8 hops to come home: 7 + 7 + 8 = 22 (notebook 13's formula, 3·cp − 2).",
        "count the hops of the forward, then what travels in the backward (notebook 13's bytes table).", rel=0.0),
    "cp_chunks": Exercise(
        "cp = 4 with causal load balancing: the sequence is cut into 8 chunks. Which two does rank 1 "
        "hold? (a list)",
        lambda: [1, 2 * 4 - 1 - 1],
        "rank i holds chunks i and 2·cp − 1 − i: 1 and 6. Under the causal mask chunk i attends to the i "
        "chunks before it in full and to itself under the mask (half a pair), chunk 7 − i to 7 − i chunks and "
        "half of itself: i + ½ + 7 − i + ½ = 8 (query, key) chunk pairs on every rank, as notebook 13 counts.",
        "the first chunk of rank i is chunk i; its second mirrors it from the end (notebook 13)."),
    "ep_dispatch_bytes": Exercise(
        "4096 tokens per rank, top_k = 8, hidden 7168, bf16 (2 bytes), ep = 8, routing spread evenly: "
        "how many bytes does one rank's dispatch of one MoE layer send?",
        lambda: 4096 * 8 * 7168 * 2 * (8 - 1) / 8,
        "tokens × top_k × hidden × bytes × (ep−1)/ep = 4096·8·7168·2·7/8 ≈ 411 MB: every (token, "
        "choice) row goes to its expert's rank, and 1/ep of them stay home. The combine sends as "
        "many back, and backward both again: four such exchanges per layer and step.",
        "each token sends top_k rows of hidden values; which share of them leaves the rank? (notebook 14)"),
    "ep_imbalance": Exercise(
        "ep = 4, top-1, the ep ranks receive [512, 0, 0, 0] tokens: what is the max/mean imbalance?",
        lambda: 4.0,
        "max/mean = 512 / (512/4) = 4 = ep: one rank does the whole layer's expert work while the "
        "three others wait for it in the combine, so the layer runs at a quarter of the group's speed.",
        "the mean is over the 4 ranks (notebook 14's tokens_per_ep_rank)."),
    "cp_tokens": Exercise(
        "Llama 3's long-context stage trains on 131,072-token sequences with cp = 16 (each rank two "
        "chunks, i and 2·cp−1−i). How many tokens of each sequence does one GPU hold?",
        lambda: 131072 // 16,
        "s / cp = 131072 / 16 = 8192: 2·cp = 32 chunks of 4096, two per rank. Every GEMM and every "
        "activation is that of an 8K sequence; only attention reaches the other chunks' keys and "
        "values (all-gathered in Llama 3, passed round a ring in Ring Attention).",
        "the sequence is cut into 2·cp chunks and each rank holds two of them."),
    "zero3_forward": Exercise(
        "ZeRO-3 moves the weights three times a step (all-gather for forward, all-gather for "
        "backward, reduce-scatter of the gradients), each the same bytes. With FSDP2's prefetching, "
        "what fraction of that traffic can run under the forward pass?",
        lambda: 1 / 3,
        "1/3: the forward's all-gathers, each layer's fetched while the layer before computes; the "
        "other two passes run under backward. Hiding only behind backward leaves a third of the "
        "traffic exposed wherever backward is too short to hold all of it.",
        "count the three passes and ask which of them the forward needs.", rel=0.03),
    "ckpt_shard": Exercise(
        "Under dp = 4 ZeRO-3 each block is one flat unit: up.weight (26×19), up.bias (26), down.weight "
        "(19×26), down.bias (19), norm.weight and norm.bias (19 each), end to end, padded to a multiple "
        "of 4 and cut into 4 equal shards. How many elements of up.weight does rank 1's shard hold?",
        lambda: _shard_overlap([26 * 19, 26, 19 * 26, 19, 19, 19], dp=4, rank=1, member=0),
        "1071 elements pad to 1072, shards of 268: rank 1 holds elements 268–535 of the unit, and "
        "up.weight is 0–493 of it, so 494 − 268 = 226 (rows 14–25, the first of them partly). A "
        "save gathers these ranges into whole tensors; a resume under tp cuts the same weight by "
        "rows or columns instead, and under pp hands it whole to one stage.",
        "lay the six tensors end to end, find rank 1's range of the padded unit, intersect it with "
        "up.weight's range (notebook 16's pieces of down.weight do the same)."),
    "drift_kind": Exercise(
        "labkit.drift reports that the dp replicas agree with each other but not with the reference. "
        "Is it a 'sync' bug or 'math or precision'? (a string)",
        lambda: "math or precision",
        "Replicas that agree all received the same average: the average itself is off (a wrong "
        "factor, or compression), not its distribution.",
        "a sync bug makes one replica differ from the others."),
}


def check(question: str, dash=None, answer=None) -> str:
    """Judge the reader's settings (``"bubble"``) or ``answer`` (the others); print and return it."""
    if question == "bubble":
        text = _check_bubble(dash)
    elif question == "bucket":
        text = _check_bucket(dash, answer)
    elif question in EXERCISES:
        text = _check_exercise(EXERCISES[question], answer, question)
    else:
        raise ValueError(f"question={question!r} is unknown; use one of {sorted(questions())}")
    print(text)
    return text


def answer(question: str, dash=None) -> str:
    """The answer, for a reader who asks for it."""
    if question == "bucket":
        total = gradient_bytes(dash.model) / MiB
        text = (f"Overlap stops helping once one bucket holds every gradient: bucket_mb ≥ {total:.2f} MiB "
                f"(this model's gradients). That bucket fills only when backward has finished, so it "
                f"cannot leave any earlier than bucketed's does.")
    elif question == "bubble":
        text = ("GPipe idles (p−1)/(m+p−1) of the step: with p = 2 that is below 20% from m = 5 on "
                "(1/6 ≈ 17%). The measured bubble adds the lab's own work per action and any exposed "
                "comm, so on a busy laptop it reads a few points above the formula.")
    elif question in EXERCISES:
        text = f"{_shown(EXERCISES[question].expected())}: {EXERCISES[question].why}"
    else:
        raise ValueError(f"question={question!r} is unknown; use one of {sorted(questions())}")
    print(text)
    return text


def questions() -> list[str]:
    """Every question ``check`` knows."""
    return ["bubble", "bucket", *EXERCISES]


def gradient_bytes(model) -> int:
    """Bytes of gradients one replica of ``model`` (a module or a zero-argument factory) averages."""
    built = model() if callable(model) and not hasattr(model, "parameters") else model
    return sum(p.numel() * p.element_size() for p in built.parameters() if p.requires_grad)


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _check_exercise(ex: Exercise, given, name: str) -> str:
    if given is None:
        return f"{ex.prompt}\nPut your answer in: course.check({name!r}, answer=...)"
    want = ex.expected()
    if isinstance(want, str):
        right = str(given).strip().lower() == want
    elif isinstance(want, list):
        readings = [want] + ([ex.also()] if ex.also else [])
        right = isinstance(given, (list, tuple)) and any(sorted(given) == sorted(w) for w in readings)
    else:
        try:
            right = abs(float(given) - want) <= ex.rel * abs(want) + 1e-12
        except (TypeError, ValueError):
            return f"{given!r} is not a number: answer with one."
    return f"Right: {ex.why}" if right else f"Not yet ({given!r}). Hint: {ex.hint}"


def _check_bubble(dash) -> str:
    live = dash.wait()
    if live is None or live.state != "done":
        return "no finished run yet: press Run (or wait for the one in flight) and check again"
    s, metrics = live.spec.strategy, live.run.metrics
    if s.pp < 2:
        return f"run {live.number}: dp={s.dp}, pp={s.pp}. Not a pipeline yet: set dp = 1 and pp = 2."
    bubble = metrics.get("bubble_fraction", float("nan"))
    where = f"run {live.number}: pp={s.pp} {s.schedule}, microbatches={s.microbatches}, bubble {bubble:.0%}"
    if s.schedule not in ("gpipe", "1f1b"):
        return f"{where}. The tour is about gpipe and 1f1b: pick one of them."
    formula = _ideal(s.schedule, s.pp, s.microbatches)
    if formula >= 0.2:
        return f"{where}. Not yet: more micro-batches shorten the fill and drain relative to the step."
    schedule = metrics.get("schedule_bubble_fraction", float("nan"))
    return (f"{where}. Goal reached: the schedule now idles {formula:.0%} of the step in theory "
            f"(measured: {schedule:.0%} waiting for the neighbour, the rest the lab's own work per "
            f"action and exposed comm, which grow with the number of micro-batches).")


def _check_bucket(dash, answer) -> str:
    if answer is None:
        return ("Make a guess first: the bucket size (MiB) from which overlap no longer beats bucketed, "
                "then run course.check('bucket', dash, answer=<MiB>).")
    from .parallel.data.sync import make_buckets

    built = dash.model() if callable(dash.model) and not hasattr(dash.model, "parameters") else dash.model
    params = [(n, p) for n, p in built.named_parameters() if p.requires_grad]
    buckets = len(make_buckets(params, float(answer) * MiB))
    if buckets == 1:
        return (f"Right: with {answer:g} MiB buckets all gradients go in one bucket, which can only "
                f"leave when backward is done, so overlap has nothing left to hide.")
    return (f"Not there yet: {answer:g} MiB buckets make {buckets} buckets; the first leaves while backward "
            f"still runs on earlier layers, so overlap can still hide it. Try larger.")
