"""Local CSR blocks over a subset of destination rows.

A worker that computes only some rows of a propagation needs the in-edges of those
rows, with each source renumbered into the rows it holds locally. ``in_edges`` lists
the in-edges of given destination rows; ``build_block`` turns them into a local CSR
(a ``Block``) whose sources index a given list of local rows followed by a given
list of fetched rows.

Pure numpy / torch functions of the graph: no communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.graph.csr import Graph


@dataclass
class Block:
    """A local CSR: destination rows and their in-edges.

    Attributes:
        graph: CSR with ``num_dst = len(dst)`` and sources indexing the local rows
            followed by the fetched rows.
        eids: (E_b,) global edge ids of the block's edges (CSR order).
        dst_pos: (len(dst),) positions of the destination rows in the local rows
            (an E stage reads the destinations' own rows there).
    """

    graph: Graph
    eids: Tensor
    dst_pos: Tensor

    def to(self, device: torch.device) -> Block:
        """The block on ``device`` (the graph's backward CSR is rebuilt there)."""
        return Block(self.graph.to(device), self.eids.to(device), self.dst_pos.to(device))


def in_edges(graph: Graph, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For destination ``rows``: (indptr, source gids, global edge ids), CSR order."""
    indptr = graph.indptr.numpy()
    starts, stops = indptr[rows], indptr[rows + 1]
    counts = stops - starts
    sub_indptr = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(counts, out=sub_indptr[1:])
    total = int(sub_indptr[-1])
    # eids: for each row, starts[r] + 0..count-1, vectorised
    eids = np.repeat(starts - sub_indptr[:-1], counts) + np.arange(total, dtype=np.int64)
    return sub_indptr, graph.indices.numpy()[eids].astype(np.int64), eids


def build_block(graph: Graph, dst: np.ndarray, cur: np.ndarray, fetched: np.ndarray,
                scratch: np.ndarray | None = None, *, local_first: bool = False) -> Block:
    """Local CSR of ``dst`` with sources indexed in ``cur`` then ``fetched``.

    Every source of an in-edge of ``dst``, and every row of ``dst``, must be in
    ``cur`` or ``fetched``.

    Args:
        graph: the global graph (CSR by destination).
        dst: gids of the destination rows, in block order.
        cur: gids of the local rows (source positions ``0..len(cur)-1``).
        fetched: gids of the fetched rows (positions after the local ones).
        scratch: optional (num_src,) int64 work array, reused across calls.
        local_first: list each row's in-edges from local rows before those from
            fetched rows, each group in CSR order (default: CSR order throughout), so
            that a kernel can read the two groups from two buffers
            (``ops.spmm.spmm_split``) instead of one buffer joining them.

    Returns:
        The Block.
    """
    if scratch is None:
        scratch = np.zeros(graph.num_src, dtype=np.int64)
    sub_indptr, src, eids = in_edges(graph, dst)
    scratch[cur] = np.arange(cur.size)
    scratch[fetched] = cur.size + np.arange(fetched.size)
    local_src = scratch[src]
    if local_first and fetched.size:
        order = _local_first_order(sub_indptr, local_src >= cur.size)
        local_src, eids = local_src[order], eids[order]
    dst_pos = scratch[dst].copy()
    block = Graph(torch.from_numpy(sub_indptr), torch.from_numpy(local_src),
                  num_src=cur.size + fetched.size, validate=False)
    return Block(block, torch.from_numpy(eids), torch.from_numpy(dst_pos))


def _local_first_order(indptr: np.ndarray, fetched: np.ndarray) -> np.ndarray:
    """The edge order that lists each row's edges with ``fetched`` False first, then
    the others, each group in its order: a stable partition of every row, in O(E)."""
    row = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    start = indptr[row]
    before_local = np.concatenate([[0], np.cumsum(~fetched)])  # local edges before each
    before_fetched = np.concatenate([[0], np.cumsum(fetched)])
    edge = np.arange(fetched.size)
    local_in_row = before_local[indptr[1:]] - before_local[indptr[:-1]]
    pos = np.where(fetched,
                   start + local_in_row[row] + before_fetched[edge] - before_fetched[start],
                   start + before_local[edge] - before_local[start])
    order = np.empty_like(pos)
    order[pos] = edge
    return order
