"""On the engines: each block's forward, backward and optimizer step, timed as the executor runs them.

Called through ``lab.apply`` by :func:`labkit.plan.costs.calibrate` (every engine at once, so
they contend for the cores as in a run). Blocks are timed one by one (the split a pipeline
needs), then scaled so that they add up to the whole model timed as one chain
(:func:`scale_to_chain`): what one forward or backward action of the executor costs.
"""
from __future__ import annotations

import time
from statistics import median

from .costs import model_signature

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


def _split_once(forward, block, inp, grad) -> tuple[float, float]:
    """Seconds of one backward split as a zero-bubble schedule runs it: I (the input gradient,
    :func:`~labkit.parallel.pipeline.split_backward.backward_input`), then W (the weights')."""
    from ..parallel.pipeline.split_backward import backward_input, backward_weight

    out = forward(block, inp)
    t0 = time.perf_counter()
    _, kept = backward_input(out, grad, inp, block)
    t1 = time.perf_counter()
    del out
    backward_weight(kept)
    return t1 - t0, time.perf_counter() - t1


def time_blocks(model, seed: int, sizes: list[int], repeats: int, data=None, loss="mse", tp: int = 1,
                tp_plan=None) -> dict:
    """This rank's seconds per block forward / backward / optimizer step for each size.

    Timed the way the executor runs them: the backward-span hooks installed and the
    recorder on, forward under the activation meter (their Python cost is part of a step).
    ``tp`` > 1: the blocks as one tensor-parallel rank holds them (the plan's modules at
    their shard's shape, no collectives), and per block the f/g calls a step makes.
    Each block's backward is also timed split in two, as the zero-bubble schedules run it:
    ``bwd_input`` (I) and ``bwd_weight`` (W); block 0 reads the data, so its I is empty and W
    is its whole backward, as on a pipeline's first stage.
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
        fwd, both, split = {}, {}, {}
        for _ in range(repeats + 1):
            for size in sizes:
                for i, block in enumerate(net):
                    inp, grad = inputs[i, size]
                    fwd.setdefault((i, size), []).append(_once(lambda: forward(block, inp)))
                    if grad is not None:
                        both.setdefault((i, size), []).append(_once(lambda: forward(block, inp).backward(grad)))
                        if i > 0:       # block 0's W is its whole backward (scale_to_chain)
                            split.setdefault((i, size), []).append(_split_once(forward, block, inp, grad))
                pred, target = inputs["loss", size]
                fwd.setdefault(("loss", size), []).append(_once(lambda: loss_fn(pred, target).item()))
                both.setdefault(("loss", size), []).append(_once(lambda: loss_fn(pred, target).backward()))
        robust = lambda samples: median(samples[1:]) if len(samples) > 1 else samples[0]     # the first warms up
        for i, b in enumerate(blocks):
            b["fwd"] = [robust(fwd[i, size]) for size in sizes]
            b["bwd"] = [max(0.0, robust(both[i, size]) - f) if (i, size) in both else 0.0
                        for size, f in zip(sizes, b["fwd"])]
            halves = [[robust([s[k] for s in split[i, size]]) if (i, size) in split else 0.0 for size in sizes]
                      for k in (0, 1)]
            b["bwd_input"], b["bwd_weight"] = halves
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
    from the loss) per size, medians over ``repeats``: what the executor runs as one action.

    Also the backward split (``bwd_input``, ``bwd_weight``) of the chain from block 1 on, its
    input needing a gradient as a later pipeline stage's does: one I and one W, as a stage runs
    them (block 0 reads the data: it only ever runs in a first stage, whose W is all of it)."""
    from ..parallel.pipeline.split_backward import backward_input, backward_weight

    out = {"fwd": [], "bwd": [], "bwd_input": [], "bwd_weight": []}
    for size in sizes:
        f, b, i, w = [], [], [], []
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
            if len(net) > 1:
                h = forward(net[0], x[:size]).detach()
                inp = h.requires_grad_(h.is_floating_point())
                for block in list(net)[1:]:
                    h = forward(block, h)
                loss = loss_fn(h, y[:size])
                t0 = time.perf_counter()
                _, kept = backward_input(loss, None, inp, net)
                t1 = time.perf_counter()
                del loss, h
                backward_weight(kept)
                i.append(t1 - t0)
                w.append(time.perf_counter() - t1)
        for key, samples in (("fwd", f), ("bwd", b), ("bwd_input", i), ("bwd_weight", w)):
            out[key].append(median(samples[1:]) if samples else 0.0)
    return out


def scale_to_chain(blocks: list[dict], loss: dict, chain: dict) -> None:
    """Scale each size's block times (in place) so that they add up to the chain's.

    A block timed alone runs with its weights and activations hot in cache; in a step the
    whole model streams through, and backward runs as one graph (measured ×1.3–1.7 for the
    backward of an MLP of 512-wide layers). The split between blocks stays as measured.
    Blocks 1… take their I and W (``bwd_input``, ``bwd_weight``) from the chain's split (the
    loss's backward is part of its I); block 0's I is empty and its W its whole backward."""
    later = blocks[1:]
    for j in range(len(chain["fwd"])):
        if later and chain.get("bwd_input"):
            for key, whole in (("bwd_input", chain["bwd_input"][j] - loss["bwd"][j]), ("bwd_weight", chain["bwd_weight"][j])):
                parts = sum(b[key][j] for b in later)
                factor = max(0.0, whole) / parts if parts > 0 else 1.0
                for b in later:
                    b[key][j] *= factor
        for key in ("fwd", "bwd"):
            parts = sum(b[key][j] for b in blocks) + loss[key][j]
            factor = chain[key][j] / parts if parts > 0 else 1.0
            for row in (*blocks, loss):
                row[key][j] *= factor
        if blocks and "bwd_weight" in blocks[0]:
            blocks[0]["bwd_input"][j], blocks[0]["bwd_weight"][j] = 0.0, blocks[0]["bwd"][j]
