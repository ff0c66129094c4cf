"""Tests of the partition quality metrics against a brute-force computation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fullgraph.graph.csr import Graph
from fullgraph.partition import PartitionBook, format_report, metrics, quality, random_partition


def _random_graph(num_nodes: int = 40, num_edges: int = 150, seed: int = 0) -> Graph:
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)
    return Graph.from_edges(src, dst, num_nodes, dedup=False)  # repeats and loops kept


def _brute_force(graph: Graph, part_of: list[int], num_parts: int) -> dict:
    src, dst = (t.tolist() for t in graph.edges())
    vertices = [part_of.count(p) for p in range(num_parts)]
    edges = [sum(1 for d in dst if part_of[d] == p) for p in range(num_parts)]
    remote = [len({s for s, d in zip(src, dst) if part_of[d] == p and part_of[s] != p})
              for p in range(num_parts)]
    cut = sum(1 for s, d in zip(src, dst) if part_of[s] != part_of[d])
    replication = (sum(vertices) + sum(remote)) / graph.num_nodes
    return dict(vertices=tuple(vertices), edges=tuple(edges), remote=tuple(remote),
                edge_cut=cut, replication_factor=replication)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bitmap", [True, False])
def test_quality_matches_brute_force(monkeypatch, seed: int, bitmap: bool) -> None:
    if not bitmap:
        monkeypatch.setattr(metrics, "BITMAP_LIMIT", 0)  # take the sort path
    graph = _random_graph(seed=seed)
    num_parts = 4
    part_of = np.random.default_rng(seed + 10).integers(0, num_parts, graph.num_nodes)
    part_of[part_of == 3] = 2  # part 3 stays empty
    q = quality(graph, PartitionBook.from_assignment(part_of, num_parts))
    expected = _brute_force(graph, part_of.tolist(), num_parts)
    for name, value in expected.items():
        assert getattr(q, name) == pytest.approx(value), name
    assert (q.num_nodes, q.num_edges, q.num_parts) == (40, 150, 4)
    assert q.vertices[3] == q.edges[3] == q.remote[3] == 0
    assert math.isinf(q.ratio("vertices"))


def test_single_part_has_no_cut() -> None:
    graph = _random_graph()
    q = quality(graph, random_partition(graph, 1))
    assert q.edge_cut == 0 and q.remote == (0,) and q.replication_factor == 1.0
    assert q.ratio("remote") == 1.0 and q.ratio("edges") == 1.0 and q.cut_fraction == 0.0


def test_ratios_and_dict() -> None:
    graph = _random_graph()
    q = quality(graph, random_partition(graph, 3, seed=1))
    assert q.ratio("vertices") == max(q.vertices) / min(q.vertices)
    assert q.ratio("remote") == max(q.remote) / min(q.remote)
    with pytest.raises(ValueError, match="one of"):
        q.ratio("cut")
    data = json.loads(json.dumps(q.as_dict()))
    assert data["remote"] == list(q.remote) and data["edges_ratio"] == q.ratio("edges")
    assert data["cut_fraction"] == q.edge_cut / q.num_edges


def test_book_of_another_graph_is_refused() -> None:
    graph = _random_graph()
    with pytest.raises(ValueError, match="41 vertices, the graph 40"):
        quality(graph, PartitionBook.from_assignment(np.zeros(41, dtype=np.int64), 2))


def test_format_report_lists_every_part_and_totals() -> None:
    graph = _random_graph()
    q = quality(graph, random_partition(graph, 3))
    report = format_report(q)
    lines = report.splitlines()
    assert lines[0].split() == ["part", "vertices", "in-edges", "remote"]
    rows = [line.split() for line in lines[2:5]]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert [int(r[3]) for r in rows] == list(q.remote)
    assert f"{q.ratio('edges'):.3f}" in next(x for x in lines if x.strip().startswith("max/min"))
    assert f"edge cut {q.edge_cut:,}" in report
    assert f"replication factor {q.replication_factor:.3f}" in report


def test_a_ratio_over_a_part_of_none_is_not_printed_as_inf() -> None:
    """A part without remote vertices (a component of its own) made max/min "inf"."""
    from fullgraph.graph.csr import Graph

    src, dst = np.array([0, 1, 2, 3]), np.array([1, 0, 3, 2])  # two components
    graph = Graph.from_edges(src, dst, 4)
    book = PartitionBook.from_assignment(np.array([0, 0, 1, 2]), 3)  # part 0: 0 and 1
    q = quality(graph, book)
    assert q.remote[0] == 0 and q.ratio("remote") == float("inf")
    row = next(x for x in format_report(q).splitlines() if x.strip().startswith("max/min"))
    assert "inf" not in row and row.split()[-2:] == ["(min", "0)"]
