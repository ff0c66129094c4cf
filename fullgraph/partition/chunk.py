"""Chunk partitioning: each part is one contiguous range of vertex ids.

The partitioner of NeuGraph, ROC and NeutronStar (G3 section 4.1): part ``p`` owns
gids ``[b_p, b_{p+1})``. It costs O(N), keeps the gid order (so ``perm`` is the
identity) and ignores locality, so its edge cut is what the vertex numbering gives.

``balance="vertices"`` gives every part ``N // P`` or ``N // P + 1`` vertices.
``balance="edges"`` weighs vertex ``v`` by ``in_degree(v) + alpha`` (NeutronStar
balances edges plus ``alpha`` times vertices) and puts each boundary at the prefix
whose weight is nearest to ``p / P`` of the total, so every part is within one
heaviest vertex of the ideal weight, unless a boundary had to move to keep every
part non-empty (a few vertices heavier than a whole part).

This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, P = number of parts.
"""
from __future__ import annotations

import warnings
from typing import Literal

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition.book import PartitionBook, check_num_parts

Balance = Literal["vertices", "edges"]
BALANCES = ("vertices", "edges")


def chunk_partition(graph: Graph, num_parts: int, *, seed: int = 0,
                    balance: Balance = "vertices", alpha: float = 0.0) -> PartitionBook:
    """Cut the gid range into ``num_parts`` contiguous, balanced ranges.

    Args:
        graph: a square graph.
        num_parts: P, with ``1 <= P <= N``.
        seed: unused (the result is deterministic); accepted for the common
            partitioner signature (default: 0).
        balance: ``"vertices"`` (equal vertex counts) or ``"edges"`` (equal
            in-edge counts, plus ``alpha`` per vertex) (default: ``"vertices"``).
        alpha: weight of one vertex relative to one in-edge under
            ``balance="edges"`` (default: 0.0).

    Returns:
        A book whose part ``p`` holds the gids ``offsets[p]..offsets[p + 1] - 1``.

    Raises:
        ValueError: ``num_parts`` out of range, unknown ``balance``, negative ``alpha``.
    """
    del seed  # deterministic
    num_nodes = graph.num_nodes
    check_num_parts(num_parts, num_nodes)
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha!r}")
    if balance == "vertices":
        if alpha:
            warnings.warn("chunk_partition: alpha has no effect with balance='vertices'",
                          stacklevel=2)
        bounds = (np.arange(num_parts + 1, dtype=np.int64) * num_nodes) // num_parts
    else:
        weight = graph.in_degrees().cpu().numpy().astype(np.float64) + float(alpha)
        bounds = weighted_bounds(weight, num_parts)
    part_of = np.repeat(np.arange(num_parts, dtype=np.int64), np.diff(bounds))
    return PartitionBook.from_assignment(part_of, num_parts)


def weighted_bounds(weight: np.ndarray, num_parts: int) -> np.ndarray:
    """(P + 1,) boundaries of ``num_parts`` contiguous ranges of near-equal weight.

    Boundary ``p`` is the prefix length whose weight is nearest to ``p / P`` of the
    total, then moved as little as needed to give every range at least one element.
    All-zero weights give equal element counts.

    Args:
        weight: (N,) non-negative weight of each element, ``N >= num_parts``.
        num_parts: P >= 1.
    """
    num_nodes = weight.shape[0]
    if not weight.any():  # nothing to balance: fall back to equal counts
        return (np.arange(num_parts + 1, dtype=np.int64) * num_nodes) // num_parts
    prefix = np.zeros(num_nodes + 1, dtype=np.float64)
    np.cumsum(weight, out=prefix[1:])
    targets = prefix[-1] * np.arange(num_parts + 1, dtype=np.float64) / num_parts
    right = np.clip(np.searchsorted(prefix, targets, side="left"), 1, num_nodes)
    left = right - 1
    nearer_left = targets - prefix[left] <= prefix[right] - targets
    bounds = np.where(nearer_left, left, right).astype(np.int64)
    # Non-empty ranges: c_p = b_p - p must be non-decreasing within [0, N - P].
    steps = np.arange(num_parts + 1, dtype=np.int64)
    slack = np.maximum.accumulate(bounds - steps)
    bounds = np.clip(slack, 0, num_nodes - num_parts) + steps
    bounds[0], bounds[-1] = 0, num_nodes
    return bounds
