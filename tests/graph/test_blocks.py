"""Local CSR blocks over a subset of destination rows."""
from __future__ import annotations

import numpy as np
import torch

from fullgraph.graph.blocks import build_block, in_edges
from fullgraph.graph.csr import Graph


def path_graph(n: int) -> Graph:
    src = np.arange(n - 1)
    return Graph.from_edges(src, src + 1, n, symmetrize=True)


def test_in_edges_lists_rows_in_csr_order():
    g = path_graph(5)
    indptr, src, eids = in_edges(g, np.array([3, 0]))
    assert indptr.tolist() == [0, 2, 3]
    assert src.tolist() == [2, 4, 1]
    assert torch.equal(g.indices[torch.from_numpy(eids)].long(), torch.from_numpy(src))


def test_build_block_indexes_sources_in_local_then_fetched_rows():
    g = path_graph(5)  # edges i <-> i+1
    dst = np.array([2, 1])
    cur = np.array([1, 2])
    fetched = np.array([3, 0])
    block = build_block(g, dst, cur, fetched)
    # row 2 reads 1, 3 -> local 0, fetched 2; row 1 reads 0, 2 -> fetched 3, local 1
    assert block.graph.num_dst == 2 and block.graph.num_src == 4
    assert block.graph.indptr.tolist() == [0, 2, 4]
    assert block.graph.indices.tolist() == [0, 2, 3, 1]
    assert block.dst_pos.tolist() == [1, 0]
    gids = np.concatenate([cur, fetched])
    sources = gids[block.graph.indices.numpy()]
    assert torch.equal(g.indices[block.eids].long(), torch.from_numpy(sources))


def test_build_block_local_first_lists_local_sources_first_in_order():
    """With ``local_first`` each row's in-edges from local rows come before those from
    fetched rows, each group in CSR order, with their edge ids; ``source_split`` finds
    where they meet, and finds none in the CSR-ordered block."""
    g = path_graph(5)
    dst, cur, fetched = np.array([2, 1]), np.array([1, 2]), np.array([3, 0])
    block = build_block(g, dst, cur, fetched, local_first=True)
    # row 2 reads 1 (local 0), 3 (fetched 2); row 1 reads 2 (local 1), then 0 (fetched 3)
    assert block.graph.indices.tolist() == [0, 2, 1, 3]
    assert block.graph.source_split(2).tolist() == [1, 3]
    assert build_block(g, dst, cur, fetched).graph.source_split(2) is None
    gids = np.concatenate([cur, fetched])
    sources = gids[block.graph.indices.numpy()]
    assert torch.equal(g.indices[block.eids].long(), torch.from_numpy(sources))
    rng = np.random.default_rng(0)
    src, dst_all = rng.integers(0, 40, 300), rng.integers(0, 40, 300)
    big = Graph.from_edges(src, dst_all, 40)
    rows = np.arange(0, 40, 3)
    local = np.unique(np.concatenate([rows, np.arange(1, 40, 4)]))
    _, srcs, _ = in_edges(big, rows)
    far = np.setdiff1d(np.unique(srcs), local)
    plain = build_block(big, rows, local, far)
    first = build_block(big, rows, local, far, local_first=True)
    split = first.graph.source_split(local.size)
    assert split is not None
    for i in range(rows.size):
        a, b = int(plain.graph.indptr[i]), int(plain.graph.indptr[i + 1])
        ids = plain.graph.indices[a:b].numpy()
        expect = np.concatenate([ids[ids < local.size], ids[ids >= local.size]])
        assert first.graph.indices[a:b].numpy().tolist() == expect.tolist()
        assert int(split[i]) == a + int((ids < local.size).sum())
    assert torch.equal(big.indices[first.eids].long(),
                       torch.from_numpy(np.concatenate([local, far])[first.graph.indices.numpy()]))
