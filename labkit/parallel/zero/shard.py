"""One flat, padded unit of parameters and this rank's 1/dp shard of it.

A unit is a few parameters (a bucket for zero=1/2, a block for zero=3) laid end to end in
one flat buffer, padded with zeros to a multiple of dp so every rank's shard has the same
length (uneven sizes are the common case: 37·13 + 37 does not divide by 2). The parameters
become views into the buffer (``p.data = flat[a:b].view(shape)``, as FSDP1's FlatParameter
does), so one all-gather into the buffer refreshes them all, and freeing the buffer's storage
(``resize_(0)``) frees them all without touching the modules.

The shard is a separate ``nn.Parameter`` of ``padded / dp`` elements: it is what the
optimizer steps, and its ``grad`` is this rank's reduce-scattered slice of the gradient.
Writing the buffer through a collective bumps only the buffer's version counter, not the
parameters' (``.data`` views keep their own), so autograd's saved weights stay valid.

Under HSDP (``Strategy.dp_shard``) the unit is sharded over a group of dp_shard ranks and that
group is one of several replicas: after the reduce-scatter inside the group, each shard's
gradient is all-reduced over the ranks holding the same shard in the other replicas
(:meth:`FlatUnit.replicate`), and the mean divides by all of dp.
"""
from __future__ import annotations

import torch
from torch import nn

from ... import comm


class Meter:
    """Bytes held now and the most held at once (reset each step)."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes

    def reset(self) -> None:
        self.peak = self.now


class FlatUnit:
    """Parameters ``members`` flattened, padded to a multiple of ``dp``; shard ``rank`` is ours."""

    def __init__(self, index: int, members: list[tuple[str, nn.Parameter]], group, dp: int, rank: int,
                 name: str):
        self.index, self.members, self.group, self.dp, self.rank = index, members, group, dp, rank
        self.name = name
        self.divisor = dp        # the mean's count: dp; an expert's replicas sum to a mean over all of dp
        params = [p for _, p in members]
        if len({p.dtype for p in params}) != 1:
            raise ValueError(f"zero: the parameters of {name} mix dtypes; a flat shard needs one dtype")
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // dp)                 # ceil: padding evens the shards
        self.padded = self.shard_numel * dp
        pieces = [getattr(p, "labkit_piece", None) for p in params]
        presharded = any(piece is not None for piece in pieces)
        if presharded and not all(piece is not None for piece in pieces):
            raise RuntimeError(f"zero: {name} mixes parameters materialised per rank with whole ones")
        # materialised per rank (labkit.parallel.materialize): parameters without values, each
        # carrying its slice of this rank's shard; the buffer only gives them their views
        make = torch.empty if presharded else torch.zeros
        self.flat = make(self.padded, dtype=params[0].dtype, device=params[0].device)
        shard = torch.zeros(self.shard_numel, dtype=params[0].dtype, device=params[0].device)
        offset, lo = 0, rank * self.shard_numel
        for p, piece in zip(params, pieces):
            n = p.numel()
            if piece is not None:
                start = max(lo - offset, 0) + offset - lo
                shard[start:start + piece.numel()].copy_(piece)
                del p.labkit_piece
            else:
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + n].view_as(p)
            offset += n
        if not presharded:
            shard.copy_(self.flat[lo:lo + self.shard_numel])
        self.shard = nn.Parameter(shard)
        self.shard.grad = torch.zeros_like(self.shard)
        self.nbytes = self.padded * self.flat.element_size()
        self.gathered = True
        if presharded:
            self.free()                  # never whole here: the first gather fills it
        self.handle = None               # an all-gather in flight
        self.grad_handles = []           # reduce-scatters in flight: (handle, output)
        self.ready = 0                   # members whose gradient exists this micro-batch
        self.sent = False                # its gradients went out at least once this step
        self.replicas = None             # HSDP: the ranks holding this shard in the other replicas

    def replicate(self, group, count: int) -> None:
        """HSDP: the unit's shard group is one of ``count`` replicas; ``group`` holds this shard
        in each of them. The gradient's mean then runs over all ``dp · count`` ranks."""
        self.replicas, self.divisor = group, self.dp * count

    def pieces(self) -> list[tuple[nn.Parameter | None, nn.Parameter]]:
        """This rank's shard cut where its members meet: (member, piece) per member that
        overlaps the shard (None for the padding), each piece a parameter sharing the shard's
        storage, its gradient a view of the shard's. An optimizer over the pieces steps the
        same elements as one over the shard, while keeping each member's state apart, so a
        member can be skipped as one process skips a parameter with no gradient."""
        spans, offset = [], 0
        for _, p in self.members:
            spans.append((p, offset, offset + p.numel()))
            offset += p.numel()
        spans.append((None, self.numel, self.padded))
        out, lo, hi = [], self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        for member, start, end in spans:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                piece = nn.Parameter(self.shard.data[a - lo:b - lo])
                piece.grad = self.shard.grad[a - lo:b - lo]
                out.append((member, piece))
        return out

    # -- parameters ------------------------------------------------------------------------
    def free(self) -> None:
        """Drop the full buffer's memory (zero=3 at rest); the parameter views stay, empty."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def gather(self) -> None:
        """Issue the all-gather of every rank's shard into the buffer (no-op if issued or held)."""
        if self.gathered or self.handle is not None:
            return
        self.flat.untyped_storage().resize_(self.nbytes)
        self.handle = comm.all_gather(self.flat, self.shard.detach(), self.group,
                                      name=f"gather {self.name}", async_op=True)

    def wait(self) -> None:
        """Block until this unit's parameters are whole here."""
        if self.gathered:
            return
        if self.handle is None:
            self.gather()
        self.handle.wait()
        self.handle = None
        self.gathered = True

    # -- gradients -------------------------------------------------------------------------
    def flat_grad(self) -> torch.Tensor:
        """The members' gradients packed and padded (missing ones as zeros)."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                                                                            device=p.device)
                 for _, p in self.members]
        if self.padded > self.numel:
            parts.append(self.flat.new_zeros(self.padded - self.numel))
        return torch.cat(parts)

    def reduce_scatter(self, flat: torch.Tensor) -> None:
        """Start summing ``flat`` over the group; this rank's slice is added to the shard's
        grad by :meth:`collect_oldest` (one micro-batch's gradients per call)."""
        out = flat.new_empty(self.shard_numel)
        handle = comm.reduce_scatter(out, flat, self.group, name=f"reduce-scatter {self.name}",
                                     async_op=True)
        self.grad_handles.append((handle, out, flat))

    def collect_oldest(self) -> int:
        """Wait for the oldest reduce-scatter, add its slice; returns the packed bytes freed."""
        handle, out, flat = self.grad_handles.pop(0)
        handle.wait()
        self.shard.grad.add_(out)
        return flat.numel() * flat.element_size()

    def average_grads(self) -> None:
        """Sum over ranks (and micro-batches) → the mean, as the all-reduce modes divide by dp;
        under HSDP the shard's sum over the replicas first."""
        if self.replicas is not None:
            comm.all_reduce(self.shard.grad, self.replicas, name=f"all-reduce {self.name} over replicas")
        self.shard.grad.div_(self.divisor)

    def shard_bytes(self) -> int:
        return self.shard_numel * self.shard.element_size()
