"""G3 bins: BFS priority order with boundary vertices first, bin limits and packing."""
from __future__ import annotations

import numpy as np
import torch

from fullgraph.graph.csr import Graph
from fullgraph.schedule.bins import (bfs_order, bin_limit, boundary_mask, pack_bins,
                                     priority_order)


def undirected(pairs, n) -> Graph:
    src, dst = np.array(pairs).T
    return Graph.from_edges(src, dst, n, symmetrize=True)


def test_bfs_visits_levels_component_by_component():
    # component {0, 3, 5, 6}: 0-5, 0-6, 5-3 ; component {1, 2}: 1-2 ; isolated 4
    g = undirected([(0, 5), (0, 6), (5, 3), (1, 2)], 7)
    order = bfs_order(g, torch.arange(7)).tolist()
    assert order == [0, 5, 6, 3, 1, 2, 4]


def test_bfs_stays_inside_the_partition():
    g = undirected([(0, 1), (1, 2), (2, 3), (3, 4)], 5)
    # owning 0, 2, 4 only: no edges among them, so three singleton components
    assert bfs_order(g, torch.tensor([4, 0, 2])).tolist() == [0, 2, 4]


def test_boundary_vertices_come_first_in_bfs_order():
    g = undirected([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], 6)
    part_of = torch.tensor([0, 0, 0, 1, 1, 1])
    owned = torch.tensor([0, 1, 2])
    assert boundary_mask(g, owned, part_of).tolist() == [False, False, True]
    assert priority_order(g, owned, part_of).tolist() == [2, 0, 1]


def test_priority_order_is_a_permutation_on_a_random_graph():
    rng = np.random.default_rng(0)
    g = Graph.from_edges(rng.integers(0, 300, 1200), rng.integers(0, 300, 1200), 300,
                         symmetrize=True)
    part_of = torch.from_numpy(rng.integers(0, 3, 300))
    owned = torch.nonzero(part_of == 1)[:, 0]
    order = priority_order(g, owned, part_of)
    assert sorted(order.tolist()) == owned.tolist()
    b = boundary_mask(g, order, part_of)
    assert not bool((b[1:] & ~b[:-1]).any())  # all boundary vertices before the rest


def test_bin_limit_and_packing():
    assert bin_limit(1024, 3, 5, 4) == 16  # 512 bytes / 32 bytes per vertex
    assert bin_limit(10, 100, 100) == 1
    bins = pack_bins(torch.arange(10), 4)
    assert [b.tolist() for b in bins] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert pack_bins(torch.arange(0), 3) == []
