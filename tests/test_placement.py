"""GPU pinning without GPUs: the engine's own code, fed each launcher's environment.

Two nodes × four GPUs, eight engines: every rank must get its launcher's rank, the local rank
on its node and cuda:<local rank>; a rank that sees no GPU while the others do must stop the
lab with an error that names its host.
"""
from __future__ import annotations

import pytest

from labkit.engine import state as engine
from labkit.session.ranks import assign_ranks
from labkit.engine.placement import RANK_SOURCES, check_device_map, choose_device, rank_from_env

NODES, GPUS = 2, 4
WORLD = NODES * GPUS


def launcher_env(kind: str, node: int, local: int) -> dict[str, str]:
    """What each launcher sets for the engine at ``local`` on ``node`` (ranks fill nodes in order)."""
    rank = node * GPUS + local
    names = {"torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
             "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
             "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
             "mpich": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE")}[kind]
    return dict(zip(names, map(str, (rank, local, WORLD))))


def describe_engine(monkeypatch, env: dict, host: str, gpus: int, visible: str | None = None) -> dict:
    """EngineSession().describe() as the engine at ``host`` with ``env`` and ``gpus`` GPUs sees it."""
    for _, *names in RANK_SOURCES:
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(engine.socket, "gethostname", lambda: host)
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(engine.torch.cuda, "device_count", lambda: gpus)
    info = engine.EngineSession().describe()
    if visible is not None:
        info["cuda_visible_devices"] = visible
    return info


def cluster(monkeypatch, kind: str, gpus_on=lambda node, local: GPUS) -> list[dict]:
    return [describe_engine(monkeypatch, launcher_env(kind, node, local), f"node{node}", gpus_on(node, local))
            for node in range(NODES) for local in range(GPUS)]


@pytest.mark.parametrize("kind", ["torchrun", "slurm", "openmpi", "mpich"])
def test_every_rank_gets_its_local_rank_and_gpu(monkeypatch, kind):
    ranks = cluster(monkeypatch, kind)
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    assert [r["world_size"] for r in ranks] == [WORLD] * WORLD
    for r in ranks:
        local = r["rank"] % GPUS
        assert (r["host"], r["local_rank"], r["device"]) == (f"node{r['rank'] // GPUS}", local, f"cuda:{local}")
        assert r["backend"] == "nccl"
    assert {r["rank_source"] for r in ranks} == {"env" if kind == "torchrun" else kind.replace("openmpi", "mpi")
                                                 .replace("mpich", "mpi")}
    check_device_map(ranks)                   # a valid map: no error


@pytest.mark.parametrize("kind", ["slurm", "openmpi"])
def test_a_rank_without_gpu_names_its_host(monkeypatch, kind):
    ranks = cluster(monkeypatch, kind, gpus_on=lambda node, local: 0 if (node, local) == (1, 2) else GPUS)
    assert ranks[6]["device"] == "cpu" and ranks[6]["backend"] == "gloo"
    with pytest.raises(RuntimeError, match=r"rank 6 on node1 sees no GPU while other ranks do"):
        check_device_map(ranks)


def test_more_engines_than_gpus_on_a_node_is_refused(monkeypatch):
    with pytest.raises(RuntimeError, match=r"host node1: local rank 3 but only 2 GPU\(s\) visible"):
        describe_engine(monkeypatch, launcher_env("slurm", 1, 3), "node1", gpus=2)


def test_one_gpu_bound_per_task(monkeypatch):
    """srun --gpus-per-task=1: every task sees one GPU (its own) as cuda:0."""
    ranks = [describe_engine(monkeypatch, launcher_env("slurm", node, local), f"node{node}", 1, visible=str(local))
             for node in range(NODES) for local in range(GPUS)]
    assert {r["device"] for r in ranks} == {"cuda:0"}
    check_device_map(ranks)
    for r in ranks:                           # the same GPU twice on one node is an error
        r["cuda_visible_devices"] = "0"
    with pytest.raises(RuntimeError, match=r"both use cuda:0 on node0"):
        check_device_map(ranks)


def test_two_engines_on_one_gpu_is_refused():
    ranks = [{"rank": r, "host": "node0", "device": f"cuda:{min(r, 1)}"} for r in range(3)]
    with pytest.raises(RuntimeError, match=r"ranks 1 and 2 both use cuda:1 on node0"):
        check_device_map(ranks)


def test_ranks_must_be_0_to_n_minus_1():
    with pytest.raises(RuntimeError, match=r"not 0..1"):
        check_device_map([{"rank": 0, "host": "a", "device": "cpu"}, {"rank": 2, "host": "b", "device": "cpu"}])


def test_no_rank_variables_means_the_lab_assigns():
    assert rank_from_env({"PATH": "/usr/bin"}) is None
    assert choose_device(0, 0, "laptop") == "cpu"


class _FakeEngine:
    """One engine's session behind ``client[eid].apply_sync`` (what labkit.session.ranks.assign_ranks calls)."""

    def __init__(self, session):
        self.session = session

    def apply_sync(self, fn, *args):
        saved, engine._session = engine._session, self.session
        try:
            return fn(*args)
        finally:
            engine._session = saved


def test_ssh_engines_get_ranks_by_host_then_local_ranks(monkeypatch):
    """SSH sets no rank variables: ranks follow hosts (then pids), local ranks count per host."""
    sessions, infos = {}, {}
    for eid, (host, pid) in enumerate([("node1", 40), ("node0", 12), ("node1", 30), ("node0", 11),
                                       ("node0", 14), ("node1", 31), ("node0", 13), ("node1", 32)]):
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        describe_engine(monkeypatch, {}, host, GPUS)
        sessions[eid] = engine.EngineSession()
        infos[eid] = dict(sessions[eid].describe(), pid=pid)
        assert infos[eid]["rank"] is None and infos[eid]["device"] == "?"
    client = {eid: _FakeEngine(s) for eid, s in sessions.items()}
    placed = sorted(assign_ranks(client, infos).values(), key=lambda r: r["rank"])
    assert [(r["host"], r["local_rank"], r["device"]) for r in placed] == \
        [(f"node{n}", i, f"cuda:{i}") for n in range(NODES) for i in range(GPUS)]
    check_device_map(placed)
