"""Edge softmax: normalisation per destination, agreement with a dense softmax, gradcheck."""
from __future__ import annotations

import torch

from fullgraph.graph.csr import Graph
from fullgraph.ops import edge_softmax


def graph(seed: int = 0, n: int = 9, e: int = 40) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    return Graph.from_edges(torch.randint(0, n, (e,), generator=gen),
                            torch.randint(0, n, (e,), generator=gen), n)


def test_sums_to_one_per_destination():
    g = graph()
    alpha = edge_softmax(g, torch.randn(g.num_edges, 3, dtype=torch.float64) * 10)
    sums = torch.zeros(g.num_dst, 3, dtype=torch.float64).index_add_(0, g.dst_index(), alpha)
    has_edges = g.in_degrees() > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]))


def test_matches_dense_masked_softmax():
    g = graph(1)
    s = torch.randn(g.num_edges, dtype=torch.float64)
    alpha = edge_softmax(g, s)
    src, dst = g.edges()
    dense = torch.full((g.num_dst, g.num_src), float("-inf"), dtype=torch.float64)
    dense[dst, src] = s
    ref = torch.softmax(dense, dim=1)
    torch.testing.assert_close(alpha, ref[dst, src])


def test_large_scores_are_stable():
    g = graph(2)
    alpha = edge_softmax(g, torch.full((g.num_edges,), 1e4, dtype=torch.float64))
    assert torch.isfinite(alpha).all()


def test_gradcheck():
    g = graph(3)
    s = torch.randn(g.num_edges, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: edge_softmax(g, s), (s,))
