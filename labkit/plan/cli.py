"""``labkit plan``: rank strategies for a model on a cluster, or predict one (no engines).

    labkit plan --layers 96 --hidden 12288 --heads 96 --vocab 51200 --seq 2048 --gpus 1024 \\
                --hardware a100 --global-batch 1536                      # the top strategies of a GPT
    labkit plan ... --tp 8 --pp 16 --dp 8 --microbatch-size 1 --recompute full --json p.json
    labkit plan --model-config config.json --seq 8192 --gpus 512 --hardware h100 --global-batch 512
    labkit plan --validate                                               # Megatron-LM SC21 Table 1
    labkit plan --published llama                                        # Llama 3 and torchtitan tables

Every argument is checked, and the output path too, before any prediction: a bad one is a
one-line message and exit code 2 (argparse's own code for bad usage). A strategy that does not
fit, or a ranking in which none fits, exits 1.
"""
from __future__ import annotations

import json
import os
import sys

from .scale.layout import strategy_choices

POSITIVE = ("layers", "hidden", "heads", "vocab", "seq", "gpus", "gpus_per_node", "global_batch", "tp", "pp", "dp",
            "microbatch_size", "chunks", "top", "cp", "ep")
GPT_SHAPE = ("layers", "hidden", "heads", "vocab")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict memory, step time and MFU of strategies at scale")
    p.error = _one_line_error
    model = p.add_argument_group("model: a GPT by its shape, or a Hugging Face config.json")
    model.add_argument("--layers", type=int)
    model.add_argument("--hidden", type=int)
    model.add_argument("--heads", type=int)
    model.add_argument("--vocab", type=int, help="GPT vocabulary (default 51200)")
    model.add_argument("--seq", type=int, help="sequence length (GPT default 2048; a config's "
                                               "max_position_embeddings)")
    model.add_argument("--model-config", metavar="PATH", help="a Llama/Mistral/Mixtral/Qwen config.json "
                                                              "(grouped-query attention, SwiGLU, MoE)")
    where = p.add_argument_group("cluster")
    where.add_argument("--gpus", type=int)
    where.add_argument("--gpus-per-node", type=int, default=8)
    where.add_argument("--hardware", default="a100", help="a100 | h100 | h200")
    p.add_argument("--global-batch", type=int, help="sequences per step")
    one = p.add_argument_group("one strategy (give --tp, --pp and --dp to predict just it)")
    for name in ("tp", "pp", "dp"):
        one.add_argument(f"--{name}", type=int)
    one.add_argument("--microbatch-size", type=int, default=1)
    one.add_argument("--recompute", choices=strategy_choices("recompute"), default="none")
    one.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    one.add_argument("--schedule", choices=strategy_choices("schedule"), default="1f1b")
    one.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    one.add_argument("--sequence-parallel", action="store_true")
    one.add_argument("--cp", type=int, default=1, help="context-parallel degree (dp·pp·cp·tp = GPUs)")
    one.add_argument("--cp-mode", choices=strategy_choices("cp_mode"), default="ring")
    one.add_argument("--dp-mode", choices=strategy_choices("dp_mode"), default="bucketed",
                     help="bucketed: gradients reduced after backward; overlap/ddp: under it")
    one.add_argument("--dp-shard", type=int, default=None,
                     help="HSDP: ZeRO inside groups of this many dp ranks, replicated across them (default: all of dp)")
    one.add_argument("--ep", type=int, default=1, help="expert-parallel degree (dividing dp and the experts)")
    one.add_argument("--ep-overlap", choices=strategy_choices("ep_overlap"), default=None,
                     help="with --ep > 1: 'microbatch' (the default there) hides the all-to-alls, 'none' exposes them")
    p.add_argument("--top", type=int, default=10, help="strategies to list when ranking (≥ 1)")
    p.add_argument("--json", help="write the prediction (one strategy) or the ranking here")
    p.add_argument("--validate", action="store_true", help="compare with Megatron-LM SC21 Table 1 and exit")
    p.add_argument("--published", choices=("sc21", "mlsys23", "llama"),
                   help="print a published table with the error per row (sc21: Megatron-LM 2021; mlsys23: "
                        "Megatron-LM 2022, sequence parallel and selective recomputation; llama: Llama 3 and torchtitan)")
    p.set_defaults(func=run)


def _one_line_error(message: str):
    """argparse's own errors (a flag that is not a number, an unknown choice) as one line, exit 2."""
    print(f"labkit plan: {message}", file=sys.stderr)
    raise SystemExit(BAD_ARGUMENTS)


BAD_ARGUMENTS = 2
"""The exit code of bad input (docs/troubleshooting.md); 1 is "does not fit"."""


def _check_config_object(path: str) -> None:
    """A config.json holds one JSON object ({"model_type": …, …}); anything else is named."""
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {path} holds a JSON {type(config).__name__}, not an object; a Hugging Face "
                         "config.json is one object such as {\"model_type\": \"llama\", \"hidden_size\": 4096, …}")


def check_args(args) -> None:
    """Every argument and the output path, before any work (ValueError naming the flag and the fix)."""
    for name in POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a whole number ≥ 1")
    if args.model_config:
        given = [f"--{n}" for n in GPT_SHAPE if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{' '.join(given)} describe a GPT; with --model-config the shape comes from the "
                             "config (give one or the other; --seq sets the sequence length of either)")
        if not os.path.isfile(args.model_config):
            raise ValueError(f"--model-config {args.model_config}: no such file; give the path of a config.json")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            raise ValueError(f"--json {args.json} is a folder; give a file path such as {args.json}/plan.json")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--json {args.json}: the folder {folder} does not exist or cannot be written; "
                             "create it or choose another path")


def _model_and_cluster(args):
    from .scale.hardware import Cluster, ModelShape
    from .scale.model import from_hf_config

    need = ("gpus", "global_batch") if args.model_config else ("layers", "hidden", "heads", "gpus", "global_batch")
    missing = [f"--{n.replace('_', '-')}" for n in need if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give {' '.join(missing)} (the model, the cluster size and the batch)")
    if args.model_config:
        try:
            _check_config_object(args.model_config)
            model = from_hf_config(args.model_config, seq=args.seq)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--model-config {args.model_config} is not a JSON file ({exc})") from None
        except KeyError as exc:
            raise ValueError(f"--model-config {args.model_config} has no {exc} field") from None
    else:
        model = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab or 51200,
                    seq=args.seq or 2048)
    return model, Cluster.of(args.gpus, args.hardware, args.gpus_per_node)


def fits_rule(cluster) -> str:
    """What "fits" means: the usable share of each GPU's memory."""
    from .scale.memory import USABLE_FRACTION

    hbm = cluster.hardware.hbm_bytes
    return (f"fits = at most {100 * USABLE_FRACTION:.0f}% of {hbm / 1e9:.1f} GB ({hbm / 2 ** 20:.0f} MiB) = "
            f"{USABLE_FRACTION * hbm / 1e9:.1f} GB per GPU "
            "(the CUDA context, NCCL buffers and allocator fragmentation take the rest)")


def _one(args, model, cluster) -> int:
    from .scale.layout import ClusterStrategy
    from .scale.step import predict

    if None in (args.tp, args.pp, args.dp):
        raise ValueError("to predict one strategy give all of --tp, --pp and --dp")
    s = ClusterStrategy(dp=args.dp, pp=args.pp, tp=args.tp, zero=args.zero, microbatch_size=args.microbatch_size,
                        schedule=args.schedule, chunks=args.chunks, recompute=args.recompute,
                        sequence_parallel=args.sequence_parallel, cp=args.cp, cp_mode=args.cp_mode, ep=args.ep,
                        ep_overlap=args.ep_overlap or ("microbatch" if args.ep > 1 else "none"), dp_mode=args.dp_mode,
                        dp_shard=args.dp_shard)
    p = predict(model, cluster, args.global_batch, s)
    m = p.memory
    print(f"{s.label()} on {cluster.gpus}× {cluster.hardware.name}, global batch {args.global_batch}")
    print(f"step time {p.step_time_s:.3f} s   MFU {100 * p.mfu:.1f}%   {p.tflops_per_gpu:.1f} TFLOP/s per GPU")
    print(f"memory per GPU {p.memory_gb_per_gpu:.1f} GB (weights {m['weights'] / 1e9:.1f}, gradients "
          f"{m['gradients'] / 1e9:.1f}, optimizer {m['optimizer'] / 1e9:.1f}, activations {m['activations'] / 1e9:.1f})"
          f" — {'fits' if p.fits else 'DOES NOT FIT'}; {fits_rule(cluster)}")
    tiers = p.parts["bytes_by_tier"]
    print(f"bytes a GPU sends a step: {tiers['intra'] / 1e9:.1f} GB inside a node (NVLink), "
          f"{tiers['inter'] / 1e9:.1f} GB across nodes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(p.summary(), f, indent=1)
    return 0 if p.fits else 1


def _rank(args, model, cluster) -> int:
    from .scale.search import search

    result = search(model, cluster, args.global_batch)
    print(result.table(top=args.top))
    print(fits_rule(cluster))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(p.summary(), strategy=p.strategy.to_dict()) for p in result.ranked[:args.top]], f, indent=1)
    return 0 if result.fits else 1


def run(args) -> int:
    """The ``plan`` subcommand; bad input prints one line and returns 2 (nothing fits: 1)."""
    try:
        check_args(args)
        if args.validate or args.published:
            from .scale import published
            return published.main("sc21" if args.validate else args.published)
        model, cluster = _model_and_cluster(args)
        if args.model_config:
            print(model.describe(ep=args.ep) + ("" if args.seq else " (seq: the config's max_position_embeddings; "
                                                          "--seq sets the training length)"))
        if any(getattr(args, n) is not None for n in ("tp", "pp", "dp")):
            return _one(args, model, cluster)
        return _rank(args, model, cluster)
    except ValueError as exc:
        print(f"labkit plan: {exc}", file=sys.stderr)
        return BAD_ARGUMENTS
