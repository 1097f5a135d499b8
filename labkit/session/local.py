"""Local CPU engines on this machine: the embedded default launcher (a laptop, a CPU VM).

One ipyparallel engine set per rank, each with its own rank variables in its environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1), so ranks never come from engine ids,
which change on restart; gloo on the loopback interface; each engine gets its share of the
cores for torch's threads.

>>> cluster, client, threads = start_local(2, timeout=120, say=print)
"""
from __future__ import annotations

import logging
import os
import time

import ipyparallel as ipp

from ..errors import LabError
from . import lifetime


# The hub keeps no task database: labkit never re-fetches a result from the hub, and its default
# in-memory one stores every step's answer (events included), growing for as long as the lab
# lives and costing the controller Python work on every message while the engines compute.
# The hub registers an engine only once its heart has answered a beat: at the default period
# of 3 s, 6 s of every start; a beat each second, with 30 misses allowed (the default's 30 s)
# before an engine counts as dead.
CONTROLLER_ARGS = ("--nodb", "--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30")


def threads_per_engine(engines: int) -> int:
    """Each engine's share of this machine's cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // engines)


def rank_env(rank: int, n: int, threads: int, debug: bool = False) -> dict:
    """The environment of a local engine: its rank variables, loopback only, its thread share."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
           "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def start_local(engines: int, timeout: float, say, debug: bool = False,
                **cluster_kwargs) -> tuple[ipp.Cluster, ipp.Client, int]:
    """A controller on 127.0.0.1 and one engine set per rank; (cluster, client, threads)."""
    threads = threads_per_engine(engines)
    cluster = ipp.Cluster(n=engines, log_level=logging.ERROR, controller_ip="127.0.0.1",
                          controller_args=[*CONTROLLER_ARGS, *cluster_kwargs.pop("controller_args", [])],
                          **cluster_kwargs)
    try:
        return cluster, _start(cluster, engines, threads, timeout, say, debug), threads
    except BaseException:
        stop_quietly(cluster)
        raise


def _start(cluster: ipp.Cluster, n: int, threads: int, timeout: float, say, debug: bool) -> ipp.Client:
    t0 = time.monotonic()
    say(f"labkit: starting controller and {n} engines…")
    cluster.start_controller_sync()
    for rank in range(n):
        cluster.start_engines_sync(n=1, engine_set_id=f"rank{rank}", environment=rank_env(rank, n, threads, debug))
    client = cluster.connect_client_sync()
    seen = -1
    while len(client.ids) < n:
        if time.monotonic() - t0 > timeout:
            raise LabError(f"only {len(client.ids)} of {n} engines registered within {timeout:g} s")
        if len(client.ids) != seen:
            seen = len(client.ids)
            say(f"labkit: {seen}/{n} engines up ({time.monotonic() - t0:.0f} s)")
        time.sleep(0.25)
    say(f"\rlabkit: {n}/{n} engines up ({time.monotonic() - t0:.0f} s)")
    return client


def restart_local(cluster: ipp.Cluster, n: int, threads: int, debug: bool = False) -> None:
    """Stop every rank's engine set (a dead one is already gone) and start it again, same environment."""
    for rank in range(n):
        try:
            cluster.stop_engines_sync(engine_set_id=f"rank{rank}")
        except Exception:
            pass               # its engine is already gone
    for rank in range(n):
        cluster.start_engines_sync(n=1, engine_set_id=f"rank{rank}", environment=rank_env(rank, n, threads, debug))


def stop_quietly(cluster: ipp.Cluster) -> None:
    """Stop engines and controller; then end whatever of their process trees is left (the
    controller's schedulers are child processes, which outlive a hub stopped half-way through
    a start that failed, e.g. when sbatch refused the engines)."""
    left = lifetime.lab_processes(cluster)
    # engines first, all at once: 0.8 s for two, where ipyparallel's stop, joining each
    # launcher's watcher, took 1.6 s; it then finds them gone
    lifetime.terminate([p for p in left if lifetime.is_engine(p)])
    try:
        cluster.stop_cluster_sync()
    except Exception:
        pass
    lifetime.terminate(left)
