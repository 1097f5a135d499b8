"""Measure what a step is made of on the lab's engines: a reloadable cost table.

``calibrate(lab, model=, batch=)`` times, on every engine at once (so the engines contend for
the cores as they do in a run), each top-level block's forward and backward per micro-batch
size, the loss, and each block's optimizer step; then the α-β of all-reduce and of
point-to-point with :func:`labkit.bench.comm_sweep` and its fit. The table is plain JSON and
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
from dataclasses import asdict, dataclass
from statistics import median

FORMAT = 1


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
    comm: dict                    # {"all_reduce": {"alpha_s", "beta_Bps", "n"}, "sendrecv": {...}}
    world_size: int = 1
    format: int = FORMAT

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
            raise ValueError(f"the cost table has no {op!r} costs (calibrated on {self.world_size} engine(s)); "
                             "calibrate on at least 2 engines for dp > 1 or pp > 1")
        c = self.comm[op]
        return c["alpha_s"], c["beta_Bps"]

    def all_reduce_s(self, nbytes: float, n: int, busy: bool = False) -> float:
        """α + 2(n−1)/n·S/β, with the bus bandwidth β measured (ring scaling to other n);
        ``busy``: while the rank computes (× the measured ``busy_factor``)."""
        alpha, beta = self.alpha_beta("all_reduce")
        return (alpha + 2 * (n - 1) / n * nbytes / beta) * (self.busy_factor if busy else 1.0)

    def p2p_s(self, nbytes: float, busy: bool = False) -> float:
        """α + S/β of one message (``busy``: × ``busy_factor``, as if its rank computed throughout)."""
        alpha, beta = self.alpha_beta("sendrecv")
        return (alpha + nbytes / beta) * (self.busy_factor if busy else 1.0)

    def copy_s(self, nbytes: float, what: str) -> float:
        """Compute-thread seconds to "pack", "unpack" or "div" ``nbytes`` of gradients (0 if not measured)."""
        rate = self.comm.get("copy", {}).get(f"{what}_Bps")
        return nbytes / rate if rate else 0.0

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
        if d.get("format") != FORMAT:
            raise ValueError(f"cost table format {d.get('format')!r} is not {FORMAT}; calibrate again")
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


def time_blocks(model, seed: int, sizes: list[int], repeats: int, data=None, loss="mse") -> dict:
    """This rank's seconds per block forward / backward / optimizer step for each size.

    Timed the way the executor runs them: the backward-span hooks installed and the
    recorder on, forward under the activation meter (their Python cost is part of a step).
    """
    import torch

    from ..engine import session
    from ..record.instrument import ActivationMeter, instrument_backward, remove_hooks
    from ..models.training import build_model, build_optimizer, resolve_data, resolve_loss

    net = build_model(model, seed)
    x, y = resolve_data(data, net, max(sizes), seed)(0)
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
        for size in sizes:
            h = x[:size]
            for i, block in enumerate(net):
                inp = h.detach().requires_grad_(i > 0 and h.is_floating_point())
                out = forward(block, inp)
                inputs[i, size] = (inp, torch.ones_like(out) if out.requires_grad else None)
                blocks[i]["out_numel"] = out[0].numel()
                h = out.detach()
            inputs["loss", size] = (h.detach().requires_grad_(True), y[:size])
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
        for i, block in enumerate(net):
            params = [p for p in block.parameters() if p.requires_grad]
            blocks[i]["optimizer"] = 0.0
            if params:
                opt = build_optimizer(params, 0.0)
                blocks[i]["optimizer"] = _timed(lambda: (opt.step(), opt.zero_grad(set_to_none=False)), repeats)
    finally:
        remove_hooks(hooks)
        recorder.drain()
        recorder.enabled = was_recording
    return {"blocks": blocks, "loss": out_loss, "signature": model_signature(net)}


def time_calls(iters: int = 20) -> dict:
    """This rank's seconds per labkit.comm call as a step makes them (recording on, each call
    waited): a 4-byte all-reduce, and one way of a 4-byte ping-pong between ranks 0 and 1.

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
    return {"all_reduce": all_reduce, "sendrecv": p2p}


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
    idle, busy = [], []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        idle.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        deadline = t0 + max(1.0, 50 * idle[-1])     # a starved comm thread must not stall calibration
        while not work.is_completed() and time.perf_counter() < deadline:
            a @ a           # polled between small matmuls: a Python callback would wait for the GIL
        busy.append(time.perf_counter() - t0)
        work.wait()
    return {"idle_s": median(idle), "busy_s": median(busy)}


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


def calibrate(lab, model, batch: int = 64, sizes=None, repeats: int = 5, data=None, loss="mse", seed: int = 0,
              comm: bool = True, seconds_per_point: float = 0.03) -> CostTable:
    """Measure ``model``'s per-block costs and the lab's α-β into a :class:`CostTable`."""
    from .. import bench

    sizes = sorted(set(sizes)) if sizes else default_sizes(batch)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes={sizes!r} must be whole numbers ≥ 1 (rows per micro-batch)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a whole number ≥ 1")
    per_rank = lab.apply(time_blocks, model, seed, sizes, repeats, data, loss)
    blocks, loss_costs = _mean_over_ranks(per_rank)
    signature = per_rank[0]["signature"]
    fits = {}
    if comm and lab.world_size > 1:
        param_bytes = sum(4 * n for b in blocks for n in b["params"])
        act_bytes = max(4 * b["out_numel"] * max(sizes) for b in blocks)
        top = max(param_bytes, act_bytes)
        grid = [4 ** k for k in range(1, 14) if 4 ** (k - 1) <= top]
        sweep = bench.comm_sweep(lab, sizes=grid, collectives=("all_reduce", "sendrecv"), algorithms=(),
                                 seconds_per_point=seconds_per_point)
        calls = lab.apply(time_calls)
        contention = lab.apply(time_busy_all_reduce, min(param_bytes, 1 << 20))
        copies = lab.apply(time_copies, min(param_bytes, 1 << 20))
        fits["copy"] = {k: min(r[k] for r in copies) for k in copies[0]}
        busy_factor = max(1.0, max(r["busy_s"] for r in contention) / max(r["idle_s"] for r in contention))
        for (collective, _), (alpha, beta) in sweep.fits.items():
            # α as a step sees it: the slowest rank's recorded small call, if above the fit's
            seen = max(r[collective] for r in calls)
            fits[collective] = {"alpha_s": max(alpha, seen), "alpha_fit_s": alpha,
                                "beta_Bps": beta if math.isfinite(beta) else 1e30, "n": lab.world_size,
                                "busy_factor": busy_factor}
    return CostTable(model=fingerprint(signature), signature=signature, sizes=sizes, blocks=blocks,
                     loss=loss_costs, comm=fits, world_size=lab.world_size)
