"""Task parallelism's chunk grid: the regroup mode's seeded groupings and the blocks it
skips (checked on a one-hot input against a hand computation), without processes."""
from __future__ import annotations

import numpy as np
import torch

from fullgraph.graph.csr import Graph
from fullgraph.ops.chunked import chunked_spmm
from fullgraph.schedule.chunks import spread_chunks
from fullgraph.schedule.regroup import ChunkGrid, chunk_groups

# 8 vertices in 4 chunks of 2: chunk k holds vertices 2k, 2k+1
EDGES = [(0, 1), (1, 0), (1, 2), (2, 5), (5, 2), (3, 6), (6, 3), (7, 0), (4, 4), (6, 7)]
CHUNKS = [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]


def tiny_grid(num_subgraphs: int = 2) -> ChunkGrid:
    src, dst = (np.array(x) for x in zip(*EDGES))
    return ChunkGrid(Graph.from_edges(src, dst, 8), CHUNKS, num_subgraphs)


def used_edges(grid: ChunkGrid, subgraphs) -> set[tuple[int, int]]:
    """(src, dst) of every edge the subgraphs aggregate: A x on a one-hot x."""
    weight = torch.ones(grid.graph.num_edges, dtype=torch.float64)
    if subgraphs.keep is not None:
        weight = weight[subgraphs.keep[0]]
    out = chunked_spmm(subgraphs.chunks, 8, torch.eye(8, dtype=torch.float64), weight,
                       torch.device("cpu"))
    assert set(out.unique().tolist()) <= {0.0, 1.0}
    return {(int(u), int(v)) for v, u in torch.nonzero(out).tolist()}


def test_regroup_skips_exactly_the_blocks_from_later_subgraphs():
    grid = tiny_grid()
    # subgraph 0 = chunks 0 and 2 (vertices 0, 1, 4, 5), subgraph 1 = chunks 1 and 3
    sub = grid.subgraphs([[0, 2], [1, 3]], skip=True)
    assert [c.ranges for c in sub.chunks] == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    # by hand: 2 -> 5 and 7 -> 0 run from subgraph 1 into subgraph 0, skipped
    assert used_edges(grid, sub) == set(EDGES) - {(2, 5), (7, 0)}
    # each hand-off sends the rows first read: none from a later subgraph
    assert [r.tolist() for r in sub.first_reads] == [[0, 1, 4], [3, 5, 6]]
    # vertex 0 keeps one of its two in-edges (1 -> 0), which counts twice; vertex 5
    # keeps none; every other kept edge keeps all its destination's in-edges
    keep, scale = sub.keep
    src, dst = grid.graph.edges()
    kept = {(int(src[e]), int(dst[e])): float(f) for e, f in zip(keep, scale)}
    assert kept == {e: 2.0 if e == (1, 0) else 1.0 for e in set(EDGES) - {(2, 5), (7, 0)}}
    # the other order skips the edges the other way round
    flipped = grid.subgraphs([[1, 3], [0, 2]], skip=True)
    assert used_edges(grid, flipped) == set(EDGES) - {(1, 2), (5, 2)}
    # exact: consecutive chunks, every edge
    assert grid.exact.groups == [[0, 1], [2, 3]] and grid.exact.keep is None
    assert used_edges(grid, grid.exact) == set(EDGES)


def test_regroup_is_seeded_and_changes_between_epochs():
    # two grids built apart (as two ranks, or two runs, build them) draw the same
    a, b = tiny_grid(), tiny_grid()
    for seed in range(5):
        x, y = a.regrouped(seed), b.regrouped(seed)
        assert x.groups == y.groups == chunk_groups(4, 2, seed)
        assert torch.equal(x.keep[0], y.keep[0]) and torch.equal(x.keep[1], y.keep[1])
        assert used_edges(a, x) == used_edges(a, a.subgraphs(x.groups, skip=True))
    assert len({str(a.regrouped(seed).groups) for seed in range(5)}) > 1
    assert a.regrouped(3) is a.regrouped(3)  # cached for the epoch's forward passes
    # every chunk in exactly one subgraph, near-equal group sizes
    for groups in (chunk_groups(12, 5, 7), chunk_groups(12, 4, None)):
        assert sorted(c for g in groups for c in g) == list(range(12))
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_every_edge_is_used_in_some_epoch():
    rng = np.random.default_rng(0)
    n = 60
    src, dst = rng.integers(0, n, 300), rng.integers(0, n, 300)
    graph = Graph.from_edges(src, dst, n)
    grid = ChunkGrid(graph, spread_chunks(graph.indptr, [30, 30], 1, num_chunks=12), 4)
    counts = np.zeros(graph.num_edges)
    for seed in range(40):
        kept = grid.regrouped(seed).keep
        assert kept is not None and 0 < kept[0].numel() < graph.num_edges
        counts[kept[0].numpy()] += 1
    assert counts.min() > 0
    # an edge across chunks is used with probability about (S + 1) / (2S) = 5/8
    assert 0.5 < counts.mean() / 40 < 0.8
