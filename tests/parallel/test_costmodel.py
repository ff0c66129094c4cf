"""The DepComm / DepCache cost model: its pure parts, without processes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fullgraph.comm.group import single_comm
from fullgraph.graph.csr import Graph
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model, propagation_inputs
from fullgraph.parallel import costmodel as cm
from fullgraph.parallel.rowplan import plan_rows
from fullgraph.partition import partition


def path_graph(n: int) -> Graph:
    src = np.arange(n - 1)
    return Graph.from_edges(src, src + 1, n, symmetrize=True)


def model(name: str, decoupled: bool, layers: int = 3):
    extra = {"heads": 2} if name == "gat" else {}
    return build_model(name, 9, 5, 3, num_layers=layers, decoupled=decoupled,
                       num_props=layers, **extra)


def test_stage_costs_radius_counts_the_propagations_still_to_come():
    gcn = model("gcn", False)  # TTPT TPT TTPT: three P stages
    assert [(c.radius, c.fetches) for c in cm.stage_costs(gcn)] == [
        (1, True), (0, True), (-1, True)]
    gat = model("gat", False, layers=2)  # TTEPT TTEPT: each P reuses its E stage's halo
    costs = cm.stage_costs(gat)
    assert [(c.radius, c.fetches) for c in costs] == [(0, True), (0, False), (-1, True),
                                                      (-1, False)]
    assert [c.dim for c in costs] == [10, 10, 3, 3]


def test_neighbourhood_sizes_on_a_path():
    g = path_graph(8)  # in-degrees 1, 2, ..., 2, 1
    stop = np.zeros(8, dtype=bool)
    stop[[2]] = True  # the walk from 5 may not pass 2; from 0 it never gets there
    verts, edges = cm.neighbourhood_sizes(g, np.array([5, 0]), 3, stop)
    assert verts.tolist() == [[1, 3, 5, 5], [1, 2, 2, 2]]
    # seed 5: {5} -> +{4, 6} -> +{3, 7} -> 2 stops the walk, 7 has nothing new
    assert edges.tolist() == [[2, 6, 9, 9], [1, 3, 3, 3]]


def test_neighbourhood_sizes_in_chunks_equal_one_pass(monkeypatch):
    ds = sbm(200, 4, avg_degree=6.0, num_features=4, seed=1)
    stop = np.random.default_rng(0).random(200) < 0.3
    seeds = np.arange(0, 200, 2)
    whole = cm.neighbourhood_sizes(ds.graph, seeds, 2, stop)
    monkeypatch.setattr(cm, "SEED_CHUNK", 7)
    chunked = cm.neighbourhood_sizes(ds.graph, seeds, 2, stop)
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_counts_are_what_caching_one_dependency_computes(name, decoupled):
    """Cache one dependency, fetch all others: the rows and edges each stage computes
    beyond the owned ones are exactly the counts of the cost model, every hop."""
    prog = model(name, decoupled)
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    g, _ = propagation_inputs(prog, ds.graph)
    part = partition(ds.graph, 3, "random", seed=0).part_of
    owned = torch.nonzero(part == 0).flatten()
    src, dst = g.edges()
    mine = torch.zeros(g.num_dst, dtype=torch.bool)
    mine[owned] = True
    direct = torch.unique(src[mine[dst] & ~mine[src]])
    stages = cm.stage_costs(prog)
    stop = np.zeros(g.num_dst, dtype=bool)
    stop[owned.numpy()] = stop[direct.numpy()] = True
    verts, edges = cm.neighbourhood_sizes(g, direct.numpy(), 1, stop)
    assert max(c.radius for c in stages) == 1 and (verts[:, 1] > 1).any()  # two hops
    for k, v in enumerate(direct.tolist()):
        fetch = torch.zeros(g.num_dst, dtype=torch.bool)
        fetch[direct] = True
        fetch[v] = False
        rows = plan_rows(prog, g, owned, fetch)
        for c in stages:
            extra = rows.rows[c.stage].numel() - owned.numel()
            extra_edges = int(rows.blocks[c.stage].graph.in_degrees()[owned.numel():].sum())
            want = (0, 0) if c.radius < 0 else (verts[k, c.radius], edges[k, c.radius])
            assert (extra, extra_edges) == want, (v, c)


def test_dependency_costs_follow_the_formulas():
    prog = model("gcn", False)  # P stages of 5, 5, 3 columns; radii 1, 0, -1
    g, _ = propagation_inputs(prog, path_graph(10))
    owned, direct = torch.arange(0, 4), torch.tensor([4])
    # caching 4: the last-but-one P computes {4} (in-edges 3, 4, 5 with self-loops);
    # the first computes {4, 5}, walking through 5 (neither owned nor a dependency)
    cache, comm = cm.dependency_costs(prog, g, owned, direct, cm.Rates(0.0, 1.0, 0.0), 8)
    assert cache.tolist() == [(3 + 3) * 5 + 3 * 5] and comm.tolist() == [0.0]
    cache, comm = cm.dependency_costs(prog, g, owned, direct, cm.Rates(0.0, 0.0, 1.0), 8)
    assert cache.tolist() == [2 * 5 + 1 * 5]
    _, comm = cm.dependency_costs(prog, g, owned, direct, cm.Rates(1.0, 0.0, 0.0), 4)
    assert comm.tolist() == [(5 + 5 + 3) * 4 * 2]


def test_choose_cached_is_strict_and_checks_shapes():
    got = cm.choose_cached(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 2.0, 2.0]))
    assert got.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="cost shapes differ"):
        cm.choose_cached(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_rates_refuse_bad_values(bad):
    with pytest.raises(ValueError, match="edge cost must be a finite number >= 0"):
        cm.Rates(1.0, bad, 1.0)


def test_measured_rates_are_positive_and_named():
    g = sbm(300, 3, avg_degree=6.0, num_features=4, seed=0).graph
    rates = cm.resolve_rates(single_comm(), g, None, None, 2e-9)
    assert rates.measured == ("byte", "edge") and rates.vertex == 2e-9
    assert 0 < rates.edge < 1e-3 and math.isfinite(rates.edge)
    assert rates.byte == 1e-9  # one worker moves nothing
    assert 0 < cm.measure_vertex_cost(rows=256, dim=8) < 1e-3
    assert "measured byte, edge; given vertex" in rates.describe()
