"""Halo exchanges over an ``ExchangeTable``, started now and finished later.

One mechanism serves every row exchange that can overlap with computation: the
data-parallel halo fetch (``placement.halo_fetch``, which is ``start_fetch(...)
.wait()``), its conjugate gradient scatter-add, and G3's per-bin pushes, each round
of which is a table with receive positions (``ExchangeTable.recv_pos``).

- ``start_fetch(x_rows, table, comm, phase)`` sends ``x_rows[table.send_idx[p]]`` to
  every peer p; ``wait()`` returns the (H, *F) halo in peer order, or
  ``wait(into)`` writes each peer's rows at ``table.recv_pos[p]`` of ``into``.
- ``start_return(x_halo, table, comm, phase)`` sends halo rows back to their owners
  (the rows at ``recv_pos[p]``, or the p-th block in peer order); ``wait(into)``
  adds them (``index_add_``) at ``table.send_idx[p]`` of the owner rows ``into``, in
  peer order, so the sums are the same on every run.

Bytes are counted under ``phase`` when ``wait`` completes (``PendingExchange``);
with ``world_size == 1`` only the local copy is made and nothing is counted.

Imports only ``primitives`` and ``exchange`` from fullgraph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.primitives import PendingExchange, all_to_all_v_start

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm


def check_table(table: ExchangeTable, comm: Comm) -> None:
    """Raise if ``table`` is not for ``comm``'s world size."""
    if table.world_size != comm.world_size:
        raise ValueError(f"halo exchange: table is for {table.world_size} ranks, comm has "
                         f"{comm.world_size}")


class PendingFetch:
    """A halo fetch in flight (``start_fetch``)."""

    def __init__(self, exchange: PendingExchange, table: ExchangeTable) -> None:
        self._exchange, self._table = exchange, table

    def wait(self, into: Tensor | None = None) -> Tensor:
        """Finish the fetch.

        Args:
            into: the halo buffer; each peer p's rows are written at
                ``table.recv_pos[p]`` (or at its block in peer order). None: a new
                (H, *F) halo in peer order (tables without ``recv_pos`` only).

        Returns:
            ``into``, or the new halo.
        """
        parts = self._exchange.wait()
        if into is None:
            if self._table.recv_pos is not None:
                raise ValueError("PendingFetch.wait: the table has receive positions; pass "
                                 "the halo buffer to write them into (into=...)")
            return torch.cat(parts, dim=0)
        positions = self._table.recv_pos
        offset = 0
        for p, part in enumerate(parts):
            n = self._table.recv_rows[p]
            if positions is None:
                into[offset:offset + n] = part
            elif n:
                into[positions[p]] = part
            offset += n
        return into


class PendingReturn:
    """Halo rows in flight back to their owners (``start_return``)."""

    def __init__(self, exchange: PendingExchange, table: ExchangeTable) -> None:
        self._exchange, self._table = exchange, table

    def wait(self, into: Tensor) -> Tensor:
        """Finish the return: add the rows from each peer p at ``table.send_idx[p]``
        of the owner rows ``into``, in peer order. Returns ``into``."""
        parts = self._exchange.wait()
        for idx, rows in zip(self._table.send_idx, parts):
            if idx.numel():
                into.index_add_(0, idx.to(into.device), rows)
        return into


def start_fetch(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str) -> PendingFetch:
    """Start fetching the rows peers need from this rank's ``x_rows`` (N_r, *F).

    Bytes per rank: sent sum_{p != r} S_p prod(F) s, received sum_{p != r}
    recv_rows[p] prod(F) s (``table.volume_bytes``).
    """
    check_table(table, comm)
    send = [x_rows.index_select(0, idx.to(x_rows.device)) for idx in table.send_idx]
    return PendingFetch(all_to_all_v_start(send, table.recv_rows, comm, phase), table)


def start_return(x_halo: Tensor, table: ExchangeTable, comm: Comm,
                 phase: str) -> PendingReturn:
    """Start sending halo rows (e.g. gradients) back to the ranks that own them.

    ``x_halo`` holds the halo (H, *F) in peer order, or, for a table with
    ``recv_pos``, a buffer the positions index. Bytes: the reverse of
    ``start_fetch`` on the same table.
    """
    check_table(table, comm)
    if table.recv_pos is None:
        if x_halo.dim() == 0 or x_halo.shape[0] != table.num_halo:
            raise ValueError(f"halo return: rank {comm.rank} expected {table.num_halo} halo "
                             f"rows from the table, got shape {tuple(x_halo.shape)}")
        send = list(torch.split(x_halo.contiguous(), table.recv_rows))
    else:
        send = [x_halo.index_select(0, pos.to(x_halo.device)) for pos in table.recv_pos]
    return PendingReturn(all_to_all_v_start(send, table.send_rows(), comm, phase), table)
