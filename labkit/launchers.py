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
OMPI_COMM_WORLD_RANK); SSH sets none, so the lab assigns them (see ``Lab._assign_ranks``).

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
from traitlets.config import Config

from .errors import LabError

LAUNCHERS = ("slurm", "mpi", "ssh")

# The engine job ipyparallel submits; {options} holds the #SBATCH lines labkit adds.
SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --job-name=ipengine-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
#SBATCH --export=ALL
{options}
srun {program_and_args}
"""


class _Cluster(ipp.Cluster):
    """An ipyparallel Cluster that also removes its work folder and waits for its jobs to go."""

    def __init__(self, *, work_dir: str, **kwargs):
        super().__init__(**kwargs)
        self._work_dir = work_dir

    async def stop_cluster(self):
        jobs = [es.job_id for es in self.engines.values() if getattr(es, "job_id", "")]
        try:
            await super().stop_cluster()
        finally:
            _wait_for_jobs_to_leave(jobs, timeout=15)
            shutil.rmtree(self._work_dir, ignore_errors=True)


def start_cluster(launcher: str, engines: int, timeout: float = 120.0, progress: bool = True,
                  **options) -> tuple[ipp.Cluster, ipp.Client]:
    """Start a controller and ``engines`` engines through ``launcher``; return (cluster, client).

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
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
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
            _check_ssh(cluster.config.SSHEngineSetLauncher, engines, timeout)
        cluster.start_controller_sync()
        try:
            cluster.start_engines_sync(n=engines, environment=env)
        except Exception as exc:
            raise LabError(f"{launcher}: could not start engines: {_message(exc)}") from None
        client = cluster.connect_client_sync()
        _wait_for_engines(launcher, cluster, client, engines, timeout, say, t0)
    except BaseException:
        _stop(cluster)
        raise
    say(f"labkit: {engines} engines up through {launcher} in {time.monotonic() - t0:.0f} s")
    return cluster, client


