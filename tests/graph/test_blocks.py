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
