"""The chunk grid of task parallelism and its subgraphs (NeutronTask §4.2, Fig. 6).

The vertex set is cut into M chunks (each a slice of every T worker's row block, as
``spread_chunks`` cuts them); block C[i][j] holds the edges from chunk j into chunk
i. The chunks are grouped into S subgraphs, which the hand-offs into the P group are
pipelined over (``schedule/pipeline.py``), subgraph 0 first.

Two dependency modes (Algorithm 1):

- ``exact``: consecutive chunks form each subgraph and every block is aggregated;
  subgraph s reads whatever sources it needs, the pipeline sends each source row once.
- ``regroup`` (approximate, training only): every epoch the M chunks are shuffled
  with a RNG seeded by the epoch's step seed (so every worker and every rerun draws
  the same grouping) and regrouped into S subgraphs; aggregating subgraph s skips the
  blocks whose source chunk belongs to a later subgraph, as Cluster-GCN drops
  between-cluster edges. Subgraph s then reads only rows of subgraphs 0..s, so its
  hand-off sends exactly its own rows. An edge from chunk j into chunk i is used in
  an epoch iff group(j) <= group(i): with probability about (S + 1) / (2S) over
  epochs when i != j, always when i == j. Each kept in-edge's weight is scaled by its
  destination's in-degree over its kept in-degree, so that an aggregation keeps its
  scale when some of its inputs are left out (Cluster-GCN normalises the adjacency of
  the subgraph it keeps for the same reason); without it the early subgraphs' sums
  shrink in training but not in the exact evaluation.

Pure functions of the graph, the chunks and the seed: tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.ops.chunked import Chunk, Ranges, build_chunks
from fullgraph.schedule.pipeline import first_reads

DEPS = ("exact", "regroup")


def chunk_groups(num_chunks: int, num_subgraphs: int, seed: int | None = None) -> list[list[int]]:
    """Chunk indices of each subgraph: near-equal groups, ascending inside a group.

    Args:
        num_chunks: M.
        num_subgraphs: S (at most M).
        seed: None: consecutive chunks (exact mode); else the chunks are shuffled by
            ``numpy.random.default_rng(seed)`` before they are grouped.
    """
    order = np.arange(num_chunks) if seed is None else \
        np.random.default_rng(seed).permutation(num_chunks)
    bounds = np.linspace(0, num_chunks, num_subgraphs + 1).round().astype(np.int64)
    return [sorted(int(c) for c in order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class Subgraphs:
    """One grouping of the chunk grid, ready for the pipeline.

    Attributes:
        chunks: per subgraph, its destinations with the in-edges it aggregates.
        first_reads: ``first_reads(chunks)``: the rows each subgraph's hand-off sends.
        keep: positions (in the whole graph's CSR) of the edges ``chunks`` hold, in
            their CSR order, and the factor each one's weight is scaled by; None when
            every edge is kept.
        groups: the chunk indices of each subgraph.
    """

    chunks: list[Chunk]
    first_reads: list[Tensor]
    keep: tuple[Tensor, Tensor] | None
    groups: list[list[int]]


class ChunkGrid:
    """M chunks of a graph grouped into S subgraphs, exactly or regrouped per epoch.

    Args:
        graph: the whole graph (CSR by destination, host memory).
        chunk_ranges: per chunk, its destination ranges (they cover every vertex).
        num_subgraphs: S, at most the number of chunks.
    """

    def __init__(self, graph: Graph, chunk_ranges: list[Ranges], num_subgraphs: int) -> None:
        if not 1 <= num_subgraphs <= len(chunk_ranges):
            raise ValueError(f"{num_subgraphs} subgraphs need between 1 and "
                             f"{len(chunk_ranges)} chunks")
        self.graph, self.ranges, self.num_subgraphs = graph, chunk_ranges, num_subgraphs
        self.chunk_of = np.empty(graph.num_dst, dtype=np.int64)
        for k, ranges in enumerate(chunk_ranges):
            for a, b in ranges:
                self.chunk_of[a:b] = k
        self._exact: Subgraphs | None = None
        self._last: tuple[int, Subgraphs] | None = None

    @property
    def exact(self) -> Subgraphs:
        """Consecutive chunks grouped, every block kept (built once, when first used)."""
        if self._exact is None:
            groups = chunk_groups(self.num_chunks, self.num_subgraphs)
            self._exact = self.subgraphs(groups, skip=False)
        return self._exact

    @property
    def num_chunks(self) -> int:
        return len(self.ranges)

    def regrouped(self, seed: int) -> Subgraphs:
        """The epoch's shuffled grouping with later-subgraph blocks skipped (cached
        for the last seed)."""
        if self._last is None or self._last[0] != seed:
            groups = chunk_groups(self.num_chunks, self.num_subgraphs, seed)
            self._last = (seed, self.subgraphs(groups, skip=True))
        return self._last[1]

    def grouping(self, seed: int | None) -> tuple[list[Ranges], Graph,
                                                  tuple[Tensor, Tensor] | None]:
        """The subgraphs' destination ranges and the graph they aggregate: consecutive
        chunks and the whole graph (``seed`` None), or the grouping ``seed`` draws with
        the later-subgraph blocks skipped and the ``keep`` of ``Subgraphs``."""
        groups = chunk_groups(self.num_chunks, self.num_subgraphs, seed)
        ranges = [_merged(sorted(r for k in g for r in self.ranges[k])) for g in groups]
        if seed is None:
            return ranges, self.graph, None
        graph, keep = _skip_later(self.graph, self._group_of(groups))
        return ranges, graph, keep

    def subgraphs(self, groups: list[list[int]], skip: bool) -> Subgraphs:
        """The subgraphs made of ``groups`` of chunks, in order; with ``skip``, blocks
        whose source chunk is in a later group than their destination are left out."""
        specs = [_merged(sorted(r for k in g for r in self.ranges[k])) for g in groups]
        graph, keep = self.graph, None
        if skip:
            graph, keep = _skip_later(self.graph, self._group_of(groups))
        chunks = build_chunks(graph, specs)
        return Subgraphs(chunks, first_reads(chunks), keep, groups)

    def _group_of(self, groups: list[list[int]]) -> np.ndarray:
        """The subgraph of every vertex."""
        of_chunk = np.empty(self.num_chunks, dtype=np.int64)
        for s, g in enumerate(groups):
            of_chunk[g] = s
        return of_chunk[self.chunk_of]


def _skip_later(graph: Graph, group: np.ndarray) -> tuple[Graph, tuple[Tensor, Tensor]]:
    """The graph without the edges whose source is in a later subgraph than their
    destination; the CSR positions of the edges kept and their weights' factors
    (in-degree / kept in-degree of their destination)."""
    indptr = graph.indptr.numpy().astype(np.int64)
    indices = graph.indices.numpy().astype(np.int64)
    dst = np.repeat(np.arange(graph.num_dst), np.diff(indptr))
    kept = np.flatnonzero(group[indices] <= group[dst])
    kept_deg = np.bincount(dst[kept], minlength=graph.num_dst)
    ptr = np.concatenate([[0], np.cumsum(kept_deg)])
    sub = Graph(torch.from_numpy(ptr), torch.from_numpy(indices[kept]), num_src=graph.num_src,
                validate=False)
    scale = np.diff(indptr)[dst[kept]] / kept_deg[dst[kept]]
    return sub, (torch.from_numpy(kept), torch.from_numpy(scale))


def _merged(ranges: Ranges) -> Ranges:
    """Sorted ranges with touching neighbours joined."""
    out: Ranges = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
