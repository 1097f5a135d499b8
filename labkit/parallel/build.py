"""A run on one rank: the spec that travels from the notebook, and the builder that composes
strategies into a job, in one commented order.

Order of composition (as picotron and torchtitan do it): pipeline split (which blocks live on
this rank) → data parallelism over the ranks holding the same blocks. Tensor parallelism and
ZeRO would slot in before and after the pipeline split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Strategy
from ..record.instrument import ActivationMeter, instrument_backward
from .data.sync import build_grad_sync
from ..models.training import build_model, build_optimizer, resolve_data, resolve_loss


@dataclass
class RunSpec:
    """Everything a rank needs to build its part of a run (pickled to the engines)."""

    strategy: Strategy
    model: Any
    data: Any = None
    loss: Any = "mse"
    batch: int = 64
    steps: int = 5
    lr: float = 0.1
    momentum: float = 0.0
    seed: int = 0
    record: bool = True
    extra: dict = field(default_factory=dict)


def build_job(spec: RunSpec, groups, recorder, device):
    """This rank's job for ``spec``, on the groups already built for its degrees."""
    if spec.strategy.pp > 1:
        from .pipeline.stages import PipelineJob
        return PipelineJob(spec, groups, recorder, device)
    return DataParallelJob(spec, groups, recorder, device)


def shard(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rows ``index``/``parts`` of the global batch (equal shares, so means average exactly)."""
    size = x.shape[0] // parts
    return x[index * size:(index + 1) * size]


class DataParallelJob:
    """The whole model on every rank; gradients averaged over dp by the chosen mode."""

    def __init__(self, spec: RunSpec, groups, recorder, device):
        self.spec, self.recorder, self.device = spec, recorder, device
        s = spec.strategy
        self.dp_index = groups.coords[0]
        model = build_model(spec.model, spec.seed).to(device)
        self.data = resolve_data(spec.data, model, spec.batch, spec.seed)
        self.loss_fn = resolve_loss(spec.loss)
        self.hooks = instrument_backward(model, recorder)
        self.sync = build_grad_sync(s.dp_mode, groups.dp, s.dp, s.bucket_mb, s.compression, s.error_feedback)
        self.model = model
        self.wrapped = self.sync.wrap(model)
        self.optimizer = build_optimizer(model.parameters(), spec.lr, spec.momentum)
        self.meter = ActivationMeter(list(model.parameters()))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's 1/dp of the step's global batch, on its device."""
        s = self.spec.strategy
        x, y = self.data(step)
        return shard(x, self.dp_index, s.dp).to(self.device), shard(y, self.dp_index, s.dp).to(self.device)

    def step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        s, rec = self.spec.strategy, self.recorder
        x, y = batch
        total = 0.0
        self.meter.start_step()
        for mb, (xm, ym) in enumerate(zip(x.chunk(s.microbatches), y.chunk(s.microbatches))):
            rec.microbatch = mb
            # forward too inside: DDP decides in forward whether this backward reduces
            with self.sync.microbatch(last=mb == s.microbatches - 1):
                with rec.span("fwd", f"F{mb}", microbatch=mb), self.meter.forward(mb, xm) as kept:
                    out = self.wrapped(xm)
                    loss = self.loss_fn(out, ym) / s.microbatches
                    kept.append(out)
                loss.backward()
            self.meter.release(mb)
            total += loss.item()
        rec.microbatch = None
        self.sync.finish()
        with rec.span("optimizer", "SGD step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return {"loss": total, "loss_weight": 1.0, "peak_activation_bytes": self.meter.peak}

    def parameters(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
