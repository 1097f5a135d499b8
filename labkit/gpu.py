"""On a GPU: peak FLOP/s and MFU, the environment that shapes stream overlap, and where a
step's time goes.

    >>> labkit.gpu.env_check(lab)                      # each rank's NCCL/CUDA variables, explained
    >>> labkit.gpu.sync_debug(lab, on=True)            # synchronise the device after every recorded op
    >>> run = lab.run(s, model=...)
    >>> print(labkit.gpu.stall_report(run))            # per rank: which op the time goes to
    >>> labkit.gpu.mfu(flops_per_step, step_s, "NVIDIA H100 80GB HBM3")

The whole check on a machine with a GPU is ``bash scripts/gpu_check.sh`` (see its header).
This module imports neither torch.distributed nor ipyparallel: the table, the formulas and
the report are pure, and the two engine-side helpers import what they need when they run.
"""
from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median

from .analysis.metrics import step_duration, total
from .record.recorder import SYNC_DEBUG_ENV

# -- peak bf16 dense tensor-core FLOP/s, by the name torch.cuda.get_device_name() gives ----------
# Vendor datasheets quote bf16 "with sparsity"; dense is half of that, and dense is what a
# training step can use (nanoGPT and torchtitan divide by the dense figure too). Most specific
# pattern first ("H100 PCIe" before "H100"); \b keeps "A10" from matching "A100" and "H200"
# from matching "GH200". A name not listed gets an infinite peak, so MFU shows as 0 rather
# than a wrong guess (nanochat does the same).
PEAK_BF16_DENSE_TFLOPS = (
    (r"\bH200 NVL\b", 835.0, "NVIDIA H200 datasheet: 1,671 TFLOPS bf16 with sparsity (NVL)"),
    (r"\bH200\b", 989.4, "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity (SXM)"),
    (r"\bGH200\b", 989.4, "NVIDIA GH200 datasheet: 1,979 TFLOPS bf16 with sparsity"),
    (r"\bH100 NVL\b", 835.0, "NVIDIA H100 datasheet: 1,671 TFLOPS bf16 with sparsity (NVL)"),
    (r"\bH100 PCIe\b", 756.0, "NVIDIA H100 datasheet: 1,513 TFLOPS bf16 with sparsity (PCIe)"),
    (r"\bH100\b", 989.4, "NVIDIA H100 datasheet: 1,979 TFLOPS bf16 with sparsity (SXM)"),
    (r"\bB200\b", 2250.0, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS bf16 with sparsity per GPU"),
    (r"\bA100\b", 312.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense (624 with sparsity)"),
    (r"\bL40S\b", 362.05, "NVIDIA L40S datasheet: 733 TFLOPS bf16 with sparsity"),
    (r"\bL4\b", 121.0, "NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity"),
    (r"\bA10\b", 125.0, "NVIDIA A10 datasheet: 250 TFLOPS bf16 with sparsity"),
)


def peak_bf16_flops(device_name: str) -> float:
    """Dense bf16 peak FLOP/s of a device named like torch names it; ``inf`` when unknown."""
    for pattern, tflops, _source in PEAK_BF16_DENSE_TFLOPS:
        if re.search(pattern, device_name or ""):
            return tflops * 1e12
    return math.inf


def mfu(flops_per_step: float, step_s: float, device_name: str) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the device's dense bf16 peak (0 if unknown)."""
    if not step_s > 0:
        raise ValueError(f"step_s={step_s!r} must be > 0 (seconds per step)")
    return flops_per_step / step_s / peak_bf16_flops(device_name)


def transformer_train_flops(matmul_params: int, n_layer: int, n_embd: int, seq_len: int, tokens: int) -> float:
    """FLOPs of one training step (forward + backward) of a decoder-only transformer.

    PaLM (Chowdhery et al. 2022, appendix B), as nanoGPT's ``estimate_mfu`` spells it:
    per token 6·N for the weight matmuls (2 forward, 4 backward) plus 12·L·d·T for attention
    scores and their weighted sum, with N the parameters that take part in matmuls
    (embedding lookups excluded, the output head included). Causal masking is not
    discounted, by the same convention, so figures compare with published MFUs.
    """
    per_token = 6 * matmul_params + 12 * n_layer * n_embd * seq_len
    return float(per_token) * tokens


# -- the environment that decides how streams behave ----------------------------------------------
# Sources: torch "ProcessGroupNCCL Environment Variables"; NCCL user guide, "Environment
# Variables" and "Logging"; CUDA C Programming Guide, "CUDA Environment Variables";
# Megatron-LM (arguments.py asks for CUDA_DEVICE_MAX_CONNECTIONS=1 to overlap TP comm).
ENV_VARS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": {
        "what": {None: "unset: torch's default, 3 (ends the process on an error or timeout)",
                 "0": "0: no handling; a timed-out NCCL collective leaves its process hung for good",
                 "1": "1: on an error or timeout the watchdog aborts the communicator and ends the process",
                 "2": "2: aborts the communicator only; the process lives and its next call raises",
                 "3": "3: ends the process without aborting the communicator (torch's default): a "
                      "hang becomes a dead engine after the group timeout, which the lab reports"},
        "overlap": "none: the watchdog runs on its own thread and blocks no stream "
                   "(TORCH_NCCL_BLOCKING_WAIT=1 would: wait() then blocks the host)",
    },
    "NCCL_DEBUG": {
        "what": {None: "unset: NCCL logs nothing unless something fails",
                 "VERSION": "VERSION: prints NCCL's version at start-up",
                 "WARN": "WARN: warnings and errors",
                 "INFO": "INFO: start-up log of topology, rings/trees and transports (NVLink P2P, SHM, "
                         "NET): the first thing to read when init hangs or a collective is slow",
                 "TRACE": "TRACE: every call, replayable (needs a TRACE build of NCCL)"},
        "overlap": "none at WARN/INFO outside start-up; per-call logging (TRACE, or INFO with "
                   "NCCL_DEBUG_SUBSYS=COLL) costs host time at every launch, which can delay the "
                   "comm kernel and shrink overlap",
    },
    "NCCL_DEBUG_SUBSYS": {
        "what": {None: "unset: INIT, BOOTSTRAP and ENV are logged (when NCCL_DEBUG is INFO or TRACE)",
                 "COLL": "COLL: one line per collective (op, count, datatype, stream)",
                 "ALL": "ALL: every subsystem"},
        "overlap": "only through logging cost: COLL/ALL write a line per collective from the "
                   "launching thread",
    },
    "CUDA_LAUNCH_BLOCKING": {
        "what": {None: "unset: kernel launches are asynchronous (normal)",
                 "0": "0: kernel launches are asynchronous (normal)",
                 "1": "1: every launch waits for its kernel: an error is raised at the kernel that "
                      "caused it, but nothing runs ahead of the host"},
        "overlap": "1 removes all overlap: the host waits out each kernel, so the comm stream never "
                   "runs beside compute, and every timing includes launch latency",
    },
    "CUDA_DEVICE_MAX_CONNECTIONS": {
        "what": {None: "unset: the driver's default of 8 hardware work queues per context (max 32)",
                 "1": "1: one work queue: kernels reach the GPU in the order the host launched them, "
                      "whatever their stream (Megatron-LM needs this for its TP/sequence-parallel "
                      "comm overlap)"},
        "overlap": "with 1, streams still run concurrently but in launch order, so a comm kernel "
                   "overlaps only compute launched after it; more queues than streams let "
                   "independent streams start out of launch order, fewer make them share queues",
    },
}


def explain_env(env) -> list[dict]:
    """One row per variable of ENV_VARS: its value in ``env``, what that value does, and its
    effect on compute/comm overlap. Pure: ``env`` is any mapping (``os.environ``, a dict)."""
    rows = []
    for name, info in ENV_VARS.items():
        value = env.get(name)
        key = value.upper() if name.startswith("NCCL_DEBUG") and value else value
        what = info["what"].get(key)
        if what is None and name == "NCCL_DEBUG_SUBSYS" and value:
            parts = {p.strip().lstrip("^").upper() for p in value.split(",")}
            what = f"{value}: only these subsystems" + (" (COLL: a line per collective)" if "COLL" in parts else "")
        if what is None and name == "CUDA_DEVICE_MAX_CONNECTIONS" and value and value.isdigit():
            what = f"{value}: {value} hardware work queues (the driver may grant fewer; max 32)"
        rows.append({"variable": name, "value": value, "what": what or f"{value}: not a value this check knows",
                     "overlap": info["overlap"]})
    return rows


@dataclass
class EnvReport:
    """Each rank's values of ENV_VARS, explained; ``print(report)`` shows the table."""

    ranks: list[dict]          # {"rank", "device", "env": {variable: value or None}}

    def rows(self, rank: int = 0) -> list[dict]:
        return explain_env(self.ranks[rank]["env"])

    def __str__(self) -> str:
        lines = []
        explained = [{row["variable"]: row for row in explain_env(r["env"])} for r in self.ranks]
        for name in ENV_VARS:
            whats = {r["rank"]: e[name]["what"] for r, e in zip(self.ranks, explained)}
            values = {r["rank"]: r["env"].get(name) for r in self.ranks}
            if len(set(values.values())) == 1:
                lines += [f"{name} = {next(iter(values.values())) or '(unset)'}",
                          f"    what:    {next(iter(whats.values()))}"]
            else:
                lines.append(f"{name} differs between ranks:")
                lines += [f"    rank {rank}: {whats[rank]}" for rank in whats]
            lines.append(f"    overlap: {ENV_VARS[name]['overlap']}")
        return "\n".join(lines)

    __repr__ = __str__


def _env_of_rank() -> dict:
    """Engine side: this rank's values of ENV_VARS and its device."""
    from . import engine
    s = engine.session()
    return {"rank": s.rank, "device": str(s.device), "env": {k: os.environ.get(k) for k in ENV_VARS}}


def env_check(lab) -> EnvReport:
    """Show and explain, per rank, the variables that decide NCCL error handling, logging and
    whether compute and comm streams can overlap."""
    return EnvReport(lab.apply(_env_of_rank))


# -- locating a stall: synchronise after every op, then see where the time went ---------------------
def _set_sync_debug(on: bool) -> dict:
    """Engine side: switch the recorder's per-op device sync (a no-op on CPU)."""
    from . import engine
    s = engine.session()
    cuda = s.device is not None and s.device.type == "cuda"
    if not cuda:
        return {"rank": s.rank, "device": str(s.device), "sync_debug": False,
                "message": f"rank {s.rank} ({s.device}): sync_debug does nothing on CPU: CPU ops already "
                           f"finish before the host goes on, so the timeline shows where time goes as is"}
    os.environ[SYNC_DEBUG_ENV] = "1" if on else "0"          # recorders made later keep the setting
    s.recorder.sync_debug = bool(on)
    state = ("the device is synchronised after every recorded op (overlap is gone while on); run, then "
             "labkit.gpu.stall_report(run)") if on else "per-op sync off"
    return {"rank": s.rank, "device": str(s.device), "sync_debug": bool(on), "message": f"rank {s.rank} ({s.device}): {state}"}


def sync_debug(lab, on: bool = True, quiet: bool = False) -> list[dict]:
    """Synchronise every rank's GPU after each recorded op (``torch.cuda.synchronize()``), so
    the host blocks in the op that is slow instead of at a later sync point. Survives a change
    of degrees; engines started with ``LABKIT_SYNC_DEBUG=1`` have it from the start."""
    answers = lab.apply(_set_sync_debug, bool(on))
    if not quiet:
        for answer in answers:
            print(answer["message"])
    return answers


def _measured(events) -> tuple[list[int], dict[int, list[dict]]]:
    by_step = defaultdict(list)
    for e in events:
        by_step[e["step"]].append(e)
    steps = sorted(by_step)
    return (steps[1:] if len(steps) >= 3 else steps), by_step     # the first step warms up


@dataclass
class StallReport:
    """Where each rank's step time goes: per op (kind and name) and the time outside any op.

    ``rows`` are per rank, largest first, in seconds per measured step; ``worst`` is the op
    that takes the most time on any rank; ``idle`` maps rank → seconds per step that no
    recorded op covers (host work, launch gaps, data, a pipeline bubble).
    """

    rows: list[dict]
    step_s: float
    idle: dict[int, float]
    steps: list[int]
    worst: dict | None = None
    top: int = 5
    notes: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        if self.worst is None:
            return "no recorded ops: run with record=True"
        w = self.worst
        line = (f"time goes to rank {w['rank']}: {w['kind']} '{w['name']}' on the {w['stream']} stream, "
                f"{w['seconds'] * 1e3:.3f} ms per step ({w['share']:.0%} of the step)")
        rank, idle = max(self.idle.items(), key=lambda kv: kv[1])
        if idle > w["seconds"]:
            line += (f"; but rank {rank} spends more ({idle * 1e3:.3f} ms, {idle / self.step_s:.0%}) outside "
                     f"any recorded op: host side (Python, data, launches) — profile the engine there")
        return line

    def __str__(self) -> str:
        lines = [f"where time goes: {len(self.steps)} measured step(s), step {self.step_s * 1e3:.3f} ms (median)",
                 f"{'rank':>4}  {'stream':<8} {'kind':<14} {'op':<28} {'calls':>5} {'ms/step':>9} {'share':>6}"]
        for rank in sorted(self.idle):
            mine = [r for r in self.rows if r["rank"] == rank][:self.top]
            mine.append({"rank": rank, "stream": "-", "kind": "idle", "name": "(no recorded op)", "calls": 0,
                         "seconds": self.idle[rank], "share": self.idle[rank] / self.step_s if self.step_s else 0})
            for r in mine:
                lines.append(f"{r['rank']:>4}  {r['stream']:<8} {r['kind']:<14} {r['name'][:28]:<28} "
                             f"{r['calls']:>5g} {r['seconds'] * 1e3:>9.3f} {r['share']:>6.0%}")
        return "\n".join(lines + self.notes + [self.verdict()])

    __repr__ = __str__


def stall_report(run, top: int = 5) -> StallReport:
    """Per rank, the ops a run's measured steps spent their time in (from its events alone).

    ``run`` is a ``lab.run`` result, a Timeline, or a list of events. Run with
    :func:`sync_debug` on so that each op's span is its own time, not time queued behind
    other streams' work.
    """
    events = getattr(getattr(run, "timeline", run), "events", run)
    steps, by_step = _measured(list(events))
    if not steps:
        return StallReport([], 0.0, {}, [], None, top)
    ranks = sorted({e["rank"] for e in events})
    durations = [step_duration(by_step[s]) for s in steps]
    step_s = median(durations)
    per_op: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    idle = {}
    for rank in ranks:
        idle_s = 0.0
        for s, duration in zip(steps, durations):
            mine = [e for e in by_step[s] if e["rank"] == rank]
            idle_s += duration - total((e["start"], e["end"]) for e in mine)
            for e in mine:
                entry = per_op[rank, e["stream"], e["kind"], e["name"]]
                entry[0] += 1
                entry[1] += e["end"] - e["start"]
        idle[rank] = idle_s / len(steps)
    rows = [{"rank": rank, "stream": stream, "kind": kind, "name": name, "calls": calls / len(steps),
             "seconds": seconds / len(steps), "share": seconds / len(steps) / step_s if step_s else 0.0}
            for (rank, stream, kind, name), (calls, seconds) in per_op.items()]
    rows.sort(key=lambda r: (r["rank"], -r["seconds"]))
    worst = max(rows, key=lambda r: r["seconds"], default=None)
    return StallReport(rows, step_s, idle, steps, worst, top)
