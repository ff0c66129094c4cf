"""The data form of task parallelism's P group: the halo tables and blocks every rank
builds on its own must agree with each other and reproduce the whole graph's
aggregation, checked by simulating the exchanges in one process."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.csr import Graph
from fullgraph.ops import spmm
from fullgraph.schedule.regroup import ChunkGrid
from fullgraph.schedule.rowfetch import offsets_of, row_fetch, to_rows

# 10 vertices; ranks 0-1 the T group (5 + 5 rows), ranks 2-4 the P group (4 + 3 + 3)
EDGES = [(0, 1), (1, 0), (9, 2), (2, 5), (5, 2), (3, 6), (6, 3), (7, 0), (4, 4), (6, 7),
         (8, 9), (9, 8), (1, 8), (0, 4), (2, 9), (3, 3), (5, 7), (7, 5)]
T_COUNTS, P_COUNTS = [5, 5, 0, 0, 0], [0, 0, 4, 3, 3]


def graph() -> Graph:
    src, dst = (np.array(x) for x in zip(*EDGES))
    return Graph.from_edges(src, dst, 10)


def send(table, rows, q):
    return rows[table.send_idx[q]]


@pytest.mark.parametrize("seed", [None, 5, 6])
def test_pieces_reproduce_the_aggregation_with_each_row_fetched_once(seed):
    """Exact (seed None): the whole graph; regrouped: the graph of the kept blocks."""
    g = graph()
    t_off, p_off = offsets_of(T_COUNTS), offsets_of(P_COUNTS)
    # two stripes, each a slice of every P rank's rows, one subgraph each
    grid = ChunkGrid(g, [[(0, 2), (4, 6), (7, 9)], [(2, 4), (6, 7), (9, 10)]], 2)
    ranges, used, keep = grid.grouping(seed)
    assert (keep is None) == (seed is None)
    fetches = [row_fetch(used, ranges, t_off, p_off, r) for r in range(5)]
    x = torch.randn(10, 3, dtype=torch.float64)
    w = torch.rand(used.num_edges, dtype=torch.float64)
    want = spmm(used, x, w)
    for r in range(2, 5):  # every P rank: its pieces over the cache the T ranks fill
        f = fetches[r]
        cache, outs = [], []
        for s, piece in enumerate(f.pieces):
            got = [send(fetches[t].fetch[s], x[t_off[t]:t_off[t + 1]], r) for t in range(2)]
            assert [len(p) for p in got] == f.fetch[s].recv_rows[:2]
            cache.append(torch.cat(got))
            a = f.edge_range[0]
            outs.append(spmm(piece, torch.cat(cache), w[a + f.piece_edges[s]]))
        torch.testing.assert_close(torch.cat(outs)[f.order], want[p_off[r]:p_off[r + 1]])
        # each source reaches the worker once: the cache has no repeats
        flat = torch.cat([torch.cat([send(fetches[t].fetch[s], torch.arange(10)[
            t_off[t]:t_off[t + 1]], r) for t in range(2)]) for s in range(2)])
        assert flat.unique().numel() == flat.numel()
        # a later P stage: the halo from the P ranks, over the block
        halo = torch.cat([send(fetches[q].within, x[p_off[q]:p_off[q + 1]], r - 2)
                          for q in range(2, 5)])  # the P group's ranks: 0, 1, 2
        a, b = f.edge_range
        torch.testing.assert_close(spmm(f.block, halo, w[a:b]), want[p_off[r]:p_off[r + 1]])
    for t in range(2):  # T ranks hold no P rows
        assert all(p.num_dst == 0 for p in fetches[t].pieces) and fetches[t].within is None


def test_rows_go_back_to_the_t_blocks_once():
    t_off, p_off = offsets_of(T_COUNTS), offsets_of(P_COUNTS)
    x = torch.arange(10)
    tables = [to_rows(t_off, p_off, r) for r in range(5)]
    for t in range(5):
        got = torch.cat([x[p_off[q]:p_off[q + 1]][tables[q].send_idx[t]] for q in range(5)])
        assert got.tolist() == list(range(t_off[t], t_off[t + 1]))
