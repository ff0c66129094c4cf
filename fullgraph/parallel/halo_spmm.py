"""A P stage over a worker's own rows and its fetched halo, as one autograd step.

``spmm(graph, halo_join(h, table, comm), weight)`` is what data parallelism's P
stages compute: the own rows ``h`` and the halo fetched from the peers joined in
one (N_r + H, D) buffer, then aggregated. ``halo_spmm`` computes the same in one
autograd function, so that its backward owns the sources' gradient: computed in a
fresh (N_r + H, D) buffer, its halo rows go back to their owners and what comes
back is added into its own rows in place. ``halo_join``'s backward, handed a
gradient it does not own, copies the own rows first: one pass over them per P
stage and step, saved here.

Same sums in the same order as the joined path, so the results are identical.
Bytes are those of ``halo_join``: ``phase`` forward, ``phase + "-grad"`` backward.
Fixed edge weights only (no weight gradient): attention's edge weights keep the
joined path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fullgraph.comm.halo import check_table, join_rows, start_fetch, start_return
from fullgraph.ops.spmm import aggregate, split_aggregate, splits, transposed_aggregate

if TYPE_CHECKING:
    from fullgraph.comm.exchange import ExchangeTable
    from fullgraph.comm.group import Comm
    from fullgraph.graph.csr import Graph


def halo_spmm(graph: Graph, h: Tensor, weight: Tensor | None, table: ExchangeTable,
              comm: Comm, phase: str = "halo") -> Tensor:
    """``spmm(graph, halo_join(h, table, comm, phase), weight)``, its backward without
    a copy of the own rows' gradient.

    Args:
        graph: the P stage's block, CSR by destination over sources ``[h | halo]``
            (num_src == N_r + table.num_halo).
        h: (N_r, D) this worker's rows, differentiable.
        weight: None or (E,) fixed edge weights (not differentiated).
        table: the halo's exchange table, without receive positions.
        comm, phase: as for ``halo_join``.

    Returns:
        (num_dst, D), differentiable in ``h``.
    """
    check_table(table, comm)
    if table.recv_pos is not None:
        raise ValueError("halo_spmm: the table has receive positions (use start_fetch)")
    if h.dim() != 2 or h.shape[0] + table.num_halo != graph.num_src:
        raise ValueError(f"halo_spmm: rank {comm.rank} has rows {tuple(h.shape)} and "
                         f"{table.num_halo} halo rows for a block of {graph.num_src} sources")
    if weight is not None and weight.requires_grad:
        raise ValueError("halo_spmm: the edge weights are fixed here (no weight gradient)")
    return _HaloSpMM.apply(h, weight, graph, table, comm, phase)


class _HaloSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor | None, graph: Graph,
                table: ExchangeTable, comm: Comm, phase: str) -> Tensor:
        ctx.graph, ctx.table, ctx.comm, ctx.phase = graph, table, comm, phase
        ctx.save_for_backward(weight)
        if splits(graph, h, weight):
            # the own rows stay where they are: the kernel reads them and the halo
            # from two buffers (the block lists each row's own sources first)
            halo = h.new_empty((table.num_halo, *h.shape[1:]))
            return split_aggregate(graph, h, start_fetch(h, table, comm, phase, into=halo).wait(),
                                   weight)
        return aggregate(graph, join_rows(h, table, comm, phase), weight, "sum")

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        # a fresh (N_r + H, D) buffer of this function's own: its own rows take the
        # returned halo gradient in place
        grad = transposed_aggregate(ctx.graph, grad_out, weight, "sum")
        n = grad.shape[0] - ctx.table.num_halo
        pending = start_return(grad[n:], ctx.table, ctx.comm, f"{ctx.phase}-grad")
        return pending.wait(grad[:n]), None, None, None, None, None
