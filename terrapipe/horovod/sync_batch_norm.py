"""Batch normalization over the batch of every rank of a process set (horovod.torch.SyncBatchNorm)."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from . import basics
from .basics import ProcessSet, global_process_set
from .mpi_ops import Sum, allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole batch across the ranks of
    ``process_set``: per channel, the ranks' counts, sums and sums of squares are summed with one
    differentiable allreduce (so gradients flow across ranks as well), accumulated in float64.
    Input: (N, C, ...) of any float dtype. In eval mode, or alone, it is plain BatchNorm."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"input: expected {self.num_features} channels in dimension 1, "
                             f"got {input.shape[1]}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        ps = self.process_set or global_process_set
        if not self.training or ps.size() == 1 or not basics.is_initialized():
            use_batch = self.training or not self.track_running_stats
            return torch.nn.functional.batch_norm(
                input, self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch, factor, self.eps)
        c = self.num_features
        dims = [0, *range(2, input.dim())]
        x = input.double()
        count = torch.full((1,), input.numel() / c, dtype=torch.float64, device=input.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = allreduce(stats, op=Sum, name=None, process_set=ps)
        total = stats[2 * c]
        mean = stats[:c] / total
        var = (stats[c:2 * c] / total - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1)) if total > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, c] + [1] * (input.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        y = y.to(input.dtype)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
