"""Bins for G3's multi-level pipeline: priority order and bin sizes (G3 §5.1, §5.3).

Step 1 (priority list): a worker visits its partition breadth-first, component by
component (each from its lowest id), then moves the vertices that have neighbours
in other parts (boundary vertices: their outputs are what peers wait for) to the
front, keeping the BFS order within both groups. Step 2 (bin size limit): half the
device budget divided by a vertex's memory in the layer (input and output rows).
Step 3 (index-based packing): consecutive runs of the priority list, each at most
the limit. BFS order keeps neighbours close, so a bin's in-edges mostly stay inside.

``build_schedule`` turns these into the whole multi-level schedule of the P2P
executor: per phase and part the bins, the exchange round of every row, and how
long each bin waits for its peers' rows (forward) and gradients (backward).

Pure functions of the graph and the partition: tested without processes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def boundary_mask(graph: Graph, vertices: Tensor, part_of: Tensor,
                  direction: str = "both") -> Tensor:
    """True for the ``vertices`` with a neighbour in another part.

    ``direction``: ``"out"`` counts only out-neighbours (the vertices whose rows other
    parts read), ``"both"`` in- and out-neighbours (default).
    """
    if direction not in ("out", "both"):
        raise ValueError(f"direction must be 'out' or 'both', got {direction!r}")
    src, dst = graph.edges()
    cross = part_of[src] != part_of[dst]
    touched = torch.zeros(graph.num_dst, dtype=torch.bool)
    touched[src[cross]] = True
    if direction == "both":
        touched[dst[cross]] = True
    return touched[vertices]


def priority_order(graph: Graph, owned: Tensor, part_of: Tensor,
                   read_remotely: Tensor | None = None) -> Tensor:
    """G3 Step 1: BFS order with the vertices other parts read (remote out-neighbours)
    moved to the front. ``read_remotely``: (N,) bool, those vertices, when known
    (default: from ``graph``'s edges, which must then be all of them)."""
    order = bfs_order(graph, owned)
    boundary = (boundary_mask(graph, order, part_of, "out") if read_remotely is None
                else read_remotely[order])
    return torch.cat([order[boundary], order[~boundary]])


def bin_limit(budget_bytes: int, in_dim: int, out_dim: int, itemsize: int = 4) -> int:
    """G3 Step 2: vertices per bin, half the budget over a vertex's input + output rows."""
    per_vertex = (in_dim + out_dim) * itemsize
    return max(1, (budget_bytes // 2) // max(1, per_vertex))


def pack_bins(order: Tensor | np.ndarray, limit: int) -> list:
    """G3 Step 3: consecutive runs of the priority list, ``limit`` vertices at most."""
    if limit < 1:
        raise ValueError(f"a bin holds at least one vertex, got limit {limit}")
    return [order[i:i + limit] for i in range(0, len(order), limit)]


# ---------------------------------------------------------------- multi-level schedule
@dataclass(frozen=True)
class ScheduleMode:
    """What a P2P schedule overlaps (G3 §5.2, the variants of Fig. 17).

    Attributes:
        priority: bins follow the priority list (BFS, boundary first); else vertex ids.
        eager: a worker computes a bin as soon as the rows it reads from peers have
            arrived (inter-layer pipeline); else it waits for all of them first.
        per_bin: each bin's rows are pushed as soon as the bin is computed, one
            exchange round per bin; else once per layer, after the last bin.
        prefetch: the next bin's input rows are loaded while the current one is
            computed (intra-layer pipeline).
    """

    priority: bool
    eager: bool
    per_bin: bool
    prefetch: bool


SCHEDULES = {
    "sequential": ScheduleMode(priority=False, eager=False, per_bin=False, prefetch=False),
    "inter-layer": ScheduleMode(priority=False, eager=True, per_bin=True, prefetch=False),
    "intra-layer": ScheduleMode(priority=True, eager=False, per_bin=True, prefetch=True),
    "multi-level": ScheduleMode(priority=True, eager=True, per_bin=True, prefetch=True),
}


@dataclass
class PhaseBins:
    """The bins of one phase (the stages between two exchanges) on every part.

    Exchange rounds: during phase k every worker issues ``rounds`` forward rounds
    (round j carries the rows of its bin j; bins it lacks send nothing), and during
    the backward of phase k the same number of gradient rounds (round t carries the
    gradients completed by its t-th backward bin). Every worker issues the same
    rounds in the same order, so they match as collectives.

    Attributes:
        bins: per part, the bins (int64 gid arrays) in forward order.
        fwd_wait: per part, (B_p,) the last round of the previous phase's pushes that
            bin b reads from (-1: none).
        bwd_order: per part, bin indices in backward order.
        bwd_wait: per part, (B_p,) by bin index, the last gradient round of the next
            phase that bin b's output gradients need (-1: none).
        rounds: exchange rounds per direction of this phase.
        round_of: (N,) the forward round that pushes each vertex's output row.
        step_of: (N,) the backward step (position in ``bwd_order``) of each vertex's bin.
    """

    bins: list[list[np.ndarray]]
    fwd_wait: list[np.ndarray]
    bwd_order: list[np.ndarray]
    bwd_wait: list[np.ndarray]
    rounds: int
    round_of: np.ndarray
    step_of: np.ndarray


def _segment_max(indptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per CSR row, the max of ``values`` over its entries (-1 for an empty row)."""
    rows = indptr.size - 1
    out = np.full(rows, -1, dtype=np.int64)
    nonempty = indptr[1:] > indptr[:-1]
    if values.size:
        red = np.maximum.reduceat(values, indptr[:-1][nonempty]) if nonempty.any() else values[:0]
        out[nonempty] = red
    return out


def remote_in_max(graph: Graph, part_of: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per vertex v, max of ``value[u]`` over in-edges u -> v from other parts (-1: none)."""
    src, dst = (t.numpy() for t in graph.edges())
    vals = np.where(part_of[src] != part_of[dst], value[src], -1)
    return _segment_max(graph.indptr.numpy(), vals)


def remote_out_max(graph: Graph, part_of: np.ndarray, value: np.ndarray,
                   dst_mask: np.ndarray | None = None) -> np.ndarray:
    """Per vertex u, max of ``value[v]`` over out-edges u -> v into other parts (-1:
    none); with ``dst_mask``, over the edges into the vertices it marks only."""
    src, dst = (t.numpy() for t in graph.edges())
    cross = part_of[src] != part_of[dst]
    if dst_mask is not None:
        cross &= dst_mask[dst]
    out = np.full(graph.num_dst, -1, dtype=np.int64)
    np.maximum.at(out, src[cross], value[dst[cross]])
    return out


def _bin_max(bins: list[np.ndarray], value: np.ndarray) -> np.ndarray:
    return np.array([int(value[b].max()) if b.size else -1 for b in bins], dtype=np.int64)


ReduceMax = Callable[[np.ndarray], np.ndarray]
"""Elementwise max of an int64 array over the workers that build parts of a
schedule (every worker calls it with the same shape, in the same order)."""


def _same(values: np.ndarray) -> np.ndarray:
    return values


def build_schedule(graph: Graph, part_of: Tensor, num_parts: int, limits: list[int],
                   mode: ScheduleMode, parts: Sequence[int] | None = None,
                   reduce_max: ReduceMax | None = None) -> list[PhaseBins]:
    """Bins, rounds and waits of every phase on every part (G3 §5.3 steps 1-3).

    Phase 0 reads only local rows; phase k >= 1 starts with a stage that reads the
    rows of remote in-neighbours pushed during phase k-1. A vertex of phase k is
    ready once every remote in-neighbour's round has arrived; with ``mode.eager`` the
    vertices are ordered by readiness first (stable, so the base order breaks ties),
    then packed into runs of ``limits[k]`` vertices. The backward visits the bins in
    reverse, the ones whose output gradients are all local (or arrive first) first.

    A pure function of its arguments: every worker computes the same schedule.
    Built in pieces: with ``parts`` a worker builds the bins of those parts only, from
    ``graph`` holding the in-edges of their vertices (those of other vertices may be
    missing, as on a per-part shard), and ``reduce_max`` combines the per-vertex
    values that cross parts (the rounds rows are pushed in, the steps their gradients
    return in, which vertices other parts read) with the other workers'. The bins of
    the parts built equal the whole-graph schedule's; ``round_of`` and ``step_of``
    cover every vertex either way.

    Args:
        graph: the propagation graph (CSR by destination).
        part_of: (N,) part of each vertex.
        num_parts: number of parts.
        limits: per phase, the most vertices in a bin.
        mode: what overlaps (see ``SCHEDULES``).
        parts: the parts to build (default: all, from the whole ``graph``).
        reduce_max: with ``parts``, the max over the workers building the others
            (default: none, ``parts`` must then be all of them).

    Returns:
        One ``PhaseBins`` per phase; ``bins`` etc. are empty for parts not built.
    """
    part_np = part_of.numpy().astype(np.int64)
    built = list(range(num_parts)) if parts is None else sorted(set(parts))
    reduce = _same if reduce_max is None else reduce_max
    if reduce_max is None and len(built) != num_parts:
        raise ValueError(f"building parts {built} of {num_parts} needs reduce_max to learn "
                         "the others' rounds")
    mine = np.isin(part_np, built)
    src, dst = (t.numpy() for t in graph.edges())
    cross = (part_np[src] != part_np[dst]) & mine[dst]
    flags = np.zeros(graph.num_dst, dtype=np.int64)
    flags[src[cross]] = 1
    read_remotely = torch.from_numpy(reduce(flags) > 0)
    base: list[np.ndarray | None] = [None] * num_parts
    for p in built:
        owned = torch.from_numpy(np.flatnonzero(part_np == p))
        base[p] = (priority_order(graph, owned, part_of, read_remotely) if mode.priority
                   else owned).numpy()
    phases: list[PhaseBins] = []
    ready = np.full(graph.num_dst, -1, dtype=np.int64)
    for k, limit in enumerate(limits):
        if limit < 1:
            raise ValueError(f"phase {k}: a bin holds at least one vertex, got limit {limit}")
        if k:
            ready = remote_in_max(graph, part_np, phases[-1].round_of)
        phases.append(_forward_bins(base, ready, limit, mode, mode.eager and k > 0, reduce))
    for k in range(len(phases) - 1, -1, -1):
        need = (reduce(remote_out_max(graph, part_np, phases[k + 1].step_of, mine))
                if k + 1 < len(phases) else np.full(graph.num_dst, -1, dtype=np.int64))
        _backward_order(phases[k], need, mode, reduce)
    return phases


def _forward_bins(base: list[np.ndarray | None], ready: np.ndarray, limit: int,
                  mode: ScheduleMode, eager: bool, reduce: ReduceMax) -> PhaseBins:
    """One phase's bins and their waits, each built part's vertices from ``base`` (by
    readiness first when ``eager``) packed ``limit`` at a time."""
    n = ready.shape[0]
    bins: list[list[np.ndarray]] = []
    waits: list[np.ndarray] = []
    round_of = np.zeros(n, dtype=np.int64)
    for order in base:
        if order is None:  # built elsewhere
            bins.append([])
            waits.append(np.empty(0, dtype=np.int64))
            continue
        if eager:
            order = order[np.argsort(ready[order], kind="stable")]
        part_bins = pack_bins(order, limit)
        for j, b in enumerate(part_bins):
            round_of[b] = j if mode.per_bin else 0
        bins.append(part_bins)
        waits.append(_bin_max(part_bins, ready))
    most = reduce(np.array([max(len(b) for b in bins)], dtype=np.int64))
    rounds = max(1, int(most[0])) if mode.per_bin else 1
    return PhaseBins(bins, waits, [], [], rounds, reduce(round_of), np.zeros(n, dtype=np.int64))


def _backward_order(ph: PhaseBins, need: np.ndarray, mode: ScheduleMode,
                    reduce: ReduceMax) -> None:
    """Fill ``ph``'s backward waits, bin order and step of each vertex: bins in
    reverse, with ``mode.eager`` those whose output gradients arrive first first."""
    for p in range(len(ph.bins)):
        wait = _bin_max(ph.bins[p], need)
        order = np.arange(len(ph.bins[p]))[::-1].copy()
        if mode.eager:
            order = order[np.argsort(wait[order], kind="stable")]
        ph.bwd_wait.append(wait)
        ph.bwd_order.append(order)
        for t, b in enumerate(order):
            ph.step_of[ph.bins[p][b]] = t if mode.per_bin else 0
    ph.step_of = reduce(ph.step_of)
