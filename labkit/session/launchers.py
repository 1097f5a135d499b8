"""Engines on a real cluster: Slurm, MPI or SSH, one engine per GPU (or per CPU rank).

>>> lab = labkit.Lab.start(engines=8, launcher="slurm", gpus_per_node=4, partition="gpu",
...                        time_limit="1:00:00")            # 2 nodes × 4 GPUs, ranks from Slurm
>>> lab = labkit.Lab.start(engines=4, launcher="mpi", hosts=["node1:2", "node2:2"])
>>> lab = labkit.Lab.start(engines=2, launcher="ssh", hosts={"node1": 1, "node2": 1})

:func:`start_cluster` builds an ipyparallel ``Cluster`` with that launcher's engine set,
starts the controller and the engines, and waits (bounded, with progress) until every engine
has registered. A launch that cannot succeed fails with a :class:`LabError` that quotes the
launcher's own words — sbatch's refusal, a job still PENDING with Slurm's reason, mpirun's
message, ssh's "Permission denied", the engine's own output — and everything it started is
stopped first. Ranks come from the launcher's variables on the engines (SLURM_PROCID,
OMPI_COMM_WORLD_RANK); SSH sets none, so the lab assigns them (see :func:`labkit.session.ranks.assign_ranks`).

Security: the controller listens on ``controller_ip`` ("*" = every interface, needed when
engines run on other nodes); ipyparallel signs its messages but does not encrypt them, and
torch's rendezvous store has no authentication. Use these launchers on a trusted network.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ipyparallel as ipp
from ipyparallel.cluster.launcher import MPIEngineSetLauncher
from traitlets.config import Config

from ..errors import LabError
from .local import CONTROLLER_ARGS, stop_quietly

LAUNCHERS = ("slurm", "mpi", "ssh")

# The engine job ipyparallel submits; {labkit_options} holds the #SBATCH lines labkit adds.
SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --job-name=ipengine-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
#SBATCH --export=ALL
{labkit_options}
srun {program_and_args}
"""


class _Cluster(ipp.Cluster):
    """An ipyparallel Cluster that also removes its work folder and waits for its jobs to go."""

    def __init__(self, *, work_dir: str, **kwargs):
        super().__init__(**kwargs)
        self._work_dir = work_dir

    async def stop_cluster(self):
        for key, es in list(self.engines.items()):
            if getattr(es, "job_id", None) == "":      # a batch job never submitted: nothing to cancel
                self.engines.pop(key)
        jobs = [es.job_id for es in self.engines.values() if getattr(es, "job_id", "")]
        try:
            await super().stop_cluster()
        finally:
            _wait_for_jobs_to_leave(jobs, timeout=15)
            shutil.rmtree(self._work_dir, ignore_errors=True)


def start_cluster(launcher: str, engines: int, timeout: float = 120.0, say=None,
                  **options) -> tuple[ipp.Cluster, ipp.Client]:
    """Start a controller and ``engines`` engines through ``launcher``; return (cluster, client).
    Progress lines go to ``say`` (the lab's status line; None: quiet).

    Options for every launcher: ``python`` (the engines' interpreter, default this one),
    ``environment`` (extra variables for the engines, e.g. ``NCCL_SOCKET_IFNAME``),
    ``controller_ip`` (default "*"), ``profile`` (an ipyparallel profile whose
    ipcluster_config.py is loaded first; the options here override it), ``config`` (a traitlets
    Config, merged last). Per launcher:

    - slurm: ``partition``, ``account``, ``time_limit`` ("HH:MM:SS" or minutes),
      ``gpus_per_node`` (one task and one GPU per engine, ``--nodes`` derived),
      ``sbatch`` (extra ``#SBATCH`` options, e.g. ``["--qos=debug"]``).
    - mpi: ``hosts`` (["node1:4", "node2:4"] → ``--host``), ``oversubscribe`` (more engines
      than slots), ``mpi_args``.
    - ssh: ``hosts`` ({"node1": 4, "node2": 4}; "host:port" allowed), ``ssh_args``
      (e.g. ["-F", "~/.ssh/config"]), ``remote_profile_dir``.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: choose one of {('local',) + LAUNCHERS}")
    say = say or (lambda text: None)
    work_dir = tempfile.mkdtemp(prefix=f"labkit-{launcher}-")
    try:
        cluster, env = _build(launcher, engines, work_dir, dict(options))
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    t0 = time.monotonic()
    try:
        say(f"labkit: starting controller and {engines} engines through {launcher}…")
        if launcher == "ssh":
            _check_ssh(cluster, timeout)
        cluster.start_controller_sync()
        try:
            cluster.start_engines_sync(n=engines, environment=env)
        except Exception as exc:
            raise LabError(f"{launcher}: could not start engines: {_message(exc)}") from None
        client = cluster.connect_client_sync()
        _wait_for_engines(launcher, cluster, client, engines, timeout, say, t0)
    except BaseException:
        stop_quietly(cluster)
        raise
    say(f"labkit: {engines} engines up through {launcher} in {time.monotonic() - t0:.0f} s")
    return cluster, client


# -- building the Cluster --------------------------------------------------------------------
class LabMPIEngineSetLauncher(MPIEngineSetLauncher):
    """ipyparallel's MPI engine set, forwarding the engines' variables to every node.

    mpirun passes its own environment only to ranks on its own node; ranks elsewhere get the
    variables named with ``-x`` (Open MPI) or ``-genvlist`` (MPICH, Intel MPI).
    """

    def find_args(self):
        names = sorted(self.get_env())
        forward = [arg for name in names for arg in ("-x", name)] if _is_open_mpi(self.mpi_cmd) \
            else ["-genvlist", ",".join(names)]
        return self.mpi_cmd + ["-n", str(self.n)] + forward + self.mpi_args + self.program + self.program_args


def _build(launcher: str, engines: int, work_dir: str, options: dict) -> tuple[ipp.Cluster, dict]:
    """The Cluster for ``launcher``: labkit's defaults < the profile's config < explicit options."""
    python = options.pop("python", sys.executable)
    # No OMP_NUM_THREADS guess: this machine's core count says nothing about the engines' nodes.
    env = dict(options.pop("environment", {}))
    profile = options.pop("profile", None)
    controller_ip = options.pop("controller_ip", "*")
    extra = options.pop("config", None)
    defaults, explicit = Config(), Config()
    BUILDERS[launcher](engines, work_dir, python, options, defaults, explicit)
    if options:
        raise TypeError(f"launcher={launcher!r} takes no option(s) {sorted(options)}")
    if extra:
        explicit.merge(extra)
    cls = LabMPIEngineSetLauncher if launcher == "mpi" else launcher
    cluster = _Cluster(work_dir=work_dir, engines=cls, n=engines, controller_ip=controller_ip, delay=0,
                       controller_args=list(CONTROLLER_ARGS), log_level=logging.ERROR, **({"profile": profile} if profile else {}))
    merged = Config()
    for layer in (defaults, cluster.profile_config, explicit):
        merged.merge(layer)
    cluster.config = merged
    return cluster, env


def _slurm(engines, work_dir, python, options, defaults, explicit) -> None:
    d, x = defaults.SlurmEngineSetLauncher, explicit.SlurmEngineSetLauncher
    d.engine_cmd = [python, "-m", "ipyparallel.engine"]
    d.batch_template = SLURM_TEMPLATE
    x.batch_file_name = os.path.join(work_dir, "slurm_engine.sbatch")    # absolute: never the cwd
    # sbatch prints its refusals on stderr, which ipyparallel does not capture: merge it.
    x.submit_command = ["sh", "-c", 'exec sbatch "$@" 2>&1', "sbatch"]
    x.job_id_regexp, x.job_id_regexp_group = r"Submitted batch job (\d+)", 1
    lines = [f"#SBATCH {flag}={options.pop(key)}" for key, flag in
             (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time"))
             if options.get(key)]
    gpus = options.pop("gpus_per_node", None)
    if gpus:   # one task per GPU, every task sees its node's GPUs and takes cuda:SLURM_LOCALID
        lines += [f"#SBATCH --nodes={-(-engines // gpus)}", f"#SBATCH --ntasks-per-node={gpus}",
                  f"#SBATCH --gpus-per-node={gpus}"]
    lines += [f"#SBATCH {opt}" for opt in options.pop("sbatch", [])]
    for key in ("partition", "account", "time_limit"):
        options.pop(key, None)
    x.namespace = {"labkit_options": "\n".join(lines)}


def _mpi(engines, work_dir, python, options, defaults, explicit) -> None:
    defaults.MPIEngineSetLauncher.engine_cmd = [python, "-m", "ipyparallel.engine"]
    args = list(options.pop("mpi_args", []))
    hosts = options.pop("hosts", None)
    if hosts:
        args += ["--host", ",".join(hosts)]
    if options.pop("oversubscribe", False):
        args.append("--oversubscribe")
    if args:
        explicit.MPIEngineSetLauncher.mpi_args = args


def _ssh(engines, work_dir, python, options, defaults, explicit) -> None:
    x = explicit.SSHEngineSetLauncher
    hosts = options.pop("hosts", None)
    if not hosts:
        raise ValueError('launcher="ssh" needs hosts={"node1": engines_on_node1, ...}')
    if not isinstance(hosts, dict):
        hosts = {h: list(hosts).count(h) for h in dict.fromkeys(hosts)}
    if sum(hosts.values()) < engines:
        raise ValueError(f"hosts={hosts} has {sum(hosts.values())} engine slot(s) for {engines} engines")
    x.engines = dict(hosts)
    # BatchMode: fail at once on a refused key instead of prompting for a password nobody sees.
    ssh_args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"] + list(options.pop("ssh_args", []))
    x.ssh_args, x.scp_args = ssh_args, list(ssh_args)
    x.remote_python = python
    # A profile folder of its own on the remote side (on localhost the same path would be
    # copied onto itself).
    x.remote_profile_dir = options.pop("remote_profile_dir", None) or os.path.join(work_dir, "remote-profile")


BUILDERS = {"slurm": _slurm, "mpi": _mpi, "ssh": _ssh}


# -- checking, waiting, reporting ------------------------------------------------------------
def _check_ssh(cluster: ipp.Cluster, timeout: float) -> None:
    """Log in to every host once and import labkit's needs, so ssh's own refusal is what we show."""
    s = cluster.config.SSHEngineSetLauncher
    for host in s.engines:
        target, _, port = host.partition(":")
        cmd = ["ssh", *s.ssh_args, *(["-p", port] if port else []), target,
               s.remote_python, "-c", "'import ipyparallel, torch'"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=min(timeout, 60))
        except subprocess.TimeoutExpired:
            raise LabError(f"ssh: no answer from {host} within {min(timeout, 60):g} s ({' '.join(cmd)})") from None
        if done.returncode:
            said = (done.stderr or done.stdout).strip()[-1500:]
            raise LabError(f"ssh: {host} refused or failed (exit {done.returncode}): {said}\n"
                           f"  command: {' '.join(cmd)}")


def _wait_for_engines(launcher: str, cluster: ipp.Cluster, client: ipp.Client, n: int, timeout: float,
                      say, t0: float) -> None:
    """Until ``n`` engines have registered: progress lines, the launcher watched, a hard deadline."""
    watch = {"slurm": _watch_slurm, "mpi": _watch_mpi, "ssh": lambda cluster: ""}[launcher]
    last = None
    while len(client.ids) < n:
        elapsed = time.monotonic() - t0
        state = watch(cluster)
        line = f"{len(client.ids)}/{n} engines up" + (f", {state}" if state else "")
        if line != last:
            say(f"labkit: {line} ({elapsed:.0f} s)")
            last = line
        if elapsed > timeout:
            raise LabError(f"{launcher}: {len(client.ids)} of {n} engines registered within {timeout:g} s"
                           + (f"; {state}" if state else "") + _hint(launcher, state) + _engine_output(cluster))
        time.sleep(0.5)


def _hint(launcher: str, state: str) -> str:
    if "PENDING" in state:
        return ("\n  the job never started: check `squeue`/`sinfo` (free nodes? partition? time limit?) or "
                "raise start_timeout")
    return ("\n  engines did not reach the controller: is controller_ip an address the engines' nodes can "
            "reach, and can they import ipyparallel and torch?")


def _slurm_job(cluster: ipp.Cluster) -> str:
    return next((es.job_id for es in cluster.engines.values() if getattr(es, "job_id", "")), "")


def _watch_slurm(cluster: ipp.Cluster) -> str:
    """The job's state and reason; a job that ended before its engines registered is an error."""
    job = _slurm_job(cluster)
    if not job:
        return ""
    state = _run(["squeue", "-h", "-j", job, "-o", "%T %r"]).strip()
    if state:
        kind, _, reason = state.partition(" ")
        return f"slurm job {job} {kind}" + (f" ({reason})" if reason and reason != "None" else "")
    info = _run(["scontrol", "-o", "show", "job", job])
    fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
    raise LabError(f"slurm: job {job} ended ({fields.get('JobState', 'gone')}, reason "
                   f"{fields.get('Reason', '?')}, exit {fields.get('ExitCode', '?')}) before its engines "
                   f"registered" + _engine_output(cluster))


def _watch_mpi(cluster: ipp.Cluster) -> str:
    """mpirun that exited before its engines registered: quote what it printed."""
    for es in cluster.engines.values():
        proc = getattr(es, "process", None)
        if proc is not None and not proc.is_running():
            code = (es.stop_data or {}).get("exit_code")
            raise LabError(f"mpi: `{' '.join(es.args)}` exited{'' if code is None else f' with code {code}'} "
                           f"before its engines registered" + _engine_output(cluster))
    return ""


def _engine_output(cluster: ipp.Cluster, lines: int = 25) -> str:
    """The last lines the engines (or the launcher running them) printed."""
    texts = []
    for es in cluster.engines.values():
        for launcher in [es, *getattr(es, "launchers", {}).values()]:
            said = _output_of(launcher).strip().splitlines()
            # Open MPI frames its messages with "-----" lines: show from the first frame on.
            start = next((i for i, line in enumerate(said) if line.startswith("-----")), None)
            said = said[start:start + 2 * lines] if start is not None else said[-lines:]
            if said:
                texts.append("\n".join("    " + line for line in said))
    return ("\n  engine output:\n" + "\n".join(texts)) if texts else "\n  (no engine output)"


def _output_of(launcher) -> str:
    path = getattr(launcher, "output_file", "")
    if path:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            pass
    if getattr(launcher, "_output", None):      # ipyparallel read it, then removed the file, at exit
        return launcher._output
    if hasattr(launcher, "remote_output_file") and getattr(launcher, "pid", -1) > 0:
        try:
            return launcher.get_output() or ""      # fetched over ssh
        except Exception as exc:
            return f"(could not fetch {launcher.remote_output_file}: {exc})"
    return ""


def _message(exc: BaseException) -> str:
    """An exception with what the launcher's command printed, if it captured any."""
    out = getattr(exc, "output", None) or getattr(exc, "stderr", None)
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = exc.cmd[-2:] if exc.cmd[:2] == ["sh", "-c"] else exc.cmd     # our sbatch wrapper
        head = f"`{' '.join(map(str, cmd))}` failed (exit {exc.returncode})"
    else:
        head = f"{type(exc).__name__}: {exc}"
    return head + ("".join(f"\n    {line}" for line in out.strip().splitlines()) if out and out.strip() else "")


# -- stopping --------------------------------------------------------------------------------
def _wait_for_jobs_to_leave(jobs: list[str], timeout: float) -> None:
    """scancel returns at once; wait (bounded) until Slurm has really ended the jobs."""
    deadline = time.monotonic() + timeout
    while jobs and time.monotonic() < deadline and _run(["squeue", "-h", "-j", ",".join(jobs), "-o", "%i"]).strip():
        time.sleep(0.25)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


_open_mpi: dict[str, bool] = {}


def _is_open_mpi(mpi_cmd: list[str]) -> bool:
    key = mpi_cmd[0]
    if key not in _open_mpi:
        _open_mpi[key] = "Open MPI" in _run([key, "--version"]) or "OpenRTE" in _run([key, "--version"])
    return _open_mpi[key]
