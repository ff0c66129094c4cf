"""A differentiable sum over ranks: column sums of rows spread over workers.

``row_sum(x, comm, rows)`` is the (D,) sum of the first ``rows`` rows of every rank's
(R, D) ``x`` (the rows the rank owns, when it also holds copies of others), the same
on every rank. Backward: the gradient of that sum is needed by every rank's loss, so
each rank's upstream gradient is summed over ranks (again an all-reduce) and handed
to its own rows. Bytes per rank: the ring volume 2 (R - 1) B / R, in each direction.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fullgraph.comm.group import Comm
from fullgraph.comm.primitives import all_reduce_


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, phase: str) -> Tensor:
        ctx.comm, ctx.phase = comm, phase
        return all_reduce_(x.detach().clone().contiguous(), comm, phase)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_reduce_(grad.detach().clone().contiguous(), ctx.comm, ctx.phase), None, None


def all_reduce_sum(x: Tensor, comm: Comm, phase: str) -> Tensor:
    """``x`` summed over all ranks (a new tensor), differentiable."""
    if comm.world_size == 1:
        return x
    return _AllReduceSum.apply(x, comm, phase)


def row_sum(x: Tensor, comm: Comm, rows: int | None = None, phase: str = "row-sum") -> Tensor:
    """(D,) column sums of the first ``rows`` rows of ``x`` (all when None) over all
    ranks, differentiable; each vertex must be among those rows on exactly one rank."""
    local = x.sum(0) if rows is None else x[:rows].sum(0)
    return all_reduce_sum(local, comm, phase)
