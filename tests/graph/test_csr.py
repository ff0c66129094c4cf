"""CSR builders, validation, transpose and normalisation against plain references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.errors import ValidationError
from fullgraph.graph import kernels as graph_kernels
from fullgraph.graph.csr import Graph, gcn_norm, index_dtype, mean_norm


def edge_set(g: Graph) -> list[tuple[int, int]]:
    src, dst = g.edges()
    return list(zip(src.tolist(), dst.tolist()))


def test_from_edges_sorts_by_destination_and_dedups():
    g = Graph.from_edges(np.array([2, 0, 2, 1, 0]), np.array([1, 1, 1, 0, 2]), 3)
    assert g.indptr.tolist() == [0, 1, 3, 4]
    assert edge_set(g) == [(1, 0), (0, 1), (2, 1), (0, 2)]
    assert g.indices.dtype == torch.int32 and g.indptr.dtype == torch.int64


def test_from_edges_keeps_duplicates_when_asked():
    g = Graph.from_edges(np.array([2, 2]), np.array([1, 1]), 3, dedup=False)
    assert g.num_edges == 2


@pytest.mark.parametrize("loops", ["keep", "add", "remove"])
@pytest.mark.parametrize("symmetrize", [False, True])
def test_builder_matches_set_reference(loops, symmetrize):
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 40, 300), rng.integers(0, 40, 300)
    g = Graph.from_edges(src, dst, 40, symmetrize=symmetrize, self_loops=loops)
    ref = set(zip(src.tolist(), dst.tolist()))
    if symmetrize:
        ref |= {(d, s) for s, d in ref}
    if loops != "keep":
        ref = {(s, d) for s, d in ref if s != d}
    if loops == "add":
        ref |= {(v, v) for v in range(40)}
    assert edge_set(g) == sorted(ref, key=lambda e: (e[1], e[0]))


def test_out_of_range_and_negative_ids_are_refused():
    with pytest.raises(ValidationError, match=r"src\[1\].*found 5.*0 <= id < 5"):
        Graph.from_edges(np.array([0, 5]), np.array([1, 1]), 5)
    with pytest.raises(ValidationError, match="negative vertex id"):
        Graph.from_edges(np.array([0, 1]), np.array([-1, 1]), 5)
    with pytest.raises(ValidationError, match="integers"):
        Graph.from_edges(np.array([0.5]), np.array([1.0]), 5)


def test_invalid_csr_is_refused():
    with pytest.raises(ValidationError, match="start at 0"):
        Graph(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValidationError, match="non-decreasing"):
        Graph(torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValidationError, match="out of range"):
        Graph(torch.tensor([0, 1]), torch.tensor([3]))


def test_transpose_lists_out_edges_and_is_cached():
    rng = np.random.default_rng(1)
    g = Graph.from_edges(rng.integers(0, 30, 200), rng.integers(0, 30, 200), 30)
    t = g.transpose()
    assert t is g.transpose()
    src, dst = g.edges()
    t_src, t_dst = t.graph.edges()  # in the transpose, "dst" is the original source
    assert torch.equal(t_dst, src[t.perm]) and torch.equal(t_src, dst[t.perm])
    assert torch.equal(t.graph.in_degrees(), g.out_degrees())


def test_bipartite_block():
    g = Graph(torch.tensor([0, 2, 3]), torch.tensor([0, 4, 1]), num_src=5)
    assert (g.num_dst, g.num_src) == (2, 5)
    assert g.transpose().graph.num_dst == 5
    with pytest.raises(ValueError, match="bipartite"):
        _ = g.num_nodes


def test_gcn_and_mean_norm_match_dense():
    rng = np.random.default_rng(2)
    g = Graph.from_edges(rng.integers(0, 20, 80), rng.integers(0, 20, 80), 20,
                         symmetrize=True, self_loops="add")
    a = torch.zeros(20, 20, dtype=torch.float64)
    src, dst = g.edges()
    a[dst, src] = 1.0
    d = a.sum(1).rsqrt()
    ref = d[:, None] * a * d[None, :]
    torch.testing.assert_close(gcn_norm(g, torch.float64), ref[dst, src])
    torch.testing.assert_close(mean_norm(g, torch.float64), (a / a.sum(1, keepdim=True))[dst, src])


def test_with_self_loops_gives_exactly_one_per_vertex():
    g = Graph.from_edges(np.array([0, 1, 1]), np.array([0, 2, 1]), 4)
    with_loops = g.with_self_loops(True)
    src, dst = with_loops.edges()
    assert int((src == dst).sum()) == 4
    assert not g.with_self_loops(False).has_self_loops()


def test_index_dtype_widens_past_int32():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31 + 5) == torch.int64


@pytest.mark.skipif(not graph_kernels.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("symmetrize, loops", [(False, "keep"), (True, "remove"),
                                               (False, "add")])
def test_row_kernels_equal_the_vectorised_path(monkeypatch, symmetrize, loops):
    """Self-loops, the loop test, the transpose and the norms by row loops (no (E,)
    int64 temporaries) give the numpy path's arrays bit for bit."""
    from fullgraph.graph import synthetic

    g = synthetic.rmat(3000, 40000, symmetrize=symmetrize, self_loops=loops, seed=2).graph
    bipartite = Graph(g.indptr[:1201], g.indices[:int(g.indptr[1200])], num_src=3000)

    def build(graph):
        fresh = Graph(graph.indptr, graph.indices, graph.num_src, validate=False)
        t = fresh.transpose()
        out = [t.graph.indptr, t.graph.indices, t.perm]
        if graph.num_src == graph.num_dst:
            out += [graph.has_self_loops(), gcn_norm(graph), gcn_norm(graph, torch.float64),
                    mean_norm(graph)]
            for present in (True, False):
                h = graph.with_self_loops(present)
                out += [h.indptr, h.indices]
        return out

    for graph in (g, bipartite):
        fast = build(graph)
        monkeypatch.setattr(graph_kernels, "HAVE_NUMBA", False)
        slow = build(graph)
        monkeypatch.setattr(graph_kernels, "HAVE_NUMBA", True)
        for a, b in zip(fast, slow):
            if isinstance(a, bool):
                assert a == b
            else:
                assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("numba", [True, False])
def test_norms_written_into_a_given_array_equal_the_made_ones(monkeypatch, numba):
    """Every norm with ``out`` (a file's array, for a spill) writes the weights it
    returns otherwise, by the row kernels and without them."""
    from fullgraph.graph import csr, synthetic
    from fullgraph.graph.csr import NORMS

    monkeypatch.setattr(graph_kernels, "HAVE_NUMBA", numba and graph_kernels.HAVE_NUMBA)
    monkeypatch.setattr(csr, "_ROW_STEP", 64)  # rows in chunks
    g = synthetic.rmat(700, 6000, self_loops="add", seed=3).graph
    for name, norm in NORMS.items():
        out = torch.full((g.num_edges,), -1.0, dtype=torch.float64)
        got = norm(g, torch.float64, None, out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, norm(g, torch.float64)), name


@pytest.mark.skipif(not graph_kernels.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("chunk", [1, 7, 500, 10**9])
def test_transpose_in_source_ranges_equals_the_whole_one(chunk):
    """The external transpose (``transpose_into``: one pass per range of sources whose
    out-edges fit ``chunk``) gives the in-memory one's arrays, with a hub of more
    out-edges than a chunk, sources without out-edges and a bipartite block."""
    from fullgraph.graph import synthetic

    g = synthetic.rmat(600, 9000, seed=5).graph
    bipartite = Graph(g.indptr[:301], g.indices[:int(g.indptr[300])], num_src=600)
    hub = Graph.from_edges(torch.zeros(50, dtype=torch.long), torch.arange(50), 60)
    for graph in (g, bipartite, hub):
        ref = Graph(graph.indptr, graph.indices, graph.num_src, validate=False).transpose()
        ids = np.full(graph.num_edges, -1, dtype=np.int32)
        perm = np.full(graph.num_edges, -1, dtype=np.int64)
        t_indptr = graph_kernels.transpose_into(graph.indptr.numpy(), graph.indices.numpy(),
                                                graph.num_src, ids, perm, chunk)
        assert np.array_equal(t_indptr, ref.graph.indptr.numpy())
        assert np.array_equal(ids, ref.graph.indices.numpy())
        assert np.array_equal(perm, ref.perm.numpy())


@pytest.mark.skipif(not graph_kernels.HAVE_NUMBA, reason="numba not installed")
def test_a_graph_already_looped_is_not_copied():
    from fullgraph.graph import synthetic

    looped = synthetic.rmat(500, 4000, self_loops="add").graph
    bare = synthetic.rmat(500, 4000, self_loops="remove").graph
    assert looped.with_self_loops(True) is looped
    assert bare.with_self_loops(False) is bare
    assert looped.with_self_loops(False) is not looped
    twice = Graph.from_edges(*looped.edges(), 500, dedup=False, self_loops="keep")
    doubled = Graph.from_edges(torch.cat([twice.edges()[0], torch.tensor([3])]),
                               torch.cat([twice.edges()[1], torch.tensor([3])]), 500,
                               dedup=False)
    fixed = doubled.with_self_loops(True)  # a vertex with two loops gets a copy with one
    assert fixed is not doubled and torch.equal(fixed.indices, looped.indices)


def test_transpose_built_by_sorting_equals_the_host_one():
    """The transpose a GPU graph builds (one stable sort, ``_transpose_on_device``) is
    the host's: same offsets, sources and permutation."""
    gen = torch.Generator().manual_seed(4)
    g = Graph.from_edges(torch.randint(0, 30, (200,), generator=gen),
                         torch.randint(0, 25, (200,), generator=gen), 30, dedup=False)
    sorted_t, host_t = g._transpose_on_device(), g.transpose()
    assert torch.equal(sorted_t.graph.indptr, host_t.graph.indptr)
    assert torch.equal(sorted_t.graph.indices.long(), host_t.graph.indices.long())
    assert torch.equal(sorted_t.perm.long(), host_t.perm.long())


def test_a_symmetric_graph_mirrors_its_transpose_and_shares_its_arrays():
    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, 40, 300), rng.integers(0, 40, 300)
    sym = Graph.from_edges(src, dst, 40, symmetrize=True)
    t = sym.transpose()
    assert t.mirrors and t.graph.indices is sym.indices and t.graph.indptr is sym.indptr
    src_e, dst_e = sym.edges()  # the permutation still maps each edge to its reverse
    assert torch.equal(t.graph.edges()[1], src_e[t.perm])
    directed = Graph.from_edges(src, dst, 40)
    assert not directed.transpose().mirrors


def test_fixed_weights_in_the_transposes_order_are_made_once():
    from fullgraph.graph.csr import gcn_norm

    rng = np.random.default_rng(3)
    src, dst = rng.integers(0, 40, 300), rng.integers(0, 40, 300)
    for symmetric in (True, False):
        g = Graph.from_edges(src, dst, 40, symmetrize=symmetric)
        t = g.transpose()
        w = gcn_norm(g)
        assert t.weights_in_order(w) is None  # the first time: not yet known to be fixed
        ordered = t.weights_in_order(w)
        assert torch.equal(ordered, w[t.perm])
        assert t.weights_in_order(w) is ordered  # kept for this tensor
        # GCN's norms on a symmetric graph are symmetric: no copy at all
        assert (ordered is w) == symmetric
        w.mul_(2.0)  # changed in place: asked about afresh
        assert t.weights_in_order(w) is None
        assert torch.equal(t.weights_in_order(w), w[t.perm])
        assert t.weights_in_order(torch.rand(g.num_edges, requires_grad=True)) is None
        assert t.weights_in_order(torch.rand(g.num_edges, 2)) is None
    asym = Graph.from_edges(src, dst, 40, symmetrize=True)
    w = torch.rand(asym.num_edges, dtype=torch.float64)  # a symmetric graph, weights not
    t = asym.transpose()
    assert t.weights_in_order(w) is None
    assert torch.equal(t.weights_in_order(w), w[t.perm])
    assert asym.transpose() is t  # the mirror check runs once, when the transpose is built
