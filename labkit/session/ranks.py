"""The rank map: which ipyparallel engine is which rank, and where the rendezvous store listens.

Ranks come from each engine's environment (the launcher's variables), never from engine ids,
which follow registration order and change on restart. Launchers that set no rank variables
(SSH) get ranks assigned here: by host, then process id, local ranks counted per host.

>>> engine_of, ranks = map_ranks(client)          # {rank: engine id}, [describe() per rank]
"""
from __future__ import annotations

import socket

from .. import engine
from ..engine.placement import check_device_map
from ..errors import LabError


def map_ranks(client, targets=None) -> tuple[dict[int, int], list[dict]]:
    """Ask every engine who it is; ``({rank: engine id}, [its description, in rank order])``."""
    everyone = client.direct_view(targets if targets is not None else "all")
    infos = everyone.apply_async(engine.describe).get_dict(timeout=180)
    if any(info["rank"] is None for info in infos.values()):
        infos = assign_ranks(client, infos)
    engine_of = {info["rank"]: eid for eid, info in infos.items()}
    ranks = [infos[engine_of[r]] for r in sorted(engine_of)]
    check_device_map(ranks)
    return engine_of, ranks


def assign_ranks(client, infos: dict) -> dict:
    """No launcher rank variables (SSH): ranks by host, then process id; local ranks per host."""
    order = sorted(infos, key=lambda eid: (infos[eid]["host"], infos[eid]["pid"]))
    per_host: dict[str, int] = {}
    for rank, eid in enumerate(order):
        host = infos[eid]["host"]
        local = per_host[host] = per_host.get(host, -1) + 1
        infos[eid] = client[eid].apply_sync(engine.assign_rank, rank, len(order), local)
    return infos


def master_address(ranks: list[dict]) -> str:
    """Where the rendezvous store listens: rank 0's MASTER_ADDR if its launcher set one, else
    rank 0's host — and never a loopback address when ranks live on several hosts."""
    first = ranks[0]
    if first.get("master_addr"):
        return first["master_addr"]
    if len({r["host"] for r in ranks}) == 1:
        return "127.0.0.1"
    address = _address_of(first["host"])
    if address.startswith("127."):
        raise LabError(f"rank 0's host {first['host']} resolves to {address}, which other hosts cannot reach; "
                       f"set MASTER_ADDR in the engines' environment to an address of {first['host']} on the "
                       f"cluster network")
    return address


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
