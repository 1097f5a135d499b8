"""What the GPU check runs on the lab's engine, and how it drives steps there.

``drive`` is ``lab.run`` without gathering the parameters; the ``on_engine_…`` functions
run on the engine through ``lab.apply`` (they travel by value: engines cannot import this
file by name, see scripts/gpu_check.py).
"""
from __future__ import annotations

from statistics import median

import torch

from labkit import engine
from labkit.run.runner import ship_by_value
from labkit.analysis.waits import split_waits


def drive(lab, spec, setup=engine.setup_run):
    """``lab.run`` without gathering the parameters (a GPT's would be gigabytes): losses,
    events (waits split), per-step wall times of the slowest rank."""
    ship_by_value(spec.model, spec.data, spec.loss)
    s = spec.strategy
    lab.apply(engine.ensure_groups, s.grid())
    lab.apply(setup, spec)
    losses, events, walls = [], [], []
    for step in range(spec.steps):
        results = lab.apply(engine.run_step, step)
        scored = [r for r in results if r.get("loss_weight", 0) > 0]
        losses.append(sum(r["loss"] * r["loss_weight"] for r in scored) / sum(r["loss_weight"] for r in scored))
        walls.append(max(r["step_s"] for r in results))
        events += split_waits([e for r in results for e in r["events"]])
    return losses, events, walls


def measured(values: list):
    return values[1:] if len(values) >= 3 else values       # the first step warms up


def on_engine_setup_pipeline(spec):
    """Engine side: the one executor at pp=1 (every strategy runs through it), built directly."""
    from labkit.parallel.build import build_job
    s = engine.session()
    s.recorder.enabled = spec.record
    s.job, s.run_id = build_job(spec, s.groups, s.recorder, s.device), None
    return {"rank": s.rank}


def on_engine_drop_job():
    import gc
    s = engine.session()
    s.job = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    return 0


def on_engine_probe(nbytes: int, repeats: int = 8) -> dict:
    """Engine side: backends in use, the comm stream, and a lone all-reduce timed by labkit.comm."""
    import torch.distributed as dist
    from labkit import comm
    s, ctx = engine.session(), comm.context()
    info = {"world_backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(s.device),
            "dp_backend": dist.get_backend(s.groups.dp) if s.groups else None}
    if s.device.type == "cuda":
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        info["comm_stream_separate"] = ctx.comm_stream is not None and ctx.comm_stream != torch.cuda.current_stream()
    t = torch.ones(max(1, nbytes // 4), device=s.device)
    s.recorder.start_step(0)
    for i in range(repeats):
        comm.all_reduce(t, name=f"probe {i}")
    spans = [e["end"] - e["start"] for e in s.recorder.drain() if e["kind"] == "allreduce"]
    info["lone_allreduce_s"] = median(spans[1:])
    info["allreduce_right"] = bool(torch.all(t == float(dist.get_world_size()) ** repeats))
    if s.device.type == "cuda":
        try:
            dist.all_reduce(torch.ones(4))
            info["cpu_tensors"] = "accepted by the world group"
        except Exception as exc:
            info["cpu_tensors"] = f"refused by the NCCL world ({type(exc).__name__}); labkit makes no gloo side group"
    return info


def on_engine_dtensor_tp(width: int) -> dict:
    """Engine side: torch's own TP (colwise, then rowwise) on a mesh of this world, against plain."""
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    s = engine.session()
    mesh = init_device_mesh(s.device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)).to(s.device)
    tp = parallelize_module(copy.deepcopy(plain), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(16, width, device=s.device)
    y_plain, y_tp = plain(x), tp(x)
    y_plain.square().mean().backward()
    y_tp.square().mean().backward()
    grad = max(float((a.grad - b.grad.full_tensor()).abs().max()) for a, b in zip(plain.parameters(), tp.parameters()))
    return {"mesh": str(mesh), "out_diff": float((y_plain - y_tp).abs().max()), "grad_diff": grad}


def on_engine_torch_cp(seq: int, heads: int = 8, head_dim: int = 64, repeats: int = 5) -> dict:
    """Engine side (CUDA): torch's own context parallelism (``context_parallel`` over a mesh of
    this world) on causal sdpa, against plain sdpa and against labkit's ring arithmetic (the
    sequence in 2·world chunks, each query chunk's partial results merged by log-sum-exp,
    labkit.parallel.context.blocks); forward outputs compared, each path timed (float32)."""
    import time
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from labkit.parallel.context.blocks import SKIP, block_forward, merge, relation
    s = engine.session()
    world = dist.get_world_size()
    mesh = init_device_mesh(s.device.type, (world,))
    gen = torch.Generator(device=s.device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=s.device, generator=gen)
               for _ in range(3))

    def timed(fn):
        out = fn()                          # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) / repeats

    plain, plain_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def torch_cp():
        qs, ks, vs = q.clone(), k.clone(), v.clone()      # sharded in place inside the context
        with context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2]):
            local = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return context_parallel_unshard(mesh, [local], [2])[0]

    theirs, theirs_s = timed(torch_cp)

    def blocks():
        n, c = 2 * world, seq // (2 * world)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for a in range(n):
            for b in range(n):
                how = relation(a, b, True)
                if how != SKIP:
                    qa, kb = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                    merge(out[:, :, qa], lse[:, :, qa], *block_forward(q[:, :, qa], k[:, :, kb], v[:, :, kb], how))
        return out

    ours, ours_s = timed(blocks)
    return {"world": world, "seq": seq, "heads": heads, "head_dim": head_dim,
            "torch_cp_max_diff": float((theirs - plain).abs().max()),
            "labkit_blocks_max_diff": float((ours - plain).abs().max()),
            "plain_ms": plain_s * 1e3, "torch_cp_ms": theirs_s * 1e3, "labkit_blocks_ms": ours_s * 1e3}
