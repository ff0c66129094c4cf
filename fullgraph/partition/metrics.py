"""Partition quality: the per-part cost factors of G3 section 4.1 and the edge cut.

For part ``i`` owning the vertex set V_i:

- ``vertices[i]`` = |V_i|, the cost of its T stages;
- ``edges[i]`` = |E(V_i)|, the in-edges of V_i, the cost of its P stages;
- ``remote[i]`` = |V_i^remote|, the distinct sources of in-edges of V_i owned by
  other parts: the rows part ``i`` must fetch per layer (DepComm, G3 push).

Totals: ``edge_cut``, the number of (directed, CSR) edges whose endpoints lie in
different parts (an undirected edge stored both ways counts twice), and the
``replication_factor`` ``sum_i (|V_i| + |V_i^remote|) / N``, the rows held per
vertex when every part keeps its remote in-neighbours. ``ratio(name)`` is the
max/min over parts of a per-part quantity (``inf`` when the minimum is 0 and the
maximum is not; 1.0 when both are 0).

Everything is vectorised over edges: one gather of the part of each edge's source
and destination, then one scatter of the cut edges into a (P, N) bitmap (or, when
that bitmap would be large, a sort of (part, source) keys with an adjacent-difference
mask, ~100x faster than ``np.unique`` on 20M int64 keys in numpy 2.4).

This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, E = number of edges, P = number of parts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition.book import PartitionBook

PER_PART = ("vertices", "edges", "remote")
BITMAP_LIMIT = 1 << 28  # bytes of the (P, N) bitmap before switching to sorting


@dataclass(frozen=True)
class PartitionQuality:
    """Cost factors of one partition of one graph.

    Attributes:
        num_nodes: N.
        num_edges: E, directed edges of the CSR.
        num_parts: P.
        vertices: (P,) |V_i|.
        edges: (P,) |E(V_i)|, in-edges of V_i.
        remote: (P,) |V_i^remote|, distinct remote in-neighbours of V_i.
        edge_cut: edges whose endpoints are in different parts.
        replication_factor: ``(sum_i |V_i| + |V_i^remote|) / N``.
    """

    num_nodes: int
    num_edges: int
    num_parts: int
    vertices: tuple[int, ...]
    edges: tuple[int, ...]
    remote: tuple[int, ...]
    edge_cut: int
    replication_factor: float

    def ratio(self, name: str) -> float:
        """max/min over parts of ``vertices``, ``edges`` or ``remote``."""
        if name not in PER_PART:
            raise ValueError(f"name must be one of {PER_PART}, got {name!r}")
        values = getattr(self, name)
        high, low = max(values), min(values)
        if low == 0:
            return 1.0 if high == 0 else math.inf
        return high / low

    @property
    def cut_fraction(self) -> float:
        """``edge_cut / E`` (0.0 for a graph without edges)."""
        return self.edge_cut / self.num_edges if self.num_edges else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict with ``cut_fraction`` and the ratios (``inf`` as "inf")."""
        out = asdict(self)
        out.update({k: list(v) for k, v in out.items() if isinstance(v, tuple)})
        out["cut_fraction"] = self.cut_fraction
        for name in PER_PART:
            value = self.ratio(name)
            out[f"{name}_ratio"] = "inf" if math.isinf(value) else value
        return out


def quality(graph: Graph, book: PartitionBook) -> PartitionQuality:
    """Measure ``book`` on ``graph``.

    Raises:
        ValueError: the book covers another number of vertices than the graph.
    """
    num_nodes, num_parts = graph.num_nodes, book.num_parts
    if book.num_nodes != num_nodes:
        raise ValueError(f"partition book has {book.num_nodes} vertices, the graph "
                         f"{num_nodes}; partition this graph")
    part_of = book.part_of.numpy()
    degree = graph.in_degrees().cpu().numpy()
    src = graph.indices.cpu().numpy()
    src_part = part_of[src]
    dst_part = np.repeat(part_of, degree)
    cut = src_part != dst_part
    cut_dst_part, cut_src = dst_part[cut], src[cut]
    del src_part, dst_part
    remote = _distinct_per_part(cut_dst_part, cut_src, num_parts, num_nodes)
    vertices = book.part_sizes().numpy()
    edges = np.bincount(part_of, weights=degree, minlength=num_parts).astype(np.int64)
    replication = float(num_nodes + remote.sum()) / num_nodes if num_nodes else 0.0
    return PartitionQuality(num_nodes=num_nodes, num_edges=graph.num_edges,
                            num_parts=num_parts, vertices=_ints(vertices),
                            edges=_ints(edges), remote=_ints(remote),
                            edge_cut=int(cut_src.size), replication_factor=replication)


def _distinct_per_part(part: np.ndarray, vertex: np.ndarray, num_parts: int,
                       num_nodes: int) -> np.ndarray:
    """(P,) number of distinct ``vertex`` values paired with each ``part``."""
    if num_parts * num_nodes <= BITMAP_LIMIT:
        seen = np.zeros(num_parts * num_nodes, dtype=bool)
        seen[part * num_nodes + vertex] = True
        return seen.reshape(num_parts, num_nodes).sum(axis=1, dtype=np.int64)
    keys = part * np.int64(num_nodes) + vertex
    keys.sort()
    if keys.size:
        fresh = np.empty(keys.size, dtype=bool)
        fresh[0] = True
        np.not_equal(keys[1:], keys[:-1], out=fresh[1:])
        keys = keys[fresh]
    return np.bincount(keys // num_nodes, minlength=num_parts).astype(np.int64)


def _ints(values: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def format_report(q: PartitionQuality) -> str:
    """A readable table: one row per part, a max/min row, then the totals."""
    header = f"{'part':>7}  {'vertices':>12}  {'in-edges':>14}  {'remote':>12}"
    lines = [header, "-" * len(header)]
    for i in range(q.num_parts):
        lines.append(f"{i:>7}  {q.vertices[i]:>12,}  {q.edges[i]:>14,}  {q.remote[i]:>12,}")
    lines.append("-" * len(header))
    ratios = [f"{r:.3f}" if math.isfinite(r) else "(min 0)" for r in map(q.ratio, PER_PART)]
    lines.append(f"{'max/min':>7}  {ratios[0]:>12}  {ratios[1]:>14}  {ratios[2]:>12}")
    lines.append(f"{'total':>7}  {sum(q.vertices):>12,}  {sum(q.edges):>14,}  "
                 f"{sum(q.remote):>12,}")
    lines.append("")
    lines.append(f"parts {q.num_parts}, vertices {q.num_nodes:,}, edges {q.num_edges:,}")
    lines.append(f"edge cut {q.edge_cut:,} ({100 * q.cut_fraction:.2f}% of edges), "
                 f"replication factor {q.replication_factor:.3f}")
    return "\n".join(lines)
