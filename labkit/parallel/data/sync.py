"""Data parallelism four ways: every rank holds the whole model and sees 1/dp of the batch;
after backward the gradients are averaged over the dp group, so every replica takes the
same optimizer step as one process would on the whole batch.

* ``naive``    — one all-reduce per gradient tensor, after backward (many small messages);
* ``bucketed`` — gradients packed into flat buckets of ``bucket_mb``, reduced after backward
                 (few large messages, still no overlap);
* ``overlap``  — the same buckets, each launched asynchronously from autograd hooks the
                 moment its last gradient is ready, while backward carries on with earlier
                 layers; waited for before the optimizer step;
* ``ddp``      — torch's DistributedDataParallel with the same bucket size, its comm hook
                 routing the all-reduce through :mod:`labkit.comm` so it is timed the same way.

``compression`` ("fp16", "bf16", "int8"; "powersgd" with ddp) shrinks each bucket's message;
see :mod:`labkit.compression`. The naive mode has no buckets and sends gradients as they are.

Every sync object has the methods the executor needs, and no caller asks which class it is::

    model = sync.wrap(model)                 # once
    with sync.defer():                       # around each forward: no reduction armed
        out = model(x)
    with sync.backward(last=is_last):        # around each micro-batch's backward; the last
        loss.backward()                      # one's gradients are the ones reduced
    sync.finish()                            # gradients averaged when it returns

``dp == 1`` (or a stage without parameters) gets :class:`NoSync`, which does nothing.
"""
from __future__ import annotations

import re
import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from ... import comm
from . import faults

MiB = 1024 * 1024


def build_grad_sync(mode: str, group, dp: int, bucket_mb: float, compression: str = "none",
                    error_feedback: bool = True) -> "GradSync":
    """The gradient synchroniser for ``dp_mode`` (see the module docstring); dp = 1: NoSync."""
    if dp == 1:
        return NoSync(group, dp, bucket_mb)
    kinds = {"naive": NaiveSync, "bucketed": BucketedSync, "overlap": OverlapSync, "ddp": DDPSync}
    if mode not in kinds:
        raise ValueError(f"dp_mode={mode!r} is unknown; use one of {sorted(kinds)}")
    if compression != "none" and mode == "naive":
        raise ValueError("compression needs buckets; use dp_mode='bucketed', 'overlap' or 'ddp'")
    sync = kinds[mode](group, dp, bucket_mb)
    sync.compression, sync.error_feedback = compression, error_feedback
    return sync


def make_buckets(params: list[tuple[str, nn.Parameter]], bucket_bytes: float) -> list[list[tuple[str, nn.Parameter]]]:
    """Group parameters into buckets of about ``bucket_bytes``, in the order gradients arrive.

    Backward runs from the last layer to the first, so buckets are filled in reverse
    registration order (as DDP does); a bucket closes once it reaches the cap.
    """
    from . import fill_buckets
    return fill_buckets(params, lambda item: item[1].numel() * item[1].element_size(), bucket_bytes)


class GradSync:
    """Base: averages gradients over ``group`` (``dp`` ranks)."""

    compression, error_feedback = "none", True

    def __init__(self, group, dp: int, bucket_mb: float):
        self.group, self.dp, self.bucket_bytes = group, dp, bucket_mb * MiB
        self.last = True

    def wrap(self, model: nn.Module) -> nn.Module:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return model

    def defer(self):
        """Around a forward: the reduction is not armed (only DDP arms it in forward)."""
        return nullcontext()

    @contextmanager
    def backward(self, last: bool):
        """Backward of one micro-batch; only the last one's gradients are reduced."""
        self.last = last
        yield

    def finish(self) -> None:
        raise NotImplementedError

    # -- what sharded syncs (labkit.parallel.zero) change; plain data parallelism needs none --
    grads_to_none = False
    """True when the optimizer drops the gradients after a step instead of zeroing them: FSDP2,
    which reduces into gradients of its own, so that a parameter no backward reached in the next
    step has none and the optimizer skips it as one process does. The other syncs keep them (a
    bucket's views stay in place) and tell the executor which were reached instead."""

    times_forward = times_backward = False
    """True when the sync records forward (backward) spans per block itself: ZeRO-3 gathers
    inside them, and only it knows where a gather's wait ends and compute begins."""

    def after_step(self) -> None:
        """After the optimizer step (ZeRO-1/2: the updated shards are all-gathered here)."""

    def full_state_dict(self, module: nn.Module) -> dict:
        """The module's whole parameters; every dp rank calls it (sharded syncs gather)."""
        return dict(module.state_dict())

    def held_bytes(self, module: nn.Module) -> dict:
        """Parameter and gradient bytes this rank holds: at rest, and the most at once."""
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
        return {"params": params, "params_peak": params, "grads": grads, "grads_peak": grads}


class NoSync(GradSync):
    """Nothing to average: one replica (dp = 1), or a stage without parameters."""

    def finish(self) -> None:
        pass


class NaiveSync(GradSync):
    """One blocking all-reduce per gradient tensor, after backward."""

    def finish(self):
        for name, p in self.params:
            comm.all_reduce(_grad_of(p), self.group, name=name)
            p.grad.div_(self.dp)


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, or zeros when backward never reached it (an unused branch, a layer
    skipped this step). Every rank then sends the same buckets, the average is right when only
    some ranks used it, and SGD moves an unused parameter by zero, as one process would; it is
    DDP's treatment with ``find_unused_parameters=True``."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class _Bucket:
    """A flat buffer for a few parameters' gradients, reduced as one message."""

    def __init__(self, index: int, members: list[tuple[str, nn.Parameter]]):
        self.index, self.members = index, members
        self.name = f"bucket {index} ({len(members)} tensors)"
        self.numel = sum(p.numel() for _, p in members)
        self.handle = None
        self.ready = 0
        self.buffer = None           # set by share_buffer: the members' gradients, flat
        self.fault = self.kept = None    # a planted fault (faults.py) and the gradient it keeps

    def share_buffer(self) -> None:
        """Make the members' ``.grad`` views of one flat buffer (DDP's ``gradient_as_bucket_view``):
        autograd accumulates into them in place, so the bucket is sent with no copy in and no
        copy out. Members of mixed dtype or device keep their own gradients (copied instead)."""
        first = self.members[0][1]
        if any(p.dtype != first.dtype or p.device != first.device for _, p in self.members):
            return
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.ptrs, offset = [], 0
        for _, p in self.members:
            view = self.buffer[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self.ptrs.append(view.data_ptr())
            offset += p.numel()

    def pack(self) -> torch.Tensor:
        if self.buffer is not None and [p.grad.data_ptr() if p.grad is not None else 0
                                        for _, p in self.members] == self.ptrs:
            return self.buffer
        return torch.cat([_grad_of(p).reshape(-1) for _, p in self.members])

    def unpack(self, flat: torch.Tensor, dp: int) -> None:
        if flat is self.buffer:      # reduced in place: the gradients are already there
            flat.div_(dp)
            return
        offset = 0
        for _, p in self.members:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad)).div_(dp)
            offset += n

    def launch(self, group, compressor=None) -> None:
        self.flat = self.pack()
        ctx = comm.context()
        self.fault = faults.active(self.index, ctx.rank, ctx.recorder.step)   # planted (faults.py); None in training
        if self.fault is not None and self.fault.kind == "skip":
            self.kept = self.flat.clone()           # reduced in place below: keep the local gradient
        if compressor is None:
            self.handle = comm.all_reduce(self.flat, group, name=self.name, async_op=True)
        else:       # compressed and sent; ``handle`` holds what finishing needs
            self.handle = compressor.start(self.index, self.name, self.flat)

    def complete(self, dp: int, compressor=None) -> None:
        if compressor is None:
            self.handle.wait()
            mean, divide = self.flat, dp
        else:
            mean, divide = compressor.finish(self.handle), 1     # already the average
        if self.fault is None:
            self.unpack(mean, divide)
        elif self.fault.kind == "skip":                          # the average is never written back
            self.unpack(self.kept, 1)
        else:                                                    # the sum divided by factor·dp
            self.unpack(mean, divide * self.fault.factor)
        self.handle = self.flat = self.fault = self.kept = None
        self.ready = 0


class BucketedSync(GradSync):
    """Flat buckets of ``bucket_mb``, reduced one after another once backward is over."""

    def wrap(self, model):
        super().wrap(model)
        self.buckets = [_Bucket(i, m) for i, m in enumerate(make_buckets(self.params, self.bucket_bytes))]
        self.compressor = None
        if self.compression != "none":
            from ...comm.compression import BucketCompressor
            self.compressor = BucketCompressor(self.compression, self.group, self.dp, self.error_feedback)
        else:                        # a compressor transforms the flat copy; views only without one
            for bucket in self.buckets:
                bucket.share_buffer()
        return model

    def finish(self):
        for bucket in self.buckets:
            bucket.launch(self.group, self.compressor)
            bucket.complete(self.dp, self.compressor)


class OverlapSync(BucketedSync):
    """Buckets launched from gradient hooks during backward, as soon as each is full.

    Launched in bucket order, as DDP's reducer does: every rank must issue the same
    collectives in the same order, and the order in which gradients land is not promised
    (a split backward's W runs its parameter groups in an order of its own), so a full bucket
    waits for the ones before it.
    """

    def wrap(self, model):
        super().wrap(model)
        self.next = 0                       # the next bucket to launch
        for bucket in self.buckets:
            for _, p in bucket.members:
                p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad(b))
        return model

    def _on_grad(self, bucket: _Bucket) -> None:
        if not self.last:          # earlier micro-batches only accumulate
            return
        bucket.ready += 1
        while self.next < len(self.buckets) and self.buckets[self.next].ready >= len(self.buckets[self.next].members):
            self.buckets[self.next].launch(self.group, self.compressor)
            self.next += 1

    def finish(self):
        for bucket in self.buckets:
            if bucket.handle is None:       # a parameter that got no gradient this step
                bucket.launch(self.group, self.compressor)
            bucket.complete(self.dp, self.compressor)
        self.next = 0


class DDPSync(GradSync):
    """torch's DistributedDataParallel; its comm hook sends each bucket through labkit.comm."""

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().wrap(model)
        device_ids = None
        if next(model.parameters()).is_cuda:
            device_ids = [next(model.parameters()).device.index]
        cap_mb = self.bucket_bytes / MiB
        if self.compression == "powersgd" and torch.distributed.get_backend(self.group) == "gloo":
            # torch's PowerSGD issues its P and Q all-reduces from future callbacks; with several
            # buckets gloo then meets them in different orders on different ranks and hangs
            # (torch's own hook too, measured). One bucket keeps the order.
            cap_mb = max(cap_mb, 1 + sum(p.numel() * p.element_size() for p in model.parameters()) / MiB)
        with warnings.catch_warnings():     # buffers stay per rank on purpose (batch norm: batchnorm.py)
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated", category=FutureWarning)
            self.ddp = DDP(model, process_group=self.group, bucket_cap_mb=cap_mb,
                           device_ids=device_ids, broadcast_buffers=False)
        if self.compression == "none":
            # A Python comm hook costs ~18 % of a small DDP step on CPU (FACTS.md): it is the
            # price of timing each bucket, so it is paid only when the timeline is recorded.
            # Otherwise DDP keeps its built-in C++ all-reduce, as plain torch runs it.
            if comm.context().recorder.enabled:
                self.ddp.register_comm_hook(self, _ddp_allreduce_hook)
        else:
            from ...comm.compression import register_ddp_hook
            self.hook_state = register_ddp_hook(self.ddp, self.compression, self.group, self.dp,
                                                self.error_feedback)
        return self.ddp

    @contextmanager
    def defer(self):
        with self._unused_named(), self.ddp.no_sync():
            yield

    @contextmanager
    def backward(self, last: bool):
        if last:
            # Forwards ran under no_sync; arm DDP's reducer for this stage's final backward
            # (torch.distributed.pipelining's PipelineStage does the same).
            with self._unused_named():
                self.ddp.reducer.prepare_for_backward([])
        yield

    @contextmanager
    def _unused_named(self):
        """torch's error for a parameter that got no gradient in the last step, in labkit's
        terms: DDP's advice (``find_unused_parameters=True``) is not an option a labkit user
        has, and the parameters are named, not numbered. The other modes handle it."""
        try:
            yield
        except RuntimeError as error:
            text = str(error)
            if "Expected to have finished reduction" not in text:
                raise
            names = [n for n, _ in self.params]
            found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
            unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
            raise RuntimeError(
                f"dp_mode='ddp': parameter(s) {unused[:6] or '(not named by torch)'} got no gradient in the last "
                "step (a layer used on some steps or rows only, or never), and torch's DDP stops there (its "
                "find_unused_parameters, which labkit leaves off, walks the graph every step); use "
                "dp_mode='bucketed' or 'overlap', which send zeros for a missing gradient and let the optimizer "
                "skip it as one process does") from None

    def finish(self):
        pass     # DDP's backward already waited for every bucket


def _ddp_allreduce_hook(sync, bucket):  # no annotations: DDP checks them literally
    """Like torch's default ``allreduce_hook`` (divide, then sum), but timed by labkit.comm."""
    flat = bucket.buffer().div_(sync.dp)
    return comm.all_reduce_future(flat, sync.group, name=f"ddp bucket {bucket.index()}")
