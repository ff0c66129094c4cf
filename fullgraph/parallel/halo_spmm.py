"""A P stage over a worker's own rows and its fetched halo, as one autograd step.

``spmm(graph, halo_join(h, table, comm), weight)`` is what data parallelism's P
stages compute: the own rows ``h`` and the halo fetched from the peers joined in
one (N_r + H, D) buffer, then aggregated. ``halo_spmm`` computes the same without
the joined buffer where it can:

- Where the block lists each row's own sources first (``build_block`` with
  ``local_first``), the kernel reads the own rows where they are and the halo from
  a buffer of its own (``ops.spmm.split_aggregate``).
- Where the ranks share one host, the halo arrives through the group's
  shared-memory window (``comm.halo.windowed``): each peer writes its rows straight
  into this rank's window and the kernel reads them there; in the backward, the
  transposed SpMM writes each peer's halo rows' gradient straight into its window.
- Otherwise the halo is joined as ``halo_join`` does, and the backward, which owns
  the sources' gradient (a fresh (N_r + H, D) buffer), adds the returned halo rows
  into its own rows in place (``halo_join``'s backward, handed a gradient it does
  not own, copies them first).

Every path makes the same sums in the same order as the joined one: identical
results. Bytes are those of ``halo_join``: ``phase`` forward, ``phase + "-grad"``
backward. Fixed edge weights only (no weight gradient): attention's edge weights
keep the joined path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fullgraph.comm.halo import check_table, join_rows, start_fetch, start_return, windowed
from fullgraph.ops.spmm import (
    aggregate,
    split_aggregate,
    splits,
    transposed_aggregate,
    transposed_rows_into,
)

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
        ctx.windows = windows = windowed(table, comm, h, phase)
        halo = None if windows is None else windows.fetch(h)
        if halo is not None:
            assert windows is not None
            # the peers wrote this rank's halo into its window: read it there
            try:
                if splits(graph, h, weight):
                    return split_aggregate(graph, h, halo, weight)
                return aggregate(graph, torch.cat([h, halo]), weight, "sum")
            finally:
                windows.release()
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
        graph, table, windows = ctx.graph, ctx.table, ctx.windows
        n = graph.num_src - table.num_halo
        if windows is not None:
            grad_out = grad_out.contiguous()
            # the own rows' gradient in a buffer of its own; each peer's halo rows'
            # straight into its window, then what the peers wrote here added in
            grad = grad_out.new_empty((n, grad_out.shape[1]))
            transposed_rows_into(graph, grad_out, weight, 0, n, grad)
            starts = [n + sum(table.recv_rows[:p]) for p in range(len(table.recv_rows))]
            if windows.give_back(
                    lambda p, block: transposed_rows_into(graph, grad_out, weight, starts[p],
                                                          starts[p] + block.shape[0], block),
                    grad) is not None:
                return grad, None, None, None, None, None
        # a fresh (N_r + H, D) buffer of this function's own: its own rows take the
        # returned halo gradient in place
        grad = transposed_aggregate(graph, grad_out, weight, "sum")
        pending = start_return(grad[n:], table, ctx.comm, f"{ctx.phase}-grad")
        return pending.wait(grad[:n]), None, None, None, None, None
