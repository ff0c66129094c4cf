"""Edge softmax: normalisation per destination, agreement with a dense softmax, gradcheck."""
from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE

from fullgraph.graph.csr import Graph
from fullgraph.ops import edge_softmax
from fullgraph.ops.edge_softmax import attention_softmax


def graph(seed: int = 0, n: int = 9, e: int = 40) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    return Graph.from_edges(torch.randint(0, n, (e,), generator=gen),
                            torch.randint(0, n, (e,), generator=gen), n).to(TEST_DEVICE)


def test_sums_to_one_per_destination():
    g = graph()
    alpha = edge_softmax(g, torch.randn(g.num_edges, 3, dtype=torch.float64, device=g.device) * 10)
    sums = torch.zeros(g.num_dst, 3, dtype=torch.float64, device=g.device)
    sums.index_add_(0, g.dst_index(), alpha)
    has_edges = g.in_degrees() > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]))


def test_matches_dense_masked_softmax():
    g = graph(1)
    s = torch.randn(g.num_edges, dtype=torch.float64, device=g.device)
    alpha = edge_softmax(g, s)
    src, dst = g.edges()
    dense = torch.full((g.num_dst, g.num_src), float("-inf"), dtype=torch.float64,
                       device=g.device)
    dense[dst, src] = s
    ref = torch.softmax(dense, dim=1)
    torch.testing.assert_close(alpha, ref[dst, src])


def test_large_scores_are_stable():
    g = graph(2)
    alpha = edge_softmax(g, torch.full((g.num_edges,), 1e4, dtype=torch.float64,
                                       device=g.device))
    assert torch.isfinite(alpha).all()


def test_gradcheck():
    g = graph(3)
    s = torch.randn(g.num_edges, 2, dtype=torch.float64, device=g.device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: edge_softmax(g, s), (s,))


def _composite(g, s_src, s_dst, slope):
    src, dst = g.edges()
    return edge_softmax(g, torch.nn.functional.leaky_relu(s_src[src] + s_dst[dst], slope))


def _block(seed: int = 4, n_dst: int = 7, n_src: int = 12, e: int = 50) -> Graph:
    """A bipartite block (more sources than destinations) with an empty row, on the
    test device."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randint(1, n_dst, (e,), generator=gen)  # row 0 has no in-edge
    src = torch.randint(0, n_src, (e,), generator=gen)
    counts = torch.bincount(dst, minlength=n_dst)
    order = torch.argsort(dst * n_src + src)
    indptr = torch.zeros(n_dst + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(counts, 0)
    return Graph(indptr, src[order].to(torch.int32), num_src=n_src).to(TEST_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_attention_equals_the_composite(dtype):
    """GAT's fused attention (numba when installed) gives the torch composite's weights
    and gradients, on a block with an empty row and scores at exactly 0."""
    g = _block()
    gen = torch.Generator().manual_seed(0)
    s_src = torch.randn(g.num_src, 3, generator=gen, dtype=dtype).to(g.device)
    s_dst = torch.randn(g.num_dst, 3, generator=gen, dtype=dtype).to(g.device)
    s_src[2], s_dst[3] = 0.5, -0.5  # pre-activation 0 where 2 -> 3 (the slope side)
    grad = torch.randn(g.num_edges, 3, generator=gen, dtype=dtype).to(g.device)
    outs = []
    for fn in (attention_softmax, _composite):
        a, b = s_src.clone().requires_grad_(), s_dst.clone().requires_grad_()
        alpha = fn(g, a, b, 0.2)
        alpha.backward(grad)
        outs.append((alpha.detach(), a.grad, b.grad))
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for got, ref in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, ref, **tol)


def test_fused_attention_gradcheck():
    g = _block(5)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(g.num_src, 2, generator=gen, dtype=torch.float64).to(g.device)
    b = torch.randn(g.num_dst, 2, generator=gen, dtype=torch.float64).to(g.device)
    a.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: attention_softmax(g, a, b, 0.2), (a, b))


def test_fused_attention_refuses_mismatched_scores():
    g = _block()
    with pytest.raises(ValueError, match="s_src must be"):
        attention_softmax(g, torch.zeros(g.num_dst, 2, device=g.device),
                          torch.zeros(g.num_dst, 2, device=g.device), 0.2)


@pytest.mark.parametrize("heads", [1, 3])
def test_segment_reductions_match_the_scatters(monkeypatch, heads):
    """``SEGMENTED`` (reductions over the CSR offsets, an option for GPUs) gives the
    scatters' weights and gradients, for the plain softmax and GAT's attention (the
    torch path, as on a GPU)."""
    import importlib

    from fullgraph.ops.spmm import set_backend

    module = importlib.import_module("fullgraph.ops.edge_softmax")  # not the function
    g = graph(seed=3, n=12, e=70)
    gen = torch.Generator().manual_seed(1)
    s_src = torch.randn(12, heads, generator=gen, dtype=torch.float64).to(TEST_DEVICE)
    s_dst = torch.randn(12, heads, generator=gen, dtype=torch.float64).to(TEST_DEVICE)
    grad = torch.randn(g.num_edges, heads, generator=gen, dtype=torch.float64).to(TEST_DEVICE)
    set_backend("torch")
    try:
        runs = []
        for segmented in (False, True):
            monkeypatch.setitem(module.SEGMENTED, TEST_DEVICE.type, segmented)
            a, b = s_src.clone().requires_grad_(), s_dst.clone().requires_grad_()
            out = attention_softmax(g, a, b, 0.2)
            out.backward(grad)
            plain = module.edge_softmax(g, a.detach()[g.edges()[0]])
            runs.append((out.detach(), a.grad, b.grad, plain.detach()))
    finally:
        set_backend("auto")
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want)
