"""What every row-partitioned strategy shares: the strategy base and the partition.

A row-partitioned strategy (``data``, ``p2p``) gives worker i the rows V_i of a
vertex partition. ``RowPartitioned`` reads the strategy's own config section plus
the ``partition`` section; ``partition_book`` builds the partition every worker uses.
Strategies share code through this module, never by importing one another.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset, Shard
from fullgraph.launch import under_torchrun
from fullgraph.models.stages import StageProgram
from fullgraph.parallel.base import DistributedStrategy, PlanT
from fullgraph.parallel.rowplan import RowPlan
from fullgraph.partition import PartitionBook, PartitionOptions, partition


class RowPartitioned(DistributedStrategy[PlanT]):
    """A strategy over a vertex partition: its own options plus the partition section."""

    shared_sections = ("partition",)

    def __init__(self, options: Any = None, partition: PartitionOptions | None = None) -> None:
        super().__init__(options)
        self.partition = partition or PartitionOptions()

    @classmethod
    def from_sections(cls, sections: Mapping[str, Any]) -> RowPartitioned:
        assert cls.section is not None, f"{cls.__name__} declares no section"
        return cls(sections[cls.section], sections["partition"])

    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        if workers > num_nodes:
            raise ValueError(f"{workers} workers for a graph of {num_nodes} vertices: strategy "
                             f"{self.name!r} gives each worker a part of the vertices; use at "
                             f"most {num_nodes} workers")

    def partition_source(self, shard: Shard | None) -> str:
        """Where the run's partition came from, for its header line."""
        return ("per-part shards" if shard is not None else
                f"partition file {self.partition.file}" if self.partition.file
                else f"partitioner {self.partition.method}")

    @staticmethod
    def owned_targets(dataset: Dataset, owned: Tensor, device: torch.device) -> dict[str, Any]:
        """Plan fields for the rows ``owned``: labels, split masks, global train count."""
        data = dataset.data
        masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
        return {"device": device, "labels": data.labels[owned].to(device),
                "masks": {k: v[owned].to(device) for k, v in masks.items()},
                "num_train_global": int(data.train_mask.sum())}


def partition_book(dataset: Dataset, comm: Comm, opts: PartitionOptions) -> PartitionBook:
    """The partition every worker uses: a shard's own, loaded from ``opts.file`` or
    computed on rank 0 with ``opts.method`` and broadcast (collective)."""
    if dataset.shard is not None:
        if opts.file:
            raise ValueError(f"partition file {opts.file}: the dataset is per-part shards, "
                             "which carry their own partition; leave out --partition-file")
        sh = dataset.shard
        if (sh.part, sh.parts) != (comm.rank, comm.world_size):
            raise ValueError(f"dataset {dataset.name!r}: worker {comm.rank} of "
                             f"{comm.world_size} was given part {sh.part} of {sh.parts} "
                             "per-part shards; worker r trains on part r of as many parts as "
                             "there are workers")
        return PartitionBook.from_assignment(sh.part_of, sh.parts)
    if opts.file:
        book = PartitionBook.load(opts.file, num_nodes=dataset.graph.num_nodes)
        if book.num_parts != comm.world_size:
            raise ValueError(f"partition file {opts.file} has {book.num_parts} "
                             f"parts but there are {comm.world_size} workers")
        _check_same_book(book, opts.file, comm)  # (first: every rank then says the same)
        if under_torchrun():  # (the local launcher checked it before the workers started)
            book.check_made_for(dataset.graph, f"partition file {opts.file}")
        return book
    part_of = torch.zeros(dataset.graph.num_nodes, dtype=torch.int64)
    if comm.rank == 0:
        part_of = partition(dataset.graph, comm.world_size, opts.method,
                            seed=opts.seed).part_of.to(torch.int64)
    prim.broadcast_(part_of, 0, comm, "setup")  # every worker uses rank 0's partition
    return PartitionBook.from_assignment(part_of, comm.world_size)


def _check_same_book(book: PartitionBook, path: str, comm: Comm) -> None:
    """Refuse partition files whose contents differ between the workers (each host
    reads its own copy under torchrun; two assignments would leave vertices owned
    twice or never): compares the checksums the files carry. Collective."""
    every = prim.all_gather_object(book.checksum, comm, "setup")
    if len(set(every)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(every):
            groups.setdefault(d, []).append(rank)
        named = "; ".join(f"{d[:8]} on rank(s) {', '.join(map(str, r))}"
                          for d, r in groups.items())
        raise ValueError(f"partition file {path}: its contents differ between the workers "
                         f"({named}); give every host the same file")


def check_shard_rows(shard: Shard | None, rows: RowPlan, what: str) -> None:
    """On a per-part shard: every row a P / E stage of ``rows`` aggregates has its
    in-edges there (ValueError naming what lacks); nothing to check off shards."""
    if shard is None:
        return
    for s, block in enumerate(rows.blocks):
        if block is not None:
            shard.check_edge_rows(rows.rows[s], what)


def whole_edge_ids(graph: Graph, in_degree: Tensor, self_loops: bool) -> Tensor:
    """For a shard's propagation graph: each edge's id in the whole one. A row whose
    in-edges the shard holds has all of them, in the same order as there (sorted by
    source when self-loops were adjusted, as stored otherwise), and the whole graph's
    row starts follow from the in-degrees (plus the self-loop the program adds)."""
    starts = torch.zeros(in_degree.numel() + 1, dtype=torch.int64)
    torch.cumsum(in_degree + int(self_loops), 0, out=starts[1:])
    dst = graph.dst_index()
    return starts[dst] + (torch.arange(graph.num_edges) - graph.indptr[dst])
