"""Row plans: which rows each stage computes and fetches, without processes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.csr import Graph
from fullgraph.models import build_model, propagation_inputs
from fullgraph.parallel.rowplan import plan_rows


def path_graph(n: int) -> Graph:
    src = np.arange(n - 1)
    return Graph.from_edges(src, src + 1, n, symmetrize=True)


def test_depcomm_computes_only_owned_rows_and_fetches_remote_neighbours():
    model = build_model("gcn", 4, 4, 2, aggregate_first=True)
    g, _ = propagation_inputs(model, path_graph(6))
    owned = torch.tensor([0, 1, 2])
    fetch = torch.zeros(6, dtype=torch.bool)
    fetch[3:] = True  # everything remote is fetched
    plan = plan_rows(model, g, owned, fetch)
    assert all(torch.equal(r, owned) for r in plan.rows)
    for s, block in enumerate(plan.blocks):
        if block is not None:
            assert plan.fetched[s].tolist() == [3]  # the one remote in-neighbour
    assert plan.edges_computed() == (2 * int(g.in_degrees()[:3].sum()), 0)


def test_depcache_grows_the_rows_by_one_hop_per_propagation():
    model = build_model("gcn", 4, 4, 2, aggregate_first=True)  # P T P T
    g, _ = propagation_inputs(model, path_graph(8))
    owned = torch.tensor([0, 1, 2])
    plan = plan_rows(model, g, owned, torch.zeros(8, dtype=torch.bool))
    assert not any(f.numel() for f in plan.fetched)
    sizes = [r.numel() for r in plan.rows]
    # last P outputs the owned rows and needs 0..3; the first P outputs 0..3, needs 0..4
    assert plan.input_rows.tolist() == [0, 1, 2, 3, 4]
    assert model.signature() == "TPT TPT"
    assert sizes == [5, 4, 4, 4, 3, 3]  # dropout on 0..4, first P -> 0..3, last P -> 0..2
    local, redundant = plan.edges_computed()
    assert redundant == int(g.in_degrees()[3])


@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_rows_always_start_with_owned_and_blocks_are_consistent(name, decoupled):
    model = build_model(name, 4, 4, 2, decoupled=decoupled, heads=2) if name == "gat" else \
        build_model(name, 4, 4, 2, decoupled=decoupled)
    rng = np.random.default_rng(0)
    base = Graph.from_edges(rng.integers(0, 30, 90), rng.integers(0, 30, 90), 30,
                            symmetrize=True, self_loops="remove")
    g, _ = propagation_inputs(model, base)
    owned = torch.arange(0, 30, 3)
    fetch = torch.from_numpy(rng.random(30) < 0.5)
    plan = plan_rows(model, g, owned, fetch)
    for s, rows in enumerate(plan.rows):
        assert torch.equal(rows[: owned.numel()], owned)
        block = plan.blocks[s]
        if block is None:
            continue
        assert block.graph.num_dst == rows.numel()
        # every block edge is a real edge of g, with its global id
        src_g, dst_g = g.edges()
        assert torch.equal(dst_g[block.eids], rows.repeat_interleave(block.graph.in_degrees()))
        assert not bool(fetch[plan.fetched[s]].logical_not().any())
