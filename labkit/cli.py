"""``labkit`` on the command line: the same engine as the notebooks, headless.

    labkit run --engines 4 --dp 2 --pp 2 --schedule 1f1b --microbatches 8 --batch 64 \\
               --steps 5 --json run.json --trace trace.json --plot timeline.png
    labkit run --tp 2 --model gpt --width 128 --depth 4 --batch 8 --lr 0.3
    labkit bench comm --engines 4 --max-mb 16 --json comm.json --plot comm.png
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from .config import Strategy, strategy_fields


def add_strategy_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Strategy field, from its metadata (``--dp-mode``, ``--error-feedback``, …),
    in one help section per axis of the registry (its degree first), then how stages compute."""
    for name, group_fields in strategy_sections():
        group = p.add_argument_group(f"{name} axis" if name not in ("compute", "grid") else name)
        for f in group_fields:
            _add_flag(group, f)


def strategy_sections() -> list[tuple[str, list]]:
    """(axis name, its Strategy fields) for every axis of the registry, then "compute", then
    "grid" (where the axes' ranks sit: ``order``)."""
    from .parallel.axes import AXES

    every = strategy_fields()
    names = [a.NAME for a in AXES] + ["compute"]
    sections = [(name, [f for f in every if f.name == name or f.metadata["axis"] == name]) for name in names]
    placed = {f.name for _, fs in sections for f in fs}
    return sections + [("grid", [f for f in every if f.name not in placed])]


def _add_flag(p, f) -> None:
    flag, m = "--" + f.name.replace("_", "-"), f.metadata
    help_text = m["doc"] + (f" (default {f.default!r})" if f.default != () else "")
    if f.type == "bool":
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
    elif f.type.startswith("tuple"):
        p.add_argument(flag, type=int, nargs="*", default=f.default, metavar="BLOCK", help=help_text)
    else:
        kind = {"int": int, "float": float, "str": str}[f.type.removesuffix(" | None")]
        if f.type.endswith(" | None"):          # --dp-shard none: the field's None
            kind = _or_none(kind)
        p.add_argument(flag, type=kind, choices=m["choices"], default=f.default, help=help_text)


def _or_none(kind):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__         # argparse names the type in its error
    return parse


def strategy_from_args(args) -> Strategy:
    """The Strategy the flags describe (ValueError names the field and the fix)."""
    values = {f.name: getattr(args, f.name) for f in strategy_fields()}
    values["split_at"] = tuple(values["split_at"])
    return Strategy(**values)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="train a model under a strategy on local engines and report")
    p.add_argument("--engines", type=int, default=None, help="local engines to start (default dp*pp*tp)")
    add_strategy_flags(p)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                   help="mlp (synthetic regression) or gpt (character-level text, cross-entropy)")
    p.add_argument("--width", type=int, default=256, help="MLP width; GPT n_embd")
    p.add_argument("--depth", type=int, default=8, help="MLP depth (Linear layers); GPT n_layer")
    p.add_argument("--heads", type=int, default=4, help="GPT attention heads")
    p.add_argument("--block-size", type=int, default=64, help="GPT context length (tokens)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="torch's own, its defaults (default sgd)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--json", help="write strategy, losses, metrics and events here")
    p.add_argument("--trace", help="write a Chrome trace (Perfetto) here")
    p.add_argument("--plot", help="write the last step's timeline as an image here")
    p.add_argument("--checkpoint", metavar="DIR", help="save the state (torch's DCP) into DIR/step_N")
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="save every K steps too (default: at the end)")
    p.add_argument("--resume", metavar="DIR", help="start from DIR's last complete checkpoint (any strategy)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    import labkit
    from .parallel.build import RunSpec
    from .run.runner import validate

    try:
        strategy = strategy_from_args(args)
        engines = strategy.world_size if args.engines is None else args.engines
        _check_options(args, engines)
        model, data, loss = build_cli_model(args)
        tp_plan = cli_tp_plan(args, model, strategy)
        saving = {"checkpoint": args.checkpoint, "checkpoint_every": args.checkpoint_every, "resume": args.resume}
        validate(RunSpec(strategy, model, data, loss, batch=args.batch, steps=args.steps, lr=args.lr,
                         seed=args.seed, optimizer=args.optimizer, tp_plan=tp_plan, extra=saving), engines)
    except (ValueError, FileNotFoundError) as exc:
        print(f"labkit run: {exc}", file=sys.stderr)
        return 2
    with labkit.Lab.start(engines=engines, timeout=args.timeout) as lab:
        run = lab.run(strategy, model=model, data=data, loss=loss, batch=args.batch, steps=args.steps,
                      lr=args.lr, seed=args.seed, optimizer=args.optimizer, tp_plan=tp_plan, **saving,
                      on_step=lambda r, s: print(f"step {s}: loss {r.losses[-1]:.5f}", file=sys.stderr))
    _report(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": strategy.to_dict(), "losses": run.losses, "metrics": run.metrics,
                       "events": run.timeline.events}, f, indent=1)
    if args.trace:
        run.timeline.save_trace(args.trace)
    if args.plot:
        run.timeline.plot().savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


def _check_options(args, engines: int) -> None:
    """What would otherwise fail late: engine count, timeout, and every output path (before
    a run of minutes, not after it)."""
    if engines < 1:
        raise ValueError(f"--engines {engines}: start at least 1 engine (default: dp*pp*tp)")
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise ValueError(f"--timeout {args.timeout:g}: give the collective timeout in seconds, > 0 (default 60)")
    for flag in ("json", "trace", "plot"):
        path = getattr(args, flag, None)
        if path is not None:
            _check_writable(f"--{flag}", path)


def _check_writable(flag: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file name, e.g. {os.path.join(path, 'out')}")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable; choose a path you can write to")


def build_cli_model(args):
    """(model, data, loss) for ``--model``: the MLP on synthetic data, or a GPT on text."""
    import labkit

    if args.model == "mlp":
        return labkit.models.mlp(width=args.width, depth=args.depth), None, "mse"
    data = labkit.data.text(batch=args.batch, block_size=args.block_size, seed=args.seed)
    model = labkit.models.gpt(n_layer=args.depth, n_head=args.heads, n_embd=args.width,
                              block_size=args.block_size, vocab_size=data.vocab_size)
    return model, data, "cross_entropy"


def cli_tp_plan(args, model, strategy) -> dict | None:
    """--tp with the MLP: a plan from its own Linear layers (pairs colwise/rowwise), since it
    has no tp_plan of its own and the command line cannot take one; the GPT ships its plan."""
    if strategy.tp == 1 or args.model != "mlp":
        return None
    from .parallel.tensor.plan import suggest_plan
    plan = suggest_plan(model())
    if not plan:
        raise ValueError(f"--tp {strategy.tp}: the MLP of --depth {args.depth} has no pair of Linear layers to split; "
                         "use --depth 2 or more, or --model gpt")
    return plan


def _report(run) -> None:
    m = run.metrics
    print(f"losses: {' '.join(f'{x:.5f}' for x in run.losses)}")
    print(f"step time {1e3 * m['step_time_s']:.2f} ms  throughput {m['throughput_samples_s']:.1f} samples/s")
    for key in ("comm_fraction", "exposed_comm_fraction", "overlap_fraction", "bubble_fraction",
                "schedule_bubble_fraction", "lab_overhead_fraction"):
        print(f"{key:>22}: {m[key]:.3f}")
    print(f"{'bytes_sent per rank':>22}: {[int(b) for b in m['bytes_sent']]}")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure communication on local engines (nccl-tests style)")
    what = p.add_subparsers(dest="bench", required=True)
    c = what.add_parser("comm", help="time, algbw and busbw per collective and size; α-β fit")
    c.add_argument("--engines", type=int, default=2, help="local engines to start")
    c.add_argument("--max-mb", type=float, default=16.0, help="largest size in MiB (sizes 4 B … this, ×4 apart)")
    c.add_argument("--sizes", type=int, nargs="+", help="sizes in bytes instead of the ×4 sweep")
    c.add_argument("--collectives", nargs="+", default=None,
                   help="all_reduce all_gather reduce_scatter broadcast sendrecv (default: all)")
    c.add_argument("--algorithms", nargs="+", default=["ring", "ps"], help="hand all-reduce algorithms: ring ps")
    c.add_argument("--seconds-per-point", type=float, default=0.05, help="time spent on each size")
    c.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    c.add_argument("--json", help="write rows and fits here")
    c.add_argument("--plot", help="write time and busbw against size as an image here")
    c.set_defaults(func=cmd_bench_comm)


def cmd_bench_comm(args) -> int:
    import labkit
    import labkit.comm.collectives
    from labkit import bench

    collectives = args.collectives or list(bench.COLLECTIVES)
    try:
        for name in collectives:
            bench.bus_factor(name, 2)
        for name in args.algorithms:
            if name not in labkit.comm.collectives.ALGORITHMS:
                raise ValueError(f"--algorithms {name}: unknown; use {' '.join(labkit.comm.collectives.ALGORITHMS)}")
        if args.engines < 2:
            raise ValueError(f"--engines {args.engines}: communication needs at least 2 engines")
        _check_options(args, args.engines)
    except ValueError as exc:
        print(f"labkit bench comm: {exc}", file=sys.stderr)
        return 2
    with labkit.Lab.start(engines=args.engines, timeout=args.timeout) as lab:
        sweep = bench.comm_sweep(lab, sizes=args.sizes, collectives=collectives, algorithms=args.algorithms,
                                 max_bytes=int(args.max_mb * 2 ** 20), seconds_per_point=args.seconds_per_point)
    print(sweep.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(sweep.to_dict(), f, indent=1)
    if args.plot:
        sweep.plot().savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_bench(sub)
    from .plan import cli as plan_cli
    plan_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import LabError

    # SIGTERM ends the command like Ctrl-C does, so the lab's `with` block stops its engines
    # (the engines' watchdog covers SIGKILL, see labkit/engine/watchdog.py).
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except LabError as exc:
        print(f"labkit {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"labkit {args.command}: interrupted; the lab's engines were stopped", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
