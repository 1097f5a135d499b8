"""Starting engines through a launcher, by name: "local" (the default) is just one of them.

:func:`start_engines` returns a :class:`Launched`: the ipyparallel Cluster and Client, the
compute threads each engine was given, and how to restart the same engines (``lab.recover``).
ipyparallel finds its launchers by name the same way; the lab never asks which one it got.

>>> launched = start_engines("local", engines=2, timeout=120, say=print)
>>> launched = start_engines("slurm", engines=8, timeout=600, say=print, gpus_per_node=4)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ipyparallel as ipp

from . import local


@dataclass
class Launched:
    """Engines this process started (``cluster`` None: someone else did, ``Lab.connect``)."""

    launcher: str
    cluster: ipp.Cluster | None
    client: ipp.Client
    threads: int | None = None      # torch threads per engine (local); None: the launcher decides
    options: dict = field(default_factory=dict)     # the launcher's keywords, for relaunch()

    def restart(self, n: int, debug: bool = False) -> None:
        """Start the same engines again (new engine ids, same ranks and environment)."""
        if self.cluster is None:
            return                      # attached with connect(): whoever started them restarts them
        if self.launcher == "local":
            local.restart_local(self.cluster, n, self.threads, debug)
        else:
            self.cluster.restart_engines_sync()

    def relaunch(self, n: int, timeout: float, say, debug: bool = False) -> "Launched":
        """A new local cluster with the same options (its controller died; lab.recover)."""
        cluster, client, threads = local.start_local(n, timeout, say, debug, **self.options)
        return Launched("local", cluster, client, threads, dict(self.options))

    def stop(self) -> None:
        if self.cluster is not None:
            local.stop_quietly(self.cluster)


def start_engines(launcher: str, engines: int, timeout: float, say=None, debug: bool = False,
                  **options) -> Launched:
    """``engines`` engines through ``launcher`` ("local", "slurm", "mpi", "ssh"), all registered;
    progress lines go to ``say`` (the lab's status line; None: quiet)."""
    say = say or (lambda text: None)
    if launcher == "local":
        cluster, client, threads = local.start_local(engines, timeout, say, debug, **options)
        return Launched("local", cluster, client, threads, dict(options))
    from .launchers import start_cluster
    cluster, client = start_cluster(launcher, engines, timeout, say, **options)
    return Launched(launcher, cluster, client)
