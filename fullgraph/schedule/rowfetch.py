"""The data form of task parallelism's P group (``--group-parallel data``, NeutronTask
section 4.3, Fig. 7): which rows move where when the P group splits its work by rows.

The T group holds contiguous row blocks (``t_offsets``); every P worker owns a
contiguous row range (``p_offsets``) and aggregates only the in-edges of its rows.
Three exchanges, each an ``ExchangeTable``; the hand-offs between the groups are
over the whole communicator (a rank outside the sending or receiving group has
empty entries), the halo inside the P group over the P group's own communicator:

- ``fetch[s]``: before the first P stage of a run, subgraph by subgraph, the T group
  sends every P worker the source rows its piece of subgraph s reads that no earlier
  subgraph read (its halo: neighbours are replicated only in the P group, each once
  per P worker). The rows arrive in ascending id order, so the worker's cache is the
  concatenation of the fetches, and piece s's sources index its first rows.
- ``within``: before a later P stage of the same run, the P workers exchange the
  source rows of their in-edges among themselves (data parallelism's halo), ranked
  by their place in the P group.
- ``to_rows``: before a T or E stage, the P workers hand their rows back to the T
  blocks (each row sent once).

The backward of each is the scatter-add of the gradient rows to their owners in
rank order (``comm.halo``), so results are deterministic.

Pure functions of the graph and the offsets: tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.graph.csr import Graph
from fullgraph.ops.chunked import Ranges


@dataclass
class RowFetch:
    """One rank's side of one grouping of the subgraphs, in the data form.

    Attributes:
        fetch: per subgraph, the T-rows -> P-cache exchange of its first reads.
        pieces: per subgraph, CSR of this rank's destinations in it, sources indexing
            the cache as it stands after that subgraph's fetch.
        piece_edges: per subgraph, positions of the piece's edges among this rank's
            edges (``edge_range`` of the graph used).
        order: this rank's rows in id order, as positions in the pieces' concatenated
            outputs.
        within: the P-rows -> P-halo exchange of the sources of this rank's edges,
            over the P group's ranks (None on a T rank).
        block: CSR of this rank's rows, sources indexing ``within``'s halo.
        edge_range: this rank's edges in the CSR of the graph used.
        keep: the CSR positions (in the whole graph) of the edges the graph used holds
            and their weights' factors; None: every edge.
    """

    fetch: list[ExchangeTable]
    pieces: list[Graph]
    piece_edges: list[Tensor]
    order: Tensor
    within: ExchangeTable | None
    block: Graph
    edge_range: tuple[int, int]
    keep: tuple[Tensor, Tensor] | None = None


def offsets_of(counts: list[int]) -> np.ndarray:
    """Row offsets of contiguous blocks of ``counts`` rows."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def exchange(needs: list[np.ndarray], offsets: np.ndarray, rank: int) -> ExchangeTable:
    """``rank``'s table when each rank q needs the ascending ids ``needs[q]`` from the
    owners of the contiguous blocks ``offsets`` (the halo is in id order)."""
    world = len(needs)
    lo, hi = int(offsets[rank]), int(offsets[rank + 1])
    send = []
    for q in range(world):
        a, b = np.searchsorted(needs[q], [lo, hi])
        send.append(torch.from_numpy(needs[q][a:b] - lo))
    bounds = np.searchsorted(needs[rank], offsets)
    return ExchangeTable(send, [int(n) for n in np.diff(bounds)])


def _sources(indptr: np.ndarray, indices: np.ndarray, ranges: Ranges) -> np.ndarray:
    parts = [indices[indptr[a]:indptr[b]] for a, b in ranges]
    return np.concatenate(parts) if parts else indices[:0]


def _csr(indptr: np.ndarray, ranges: Ranges, src: np.ndarray, num_src: int) -> Graph:
    """CSR of the destinations ``ranges`` whose edges read the local sources ``src``."""
    ptr = [np.zeros(1, dtype=np.int64)]
    for a, b in ranges:
        ptr.append(indptr[a + 1:b + 1] - indptr[a] + ptr[-1][-1])
    return Graph(torch.from_numpy(np.concatenate(ptr)), torch.from_numpy(src.astype(np.int64)),
                 num_src=num_src, validate=False)


def clip(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """``ranges`` clipped to ``[lo, hi)``, empty ones dropped."""
    out = [(max(a, lo), min(b, hi)) for a, b in ranges]
    return [(a, b) for a, b in out if b > a]


def first_reads(indptr: np.ndarray, indices: np.ndarray, groups: list[Ranges], lo: int,
                hi: int) -> list[np.ndarray]:
    """Per subgraph, the ascending sources that the rows ``[lo, hi)`` in it read and
    that no earlier subgraph's rows in ``[lo, hi)`` read."""
    seen = np.zeros(0, dtype=np.int64)
    out = []
    for ranges in groups:
        src = np.unique(_sources(indptr, indices, clip(ranges, lo, hi)))
        fresh = np.setdiff1d(src, seen, assume_unique=True)
        seen = np.union1d(seen, fresh)
        out.append(fresh)
    return out


def row_fetch(graph: Graph, groups: list[Ranges], t_offsets: np.ndarray,
              p_offsets: np.ndarray, rank: int,
              keep: tuple[Tensor, Tensor] | None = None) -> RowFetch:
    """``rank``'s exchanges and blocks for the subgraphs ``groups`` (each a list of
    ascending destination ranges; together they cover every vertex).

    Args:
        graph: the graph the P stages aggregate (CSR by destination).
        groups: the subgraphs' destination ranges, in pipeline order.
        t_offsets, p_offsets: ``world + 1`` offsets of the T blocks and of the P
            ranges (a rank outside a group has an empty block).
        rank: this rank; the P group is the ranks with a P range, the last ranks.
        keep: recorded in the result (see ``RowFetch``).
    """
    indptr = graph.indptr.numpy().astype(np.int64)
    indices = graph.indices.numpy().astype(np.int64)
    world = len(t_offsets) - 1
    firsts = [first_reads(indptr, indices, groups, int(p_offsets[q]), int(p_offsets[q + 1]))
              for q in range(world)]
    fetch = [exchange([f[s] for f in firsts], t_offsets, rank) for s in range(len(groups))]
    lo, hi = int(p_offsets[rank]), int(p_offsets[rank + 1])
    cache = np.concatenate(firsts[rank]) if groups else indices[:0]
    position = np.full(graph.num_src, -1, dtype=np.int64)
    position[cache] = np.arange(cache.size)
    pieces, piece_edges, rows = [], [], []
    cached = 0
    for s, ranges in enumerate(groups):
        mine = clip(ranges, lo, hi)
        cached += firsts[rank][s].size
        pieces.append(_csr(indptr, mine, position[_sources(indptr, indices, mine)], cached))
        edges = [np.arange(indptr[a], indptr[b]) - indptr[lo] for a, b in mine]
        piece_edges.append(torch.from_numpy(np.concatenate(edges) if edges
                                            else np.zeros(0, dtype=np.int64)))
        rows += [np.arange(a, b) for a, b in mine]
    order = np.argsort(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)
    within, block = _within(indptr, indices, p_offsets, rank)
    return RowFetch(fetch, pieces, piece_edges, torch.from_numpy(order), within, block,
                    (int(indptr[lo]), int(indptr[hi])), keep)


def _within(indptr: np.ndarray, indices: np.ndarray, p_offsets: np.ndarray,
            rank: int) -> tuple[ExchangeTable | None, Graph]:
    """The halo exchange inside the P group (ranked by place in it) and the block of
    this rank's rows over its halo; None and an empty block on a T rank."""
    lo, hi = int(p_offsets[rank]), int(p_offsets[rank + 1])
    own = [(lo, hi)] if hi > lo else []
    first_p = int(np.searchsorted(p_offsets, 0, side="right")) - 1  # the first P rank
    if rank < first_p:
        return None, _csr(indptr, own, indices[:0], 0)
    group = p_offsets[first_p:]
    needs = [np.unique(indices[indptr[a]:indptr[b]]) for a, b in zip(group[:-1], group[1:])]
    halo = needs[rank - first_p]
    block = _csr(indptr, own, np.searchsorted(halo, _sources(indptr, indices, own)), halo.size)
    return exchange(needs, group, rank - first_p), block


def to_rows(t_offsets: np.ndarray, p_offsets: np.ndarray, rank: int) -> ExchangeTable:
    """``rank``'s table of the hand-off from the P ranges back to the T blocks."""
    world = len(t_offsets) - 1
    needs = [np.arange(t_offsets[q], t_offsets[q + 1], dtype=np.int64) for q in range(world)]
    return exchange(needs, p_offsets, rank)


def fetch_to(fetch: RowFetch, device: torch.device) -> RowFetch:
    """``fetch`` with its graphs and index tensors on ``device``."""
    if device.type == "cpu":
        return fetch
    keep = None if fetch.keep is None else (fetch.keep[0].to(device), fetch.keep[1].to(device))
    return RowFetch([t.to(device) for t in fetch.fetch], [g.to(device) for g in fetch.pieces],
                    [e.to(device) for e in fetch.piece_edges], fetch.order.to(device),
                    None if fetch.within is None else fetch.within.to(device),
                    fetch.block.to(device), fetch.edge_range, keep)
