"""Batch norm over the whole global batch: the statistics of every dp replica's rows at once.

Batch norm normalises each channel by the mean and variance of the rows in the batch (Ioffe &
Szegedy 2015, Alg. 1). Under data parallelism each replica holds 1/dp of the rows, so plain
``nn.BatchNorm*`` normalises by a smaller, different sample on every replica: the model is not
the single-process one. torch's ``nn.SyncBatchNorm`` all-reduces the statistics, but only on
GPUs; this is the same idea written out, for any backend, through ``labkit.comm``:

* forward: one all-reduce of ``[Σx, Σx², count]`` per channel, then mean = Σx/n and
  var = Σx²/n − mean² (biased, as batch norm normalises);
* backward: autograd differentiates through that all-reduce, whose backward is an all-reduce
  of the gradients (a sum's gradient reaches every summand), so each replica's gradient
  includes what its rows did to everyone's statistics;
* running statistics take the unbiased variance, var · n/(n−1), as ``nn.BatchNorm`` does.

Names, parameters and buffers stay those of ``nn.BatchNorm*``, so ``state_dict`` keys match.

>>> model = build_sync_batchnorm(model, groups.dp)   # before wrapping in a gradient sync
"""
from __future__ import annotations

import torch
from torch import nn

from ... import comm


class _SumOverReplicas(torch.autograd.Function):
    """Forward: all-reduce sum over ``group``; backward: all-reduce sum of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group, name="batchnorm statistics")
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group, name="batchnorm statistics grad")
        return grad, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` whose training statistics cover every replica in ``group``."""

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, group):
        super().__init__(source.num_features, source.eps, source.momentum, source.affine,
                         source.track_running_stats)
        self.load_state_dict(source.state_dict())
        self.group = group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"batch norm expects (rows, channels, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        self._check_input_dim(x)
        c, dims = x.shape[1], [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / c], dtype=x.dtype, device=x.device)
        total = _SumOverReplicas.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]), self.group)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(n.detach()))
        return y

    @torch.no_grad()
    def _update_running(self, mean, var, n: float) -> None:
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(var * (n / max(n - 1, 1)), alpha=m)


def build_sync_batchnorm(model: nn.Module, group) -> nn.Module:
    """Replace every batch-norm layer of ``model`` (in place) by :class:`SyncBatchNorm`."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, SyncBatchNorm):
            setattr(model, name, SyncBatchNorm(child, group).to(next(child.buffers(), torch.empty(0)).device))
        else:
            build_sync_batchnorm(child, group)
    return model
