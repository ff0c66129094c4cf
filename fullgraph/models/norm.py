"""Batch normalisation over all vertices, as ``torch.nn.BatchNorm1d`` on the full graph.

Full-graph training has one batch: every vertex. The statistics are column sums over
all of them, which the executor provides through ``StageContext.sum_rows`` (a local
sum on one process, an all-reduce where rows are spread over workers), so every
strategy normalises with the same numbers and stays exact.

Training: ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased
variance of the batch, computed in two passes (mean, then the mean squared deviation)
for accuracy; the running mean and the running unbiased variance follow with
``momentum``. Evaluation uses the running statistics. Every worker derives them from
the same global sums, so they stay identical without being synchronised.

Shapes: R rows, D columns.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from fullgraph.models.stages import StageContext

_REPLAY = contextvars.ContextVar("fullgraph_batch_norm_replay", default=False)


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Within: stages run again for their backward pass (recomputation), so batch
    normalisation computes as before but leaves its running statistics as they are
    (updated once per step, by the first run)."""
    token = _REPLAY.set(True)
    try:
        yield
    finally:
        _REPLAY.reset(token)


class GlobalBatchNorm(nn.Module):
    """``BatchNorm1d(dim)`` whose batch is every vertex of the graph.

    Args:
        dim: D, the normalised columns.
        eps: added to the variance (default: 1e-5, as torch).
        momentum: weight of the new statistics in the running ones (default: 0.1).
    """

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        self.dim, self.eps, self.momentum = dim, float(eps), float(momentum)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.running_mean: Tensor
        self.running_var: Tensor
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x: Tensor, ctx: StageContext) -> Tensor:
        if not ctx.training:
            scale = torch.rsqrt(self.running_var + self.eps) * self.weight
            return (x - self.running_mean) * scale + self.bias
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        sums = ctx.sum_rows(torch.cat([x, ones], dim=1))
        count = sums[-1]
        if float(count.detach()) < 2:
            raise ValueError(f"batch normalisation needs at least 2 rows, got {float(count):g}")
        mean = sums[:-1] / count
        centred = x - mean
        var = ctx.sum_rows(centred * centred) / count
        if _REPLAY.get():
            return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            unbiased = var.detach() * (count / (count - 1))
            self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, momentum={self.momentum}"
