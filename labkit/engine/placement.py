"""Where each rank lives: rank, local rank and device from the launcher's environment.

Ranks come from the environment the launcher gave the engine (torchrun/local: RANK,
Slurm: SLURM_PROCID, Open MPI: OMPI_COMM_WORLD_RANK, MPICH/Intel MPI: PMI_RANK), never from
ipyparallel engine ids, which change when engines restart.

>>> rank_from_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"})
{'rank': 5, 'local_rank': 1, 'world_size': 8, 'source': 'slurm'}
"""
from __future__ import annotations

# (source, rank variable, local-rank variable, world-size variable), most specific first.
RANK_SOURCES = (
    ("env", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)


def rank_from_env(env) -> dict | None:
    """Rank, local rank and world size from a launcher's variables, or None if there are none."""
    for source, rank_var, local_var, size_var in RANK_SOURCES:
        if rank_var in env:
            rank = int(env[rank_var])
            return {"rank": rank, "local_rank": int(env.get(local_var, 0)),
                    "world_size": int(env[size_var]) if size_var in env else None, "source": source}
    return None


def choose_device(local_rank: int, gpu_count: int, host: str) -> str:
    """One engine per GPU: local rank i drives cuda:i; no GPU means CPU.

    An engine that sees exactly one GPU drives it whatever its local rank: the launcher has
    bound one GPU to each task (``srun --gpus-per-task=1``, a per-rank CUDA_VISIBLE_DEVICES).
    """
    if gpu_count == 0:
        return "cpu"
    if gpu_count == 1:
        return "cuda:0"
    if local_rank >= gpu_count:
        raise RuntimeError(f"host {host}: local rank {local_rank} but only {gpu_count} GPU(s) visible; "
                           f"start one engine per GPU (engines per node = GPUs per node)")
    return f"cuda:{local_rank}"


def check_device_map(ranks: list[dict]) -> None:
    """Every rank on a GPU, or every rank on CPU: a mix would pick gloo on some ranks and NCCL on others."""
    on_gpu = [r for r in ranks if r["device"].startswith("cuda")]
    if on_gpu and len(on_gpu) != len(ranks):
        cpu = [r for r in ranks if not r["device"].startswith("cuda")]
        where = ", ".join(f"rank {r['rank']} on {r['host']}" for r in cpu)
        raise RuntimeError(f"{where} sees no GPU while other ranks do; check CUDA_VISIBLE_DEVICES and the "
                           f"GPU driver on those hosts")
    ids = sorted(r["rank"] for r in ranks)
    if ids != list(range(len(ranks))):
        raise RuntimeError(f"engine ranks {ids} are not 0..{len(ranks) - 1}; the launcher's rank variables "
                           f"disagree with the number of engines")
    seen = {}
    for r in on_gpu:
        # Two engines that each see one GPU both say cuda:0; what they see tells them apart.
        key = (r["host"], r.get("cuda_visible_devices"), r["device"])
        if key in seen:
            raise RuntimeError(f"ranks {seen[key]} and {r['rank']} both use {r['device']} on {r['host']}; "
                               f"give each engine its own LOCAL_RANK")
        seen[key] = r["rank"]
