"""Troubleshooting: explain a hang from every rank's flight log, and check the settings.

Every labkit.comm call is logged per rank with a call number per channel (a group's
collectives, or one direction of a pair), so after a timeout the lab can line the logs up:

>>> report = labkit.diagnose.explain_hang({0: log0, 1: log1})
>>> print(report)
step 3, all_reduce 'bucket 0' (call #7 on group [0, 1]): reached by ranks [0], not reached by ranks [1]

:func:`check_settings` flags environment variables known to defeat overlap or to hide
errors; :data:`ENV_VARS` explains the debugging switches of NCCL and torch.distributed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

NOT_DONE = ("timeout", "failed", "mismatch", "issued")


# -- hangs ------------------------------------------------------------------------------------
@dataclass
class HangReport:
    """Which call a group got stuck in, and which of its ranks reached it."""

    step: int | None
    op: str
    name: str
    call: int
    channel: str
    reached: list[int]
    not_reached: list[int]
    notes: dict[int, str] = field(default_factory=dict)     # rank → what it did instead

    def __str__(self) -> str:
        head = (f"step {self.step}, {self.op} '{self.name}' (call #{self.call} on {self.channel}): "
                f"reached by ranks {self.reached}, not reached by ranks {self.not_reached}")
        return "\n".join([head] + [f"    rank {r}: {text}" for r, text in sorted(self.notes.items())])


def _members(entry: dict) -> list[int]:
    """The ranks that must all make this call: the group, or the sending and receiving pair."""
    if entry["op"] in ("send", "recv"):
        src, dst = entry["channel"].split()[1].split("->")
        return sorted({int(src), int(dst)})
    return list(entry["group"])


def _counterpart(entry: dict) -> tuple[str, str]:
    """The channel and the op a peer logs for the same call (a send's receive, and so on)."""
    partner = {"send": "recv", "recv": "send"}.get(entry["op"], entry["op"])
    return entry["channel"], partner


def stuck_call(logs: dict[int, list[dict]]) -> tuple[int, dict] | None:
    """(rank, entry) of the earliest call that did not complete, preferring one that timed out."""
    for states in (("timeout", "mismatch", "failed"), ("issued",)):
        pending = [(e["time"], rank, e) for rank, log in logs.items() for e in log if e["state"] in states]
        if pending:
            _, rank, entry = min(pending, key=lambda item: (item[0], item[1]))
            return rank, entry
    return None


def explain_hang(logs: dict[int, list[dict]], silent: dict[int, str] | None = None,
                 timeout_s: float | None = None) -> HangReport | None:
    """Line up every rank's flight log at the call that did not complete.

    ``logs`` maps rank → :func:`labkit.comm.flight_log` entries; ``silent`` maps the ranks
    whose log could not be read to why ("still busy", "engine died"). A rank that made the
    call more than ``timeout_s`` after the first one counts as not having reached it (it
    came too late). None if no call is pending in any log.
    """
    silent = dict(silent or {})
    found = stuck_call(logs)
    if found is None:
        return None
    _, entry = found
    channel, n = entry["channel"], entry["call"]
    reached, missing, notes = [], [], {}
    for rank in _members(entry):
        if rank in silent:
            missing.append(rank)
            notes[rank] = f"{silent[rank]}; its log could not be read"
            continue
        on_channel = [e for e in logs.get(rank, []) if e["channel"] == channel]
        same = [e for e in on_channel if e["call"] == n]
        late = same and timeout_s is not None and same[0]["time"] - entry["time"] > timeout_s
        if late:
            missing.append(rank)
            notes[rank] = (f"arrived {same[0]['time'] - entry['time']:.1f} s after the first rank, "
                           f"when the others had given up (a straggler)")
        elif same or any(e["call"] > n for e in on_channel):
            reached.append(rank)
            if same and same[0]["op"] not in _counterpart(entry)[1:] + (entry["op"],):
                notes[rank] = f"made {same[0]['op']} '{same[0]['name']}' as call #{n} instead: the ranks disagree"
            elif same and same[0]["state"] not in ("done", "issued"):
                notes[rank] = "timed out there" if same[0]["state"] == "timeout" else f"{same[0]['state']} there"
        else:
            missing.append(rank)
            notes[rank] = _last_seen(logs.get(rank, []), channel)
    return HangReport(entry["step"], entry["op"], entry["name"], n, channel, reached, missing, notes)


def _last_seen(log: list[dict], channel: str) -> str:
    on_channel = [e for e in log if e["channel"] == channel]
    if not on_channel:
        last = log[-1] if log else None
        if last is None:
            return "made no labkit.comm call since its log began"
        return f"never called on this channel; its last call was {last['op']} '{last['name']}' at step {last['step']}"
    last = on_channel[-1]
    return f"stopped at call #{last['call']} ({last['op']} '{last['name']}', step {last['step']}, {last['state']})"


# -- settings ---------------------------------------------------------------------------------
ENV_VARS = {
    "NCCL_DEBUG": (
        "NCCL's own log: WARN prints only errors, INFO prints the chosen rings/trees, transports "
        "(NVLink, PCIe, IB, sockets) and versions at start-up. Use INFO when a job hangs at "
        "init or is slower than expected; add NCCL_DEBUG_SUBSYS=INIT,NET to narrow it. TRACE "
        "logs every call and slows everything down."),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "What the NCCL watchdog does when a collective times out or fails: 0 nothing (the job "
        "hangs forever), 1 abort the communicators and kill the process, 2 abort only, 3 (the "
        "default in recent torch) kill the process without cleaning up. Leave it on in "
        "training so a stuck rank turns into an error; set 0 only to attach a debugger to a "
        "hung process. (Older name: NCCL_ASYNC_ERROR_HANDLING.)"),
    "TORCH_NCCL_BLOCKING_WAIT": (
        "1 makes work.wait() block the host until the collective finishes and raise a "
        "timeout error on that very call, instead of the watchdog tearing the process down "
        "later. Easier to read errors, but the host can no longer queue compute while the "
        "collective runs, so it costs overlap: use it to debug, not to train. (Older name: "
        "NCCL_BLOCKING_WAIT.)"),
    "TORCH_DISTRIBUTED_DEBUG": (
        "OFF (default), INFO, or DETAIL. DETAIL wraps every process group in a checker that "
        "first compares the op and tensor shapes across ranks, so a mismatched collective "
        "fails on all ranks at once with a message naming both sides, and logs DDP's unused "
        "parameters. It adds a small collective per call (~4 ms each on gloo/CPU here) and "
        "does not check point-to-point sends; read when a group is created, so it must be in "
        "the engines' environment before torch.distributed starts: Lab.start(debug=True)."),
}

# (variable, bad value or None for "any", what it does to a run)
OVERLAP_KILLERS = (
    ("CUDA_LAUNCH_BLOCKING", "1",
     "every kernel launch waits for the kernel to finish: nothing overlaps, and step times are "
     "those of a debugging run"),
    ("TORCH_NCCL_BLOCKING_WAIT", "1",
     "work.wait() blocks the host until the collective ends, so compute cannot be queued behind it"),
    ("NCCL_BLOCKING_WAIT", "1", "older name of TORCH_NCCL_BLOCKING_WAIT: the host blocks in wait()"),
    ("TORCH_DISTRIBUTED_DEBUG", "DETAIL",
     "an extra shape-checking collective before every collective (a few ms each): timings are not "
     "representative"),
    ("NCCL_DEBUG", "TRACE", "logs every NCCL call: slow"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0",
     "a timed-out NCCL collective is never turned into an error: the job hangs instead"),
)


@dataclass
class Finding:
    """One setting worth knowing about, on one rank (None: the notebook's process)."""

    rank: int | None
    variable: str
    value: str
    why: str

    def __str__(self) -> str:
        where = "notebook" if self.rank is None else f"rank {self.rank}"
        return f"{where}: {self.variable}={self.value}: {self.why}"


def settings_snapshot() -> dict:
    """The variables :func:`check_settings` looks at, plus thread counts (runs on an engine)."""
    import torch

    names = {name for name, _, _ in OVERLAP_KILLERS} | set(ENV_VARS) | {"OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"}
    return {"env": {k: os.environ[k] for k in names if k in os.environ},
            "threads": torch.get_num_threads(), "cpus": os.cpu_count() or 1,
            "rank": int(os.environ.get("RANK", -1))}


def check_settings(env: dict | None = None, rank: int | None = None, threads: int | None = None,
                   cpus: int | None = None, local_ranks: int = 1) -> list[Finding]:
    """Settings in ``env`` (default: this process) known to defeat overlap or hide errors.

    With ``threads``/``cpus``/``local_ranks`` it also flags CPU oversubscription: more
    compute threads than cores starve gloo's communication threads.
    """
    env = dict(os.environ if env is None else env)
    found = [Finding(rank, name, env[name], why) for name, bad, why in OVERLAP_KILLERS
             if name in env and env[name].strip().upper() == bad.upper()]
    if threads and cpus and threads * local_ranks > cpus:
        found.append(Finding(rank, "OMP_NUM_THREADS", str(threads),
                             f"{local_ranks} ranks × {threads} threads on {cpus} cores: compute threads "
                             "crowd out the communication threads, which look slower than they are"))
    return found


def check_lab(lab) -> list[Finding]:
    """:func:`check_settings` on every rank of ``lab`` (each engine's own environment)."""
    snaps = lab.apply(settings_snapshot)
    local = max(1, sum(1 for r in lab.ranks if r["host"] == lab.ranks[0]["host"]))
    found = []
    for rank, snap in enumerate(snaps):
        found += check_settings(snap["env"], rank, snap["threads"], snap["cpus"], local)
    return found


class EnvTable:
    """The debugging variables and what they do (HTML in a notebook, text elsewhere)."""

    def __init__(self, rows: dict[str, str]):
        self.rows = rows

    def __repr__(self) -> str:
        return "\n\n".join(f"{name}\n    {text}" for name, text in self.rows.items())

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td><code>{k}</code></td><td style='text-align:left'>{v}</td></tr>"
                       for k, v in self.rows.items())
        return f"<table><tr><th>variable</th><th style='text-align:left'>what it does</th></tr>{body}</table>"


def explain(*names: str) -> EnvTable:
    """What NCCL_DEBUG, TORCH_NCCL_ASYNC_ERROR_HANDLING, … do (all of them when no name is given)."""
    unknown = [n for n in names if n not in ENV_VARS]
    if unknown:
        raise ValueError(f"no explanation for {unknown}; known: {sorted(ENV_VARS)}")
    return EnvTable({n: ENV_VARS[n] for n in (names or ENV_VARS)})


# -- exposure ---------------------------------------------------------------------------------
def listening_addresses(port: int) -> list[str]:
    """Local addresses a TCP socket listens on for ``port`` (Linux /proc; [] elsewhere)."""
    found = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:       # 0A: LISTEN
                found.append(_address(address, width))
    return found


def _address(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]     # four little-endian 32-bit words
    flat = b"".join(words)
    if flat[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in flat[12:])               # IPv4-mapped
    import ipaddress
    return str(ipaddress.IPv6Address(flat))


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"
