"""The GPU check: prove (or disprove) labkit's GPU paths in one short run, and say what it measured.

    bash scripts/gpu_check.sh                          # set up as the README does, then this
    python scripts/gpu_check.py --out DIR [--budget S] # with an interpreter that has labkit's packages

Parts, in order, each bounded by a timeout and printed as one line PASS / FAIL (why) / SKIP (why):
device · tests (tests/test_gpu.py) · lab (one engine: NCCL world of one on a GPU, gloo on CPU) ·
dp (naive, bucketed, overlap, ddp against one process) · profile (a profiled run's kernels read back
with Timeline.from_profiler) · backend (the world's backend, a lone
all-reduce) · cuda_events (compute and comm spans from CUDA events, comm spans against the lone
all-reduce) · pipeline (1F1B and GPipe at pp=1 through the pipeline executor) · tp · tp_dtensor ·
torch_cp (torch's context_parallel on causal sdpa against plain and labkit's ring arithmetic) ·
gpt (a GPT step on the engine: TFLOP/s, MFU, overlap) · gpt_events (its CUDA-event spans) · gpt_plain (the same step in plain torch) ·
stall (sync_debug + stall_report) · env (env_check).
On CPU the same parts run at small sizes and the GPU-only ones are skipped, each with its reason.
Writes report.txt, report.json, timeline.png + trace.json (GPT step), timeline_dp.png +
trace_dp.json (DP overlap), timeline_profile.png + profile/rank0.json.gz, test_gpu.log. Exit status 1 if any part failed, naming each.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import cloudpickle  # noqa: E402
import torch  # noqa: E402

from labkit.analysis.timeline import Timeline  # noqa: E402

import gpu_engine  # noqa: E402  (beside this file)
import gpu_model  # noqa: E402
import gpu_parts  # noqa: E402
from gpu_parts import PARTS, Skip  # noqa: E402

# Engines cannot import these modules by name: their functions and classes travel by value.
for _module in (gpu_engine, gpu_model, gpu_parts):
    cloudpickle.register_pickle_by_value(_module)

SIZES = {   # GPU: a GPT of ~0.7 B matmul parameters, 16 k tokens a step; CPU: enough to run the code
    "gpu": {"mlp": dict(width=1024, depth=8), "batch": 256, "bucket_mb": 1.0,
            "gpt": dict(n_layer=12, n_head=16, n_embd=2048, block_size=1024, vocab_size=50304), "gpt_batch": 16,
            "gpt_steps": 6, "cp_seq": 8192},
    "cpu": {"mlp": dict(width=64, depth=4), "batch": 32, "bucket_mb": 0.005,
            "gpt": dict(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128), "gpt_batch": 4,
            "gpt_steps": 3, "cp_seq": 256},
}
TIMEOUTS = {"device": 30, "tests": 150, "lab": 180, "dp": 120, "profile": 90, "backend": 60, "cuda_events": 10, "pipeline": 90,
            "tp": 5, "tp_dtensor": 60, "torch_cp": 60, "gpt": 150, "gpt_events": 30, "gpt_plain": 90, "stall": 60,
            "env": 30}


class PartTimeout(KeyboardInterrupt):
    """Raised by the alarm; a KeyboardInterrupt, so the lab frees ranks left busy."""


def _alarm(_signum, _frame):
    raise PartTimeout()


class Check:
    """Runs parts under a time budget and keeps what each found."""

    def __init__(self, out: Path, budget_s: float, size: str):
        self.out, self.size, self.sizes = out, size, SIZES[size]
        self.cuda = torch.cuda.is_available()
        self.deadline = time.monotonic() + budget_s
        self.parts: list[dict] = []
        self.state: dict = {}

    def run(self, name: str, fn) -> None:
        left = self.deadline - time.monotonic()
        limit = min(TIMEOUTS[name], left)
        part = {"part": name, "status": "SKIP", "summary": "", "seconds": 0.0, "details": {}}
        t0 = time.monotonic()
        if left < 3:
            part["summary"] = "not started: the run's time budget is spent"
        else:
            signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                part["summary"], part["details"] = fn(self)
                part["status"] = "PASS"
            except Skip as why:
                part["summary"] = str(why)
            except PartTimeout:
                part["status"], part["summary"] = "FAIL", f"timed out after {limit:.0f} s"
            except Exception as exc:       # the check reports every failure and goes on
                first = (str(exc).strip().splitlines() or [""])[0]
                part["status"], part["summary"] = "FAIL", f"{type(exc).__name__}: {first}"[:400]
                part["details"]["traceback"] = traceback.format_exc()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        part["seconds"] = round(time.monotonic() - t0, 2)
        self.parts.append(part)
        print(f"{part['status']:<4} {name:<12} {part['seconds']:6.1f}s  {part['summary']}", flush=True)

    def require_gpu(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device: {what}")

    @property
    def lab(self):
        if self.state.get("lab") is None:
            raise Skip("no lab (the lab part did not start one)")
        return self.state["lab"]

    def save_timeline(self, events, stem: str, title: str) -> None:
        tl = Timeline(events, 1, title=title)
        tl.plot().savefig(self.out / f"{stem}.png", dpi=110, bbox_inches="tight")
        tl.save_trace(self.out / (stem.replace("timeline", "trace") + ".json"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="labkit's GPU check (runs on CPU too, GPU parts skipped)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "gpu"),
                        help="folder for report.txt/json, timelines, traces (default $OUT, else out/gpu)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for all parts together")
    parser.add_argument("--size", choices=("auto", "gpu", "cpu"), default="auto",
                        help="problem sizes (auto: gpu where CUDA is available)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = args.size if args.size != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    check = Check(out, args.budget, size)
    print(f"labkit GPU check: sizes '{size}', budget {args.budget:.0f} s, output {out}", flush=True)
    try:
        for name, fn in PARTS:
            check.run(name, fn)
    finally:
        if check.state.get("lab") is not None:
            check.state.pop("lab").close()
    return write_report(check)


def write_report(check: Check) -> int:
    failed = [p for p in check.parts if p["status"] == "FAIL"]
    lines = [f"{p['status']:<4} {p['part']:<12} {p['seconds']:6.1f}s  {p['summary']}" for p in check.parts]
    blocks = [f"\n== {p['part']} ==\n{p['details']['text']}" for p in check.parts if p["details"].get("text")]
    tail = ([f"FAILED: {len(failed)} part(s): " + "; ".join(f"{p['part']} ({p['summary']})" for p in failed)]
            if failed else ["all parts passed or were skipped with a reason"])
    (check.out / "report.txt").write_text("\n".join(lines + blocks + [""] + tail) + "\n")
    (check.out / "report.json").write_text(json.dumps({"size": check.size, "cuda": check.cuda, "parts": check.parts},
                                                      indent=1, default=str))
    print("\n".join(blocks + ["", "summary:"] + lines + tail), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
