"""G3 bins: BFS priority order with boundary vertices first, bin limits and packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.csr import Graph
from fullgraph.schedule.bins import (
    SCHEDULES,
    bfs_order,
    bin_limit,
    boundary_mask,
    build_schedule,
    pack_bins,
    priority_order,
)


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


# ---------------------------------------------------------------- build_schedule


def random_case(seed=0, n=120, parts=3):
    rng = np.random.default_rng(seed)
    g = Graph.from_edges(rng.integers(0, n, 4 * n), rng.integers(0, n, 4 * n), n,
                         symmetrize=True)
    return g, torch.from_numpy(rng.integers(0, parts, n)), parts


def edges_np(g):
    src, dst = g.edges()
    return src.numpy().astype(np.int64), dst.numpy().astype(np.int64)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_bins_cover_each_part_within_the_limit(name):
    g, part_of, parts = random_case()
    phases = build_schedule(g, part_of, parts, [7, 5, 9], SCHEDULES[name])
    for ph in phases:
        for p in range(parts):
            got = np.concatenate(ph.bins[p]) if ph.bins[p] else np.empty(0, np.int64)
            assert sorted(got.tolist()) == torch.nonzero(part_of == p)[:, 0].tolist()
        limit = [7, 5, 9][phases.index(ph)]
        assert all(b.size <= limit for bins in ph.bins for b in bins)
        assert ph.rounds == (max(len(b) for b in ph.bins) if SCHEDULES[name].per_bin else 1)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_waits_cover_every_remote_dependency(name):
    """Forward: a bin waits for the round of every remote row it reads; backward: for
    the gradient round of every remote reader of its rows."""
    g, part_of, parts = random_case(1)
    mode = SCHEDULES[name]
    phases = build_schedule(g, part_of, parts, [6, 4, 8], mode)
    src, dst = edges_np(g)
    part = part_of.numpy()
    cross = part[src] != part[dst]
    for k, ph in enumerate(phases):
        for p in range(parts):
            bin_of = {int(v): b for b, vs in enumerate(ph.bins[p]) for v in vs}
            if k:
                for u, v in zip(src[cross], dst[cross]):
                    if part[v] == p:
                        assert phases[k - 1].round_of[u] <= ph.fwd_wait[p][bin_of[int(v)]]
            if k + 1 < len(phases):
                for u, v in zip(src[cross], dst[cross]):
                    if part[u] == p:
                        assert phases[k + 1].step_of[v] <= ph.bwd_wait[p][bin_of[int(u)]]
            steps = {int(b): t for t, b in enumerate(ph.bwd_order[p])}
            assert sorted(steps) == list(range(len(ph.bins[p])))
            for b, vs in enumerate(ph.bins[p]):
                assert (ph.round_of[vs] == (b if mode.per_bin else 0)).all()
                assert (ph.step_of[vs] == (steps[b] if mode.per_bin else 0)).all()
            if mode.eager and k:
                assert list(ph.fwd_wait[p]) == sorted(ph.fwd_wait[p])  # ready bins first
            if mode.eager:
                waits = [ph.bwd_wait[p][b] for b in ph.bwd_order[p]]
                assert waits == sorted(waits)


def test_priority_schedules_put_boundary_vertices_first_in_phase_zero():
    g, part_of, parts = random_case(2)
    for name in ("intra-layer", "multi-level"):
        ph = build_schedule(g, part_of, parts, [5], SCHEDULES[name])[0]
        for p in range(parts):
            order = torch.from_numpy(np.concatenate(ph.bins[p]))
            b = boundary_mask(g, order, part_of)
            assert not bool((b[1:] & ~b[:-1]).any())
    ph = build_schedule(g, part_of, parts, [5], SCHEDULES["sequential"])[0]
    for p in range(parts):  # vertex-id order
        order = np.concatenate(ph.bins[p])
        assert (np.diff(order) > 0).all()


def test_schedule_refuses_an_empty_bin_limit():
    g, part_of, parts = random_case()
    with pytest.raises(ValueError, match="phase 1"):
        build_schedule(g, part_of, parts, [3, 0], SCHEDULES["multi-level"])


def test_priority_counts_only_vertices_that_other_parts_read():
    # directed 0 -> 3 and 4 -> 1: 0 is read by part 1, 1 only reads from part 1
    g = Graph.from_edges(np.array([0, 4, 0, 1]), np.array([3, 1, 1, 2]), 6)
    part_of = torch.tensor([0, 0, 0, 1, 1, 1])
    owned = torch.tensor([0, 1, 2])
    assert boundary_mask(g, owned, part_of).tolist() == [True, True, False]
    assert boundary_mask(g, owned, part_of, "out").tolist() == [True, False, False]
    assert priority_order(g, owned, part_of)[0].item() == 0
