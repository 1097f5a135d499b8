"""The one point-to-point header format, [dtype code, ndim, dims…] as int64, and the receive
that reads it first: a mismatch is an error naming both ranks, never a gloo abort.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import CommMismatch


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
MAX_DIMS = 14


HEADER_LEN = 2 + MAX_DIMS


def describable(tensor: torch.Tensor) -> bool:
    """Whether a message header can describe ``tensor`` (its dtype and number of dims)."""
    return tensor.dtype in DTYPES and tensor.dim() <= MAX_DIMS


def header(tensor: torch.Tensor) -> torch.Tensor:
    """The one point-to-point header format: [dtype code, ndim, dims…, 0…], int64, HEADER_LEN long.

    Sent before a payload, it lets the receiver check what arrives (``irecv(check=True)``) or
    allocate for it (the pipeline's first activation on a channel, :func:`read_header`).
    """
    if not describable(tensor):
        raise ValueError(f"labkit.comm: cannot describe a {tensor.dim()}-d {tensor.dtype} tensor in a "
                         f"message header; call labkit.comm.set_p2p_check(False) on every rank")
    values = [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def read_header(values: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) that a :func:`header` announces."""
    code, ndim, *dims = values.tolist()
    return tuple(dims[:ndim]), DTYPES[code]



def _describe(dtype, shape) -> str:
    return f"shape {tuple(shape)} {str(dtype).replace('torch.', '')}"


class _Works:
    """Several torch works waited for as one (a header and its payload)."""

    def __init__(self, works, keep=None):
        self.works, self._keep = works, keep

    def wait(self):
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self):
        return self.works[-1].get_future()


class _CheckedRecv:
    """A receive that reads the sender's header before posting the payload's receive."""

    def __init__(self, tensor, src, group, tag):
        self.tensor, self.src, self.group, self.tag = tensor, src, group, tag
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=tensor.device)
        self.header_work = dist.irecv(self.header, src, group=group, tag=tag)
        self._done = False

    def wait(self):
        if self._done:
            return True
        self.header_work.wait()
        shape, dtype = read_header(self.header)
        if dtype == self.tensor.dtype and shape == tuple(self.tensor.shape):
            dist.irecv(self.tensor, self.src, group=self.group, tag=self.tag).wait()
            self._done = True
            return True
        scratch = torch.empty(shape, dtype=dtype, device=self.tensor.device)
        dist.irecv(scratch, self.src, group=self.group, tag=self.tag).wait()     # drain: both stay in step
        self._done = True
        raise CommMismatch(f"this rank expected {_describe(self.tensor.dtype, self.tensor.shape)} from rank "
                           f"{self.src}, but rank {self.src} sent {_describe(dtype, shape)}")

    def is_completed(self) -> bool:
        return self._done

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result([self.tensor])
        return future
