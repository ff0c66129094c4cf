"""G3's locality-aware iterative partitioner (Wan et al., G3, section 4.2, Algorithm 1).

Stage 1 is a multi-constraint METIS partition, weights ``(1, in_degree)``: it balances
|V_i| and the in-edges of every part (G3 equations 1-2) while minimising the cut (a
proxy for equation 3). Stage 2 balances |V_i^remote|, the distinct vertices outside
part ``i`` with an out-edge into it (equation 4): while ``min_i |V_i^remote| <
(1 - threshold) * max_i |V_i^remote|`` it takes the part ``a`` with the most remote
vertices and the part ``b`` with the fewest (lowest index on ties) and swaps a vertex
of ``a`` with one of ``b``, so every |V_i| keeps its stage-1 value exactly.

How Algorithm 1 is read here (the paper leaves these open):

- Line 10, "remote neighbours of v", is the exact drop of |V_a^remote| when ``v``
  leaves ``a``: the in-neighbours ``u`` of ``v`` outside ``a`` whose only out-edge
  into ``a`` goes to ``v``, minus 1 when ``v`` itself then becomes remote to ``a``.
  (The raw count of remote in-neighbours overstates the effect whenever other
  vertices of ``a`` share them, as R-MAT hubs' in-neighbours mostly are.)
- Line 11, |N(v) - V_max|, is the exact growth of |V_a^remote| if ``v`` joins ``a``:
  in-neighbours of ``v`` outside ``a`` not yet remote to ``a``, minus 1 when ``v`` is
  remote to ``a`` now. ``v_min`` is the vertex of ``b`` minimising it.
- ``v_max`` is chosen among the ``candidates`` vertices of ``a`` with the highest
  line-10 score: those predicted to lower ``max(|V_a^remote|, |V_b^remote|)`` are
  tried in order of the remote vertices they add to ``b`` per remote vertex they take
  from ``a`` (fewest first). ``candidates=1`` is the literal line 10; over METIS
  partitions of Cora, Coauthor CS and a 3000-vertex R-MAT graph (P = 2..16, 3 seeds)
  it missed "max/min closer to 1 than METIS, total at most 10% above" 15 times in
  45, against 5 with 64 candidates (all on the total: +11% on Cora at P = 8, +36
  to 43% on the R-MAT graph at P = 16, where METIS's max/min is 5 to 6).
- Cycles: a swap is kept only when it lowers ``max(|V_a^remote|, |V_b^remote|)``
  below the old maximum, else it is undone and the next candidate is tried; when none
  is left stage 2 stops (``"no_improvement"``). Each kept swap lowers the descending
  sorted vector of |V_i^remote| lexicographically, so no state can recur.
- In-edges are not re-balanced by stage 2 (the paper gives no bound):
  ``quality(graph, book).ratio("edges")`` reports them.

Fast neighbour tracking (section 4.2): ``count[i, u]`` is the number of out-edges of
``u`` into part ``i`` (the paper's in-partition degree), so ``u`` is in V_i^remote iff
``part[u] != i and count[i, u] > 0``. ``xor[i, u]``, the XOR of those out-neighbours,
names the last one when ``count[i, u] == 1``, so the line-10 scores stay exact with
O(1) work per changed counter. Moving ``v`` from ``a`` to ``b`` costs O(d_in(v) +
d_out(v) + P) updates, plus d_out(u) for each in-neighbour ``u`` that enters or leaves
the remote set of ``a`` or ``b`` (the line-11 scores of ``u``'s out-neighbours move).
The scores live in bucket lists, FM-style (one per part for line 10, one per ordered
pair of parts for line 11; keys above ``NUM_BUCKETS - 2`` share the last bucket,
which is scanned), so a pick is O(1) amortised and an iteration is O(candidates)
plus its moves: two, and four more per tried swap that is undone. Memory: O(P * N)
int32 counters and list links, and both adjacencies.

Self-loops and repeated edges change no remote set and are dropped first. Stage 2 is
deterministic: ``seed`` only reaches stage 1. It runs compiled with numba when
installed; otherwise the same kernels run as plain Python (same result, slow).

This module must not import torch.distributed or anything above the partition layer.

The counters and kernels live in ``g3_tracking``.

Shapes: N = number of vertices, E = number of edges, P = number of parts.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition import register_partitioner
from fullgraph.partition.book import PartitionBook, check_num_parts
from fullgraph.partition.g3_tracking import (
    _BUDGET,
    CHUNK_SWAPS,
    JIT_KERNELS,
    NUM_BUCKETS,
    PY_KERNELS,
    STOP_REASONS,
    Adjacency,
    Buckets,
    Kernels,
    Tracker,
    adjacency,
    build_tracker,
    recount,
    select_kernels,
)

__all__ = ["JIT_KERNELS", "NUM_BUCKETS", "PY_KERNELS", "STOP_REASONS", "Adjacency", "Buckets",
           "Kernels", "RefineStats", "Tracker", "adjacency", "build_tracker", "g3_partition",
           "g3_refine", "recount", "select_kernels"]


UNEVEN_WARNING = 1.05
"""``g3_partition`` warns where stage 2 stopped short with the remote counts' max/min
above this."""


@dataclass(frozen=True)
class RefineStats:
    """What stage 2 did.

    Attributes:
        swaps: iterations of Algorithm 1 kept (each moves two vertices).
        stop: why it stopped, one of ``STOP_REASONS``.
        remote_before, remote_after: (P,) |V_i^remote| before and after.
        seconds: wall time of stage 2, setup included.
    """

    swaps: int
    stop: str
    remote_before: tuple[int, ...]
    remote_after: tuple[int, ...]
    seconds: float


# ----------------------------------------------------------------- entry points
@register_partitioner("g3")
def g3_partition(graph: Graph, num_parts: int, *, seed: int = 0, threshold: float = 0.005,
                 max_moves: int | None = None, max_seconds: float | None = None,
                 stage1: str = "metis", candidates: int = 64,
                 use_numba: bool | None = None) -> PartitionBook:
    """Partition with G3's two stages: multi-constraint METIS, then remote balancing.

    The part sizes are exactly stage 1's: swaps never change them.

    Args:
        graph: a square graph.
        num_parts: P, with ``1 <= P <= N``.
        seed: seed of stage 1; stage 2 is deterministic (default: 0).
        threshold: stop once ``min/max`` of |V_i^remote| is at least
            ``1 - threshold`` (default: 0.005, the paper's 0.5%).
        max_moves: at most this many swaps (default: None, no limit).
        max_seconds: stop stage 2 after about this long (default: None, no limit).
        stage1: the registered partitioner of stage 1 (default: ``"metis"``, run
            with G3's weights ``(1, in_degree)``).
        candidates: top-scored vertices of the busiest part considered per swap;
            1 is the paper's literal rule (default: 64).
        use_numba: run stage 2 compiled (default: None, when numba is installed).

    Raises:
        ValueError: ``num_parts`` out of range, a bad option, or ``use_numba=True``
            without numba.
    """
    check_num_parts(num_parts, graph.num_nodes)
    _check_options(threshold, max_moves, max_seconds, candidates)
    book = _stage1(graph, num_parts, seed, stage1)
    refined, stats = g3_refine(graph, book, threshold=threshold, max_moves=max_moves,
                               max_seconds=max_seconds, candidates=candidates,
                               use_numba=use_numba)
    after = stats.remote_after
    if stats.stop != "converged" and min(after) * UNEVEN_WARNING < max(after):
        why = {"no_improvement": "no swap lowered the busiest part's count",
               "no_candidate": "the busiest part had no vertex to swap",
               "max_moves": "max_moves was reached",
               "max_seconds": "max_seconds was reached"}[stats.stop]
        warnings.warn(f"g3: remote vertices per part still {max(after)}/{min(after)} = "
                      f"{max(after) / max(min(after), 1):.2f}x max/min after "
                      f"{stats.swaps} swaps ({why}; stage 1 left "
                      f"{max(stats.remote_before)}/{min(stats.remote_before)})",
                      stacklevel=2)
    return refined


def g3_refine(graph: Graph, book: PartitionBook, *, threshold: float = 0.005,
              max_moves: int | None = None, max_seconds: float | None = None,
              candidates: int = 64,
              use_numba: bool | None = None) -> tuple[PartitionBook, RefineStats]:
    """Stage 2 alone (Algorithm 1, lines 3-14), starting from ``book``.

    Args and Raises: as ``g3_partition``; ``book`` must cover the graph's vertices.

    Returns:
        The refined book (the part sizes of ``book``) and what stage 2 did.
    """
    start = time.perf_counter()
    _check_options(threshold, max_moves, max_seconds, candidates)
    kernels = select_kernels(use_numba)
    if book.num_nodes != graph.num_nodes:
        raise ValueError(f"partition book has {book.num_nodes} vertices, the graph "
                         f"{graph.num_nodes}; partition this graph")
    adj = adjacency(graph)
    tracker = build_tracker(adj, book.part_of.numpy(), book.num_parts, kernels)
    before = tuple(int(r) for r in tracker.remote)
    swaps, stop = 0, "converged"
    while book.num_parts > 1:
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            stop = "max_seconds"  # the budget counts the setup too
            break
        budget = CHUNK_SWAPS if max_moves is None else min(CHUNK_SWAPS, max_moves - swaps)
        if budget <= 0:
            stop = "max_moves"
            break
        done, code = kernels.run(adj, tracker, float(threshold), budget, int(candidates))
        swaps += int(done)
        if code != _BUDGET:
            stop = STOP_REASONS[code]
            break
    refined = PartitionBook.from_assignment(tracker.part.astype(np.int64), book.num_parts)
    return refined, RefineStats(swaps=swaps, stop=stop, remote_before=before,
                                remote_after=tuple(int(r) for r in tracker.remote),
                                seconds=time.perf_counter() - start)


def _stage1(graph: Graph, num_parts: int, seed: int, stage1: str) -> PartitionBook:
    from fullgraph.partition import PARTITIONERS  # looked up per call, as partition() does

    if stage1 == "g3" or stage1 not in PARTITIONERS:
        known = ", ".join(sorted(set(PARTITIONERS) - {"g3"}))
        raise ValueError(f"stage1 must be a registered partitioner other than 'g3' "
                         f"({known}), got {stage1!r}")
    # G3's equations 1-2 for METIS: vertex and in-edge counts balanced
    opts = {"constraints": "vertices+degree"} if stage1 == "metis" else {}
    return PARTITIONERS[stage1](graph, num_parts, seed=seed, **opts)


def _check_options(threshold: float, max_moves: int | None, max_seconds: float | None,
                   candidates: int) -> None:
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must satisfy 0 <= threshold < 1, got {threshold}")
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves must be >= 0 or None, got {max_moves}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0 or None, got {max_seconds}")
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1 (1: the paper's rule), got {candidates}")
