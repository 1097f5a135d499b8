"""Measure what a step is made of on the lab's engines: a reloadable cost table.

``calibrate(lab, model=, batch=)`` times, on every engine at once (so the engines contend for
the cores as they do in a run), each top-level block's forward and backward per micro-batch
size, the loss, and each block's optimizer step; then the α-β of all-reduce, all-gather,
reduce-scatter (ZeRO's calls) and point-to-point with :func:`labkit.bench.comm_sweep` and its
fit. With ``tp=(2,)`` it also times the blocks as the model's tensor plan cuts them, at one
rank's shard width, and labkit's f/g calls (:mod:`labkit.plan.tensor_costs`). The table is plain JSON and
knows the model it was measured on (block types and parameter shapes): simulating or loading
it for another model is refused.

    >>> costs = labkit.plan.calibrate(lab, model=labkit.models.mlp(width=256, depth=8), batch=64)
    >>> costs.save("costs.json"); costs = labkit.plan.CostTable.load("costs.json", model=make_model)
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from statistics import median

FORMAT = 2
"""2: all-gather and reduce-scatter α-β, and ``tensor`` (tp-sharded block costs). A format-1
table still loads (it simulates what it measured: no zero, no tp)."""


def model_signature(net) -> list:
    """What identifies a model for its costs: each block's type and parameter shapes."""
    return [[type(b).__name__, [list(p.shape) for p in b.parameters()]] for b in net]


def fingerprint(signature: list) -> str:
    return hashlib.sha1(json.dumps(signature).encode()).hexdigest()[:16]


@dataclass
class CostTable:
    """Seconds per block and micro-batch size, α-β per collective; JSON-ready."""

    model: str                    # fingerprint of the model's signature
    signature: list
    sizes: list[int]              # micro-batch sizes measured
    blocks: list[dict]            # name, params (numel per tensor), out_numel (per sample), fwd, bwd, optimizer
    loss: dict                    # {"fwd": [...], "bwd": [...]} per size
    comm: dict                    # {"all_reduce": {"alpha_s", "beta_Bps", "n"}, "sendrecv": {...}, ...}
    world_size: int = 1
    format: int = FORMAT
    tensor: dict = field(default_factory=dict)
    """str(tp) → {"plan", "blocks" (fwd, bwd, optimizer, out_numel, calls), "loss", "calls" (α-β of g and f)}."""
    in_step: dict = field(default_factory=dict)
    """How much slower each collective runs inside a real step than in the sweep, and the
    executor's untimed seconds per action (``gap_s``): :mod:`labkit.plan.in_step`."""

    # -- lookups ----------------------------------------------------------------------------
    def at(self, values: list[float], size: int) -> float:
        """A per-size measurement at ``size``: linear between the measured sizes, beyond them
        along the line through the last two (compute time grows about linearly in rows)."""
        xs = self.sizes
        if len(xs) == 1:
            return values[0] * size / xs[0]
        i = next((k for k in range(1, len(xs) - 1) if size <= xs[k]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(0.0, y0 + (y1 - y0) * (size - x0) / (x1 - x0))

    def alpha_beta(self, op: str) -> tuple[float, float]:
        if op not in self.comm:
            if self.world_size > 1:
                raise ValueError(f"the cost table has no {op!r} costs (format {self.format}, before they were "
                                 "measured); calibrate again with labkit.plan.calibrate(lab, model=...)")
            raise ValueError(f"the cost table has no {op!r} costs (calibrated on {self.world_size} engine(s)); "
                             "calibrate on at least 2 engines for dp > 1 or pp > 1")
        c = self.comm[op]
        return c["alpha_s"], c["beta_Bps"]

    def collective_s(self, op: str, nbytes: float, n: int, busy: bool = False) -> float:
        """α + (n−1)/n·S/β of an all-gather or reduce-scatter of a whole buffer of ``nbytes``
        (nccl-tests' bus factor; β the measured bus bandwidth); ``busy`` as for all-reduce."""
        alpha, beta = self.alpha_beta(op)
        return (alpha + (n - 1) / n * nbytes / beta) * (self.busy_factor if busy else 1.0) * self.slowdown(op)

    def sharded(self, tp: int) -> dict:
        """The blocks as ``tp`` ranks hold them (ValueError naming the fix if not measured)."""
        entry = self.tensor.get(str(tp))
        if entry is None:
            have = sorted(int(k) for k in self.tensor) or "none"
            raise ValueError(f"the cost table has no blocks timed at tp={tp} (measured: {have}); calibrate "
                             f"with labkit.plan.calibrate(lab, model=..., tp=({tp},))")
        return entry

    def tp_call_s(self, direction: str, nbytes: float, n: int) -> float:
        """Seconds of one f ("f": backward) or g ("g": forward) all-reduce of ``nbytes`` over ``n``
        tp ranks, as measured through labkit's own f and g."""
        calls = next(iter(self.tensor.values()))["calls"]
        c = calls[direction]
        return (c["alpha_s"] + 2 * (n - 1) / n * nbytes / c["beta_Bps"]) * self.slowdown("tp")

    def all_reduce_s(self, nbytes: float, n: int, busy: bool = False) -> float:
        """α + 2(n−1)/n·S/β, with the bus bandwidth β measured (ring scaling to other n);
        ``busy``: while the rank computes (× the measured ``busy_factor``)."""
        alpha, beta = self.alpha_beta("all_reduce")
        return (alpha + 2 * (n - 1) / n * nbytes / beta) * (self.busy_factor if busy else 1.0) * self.slowdown("all_reduce")

    def slowdown(self, op: str) -> float:
        """How much slower ``op`` ran inside the measured step than the sweep predicts (1 if not measured)."""
        return self.in_step.get(op, 1.0)

    def gap_s(self, pp: int) -> float:
        """The executor's untimed seconds per action (pipeline runs and data-parallel ones differ)."""
        return self.in_step.get("gap_s" if pp > 1 else "gap_dp_s", 0.0)

    def p2p_s(self, nbytes: float, busy: bool = False) -> float:
        """α + S/β of one message (``busy``: × ``busy_factor``, as if its rank computed throughout)."""
        alpha, beta = self.alpha_beta("sendrecv")
        return (alpha + nbytes / beta) * (self.busy_factor if busy else 1.0) * self.slowdown("sendrecv")

    def copy_s(self, nbytes: float, what: str) -> float:
        """Compute-thread seconds to "pack", "unpack" or "div" ``nbytes`` of gradients (0 if not measured)."""
        rate = self.comm.get("copy", {}).get(f"{what}_Bps")
        return nbytes / rate if rate else 0.0

    @property
    def compute_factor(self) -> float:
        """How much longer compute takes while a transfer of its rank is in flight (1 when not measured)."""
        return self.comm.get("contention", {}).get("compute_factor", 1.0)

    @property
    def busy_factor(self) -> float:
        """How much longer a transfer takes while its rank computes (1 when not measured)."""
        return self.comm.get("all_reduce", {}).get("busy_factor", 1.0)

    def check(self, model) -> None:
        """Raise ValueError unless ``model`` (a factory or module) is the one measured."""
        from ..models.training import build_model

        mine = fingerprint(model_signature(build_model(model, 0)))
        if mine != self.model:
            raise ValueError(f"this cost table was measured on another model (fingerprint {self.model}, "
                             f"this one {mine}); calibrate again with labkit.plan.calibrate(lab, model=...)")

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        if d.get("format") not in (1, FORMAT):
            raise ValueError(f"cost table format {d.get('format')!r} is neither 1 nor {FORMAT}; calibrate again")
        return cls(**d)

    @classmethod
    def load(cls, path, model=None) -> "CostTable":
        """Read a saved table; with ``model``, refuse it unless it was measured on that model."""
        with open(path) as f:
            table = cls.from_dict(json.load(f))
        if model is not None:
            table.check(model)
        return table


# -- on the engines ---------------------------------------------------------------------------
def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):            # the first call warms up allocations
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def time_blocks(model, seed: int, sizes: list[int], repeats: int, data=None, loss="mse", tp: int = 1,
                tp_plan=None) -> dict:
    """This rank's seconds per block forward / backward / optimizer step for each size.

    Timed the way the executor runs them: the backward-span hooks installed and the
    recorder on, forward under the activation meter (their Python cost is part of a step).
    ``tp`` > 1: the blocks as one tensor-parallel rank holds them (the plan's modules at
    their shard's shape, no collectives), and per block the f/g calls a step makes.
    """
    import torch

    from ..engine import session
    from ..record.instrument import ActivationMeter, instrument_backward, remove_hooks
    from ..models.training import build_model, build_optimizer, resolve_data, resolve_loss

    from .tensor_costs import build_local_shard, watch_calls

    net = build_model(model, seed)
    x, y = resolve_data(data, net, max(sizes), seed)(0)
    signature = model_signature(net)         # of the whole model, whatever the shard
    matched, calls, watchers = ({}, {}, [])
    if tp > 1:
        matched = build_local_shard(net, tp_plan, tp)
    loss_fn = resolve_loss(loss)
    recorder = session().recorder
    was_recording, recorder.enabled = recorder.enabled, True
    hooks = instrument_backward(net, recorder)
    meter = ActivationMeter(list(net.parameters()))

    try:
        def forward(block, inp):
            with meter.forward(0, inp) as kept:
                out = block(inp)
                kept.append(out)
            return out

        blocks = [{"name": f"{type(b).__name__} {i}", "params": [p.numel() for p in b.parameters()],
                   "out_numel": 0} for i, b in enumerate(net)]
        # Each block's input at each size, and its output's gradient (ones: the cost does not
        # depend on the values).
        inputs: dict[tuple, tuple] = {}
        if matched:
            calls, watchers = watch_calls(net, matched)
        for size in sizes:
            h = x[:size]
            for i, block in enumerate(net):
                inp = h.detach().requires_grad_(i > 0 and h.is_floating_point())
                out = forward(block, inp)
                inputs[i, size] = (inp, torch.ones_like(out) if out.requires_grad else None)
                blocks[i]["out_numel"] = out[0].numel()
                h = out.detach()
            inputs["loss", size] = (h.detach().requires_grad_(True), y[:size])
        remove_hooks(watchers)
        for i, b in enumerate(blocks):     # one forward's calls (the hooks saw each size once)
            b["calls"] = calls.get(i, [])[:len(calls.get(i, [])) // len(sizes)]
        # Rounds over every (block, size) rather than repeats back to back: on a loaded machine
        # the median then spans the load's ups and downs instead of one moment of it.
        fwd, both = {}, {}
        for _ in range(repeats + 1):
            for size in sizes:
                for i, block in enumerate(net):
                    inp, grad = inputs[i, size]
                    fwd.setdefault((i, size), []).append(_once(lambda: forward(block, inp)))
                    if grad is not None:
                        both.setdefault((i, size), []).append(_once(lambda: forward(block, inp).backward(grad)))
                pred, target = inputs["loss", size]
                fwd.setdefault(("loss", size), []).append(_once(lambda: loss_fn(pred, target).item()))
                both.setdefault(("loss", size), []).append(_once(lambda: loss_fn(pred, target).backward()))
        robust = lambda samples: median(samples[1:]) if len(samples) > 1 else samples[0]     # the first warms up
        for i, b in enumerate(blocks):
            b["fwd"] = [robust(fwd[i, size]) for size in sizes]
            b["bwd"] = [max(0.0, robust(both[i, size]) - f) if (i, size) in both else 0.0
                        for size, f in zip(sizes, b["fwd"])]
        out_loss = {"fwd": [robust(fwd["loss", size]) for size in sizes]}
        out_loss["bwd"] = [max(0.0, robust(both["loss", size]) - f) for size, f in zip(sizes, out_loss["fwd"])]
        chain = time_chain(net, forward, loss_fn, x, y, sizes, repeats)
        scale_to_chain(blocks, out_loss, chain)
        for i, block in enumerate(net):
            params = [p for p in block.parameters() if p.requires_grad]
            blocks[i]["optimizer"] = 0.0
            if params:
                opt = build_optimizer(params, 0.0)
                blocks[i]["optimizer"] = _timed(lambda: (opt.step(), opt.zero_grad(set_to_none=False)), repeats)
        # The executor steps every parameter in one call: scale the blocks' steps to its time.
        whole = build_optimizer([p for p in net.parameters() if p.requires_grad], 0.0)
        chain["optimizer"] = _timed(lambda: (whole.step(), whole.zero_grad(set_to_none=False)), repeats)
        parts = sum(b["optimizer"] for b in blocks)
        for b in blocks:
            b["optimizer"] *= chain["optimizer"] / parts if parts > 0 else 1.0
    finally:
        remove_hooks(hooks)
        recorder.drain()
        recorder.enabled = was_recording
    return {"blocks": blocks, "loss": out_loss, "signature": signature, "plan": matched, "chain": chain}


def time_chain(net, forward, loss_fn, x, y, sizes: list[int], repeats: int) -> dict:
    """Seconds of the whole model's forward (blocks and loss) and backward (one ``backward()``
    from the loss) per size, medians over ``repeats``: what the executor runs as one action."""
    out = {"fwd": [], "bwd": []}
    for size in sizes:
        f, b = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            h = x[:size]
            for block in net:
                h = forward(block, h)
            loss = loss_fn(h, y[:size])
            t1 = time.perf_counter()
            loss.backward()
            f.append(t1 - t0)
            b.append(time.perf_counter() - t1)
        out["fwd"].append(median(f[1:]))
        out["bwd"].append(median(b[1:]))
    return out


def scale_to_chain(blocks: list[dict], loss: dict, chain: dict) -> None:
    """Scale each size's block times (in place) so that they add up to the chain's.

    A block timed alone runs with its weights and activations hot in cache; in a step the
    whole model streams through, and backward runs as one graph (measured ×1.3–1.7 for the
    backward of an MLP of 512-wide layers). The split between blocks stays as measured."""
    for key in ("fwd", "bwd"):
        for j in range(len(chain[key])):
            parts = sum(b[key][j] for b in blocks) + loss[key][j]
            factor = chain[key][j] / parts if parts > 0 else 1.0
            for row in (*blocks, loss):
                row[key][j] *= factor


def time_calls(iters: int = 20) -> dict:
    """This rank's seconds per labkit.comm call as a step makes them (recording on, each call
    waited): a 4-byte all-reduce, all-gather and reduce-scatter, and one way of a 4-byte ping-pong between ranks 0 and 1.

    The sweep times bare transport with calls back to back; a step also pays the flight
    recorder, the recording and a thread wake-up per message, which is the α a step sees.
    """
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..engine import session

    recorder = session().recorder
    was_recording, recorder.enabled = recorder.enabled, True
    me, x = dist.get_rank(), torch.zeros(1)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, name="calibrate")
        all_reduce = (time.perf_counter() - t0) / iters
        n = dist.get_world_size()
        whole, part = torch.zeros(n), torch.zeros(1)
        sharded = {}
        for op, call in (("all_gather", lambda: comm.all_gather(whole, part, name="calibrate")),
                         ("reduce_scatter", lambda: comm.reduce_scatter(part, whole, name="calibrate"))):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            sharded[op] = (time.perf_counter() - t0) / iters
        dist.barrier()
        p2p = 0.0
        if me in (0, 1):
            peer = 1 - me
            t0 = time.perf_counter()
            for _ in range(iters):
                for sending in ((True, False) if me == 0 else (False, True)):
                    call = comm.isend if sending else comm.irecv
                    call(x, peer, None, "calibrate", tag=7, check=False).wait()
            p2p = (time.perf_counter() - t0) / iters / 2
        dist.barrier()
    finally:
        recorder.drain()
        recorder.enabled = was_recording
    return {"all_reduce": all_reduce, "sendrecv": p2p, **sharded}


def time_busy_all_reduce(nbytes: int, iters: int = 8) -> dict:
    """Seconds of one all-reduce of ``nbytes`` with this rank idle, and with it computing
    meanwhile (issue, then small matmuls until the work completes), medians over ``iters``.

    On CPU the comm thread and the compute thread share the cores, so a transfer that
    overlaps compute (a bucket launched during backward, a pipeline send) takes longer
    than the same call on an idle rank; the ratio is the table's ``busy_factor``.
    """
    import torch
    import torch.distributed as dist

    x, a = torch.zeros(max(1, nbytes // 4)), torch.randn(128, 128)
    idle, busy, alone, beside = [], [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        alone.append((time.perf_counter() - t0) / 20)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        idle.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        deadline = t0 + max(1.0, 50 * idle[-1])     # a starved comm thread must not stall calibration
        done = 0
        while not work.is_completed() and time.perf_counter() < deadline:
            a @ a           # polled between small matmuls: a Python callback would wait for the GIL
            done += 1
        busy.append(time.perf_counter() - t0)
        if done:
            beside.append(busy[-1] / done)
        work.wait()
    # and the other way round: each matmul beside the transfer against one alone
    compute = median(beside) / median(alone) if beside else 1.0
    return {"idle_s": median(idle), "busy_s": median(busy), "compute_factor": compute}


def time_copies(nbytes: int, parts: int = 4, iters: int = 9) -> dict:
    """Bytes per second of what a bucket costs the compute thread: packing gradients into one
    flat buffer (``torch.cat``), copying the average back and dividing, and dividing alone
    (the naive mode's per-tensor ``div_``). The lab times none of them as compute."""
    import torch

    grads = [torch.randn(max(1, nbytes // 4 // parts)) for _ in range(parts)]
    flat = torch.cat(grads)

    def unpack():
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()]).div_(2)
            offset += g.numel()

    size = flat.numel() * 4
    rate = lambda fn: size / max(_timed(fn, iters), 1e-9)
    return {"pack_Bps": rate(lambda: torch.cat(grads)), "unpack_Bps": rate(unpack),
            "div_Bps": rate(lambda: [g.div_(2) for g in grads])}


# -- in the notebook --------------------------------------------------------------------------
def default_sizes(batch: int) -> list[int]:
    """Micro-batch sizes worth measuring for ``batch``: batch, batch/2, … down to 1."""
    sizes, s = [], batch
    while s >= 1:
        sizes.append(s)
        s //= 2
    return sorted(set(sizes))


def _mean_over_ranks(per_rank: list[dict]) -> tuple[list[dict], dict]:
    blocks = []
    for i, b in enumerate(per_rank[0]["blocks"]):
        rows = [r["blocks"][i] for r in per_rank]
        blocks.append(dict(b, **{k: [sum(r[k][j] for r in rows) / len(rows) for j in range(len(b[k]))]
                                 for k in ("fwd", "bwd")},
                           optimizer=sum(r["optimizer"] for r in rows) / len(rows)))
    loss = {k: [sum(r["loss"][k][j] for r in per_rank) / len(per_rank) for j in range(len(per_rank[0]["loss"][k]))]
            for k in ("fwd", "bwd")}
    return blocks, loss


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")


def calibrate(lab, model, batch: int = 64, sizes=None, repeats: int = 5, data=None, loss="mse", seed: int = 0,
              comm: bool = True, seconds_per_point: float = 0.03, tp=(), tp_plan: dict | None = None,
              in_step: bool = True) -> CostTable:
    """Measure ``model``'s per-block costs and the lab's α-β into a :class:`CostTable`.

    ``in_step``: also run the executor once per kind of call (a few steps each) to measure how
    much slower collectives run inside a step and its gaps between actions (:mod:`.in_step`).
    ``tp``: tensor-parallel degrees to time the blocks at as well (e.g. ``(2,)``), cut by
    ``tp_plan`` (default: the model's own); the f/g calls are timed on the lab's engines.
    """
    from .. import bench

    sizes = sorted(set(sizes)) if sizes else default_sizes(batch)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes={sizes!r} must be whole numbers ≥ 1 (rows per micro-batch)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a whole number ≥ 1")
    tp = (tp,) if isinstance(tp, int) else tuple(tp)
    if any(not isinstance(t, int) or t < 2 for t in tp):
        raise ValueError(f"tp={tp!r} must list tensor-parallel degrees ≥ 2, e.g. tp=(2,)")
    if tp and lab.world_size < 2:
        raise ValueError("tp: the f/g calls are timed between engines; calibrate on at least 2 engines")
    per_rank = lab.apply(time_blocks, model, seed, sizes, repeats, data, loss)
    blocks, loss_costs = _mean_over_ranks(per_rank)
    signature = per_rank[0]["signature"]
    tensor = {str(t): time_sharded(lab, t, model, seed, sizes, repeats, data, loss, tp_plan) for t in tp}
    fits = {}
    if comm and lab.world_size > 1:
        param_bytes = sum(4 * n for b in blocks for n in b["params"])
        act_bytes = max(4 * b["out_numel"] * max(sizes) for b in blocks)
        top = max(param_bytes, act_bytes)
        grid = [4 ** k for k in range(1, 14) if 4 ** (k - 1) <= top]
        sweep = bench.comm_sweep(lab, sizes=grid, collectives=COLLECTIVES, algorithms=(),
                                 seconds_per_point=seconds_per_point)
        calls = lab.apply(time_calls)
        contention = lab.apply(time_busy_all_reduce, min(param_bytes, 1 << 20))
        copies = lab.apply(time_copies, min(param_bytes, 1 << 20))
        fits["copy"] = {k: min(r[k] for r in copies) for k in copies[0]}
        busy_factor = max(1.0, max(r["busy_s"] for r in contention) / max(r["idle_s"] for r in contention))
        fits["contention"] = {"compute_factor": max(1.0, median(r["compute_factor"] for r in contention))}
        for (collective, _), (alpha, beta) in sweep.fits.items():
            # α as a step sees it: the slowest rank's recorded small call, if above the fit's
            seen = max(r[collective] for r in calls)
            fits[collective] = {"alpha_s": max(alpha, seen), "alpha_fit_s": alpha,
                                "beta_Bps": beta if math.isfinite(beta) else 1e30, "n": lab.world_size,
                                "busy_factor": busy_factor}
    table = CostTable(model=fingerprint(signature), signature=signature, sizes=sizes, blocks=blocks,
                      loss=loss_costs, comm=fits, world_size=lab.world_size, tensor=tensor)
    if in_step and fits:
        from .in_step import time_in_step
        table.in_step = time_in_step(lab, model, batch, table, data=data, loss=loss, tp_plan=tp_plan)
    return table


def time_sharded(lab, tp: int, model, seed, sizes, repeats, data, loss, tp_plan) -> dict:
    """The blocks at one tp rank's shard shape, and the α-β of f and g through labkit's own."""
    from .tensor_costs import fit_tp_calls, time_tp_calls

    per_rank = lab.apply(time_blocks, model, seed, sizes, repeats, data, loss, tp, tp_plan)
    blocks, loss_costs = _mean_over_ranks(per_rank)
    nbytes = sorted({4 * numel * s for b in blocks for _, numel in b["calls"] for s in sizes}) or [4]
    calls = fit_tp_calls(lab.apply(time_tp_calls, nbytes), lab.world_size)
    return {"plan": per_rank[0]["plan"], "blocks": blocks, "loss": loss_costs, "calls": calls}
