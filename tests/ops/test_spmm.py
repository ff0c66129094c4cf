"""SpMM forward against a dense reference and gradcheck of its backward, per backend."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import TEST_DEVICE, cpu_only

from fullgraph.graph.csr import Graph
from fullgraph.ops import kernels, padded, spmm
from fullgraph.ops.spmm import (
    aggregate,
    edge_dot,
    set_backend,
    split_aggregate,
    splits,
    spmm_add_,
)

# numba's kernels are CPU only: on a GPU every backend resolves to torch
NUMBA = pytest.param("numba", marks=cpu_only("numba's kernels"))
BACKENDS = ["torch"] + ([NUMBA] if kernels.HAVE_NUMBA else [])


@pytest.fixture(params=BACKENDS)
def backend(request):
    set_backend(request.param)
    yield request.param
    set_backend("auto")


def random_block(num_dst: int, num_src: int, num_edges: int, seed: int) -> Graph:
    g = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    key = torch.unique(dst * num_src + src)
    dst, src = key // num_src, key % num_src
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_dst), 0)
    return Graph(indptr, src, num_src=num_src).to(TEST_DEVICE)


def dense(graph: Graph, weight: torch.Tensor | None, dtype) -> torch.Tensor:
    a = torch.zeros(graph.num_dst, graph.num_src, dtype=dtype, device=graph.device)
    src, dst = graph.edges()
    a[dst, src] = (torch.ones(graph.num_edges, dtype=dtype, device=graph.device)
                   if weight is None else weight)
    return a


@pytest.mark.parametrize("shape", [(7, 7, 20), (5, 9, 18), (6, 4, 0)])
def test_forward_matches_dense(backend, shape):
    g = random_block(*shape, seed=1)
    x = torch.randn(g.num_src, 5, dtype=torch.float64, device=TEST_DEVICE)
    w = torch.rand(g.num_edges, dtype=torch.float64, device=TEST_DEVICE)
    a = dense(g, w, torch.float64)
    torch.testing.assert_close(spmm(g, x, w), a @ x)
    ones = dense(g, None, torch.float64)
    torch.testing.assert_close(spmm(g, x), ones @ x)
    deg = ones.sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(spmm(g, x, reduce="mean"), ones @ x / deg)


def test_multi_head_matches_per_head_dense(backend):
    g = random_block(8, 8, 30, seed=2)
    heads, chans = 3, 4
    x = torch.randn(8, heads * chans, dtype=torch.float64, device=TEST_DEVICE)
    w = torch.rand(g.num_edges, heads, dtype=torch.float64, device=TEST_DEVICE)
    out = spmm(g, x, w)
    for h in range(heads):
        ref = dense(g, w[:, h], torch.float64) @ x[:, h * chans:(h + 1) * chans]
        torch.testing.assert_close(out[:, h * chans:(h + 1) * chans], ref)


@pytest.mark.parametrize("mode", ["none", "mean", "scalar", "heads"])
def test_gradcheck(backend, mode):
    g = random_block(6, 9, 25, seed=3)
    x = torch.randn(g.num_src, 4, dtype=torch.float64, device=TEST_DEVICE,
                    requires_grad=True)
    if mode == "scalar":
        w = torch.rand(g.num_edges, dtype=torch.float64, device=TEST_DEVICE,
                       requires_grad=True)
        fn = lambda x, w: spmm(g, x, w)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w))
    elif mode == "heads":
        w = torch.rand(g.num_edges, 2, dtype=torch.float64, device=TEST_DEVICE,
                       requires_grad=True)
        fn = lambda x, w: spmm(g, x, w)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w))
    else:
        reduce = "mean" if mode == "mean" else "sum"
        assert torch.autograd.gradcheck(lambda x: spmm(g, x, reduce=reduce), (x,))


def test_float32_matches_float64(backend):
    g = random_block(50, 50, 400, seed=4)
    x = torch.randn(50, 16, dtype=torch.float64, device=TEST_DEVICE)
    w = torch.rand(g.num_edges, dtype=torch.float64, device=TEST_DEVICE)
    out32 = spmm(g, x.float(), w.float())
    # float32 accumulation of <= ~20 terms of size O(1): 1e-5 relative is ample
    torch.testing.assert_close(out32.double(), spmm(g, x, w), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    g = random_block(5, 5, 10, seed=5)
    with pytest.raises(ValueError, match="num_src=5"):
        spmm(g, torch.randn(4, 3, device=TEST_DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        spmm(g, torch.randn(5, 3, device=TEST_DEVICE), torch.rand(3, device=TEST_DEVICE))
    with pytest.raises(ValueError, match="do not split"):
        spmm(g, torch.randn(5, 3, device=TEST_DEVICE),
             torch.rand(g.num_edges, 2, device=TEST_DEVICE))


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba kernels")
def test_numba_spmm_prefetches_the_rows_ahead_and_sums_as_before():
    """The kernels ask for the source row PREFETCH_EDGES edges ahead (LLVM's prefetch
    in their code); rows with fewer and more edges than that sum as a plain loop does."""
    gen = torch.Generator().manual_seed(0)
    degrees = torch.tensor([0, 1, 3, kernels.PREFETCH_EDGES + 5, 2])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), degrees.cumsum(0)])
    indices = torch.randint(0, 7, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    x = torch.randn(7, 33, generator=gen)
    weight = torch.rand(int(indptr[-1]), generator=gen)
    out = torch.zeros(5, 33)
    kernels.spmm_scalar(indptr.numpy(), indices.numpy(), weight.numpy(), x.numpy(), out.numpy())
    expected = torch.zeros(5, 33)
    for i in range(5):
        for k in range(int(indptr[i]), int(indptr[i + 1])):
            expected[i] += weight[k] * x[int(indices[k])]
    torch.testing.assert_close(out, expected)
    fresh = kernels.numba.njit(kernels.spmm_scalar.py_func)  # the cached one hides its IR
    fresh(indptr.numpy(), indices.numpy(), weight.numpy(), x.numpy(), out.numpy())
    assert "llvm.prefetch" in "".join(fresh.inspect_llvm().values())


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba kernels")
def test_numba_kernels_split_rows_by_edges_and_cover_every_row():
    """The CSR kernels' row blocks cover every row once, in order, and hold about equal
    costs (in-edges plus one per row) even when a few rows hold most edges; the sums
    over such a graph are the plain loop's, in every thread count."""
    degrees = torch.cat([torch.tensor([5000, 3000]), torch.ones(998, dtype=torch.int64)])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), degrees.cumsum(0)])
    bounds = kernels._row_blocks(indptr.numpy())
    assert bounds[0] == 0 and bounds[-1] == 1000 and (bounds[1:] >= bounds[:-1]).all()
    costs = [int(indptr[b] - indptr[a]) + int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    assert sum(costs) == int(indptr[-1]) + 1000
    step = sum(costs) // kernels.ROW_BLOCKS + 1
    for a, b in zip(bounds[:-1], bounds[1:]):  # a block is over its share by its last row
        if b - a > 1:
            assert int(indptr[b - 1] - indptr[a]) + int(b - 1 - a) <= step
    for rows in (0, 3):  # fewer rows than blocks, and none
        few = indptr[: rows + 1].numpy()
        assert list(kernels._row_blocks(few))[-1] == rows
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 50, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    x, weight = torch.randn(50, 16, generator=gen), torch.rand(int(indptr[-1]), generator=gen)
    expected = torch.zeros(1000, 16).index_add_(
        0, torch.repeat_interleave(torch.arange(1000), degrees), weight[:, None] * x[indices])
    for threads in (1, 2):
        kernels.set_threads(threads)
        out = torch.zeros(1000, 16)
        kernels.spmm_scalar(indptr.numpy(), indices.numpy(), weight.numpy(), x.numpy(),
                            out.numpy())
        torch.testing.assert_close(out, expected)
    kernels.set_threads(torch.get_num_threads())


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba kernels")
def test_numba_spmm_kernels_overwrite_their_output():
    """The callers allocate the output with ``torch.empty``: every row is written,
    rows without in-edges too, whatever the memory held before."""
    indptr = torch.tensor([0, 2, 2, 5, 5])  # rows 1 and 3 have no in-edges
    indices = torch.tensor([0, 3, 1, 2, 3], dtype=torch.int32)
    x = torch.randn(4, 6, dtype=torch.float64)
    w = torch.rand(5, dtype=torch.float64)
    dense = torch.zeros(4, 4, dtype=torch.float64)
    dense[torch.repeat_interleave(torch.arange(4), indptr.diff()), indices.long()] = w
    args = (indptr.numpy(), indices.numpy())
    cases = {
        "scalar": (lambda out: kernels.spmm_scalar(*args, w.numpy(), x.numpy(), out), dense @ x),
        "weighted": (lambda out: kernels.spmm_weighted(*args, w[:, None].numpy(), x.numpy(),
                                                       out), dense @ x),
        "unweighted": (lambda out: kernels.spmm_unweighted(*args, x.numpy(), out, False),
                       (dense != 0).double() @ x),
    }
    for name, (run, expected) in cases.items():
        out = torch.full((4, 6), float("nan"), dtype=torch.float64)
        run(out.numpy())
        torch.testing.assert_close(out, expected, msg=name)


def test_edge_dot_of_an_empty_column_slice_is_zero():
    """A worker's column slice may be empty: the SDDMM then gives zeros, not an error."""
    g = random_block(6, 5, 14, seed=2)
    a = torch.zeros(6, 0, device=TEST_DEVICE)
    b = torch.zeros(5, 0, device=TEST_DEVICE)
    set_backend("torch")
    try:
        out = edge_dot(g, a, b)
    finally:
        set_backend("auto")
    assert out.shape == (g.num_edges, 1) and not out.any()


@pytest.mark.parametrize("symmetric", [True, False])
def test_backward_reading_fixed_weights_in_order_gives_the_same_bits(backend, symmetric):
    # the transposed product reads fixed edge weights (GCN's norms) in the transpose's
    # order instead of through its permutation: the same sums in the same order
    from fullgraph.graph.csr import gcn_norm
    from fullgraph.ops.spmm import _transposed_numba, aggregate

    g = torch.Generator().manual_seed(5)
    src, dst = torch.randint(0, 60, (500,), generator=g), torch.randint(0, 60, (500,), generator=g)
    graph = Graph.from_edges(src.numpy(), dst.numpy(), 60, symmetrize=symmetric).to(TEST_DEVICE)
    w64 = gcn_norm(graph).to(torch.float64)
    x = torch.randn(60, 7, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    grad = torch.randn(60, 7, dtype=torch.float64, device=TEST_DEVICE)
    grads = []
    for _ in range(2):  # through the permutation, then in order (the weights seen twice)
        spmm(graph, x, w64).backward(grad)
        grads.append(x.grad)
        x.grad = None
    t = graph.transpose()
    assert t.weights_in_order(w64) is not None
    if backend == "numba":
        expected = _transposed_numba(t, grad, w64)
    else:
        expected = aggregate(t.graph, grad, w64[t.perm], "sum")
    assert torch.equal(grads[0], expected) and torch.equal(grads[1], expected)


def test_spmm_add_accumulates_in_place_and_differentiates(backend):
    """``spmm_add_(out, g, x, w)`` is ``out + spmm(g, x, w)`` written into ``out``; its
    gradient reaches ``out`` unchanged and ``x`` through the transpose; bad shapes and
    trainable weights are refused."""
    g = random_block(6, 9, 25, seed=5)
    w = torch.rand(g.num_edges, dtype=torch.float64, device=TEST_DEVICE)
    base = torch.randn(6, 4, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    x = torch.randn(9, 4, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    out = base * 2  # a non-leaf, as the sum of an earlier block
    storage = out.data_ptr()
    got = spmm_add_(out, g, x, w)
    assert got.data_ptr() == storage
    torch.testing.assert_close(got, base.detach() * 2 + dense(g, w, torch.float64) @ x.detach())
    grad = torch.randn(6, 4, dtype=torch.float64, device=TEST_DEVICE)
    got.backward(grad)
    torch.testing.assert_close(base.grad, 2 * grad)
    torch.testing.assert_close(x.grad, dense(g, w, torch.float64).T @ grad)
    assert torch.autograd.gradcheck(lambda b, x: spmm_add_(b * 1.0, g, x, w), (base, x))
    with pytest.raises(ValueError, match="out must be"):
        spmm_add_(torch.zeros(5, 4, dtype=torch.float64), g, x, w)
    with pytest.raises(ValueError, match="fixed"):
        spmm_add_(torch.zeros(6, 4, dtype=torch.float64), g, x, w.clone().requires_grad_())


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba kernels")
def test_split_aggregate_reads_two_buffers_and_sums_as_the_joined_rows():
    """Over a graph that lists each row's in-edges from the first n sources first,
    ``split_aggregate(g, x, halo, w)`` equals the kernel over ``cat([x, halo])`` to the
    bit, weighted and not, rows longer than the prefetch distance included; a graph
    that does not list them so, or the torch backend, is not split."""
    gen = torch.Generator().manual_seed(3)
    n, h = 9, 6
    degrees = torch.tensor([0, 3, kernels.PREFETCH_EDGES + 7, 1, 5, 2 * kernels.PREFETCH_EDGES])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), degrees.cumsum(0)])
    indices = torch.randint(0, n + h, (int(indptr[-1]),), generator=gen)
    rows = torch.repeat_interleave(torch.arange(degrees.numel()), degrees)
    order = torch.from_numpy(np.lexsort(((indices >= n).numpy(), rows.numpy())))
    mixed, grouped = Graph(indptr, indices, num_src=n + h), Graph(indptr, indices[order],
                                                                  num_src=n + h)
    split = grouped.source_split(n)
    assert split is not None and mixed.source_split(n) is None
    assert torch.equal(split - indptr[:-1], torch.bincount(rows, weights=(indices < n).double(),
                                                           minlength=6).long())
    x, halo = torch.randn(n, 19, generator=gen), torch.randn(h, 19, generator=gen)
    set_backend("numba")
    try:
        for w in (None, torch.rand(grouped.num_edges, generator=gen)):
            assert splits(grouped, x, w) and not splits(mixed, x, w)
            got = split_aggregate(grouped, x, halo, w)
            assert torch.equal(got, aggregate(grouped, torch.cat([x, halo]), w, "sum"))
            # own rows padded to cache lines (``ops.padded``): read at their stride
            x47, halo47 = torch.randn(n, 47, generator=gen), torch.randn(h, 47, generator=gen)
            full = torch.zeros(n, 48)
            full[:, :47] = x47
            xp = padded.rows_of(full, 47)
            assert padded.widen(xp) is not None
            assert torch.equal(split_aggregate(grouped, xp, halo47, w),
                               aggregate(grouped, torch.cat([x47, halo47]), w, "sum"))
        with pytest.raises(ValueError, match="first"):
            split_aggregate(mixed, x, halo, None)
        with pytest.raises(ValueError, match="first"):
            split_aggregate(grouped, x, halo[1:], None)
        set_backend("torch")
        assert not splits(grouped, x, None)
    finally:
        set_backend("auto")
