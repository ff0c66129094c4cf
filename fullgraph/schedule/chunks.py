"""Chunks of destination vertices sized to fit a device-memory budget.

NeutronTP §4.2.1 schedules propagation chunk by chunk: a chunk is a range of
destination vertices with all their in-edges, so every chunk aggregates
independently, and the graph only has to be cut logically (CSR row ranges). A chunk
is streamed to the device with the source rows it reads and its output rows, and in
the backward with its transposed CSR, output gradients and source gradients. With
S <= E distinct sources, itemsize s and 8-byte offsets, every step holds at most

    rows x (8 + D x s)              offsets, output rows / output gradients
    + edges x (12 + s + D x s) + 8  indices and offsets of the transpose, weights,
                                    source rows / source gradients (at most one per edge)

so chunks built under that bound fit the budget whatever the sources' overlap.
``fullgraph.memory.MemoryAccount`` records what is resident, so the peak can be
checked against the budget on any device (on the CPU the budget is enforced by this
accounting alone).
"""
from __future__ import annotations

import numpy as np
from torch import Tensor


def chunk_footprint(rows: int, edges: int, dim: int, itemsize: int = 4) -> int:
    """Upper bound of the device bytes one chunk needs (see the module docstring)."""
    return rows * (8 + dim * itemsize) + edges * (12 + itemsize + dim * itemsize) + 8


def chunk_ranges(indptr: Tensor, budget: int, dim: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Contiguous destination ranges of near-equal footprint, as few as the budget allows.

    Raises:
        ValueError: when a single destination (with its in-edges) exceeds the budget.
    """
    n = int(indptr.numel()) - 1
    return [ranges[0] for ranges in spread_chunks(indptr, [n], dim, itemsize, budget=budget)]


def spread_chunks(indptr: Tensor, row_counts: list[int], dim: int, itemsize: int = 4, *,
                  budget: int | None = None,
                  num_chunks: int | None = None) -> list[list[tuple[int, int]]]:
    """Chunks that each take a slice of every worker's contiguous row block.

    NeutronTP (Algorithm 1, line 2) spreads each chunk's vertices evenly over the
    workers, so every chunk's split and gather is a balanced all-to-all. Every block
    (``row_counts[p]`` rows, in order) is cut at the same local rows, placed so that
    the chunks' footprints are near-equal.

    Args:
        indptr: (N+1,) CSR offsets by destination.
        row_counts: rows of each worker's block; they sum to N.
        dim, itemsize: columns and bytes per value of the propagated rows.
        budget: device bytes a chunk may hold; the fewest chunks that fit are used.
        num_chunks: use exactly this many chunks (cut by rows) instead.

    Returns:
        Per chunk, its ``(start, stop)`` ranges, one per worker with rows in it.

    Raises:
        ValueError: when a single destination (with its in-edges), or one row of every
            worker's block, exceeds the budget.
    """
    ptr = indptr.cpu().numpy().astype(np.int64)
    n = ptr.size - 1
    offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    if offsets[-1] != n:
        raise ValueError(f"row_counts sum to {offsets[-1]}, the graph has {n} rows")
    if num_chunks is not None:
        return _cut(_summed(np.arange(n + 1, dtype=np.int64), offsets), offsets,
                    max(1, num_chunks))
    assert budget is not None, "give a budget or a chunk count"
    # cumulative footprint of rows [0, i); a chunk costs its rows' sum plus 8 bytes
    cum = ptr * (12 + itemsize + dim * itemsize) + np.arange(n + 1, dtype=np.int64) * (
        8 + dim * itemsize)
    row_cost = np.diff(cum)
    if n and int(row_cost.max()) + 8 > budget:
        v = int(row_cost.argmax())
        raise ValueError(f"device memory budget of {budget} bytes cannot hold vertex {v} "
                         f"with its {int(ptr[v + 1] - ptr[v])} in-edges "
                         f"({int(row_cost[v]) + 8} bytes at {dim} columns); raise --device-memory")
    summed = _summed(cum, offsets)
    least = int(np.diff(summed).max(initial=0)) + 8  # one local row of every block
    if least > budget:
        raise ValueError(f"device memory budget of {budget} bytes cannot hold a chunk, which "
                         f"takes a row of each of the {len(row_counts)} workers' blocks "
                         f"({least} bytes at {dim} columns); raise --device-memory to "
                         f"{least} or more")
    count = max(1, int(np.ceil((int(summed[-1]) + 8) / budget)))
    while True:
        cuts = _cuts(summed, count)
        if int(np.diff(summed[cuts]).max(initial=0)) + 8 <= budget or count >= n:
            return _cut(summed, offsets, count)
        count += max(1, count // 16)


def check_one_vertex(indptr: Tensor, dim: int, budget: int,
                     flag: str = "--device-memory") -> None:
    """Refuse a ``budget`` that cannot hold one destination with its in-edges at ``dim``
    float32 columns (``spread_chunks``'s first refusal, whatever the row blocks).

    Raises:
        ValueError: naming the vertex, its bytes and ``flag``.
    """
    try:
        spread_chunks(indptr, [int(indptr.numel()) - 1], dim, 4, budget=budget)
    except ValueError as err:
        raise ValueError(str(err).replace("--device-memory", flag)) from None


def even_ranges(num_rows: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` contiguous ranges of near-equal row counts."""
    bounds = np.linspace(0, num_rows, max(1, num_chunks) + 1).round().astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _summed(cum: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``summed[i]``: the footprint of the first ``i`` rows of every block, added up."""
    lo, sizes = offsets[:-1], np.diff(offsets)
    local = np.arange(int(sizes.max(initial=0)) + 1)
    summed = np.zeros(local.size, dtype=np.int64)
    for start, size in zip(lo, sizes):
        summed += cum[start + np.minimum(local, size)] - cum[start]
    return summed


def _cuts(summed: np.ndarray, count: int) -> np.ndarray:
    """Local rows ``i_0 = 0 < ... <= i_count`` where ``summed`` grows by equal steps."""
    targets = summed[-1] * np.arange(count + 1) / count
    cuts = np.maximum.accumulate(np.searchsorted(summed, targets, side="left"))
    cuts[0], cuts[-1] = 0, summed.size - 1
    return cuts


def _cut(summed: np.ndarray, offsets: np.ndarray, count: int) -> list[list[tuple[int, int]]]:
    """Cut every block at the same local rows ``_cuts(summed, count)``: every chunk
    holds the same rows of every block (within one) and near-equal bytes."""
    lo, sizes = offsets[:-1], np.diff(offsets)
    cuts = _cuts(summed, count)
    chunks = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        ranges = [(int(s + min(a, n)), int(s + min(b, n))) for s, n in zip(lo, sizes)]
        chunks.append([(x, y) for x, y in ranges if y > x])
    return [c for c in chunks if c]
