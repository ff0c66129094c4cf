"""Random partitioning: a seeded uniform assignment with equal part sizes.

A seeded permutation of the gids is cut into ``num_parts`` near-equal pieces
(``N // P`` or ``N // P + 1`` vertices each), so every part is a uniform random
vertex subset. It is the locality-free baseline: in expectation a fraction
``1 - 1/P`` of the edges is cut. The same seed gives the same book on any machine
(numpy's PCG64 ``default_rng``).

This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, P = number of parts.
"""
from __future__ import annotations

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition.book import PartitionBook, check_num_parts


def random_partition(graph: Graph, num_parts: int, *, seed: int = 0) -> PartitionBook:
    """Assign the vertices to ``num_parts`` equal-sized parts uniformly at random.

    Args:
        graph: a square graph (only its vertex count is used).
        num_parts: P, with ``1 <= P <= N``.
        seed: seed of the permutation (default: 0).

    Raises:
        ValueError: ``num_parts`` out of range.
    """
    num_nodes = graph.num_nodes
    check_num_parts(num_parts, num_nodes)
    order = np.random.default_rng(seed).permutation(num_nodes)
    bounds = (np.arange(num_parts + 1, dtype=np.int64) * num_nodes) // num_parts
    part_of = np.empty(num_nodes, dtype=np.int64)
    part_of[order] = np.repeat(np.arange(num_parts, dtype=np.int64), np.diff(bounds))
    return PartitionBook.from_assignment(part_of, num_parts)
