"""What this engine reports back: its flight log (for failure reports) and its parameters
(``run.parameters()``, ``run.max_diff``).
"""
from __future__ import annotations

import hashlib

import torch

from .. import comm
from .state import session


def flight_log() -> dict:
    """This rank's flight recorder (its last labkit.comm calls), for the lab's failure reports."""
    s = session()
    try:
        entries = comm.flight_log()
    except RuntimeError:          # not initialised (yet, or any more)
        entries = []
    return {"rank": s.rank, "entries": entries}


def parameters() -> dict:
    """The parameters this rank's job reports (its ``full_state_dict()``), on CPU, keyed as in
    the model's state_dict; merged over ranks they are the whole model."""
    s = session()
    return s.job.full_state_dict() if s.job is not None else {}


def parameter_copy(whole: bool = False) -> dict:
    """This rank's copy of the parameters, for the check that reads every replica
    (``run.max_diff``): a digest of each tensor (its bytes hashed), and the tensors themselves
    where this rank reports them for ``run.parameters()`` (``owner``) or ``whole`` asks. A
    collective like :func:`parameters`: every rank calls it."""
    s = session()
    if s.job is None:
        return {"rank": s.rank, "owner": False, "digests": {}, "state": {}}
    owner, state = s.job.owns_parameters, s.job.full_state_dict(every=True)
    return {"rank": s.rank, "owner": owner, "digests": {k: tensor_digest(v) for k, v in state.items()},
            "state": state if owner or whole else {}}


def tensor_digest(t: torch.Tensor) -> str:
    """A tensor's dtype, shape and bytes, hashed: equal digests, bitwise-equal tensors."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode() + data, digest_size=16).hexdigest()
