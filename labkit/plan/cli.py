"""``labkit plan``: rank strategies for a GPT on a cluster, or predict one (no engines).

    labkit plan --layers 96 --hidden 12288 --heads 96 --vocab 51200 --seq 2048 --gpus 1024 \\
                --hardware a100 --global-batch 1536                      # the top strategies
    labkit plan ... --tp 8 --pp 16 --dp 8 --microbatch-size 1 --recompute full --json p.json
    labkit plan --validate                                               # Megatron-LM SC21 Table 1
"""
from __future__ import annotations

import json
import sys

from .layout import RECOMPUTE, SCHEDULES

ONE_STRATEGY = ("tp", "pp", "dp", "microbatch_size", "recompute", "zero", "schedule", "chunks")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict memory, step time and MFU of GPT strategies at scale")
    model = p.add_argument_group("model (a GPT)")
    model.add_argument("--layers", type=int)
    model.add_argument("--hidden", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--vocab", type=int, default=51200)
    model.add_argument("--seq", type=int, default=2048)
    where = p.add_argument_group("cluster")
    where.add_argument("--gpus", type=int)
    where.add_argument("--gpus-per-node", type=int, default=8)
    where.add_argument("--hardware", default="a100", help="a100 | h100 | h200")
    p.add_argument("--global-batch", type=int, help="sequences per step")
    one = p.add_argument_group("one strategy (give --tp, --pp and --dp to predict just it)")
    for name in ("tp", "pp", "dp"):
        one.add_argument(f"--{name}", type=int)
    one.add_argument("--microbatch-size", type=int, default=1)
    one.add_argument("--recompute", choices=RECOMPUTE, default="none")
    one.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    one.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    one.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--top", type=int, default=10, help="strategies to list when ranking")
    p.add_argument("--json", help="write the prediction (one strategy) or the ranking here")
    p.add_argument("--validate", action="store_true", help="compare with Megatron-LM SC21 Table 1 and exit")
    p.set_defaults(func=run)


def _model_and_cluster(args):
    from .hardware import GPT, Cluster

    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "gpus", "global_batch")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give {' '.join(missing)} (the model, the cluster size and the batch)")
    model = GPT(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq)
    return model, Cluster.of(args.gpus, args.hardware, args.gpus_per_node)


def _one(args, model, cluster) -> int:
    from .layout import ClusterStrategy
    from .step import predict

    if None in (args.tp, args.pp, args.dp):
        raise ValueError("to predict one strategy give all of --tp, --pp and --dp")
    s = ClusterStrategy(dp=args.dp, pp=args.pp, tp=args.tp, zero=args.zero, microbatch_size=args.microbatch_size,
                        schedule=args.schedule, chunks=args.chunks, recompute=args.recompute)
    p = predict(model, cluster, args.global_batch, s)
    m = p.memory
    print(f"{s.label()} on {cluster.gpus}× {cluster.hardware.name}, global batch {args.global_batch}")
    print(f"step time {p.step_time_s:.3f} s   MFU {100 * p.mfu:.1f}%   {p.tflops_per_gpu:.1f} TFLOP/s per GPU")
    print(f"memory per GPU {p.memory_gb_per_gpu:.1f} GB (weights {m['weights'] / 1e9:.1f}, gradients "
          f"{m['gradients'] / 1e9:.1f}, optimizer {m['optimizer'] / 1e9:.1f}, activations {m['activations'] / 1e9:.1f})"
          f" — {'fits' if p.fits else 'DOES NOT FIT'} in {cluster.hardware.hbm_bytes / 1e9:.0f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(p.summary(), f, indent=1)
    return 0


def _rank(args, model, cluster) -> int:
    from .search import search

    result = search(model, cluster, args.global_batch)
    print(result.table(top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(p.summary(), strategy=p.strategy.to_dict()) for p in result.ranked[:args.top]], f, indent=1)
    return 0 if result.fits else 1


def run(args) -> int:
    """The ``plan`` subcommand; bad input prints a message and returns 1."""
    try:
        if args.validate:
            from . import published
            print(published.table(published.compare()))
            return 0
        model, cluster = _model_and_cluster(args)
        if any(getattr(args, n) is not None for n in ("tp", "pp", "dp")):
            return _one(args, model, cluster)
        return _rank(args, model, cluster)
    except ValueError as exc:
        print(f"labkit plan: {exc}", file=sys.stderr)
        return 1
