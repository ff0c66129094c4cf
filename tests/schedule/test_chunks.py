"""Chunk ranges under a memory budget, and chunked SpMM against the whole-graph SpMM."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.csr import Graph
from fullgraph.memory import MemoryAccount, parse_bytes
from fullgraph.ops import spmm
from fullgraph.ops.chunked import build_chunks, chunked_spmm
from fullgraph.schedule.chunks import chunk_footprint, chunk_ranges, even_ranges, spread_chunks


def graph(n=50, e=400, seed=0) -> Graph:
    rng = np.random.default_rng(seed)
    return Graph.from_edges(rng.integers(0, n, e), rng.integers(0, n, e), n, symmetrize=True)


def test_parse_bytes():
    assert parse_bytes("512MB") == 512 * 2**20
    assert parse_bytes("1.5G") == int(1.5 * 2**30)
    assert parse_bytes(1000) == 1000
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


def test_ranges_cover_rows_and_respect_the_budget():
    g = graph()
    budget = 4000
    ranges = chunk_ranges(g.indptr, budget, dim=4)
    assert ranges[0][0] == 0 and ranges[-1][1] == g.num_dst
    assert all(a == b0 for (_, a), (b0, _) in zip(ranges[:-1], ranges[1:]))
    deg = g.in_degrees()
    for a, b in ranges:
        assert chunk_footprint(b - a, int(deg[a:b].sum()), 4) <= budget
    assert len(chunk_ranges(g.indptr, 10**9, dim=4)) == 1


@pytest.mark.parametrize("spec", [{"num_chunks": 4}, {"budget": 4000}])
def test_spread_chunks_take_equal_rows_of_every_block(spec):
    """Every chunk holds the same rows (within one) of every worker's block, so each
    chunk's exchange is a balanced all-to-all; together they cover each row once."""
    g = graph(n=61, e=500)
    row_counts = [21, 20, 20]
    chunks = spread_chunks(g.indptr, row_counts, dim=4, **spec)
    assert len(chunks) > 1
    offsets = np.concatenate([[0], np.cumsum(row_counts)])
    covered = sorted(r for c in chunks for a, b in c for r in range(a, b))
    assert covered == list(range(61))
    deg = g.in_degrees()
    for c in chunks:
        per_block = [sum(max(0, min(b, hi) - max(a, lo)) for a, b in c)
                     for lo, hi in zip(offsets[:-1], offsets[1:])]
        assert max(per_block) - min(per_block) <= 1, (c, per_block)
        if "budget" in spec:
            rows, edges = sum(b - a for a, b in c), sum(int(deg[a:b].sum()) for a, b in c)
            assert chunk_footprint(rows, edges, 4) <= spec["budget"]


def test_multi_range_chunks_match_spmm():
    g = graph(n=12, e=30, seed=9)  # small: gradcheck perturbs every input in turn
    chunks = build_chunks(g, spread_chunks(g.indptr, [4, 4, 4], dim=2, num_chunks=3))
    assert all(len(c.ranges) == 3 for c in chunks)  # every chunk spans the three blocks
    x = torch.randn(g.num_src, 2, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: chunked_spmm(chunks, g.num_dst, x, w, torch.device("cpu")), (x, w))


def test_budget_too_small_for_one_vertex_is_refused():
    with pytest.raises(ValueError, match="raise --device-memory"):
        chunk_ranges(graph().indptr, 10, dim=4)


def test_a_budget_that_holds_a_vertex_but_not_a_row_of_every_block_is_refused():
    """Every chunk takes a row of each worker's block: where the budget holds the largest
    vertex but not such a row set, the chunks would overrun it (they did, silently)."""
    g = graph()
    ptr, dim, item = g.indptr.numpy(), 3, 8
    cost = np.diff(ptr) * (12 + item + dim * item) + (8 + dim * item)
    budget = int(cost.max()) + 8 + 10
    assert spread_chunks(g.indptr, [g.num_dst], dim, item, budget=budget)  # one block: fits
    with pytest.raises(ValueError, match=r"a row of each of the 3 workers' blocks \((\d+) "
                                         r"bytes at 3 columns\); raise --device-memory to \1"):
        spread_chunks(g.indptr, [17, 17, 16], dim, item, budget=budget)
    least = int(str(pytest.raises(ValueError, spread_chunks, g.indptr, [17, 17, 16], dim,
                                  item, budget=budget).value).split(" to ")[1].split()[0])
    chunks = spread_chunks(g.indptr, [17, 17, 16], dim, item, budget=least)
    worst = max(sum(chunk_footprint(b - a, int(ptr[b] - ptr[a]), dim, item) for a, b in c)
                - 8 * (len(c) - 1) for c in chunks)
    assert worst <= least


@pytest.mark.parametrize("num_chunks", [1, 3, 7])
def test_chunked_spmm_matches_spmm_and_its_gradients(num_chunks):
    g = graph(seed=num_chunks)
    chunks = build_chunks(g, even_ranges(g.num_dst, num_chunks))
    x = torch.randn(g.num_src, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    account = MemoryAccount()
    out = chunked_spmm(chunks, g.num_dst, x, w, torch.device("cpu"), account)
    ref = spmm(g, x, w)
    torch.testing.assert_close(out, ref)
    proj = torch.randn_like(ref)
    gx, gw = torch.autograd.grad((out * proj).sum(), (x, w))
    rx, rw = torch.autograd.grad((ref * proj).sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert account.current == 0 and account.peak > 0


def test_chunked_spmm_gradcheck():
    g = graph(n=10, e=24, seed=5)
    chunks = build_chunks(g, even_ranges(g.num_dst, 3))
    x = torch.randn(g.num_src, 2, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: chunked_spmm(chunks, g.num_dst, x, w, torch.device("cpu")), (x, w))
