"""A whole-graph view of per-part shards, for strategies that propagate every vertex.

Tensor parallelism (NeutronTP) gives every worker a slice of the columns of every
vertex for its P stages, so each worker holds the whole topology by design; its T
stages read a contiguous block of feature rows. Task parallelism (NeutronTask) is
the same for its T and P groups. On per-part shards (``partition.shards``) neither
is on one worker's disk: each holds its own vertices' in-edges and feature rows.
``assemble`` builds what such a strategy needs through collectives at setup: the
whole stored graph from every part's in-edges (an all-gather, in the stored order,
so edge ids and edge-keyed dropout match the whole dataset), and the feature rows a
worker asks for from the parts that hold them (one all-to-all). Feature rows nobody
asked for stay where they are, so a worker holds its block, not the whole matrix.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.graph.sparse import densify, is_sparse, to_sparse


def whole_graph(dataset: Dataset, comm: Comm) -> Graph:
    """The whole stored graph from the parts' own in-edges (collective).

    Raises:
        ValueError: the parts' edges do not add up to the whole graph's.
    """
    sh = dataset.shard
    assert sh is not None, "whole_graph: the dataset is not a per-part shard"
    graph, part_of = dataset.graph, sh.part_of
    n = graph.num_dst
    own = torch.nonzero(part_of == comm.rank).flatten()
    counts = torch.zeros(n, dtype=torch.int64)
    counts[own] = graph.indptr[own + 1].to(torch.int64) - graph.indptr[own].to(torch.int64)
    prim.all_reduce_(counts, comm, "setup")
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    if int(indptr[-1]) != sh.num_edges:
        raise ValueError(f"dataset {dataset.name!r}: the {sh.parts} parts hold "
                         f"{int(indptr[-1])} in-edges of their own vertices, the whole graph "
                         f"{sh.num_edges}; the shards are not of one partition")
    _, src, _ = in_edges(graph, own.numpy())
    sizes = [int(s) for s in prim.all_gather_object(src.size, comm, "setup")]
    chunks = prim.all_gather_rows(torch.from_numpy(src).to(graph.indices.dtype), sizes, comm,
                                  "setup")
    indices = torch.empty(int(indptr[-1]), dtype=graph.indices.dtype)
    for q, chunk in enumerate(chunks):  # part q's rows, ascending, each in stored order
        rows = torch.nonzero(part_of == q).flatten()
        lens = counts[rows]
        ends = torch.cumsum(lens, 0)
        pos = torch.repeat_interleave(indptr[rows] - (ends - lens), lens) + \
            torch.arange(int(ends[-1]) if ends.numel() else 0)
        indices[pos] = chunk
    return Graph(indptr.to(graph.indptr.dtype), indices, num_src=n)


def gather_rows(dataset: Dataset, blocks: list[Tensor], comm: Comm) -> Tensor:
    """The feature rows ``blocks[comm.rank]`` (ascending global ids) from the parts that
    hold them, ``blocks[t]`` being what worker t asks for (collective; dense rows
    travel, CSR features come back as CSR)."""
    sh = dataset.shard
    assert sh is not None, "gather_rows: the dataset is not a per-part shard"
    data, part_of = dataset.data, sh.part_of
    send = []
    for ids in blocks:  # the rows of each asker's block that this part holds
        mine = ids[part_of[ids] == comm.rank]
        send.append(densify(data.take_features(mine)))
    want = blocks[comm.rank]
    owner = part_of[want]
    counts = [int((owner == q).sum()) for q in range(comm.world_size)]
    got = prim.all_to_all_v(send, counts, comm, "setup")
    width = int(data.features.shape[1])
    rows = torch.empty(want.numel(), width, dtype=send[comm.rank].dtype)
    for q, block in enumerate(got):
        rows[owner == q] = block
    return to_sparse(rows) if is_sparse(data.features) else rows


def assemble(dataset: Dataset, comm: Comm, rows: list[Tensor],
             graph: Graph | None = None) -> Dataset:
    """``dataset`` (a per-part shard) with the whole graph (``graph`` when it was
    gathered already) and the feature rows ``rows[comm.rank]`` (``VertexData.row_ids``),
    worker t holding ``rows[t]`` (collective). Labels and masks cover every vertex."""
    graph = whole_graph(dataset, comm) if graph is None else graph
    features = gather_rows(dataset, rows, comm)
    data = dataclasses.replace(dataset.data, features=features, row_ids=rows[comm.rank])
    return dataclasses.replace(dataset, graph=graph, data=data, shard=None)


def contiguous_blocks(row_counts: list[int]) -> list[Tensor]:
    """Consecutive id blocks of ``row_counts`` rows each."""
    starts = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    return [torch.arange(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
