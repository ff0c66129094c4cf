"""Bins for G3's multi-level pipeline: priority order and bin sizes (G3 §5.1, §5.3).

Step 1 (priority list): a worker visits its partition breadth-first, component by
component (each from its lowest id), then moves the vertices that have neighbours
in other parts (boundary vertices: their outputs are what peers wait for) to the
front, keeping the BFS order within both groups. Step 2 (bin size limit): half the
device budget divided by a vertex's memory in the layer (input and output rows).
Step 3 (index-based packing): consecutive runs of the priority list, each at most
the limit. BFS order keeps neighbours close, so a bin's in-edges mostly stay inside.

Pure functions of the graph and the partition: tested without processes.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import connected_components
from torch import Tensor

from fullgraph.graph.csr import Graph


def _induced(graph: Graph, owned: np.ndarray) -> sp.csr_matrix:
    """The undirected subgraph induced by ``owned`` (local ids 0..len(owned)-1)."""
    n = graph.num_dst
    local = np.full(n, -1, dtype=np.int64)
    local[owned] = np.arange(owned.size)
    src, dst = (t.numpy() for t in graph.edges())
    keep = (local[src] >= 0) & (local[dst] >= 0)
    a, b = local[src[keep]], local[dst[keep]]
    m = sp.coo_matrix((np.ones(a.size, dtype=np.int8), (a, b)), shape=(owned.size,) * 2)
    return (m + m.T).tocsr()


def bfs_order(graph: Graph, owned: Tensor) -> Tensor:
    """``owned`` in breadth-first order of their induced subgraph, component by component.

    Each component starts from its lowest-id vertex; within a BFS level vertices keep
    the order they were discovered in.
    """
    own = np.sort(owned.numpy().astype(np.int64))
    if own.size == 0:
        return owned.clone()
    adj = _induced(graph, own)
    _, comp = connected_components(adj, directed=False)
    first = np.full(comp.max() + 1, own.size, dtype=np.int64)
    np.minimum.at(first, comp, np.arange(own.size))
    level = np.full(own.size, -1, dtype=np.int64)
    seq = np.full(own.size, -1, dtype=np.int64)  # discovery sequence number
    frontier = first[first < own.size]
    level[frontier], seq[frontier], counter, depth = 0, np.arange(frontier.size), frontier.size, 0
    indptr, indices = adj.indptr, adj.indices
    while frontier.size:
        depth += 1
        counts = indptr[frontier + 1] - indptr[frontier]
        starts = np.repeat(indptr[frontier] - np.concatenate([[0], np.cumsum(counts)[:-1]]),
                           counts)
        nbrs = indices[starts + np.arange(counts.sum())]
        nbrs = nbrs[level[nbrs] < 0]
        nbrs = nbrs[np.sort(np.unique(nbrs, return_index=True)[1])]  # first discovery wins
        level[nbrs], seq[nbrs] = depth, counter + np.arange(nbrs.size)
        counter += nbrs.size
        frontier = nbrs
    order = np.lexsort((seq, level, first[comp]))
    return torch.from_numpy(own[order])


def boundary_mask(graph: Graph, vertices: Tensor, part_of: Tensor) -> Tensor:
    """True for the ``vertices`` with an in- or out-neighbour in another part."""
    src, dst = graph.edges()
    cross = part_of[src] != part_of[dst]
    touched = torch.zeros(graph.num_dst, dtype=torch.bool)
    touched[src[cross]] = True
    touched[dst[cross]] = True
    return touched[vertices]


def priority_order(graph: Graph, owned: Tensor, part_of: Tensor) -> Tensor:
    """G3 Step 1: BFS order with the boundary vertices moved to the front."""
    order = bfs_order(graph, owned)
    boundary = boundary_mask(graph, order, part_of)
    return torch.cat([order[boundary], order[~boundary]])


def bin_limit(budget_bytes: int, in_dim: int, out_dim: int, itemsize: int = 4) -> int:
    """G3 Step 2: vertices per bin, half the budget over a vertex's input + output rows."""
    per_vertex = (in_dim + out_dim) * itemsize
    return max(1, (budget_bytes // 2) // max(1, per_vertex))


def pack_bins(order: Tensor, limit: int) -> list[Tensor]:
    """G3 Step 3: consecutive runs of the priority list, ``limit`` vertices at most."""
    if limit < 1:
        raise ValueError(f"a bin holds at least one vertex, got limit {limit}")
    return list(torch.split(order, limit)) if order.numel() else []
