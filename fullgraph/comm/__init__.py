"""Communication layer: the only part of fullgraph that calls torch.distributed.

``group`` holds the explicit ``Comm`` handle and the process-group lifecycle,
``subgroup`` the sub-group communicators made by ``Comm.split``, ``primitives``
the timed, byte-counted collectives, ``placement`` the conjugate autograd pairs
that change a tensor's placement, ``exchange`` the P2P tables of halo
exchanges and ``halo`` their asynchronous start / wait forms (and the halo pair). See
docs/architecture.md ("Placements").
"""
from __future__ import annotations

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import (
                                  DEFAULT_TIMEOUT_S,
                                  ByteCounter,
                                  Comm,
                                  destroy_comm,
                                  init_comm,
                                  single_comm,
)
from fullgraph.comm.halo import (
                                  PendingBlocks,
                                  PendingFetch,
                                  PendingReturn,
                                  halo_fetch,
                                  halo_join,
                                  halo_scatter_add,
                                  start_blocks,
                                  start_fetch,
                                  start_return,
)
from fullgraph.comm.placement import (
                                  RowColLayout,
                                  all_reduce_grads,
                                  cols_to_rows,
                                  gather_rows,
                                  rows_to_cols,
)
from fullgraph.comm.primitives import (
                                  CommError,
                                  ReduceOp,
                                  all_gather_object,
                                  all_gather_rows,
                                  all_reduce_,
                                  all_to_all_v,
                                  barrier,
                                  broadcast_,
)
from fullgraph.comm.subgroup import GroupCounter

__all__ = [
    "ByteCounter", "Comm", "CommError", "DEFAULT_TIMEOUT_S", "ExchangeTable", "GroupCounter",
    "PendingBlocks", "PendingFetch", "PendingReturn", "ReduceOp", "RowColLayout",
    "all_gather_object", "all_gather_rows", "all_reduce_", "all_reduce_grads", "all_to_all_v",
    "barrier", "broadcast_", "cols_to_rows", "destroy_comm", "gather_rows", "halo_fetch",
    "halo_join", "halo_scatter_add", "init_comm", "rows_to_cols", "single_comm", "start_blocks",
    "start_fetch", "start_return",
]
