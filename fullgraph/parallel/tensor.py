"""Tensor parallelism (NeutronTP): vertex tensors split by columns for propagation.

Every worker holds the whole graph topology. T stages run on ``Shard(0)``: worker r
owns a contiguous block of about N/R vertices and their whole rows. P stages run on
``Shard(1)``: every vertex, a slice of about D/R columns, with the full graph and no
communication (propagation is linear and column-independent). The executor keeps
track of the current placement and changes it only when the next stage needs the
other one (NeutronTP §3.1):
- before a P stage on rows: ``split`` (rows -> columns, all-to-all);
- before a T or E stage on columns: ``gather`` (columns -> rows, all-to-all).

So the program decides the communication: a coupled model alternates (naive tensor
parallelism, 2 collectives per layer), a decoupled one runs all T stages, one split,
K propagations, one gather: 4 collective rounds per epoch with the backward,
whatever L and K are (NeutronTP §4.1).

E stages (GAT attention) need whole rows of both endpoints: each worker computes the
coefficients of the in-edges of the destinations it owns, fetching the source rows
it does not own (a halo exchange), and the coefficients are then shared with every
worker (all-gather; its backward sums the coefficient gradients back to the owner),
so each can propagate its column slice. Attention parameters are trained (their
gradients flow through the shared coefficients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import Comm
from fullgraph.comm.placement import (
    RowColLayout,
    cols_to_rows,
    gather_rows,
    halo_fetch,
    rows_to_cols,
)
from fullgraph.comm.reduce import row_sum
from fullgraph.fields import option
from fullgraph.graph.blocks import Block, build_block, in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.memory import MemoryAccount, parse_bytes
from fullgraph.models.stages import EdgeTransform, StageContext, StageProgram, propagation_inputs
from fullgraph.models.walk import Carry, Runner, describe, has_edge_stage, walk
from fullgraph.ops import spmm
from fullgraph.ops.chunked import Chunk, build_chunks, chunked_spmm
from fullgraph.parallel.base import DistributedStrategy, LocalResult, Plan, Work, register
from fullgraph.schedule.chunks import spread_chunks
from fullgraph.schedule.pipeline import Segment, first_reads, pipelined_propagation

COLUMN_SPLITS = ("balanced", "even")
"""``column_split``: equal work and bytes per worker, or near-equal slices."""


@dataclass
class EdgePlan:
    """What an E stage needs on this worker: its block and the halo of source rows."""

    block: Block
    table: ExchangeTable | None
    edge_counts: list[int]


@dataclass
class TensorPlan(Plan):
    """A worker's state for tensor-parallel execution."""

    comm: Comm
    graph: Graph
    norms: dict[str, Tensor]
    row_counts: list[int]
    gids: Tensor
    features: Tensor
    edges: EdgePlan | None = None
    layouts: dict[int, RowColLayout] = field(default_factory=dict)
    chunks: list[Chunk] | None = None
    account: MemoryAccount | None = None
    first_reads: list[Tensor] | None = None
    _device_graph: Graph | None = None

    column_split: str = "balanced"

    def device_graph(self) -> Graph:
        """The graph on the propagation device (cached)."""
        if self._device_graph is None:
            self._device_graph = self.graph.to(self.device)
        return self._device_graph

    def layout(self, dim: int) -> RowColLayout:
        if dim not in self.layouts:
            make = RowColLayout.balanced if self.column_split == "balanced" else \
                RowColLayout.for_rows
            self.layouts[dim] = make(self.row_counts, dim)
        return self.layouts[dim]


@register
class TensorParallel(DistributedStrategy[TensorPlan]):
    """Column-split propagation, row-split transforms (NeutronTP)."""

    name = "tensor"
    section = "tensor_parallel"

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of tensor parallelism (NeutronTP §4.2).

        Attributes:
            device_memory: budget for propagation on the device, e.g. ``"2GB"``; the
                graph is then cut into chunks that fit it, its topology and edge
                weights kept in host memory and streamed chunk by chunk. The budget
                bounds the streamed working set only; the rows of transform stages
                that run on the device stay there (``MemoryAccount.resident``)
                (default: None, the whole graph at once).
            num_chunks: cut into this many equal chunks instead (default: None).
            pipeline: cut each split and gather into per-chunk pieces that overlap the
                neighbouring chunk's aggregation, sending each vertex once (§4.2.2);
                uses 4 chunks unless a budget or a count is given (default: False).
            nn_device: run the T / E stages (and keep vertex rows) on this device, e.g.
                ``cpu`` while propagation streams chunks to the GPU, as NeutronTP does
                for graphs beyond device memory (default: None, the training device).
            column_split: ``balanced``: D // R columns per worker and the D % R
                remaining ones propagated by every worker, so work and bytes are equal
                on every worker; ``even``: near-equal slices, no repeated work, up to
                one column more on some workers (default: ``balanced``).
        """

        device_memory: str | None = option(None, "device budget for propagation, e.g. 2GB: "
                                           "the graph streams through it in chunks; unset: the "
                                           "whole graph at once")
        num_chunks: int | None = option(None, "cut the graph into this many equal chunks; "
                                          "unset: as --device-memory needs")
        column_split: str = option("balanced", "how feature columns are split over workers",
                                   choices=COLUMN_SPLITS)
        pipeline: bool = option(False, "overlap each chunk's communication with the next "
                                "chunk's aggregation")
        nn_device: str | None = option(None, "run the dense (T / E) stages on this device, "
                                       "e.g. cpu; unset: --device")

        def __post_init__(self) -> None:
            if self.column_split not in COLUMN_SPLITS:
                raise ValueError(f"column_split {self.column_split!r}; expected balanced or even")
            if self.device_memory is not None:
                parse_bytes(self.device_memory)  # raises on a bad size
            if self.num_chunks is not None and self.num_chunks < 1:
                raise ValueError(f"num_chunks must be >= 1, got {self.num_chunks}")

    options: Options

    def model_device(self, device: torch.device) -> torch.device:
        return torch.device(self.options.nn_device) if self.options.nn_device else device

    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> TensorPlan:
        if comm is None:
            from fullgraph.comm.group import single_comm

            comm = single_comm()
        graph, norms = propagation_inputs(program, dataset.graph, dtype)
        graph.transpose()  # the backward CSR, built once
        rows_device = self.model_device(device)  # where T stages and vertex rows live
        # chunked propagation streams the topology and edge weights from host memory
        graph_device = torch.device("cpu") if self._chunked else rows_device
        n, world = graph.num_dst, comm.world_size
        row_counts = [n // world + (1 if r < n % world else 0) for r in range(world)]
        start = sum(row_counts[:comm.rank])
        gids = torch.arange(start, start + row_counts[comm.rank])
        data = dataset.data
        masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
        plan = TensorPlan(
            device=device, labels=data.labels[gids].to(rows_device),
            masks={k: v[gids].to(rows_device) for k, v in masks.items()},
            num_train_global=int(data.train_mask.sum()), comm=comm,
            graph=graph.to(graph_device),
            norms={k: v.to(graph_device) for k, v in norms.items()},
            row_counts=row_counts, gids=gids.to(rows_device),
            features=data.features[gids].to(dtype).to(rows_device),
            column_split=self.options.column_split)
        if has_edge_stage(program):
            plan.edges = _edge_plan(graph, row_counts, comm)
            plan.edges.block = plan.edges.block.to(rows_device)
        self._chunk(program, plan, dtype)
        if plan.account is not None and rows_device == device:
            _count_resident(program, plan, dtype)
        return plan

    @property
    def _chunked(self) -> bool:
        opts = self.options
        return opts.device_memory is not None or opts.num_chunks is not None or opts.pipeline

    def _chunk(self, program: StageProgram, plan: TensorPlan, dtype: torch.dtype) -> None:
        """Cut the graph into destination chunks when a budget or a count is given."""
        opts = self.options
        if not self._chunked:
            return
        widest = max((plan.layout(program.stages[i.index].in_dim).local_cols(plan.comm.rank)
                      for i in describe(program) if i.is_propagate), default=1)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        budget = parse_bytes(opts.device_memory) if opts.device_memory is not None else None
        count = None if budget is not None else (opts.num_chunks or 4)
        ranges = spread_chunks(plan.graph.indptr, plan.row_counts, widest, itemsize,
                               budget=budget, num_chunks=count)
        plan.chunks = build_chunks(plan.graph.to("cpu"), ranges)
        plan.account = MemoryAccount(budget)
        if opts.pipeline:
            plan.first_reads = first_reads(plan.chunks)

    def describe(self, model: StageProgram, plan: TensorPlan) -> list[str]:
        if plan.chunks is None:
            return []
        account = plan.account
        assert account is not None
        budget = "no budget" if account.budget is None else f"budget {account.budget} B"
        line = (f"tensor   {len(plan.chunks)} chunks ({budget}) streamed from host memory"
                f"{', pipelined' if plan.first_reads is not None else ''}")
        if account.resident:
            kept = ", ".join(f"{k} {v} B" for k, v in account.resident.items())
            line += f"; resident on {plan.device} beside them: {kept}"
        return [line]

    def work(self, model: StageProgram, plan: TensorPlan) -> Work:
        """Every edge on this worker's column slice per P; own edges for E stages."""
        n_edges, rank = plan.graph.num_edges, plan.comm.rank
        edges = dims = 0
        for info, s in zip(describe(model), model.stages):
            if info.is_propagate:
                cols = plan.layout(s.in_dim).local_cols(rank)
                edges, dims = edges + n_edges, dims + n_edges * cols
            elif info.is_edge:
                own = plan.edges.edge_counts[rank] if plan.edges else n_edges
                edges, dims = edges + own, dims + own * s.in_dim
        return Work(edges, 0, dims)

    def forward(self, model: StageProgram, plan: TensorPlan, *, training: bool,
                seed: int) -> LocalResult:
        runner = _PlacementRunner(plan, seed, training)
        h = walk(model, runner, plan.features)
        if not runner.on_rows:
            h = cols_to_rows(h, plan.layout(model.out_dim), plan.comm)
        return LocalResult(h, plan.gids)


class _PlacementRunner(Runner):
    """Stage hooks that keep track of the placement: T and E stages on this worker's
    rows (``Shard(0)``), P stages on every vertex's column slice (``Shard(1)``), with
    a gather or a split only when the next stage needs the other placement. A run of
    P stages entered from rows is one pipelined segment when chunks are pipelined."""

    def __init__(self, plan: TensorPlan, seed: int, training: bool) -> None:
        self.plan, self.on_rows = plan, True
        self.ctx = StageContext(plan.gids, seed, training,
                                row_sum=partial(row_sum, comm=plan.comm, phase="row-sum"))

    def _rows(self, h: Tensor, dim: int) -> Tensor:
        if not self.on_rows:  # gather: Shard(1) -> Shard(0)
            h, self.on_rows = cols_to_rows(h, self.plan.layout(dim), self.plan.comm), True
        return h

    def transform(self, s: int, stage: Any, h: Tensor, layer_input: Tensor | None) -> Tensor:
        return stage(self._rows(h, stage.in_dim), self.ctx, layer_input)

    def edge(self, s: int, stage: Any, h: Tensor) -> Tensor:
        return _edge_weights(self.plan, stage, self._rows(h, stage.in_dim), self.ctx)

    def propagate(self, s: int, stage: Any, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        plan = self.plan
        if self.on_rows:  # split: Shard(0) -> Shard(1)
            h, self.on_rows = rows_to_cols(h, plan.layout(h.shape[1]), plan.comm), False
        weight = plan.norms[stage.norm] if edge_weights is None else edge_weights
        return _propagate_cols(plan, h, weight, stage.in_dim)

    def propagate_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        plan = self.plan
        if not self.on_rows or plan.first_reads is None:
            return super().propagate_run(stages, program, h, carry)
        infos = describe(program)  # split, P ... P, gather in one pipeline
        weights = []
        for s in stages:
            src = infos[s].edge_weights_from
            weights.append(plan.norms[program.propagate_stage(s).norm] if src is None
                           else carry.edge_weights[src])
        assert plan.chunks is not None
        return pipelined_propagation(h, weights, Segment(
            plan.comm, plan.layout(program.stages[stages[0]].in_dim), plan.chunks,
            plan.first_reads, plan.device, plan.account))


def _count_resident(program: StageProgram, plan: TensorPlan, dtype: torch.dtype) -> None:
    """What stays on the compute device beside the streamed chunks when the transform
    stages run there too: their parameters (and gradients), this worker's feature rows,
    the activations autograd keeps (an estimate: every stage's output, rows for T / E,
    the column slice of all vertices for P) and the E stages' edge block."""
    account, itemsize = plan.account, torch.empty(0, dtype=dtype).element_size()
    assert account is not None
    rows, n = int(plan.gids.numel()), plan.graph.num_dst
    account.reside("feature rows", plan.features.numel() * itemsize)
    params = sum(p.numel() * p.element_size() for p in program.parameters())
    account.reside("parameters and gradients", 2 * params)
    acts = 0
    for info, s in zip(describe(program), program.stages):
        if info.is_propagate:
            acts += n * plan.layout(s.in_dim).local_cols(plan.comm.rank) * itemsize
        elif info.is_transform:
            acts += rows * s.out_dim * itemsize
    account.reside("activations (estimate)", acts)
    if plan.edges is not None:
        g = plan.edges.block.graph
        account.reside("edge block", g.indptr.numel() * g.indptr.element_size()
                       + g.indices.numel() * g.indices.element_size())


def _aggregate(plan: TensorPlan, h_cols: Tensor, weight: Tensor) -> Tensor:
    """One weighted SpMM over the whole graph, or chunk by chunk on the device."""
    if plan.chunks is None:
        if h_cols.device != plan.device:  # rows live elsewhere (nn_device): go and come back
            graph = plan.device_graph()
            return spmm(graph, h_cols.to(plan.device), weight.to(plan.device)).to(h_cols.device)
        return spmm(plan.graph, h_cols, weight)
    return chunked_spmm(plan.chunks, plan.graph.num_dst, h_cols, weight, plan.device,
                        plan.account)


def _propagate_cols(plan: TensorPlan, h_cols: Tensor, weight: Tensor, dim: int) -> Tensor:
    """P on this worker's column slice of all vertices; multi-head weights per head."""
    if weight.dim() == 1 or weight.shape[1] == 1:
        return _aggregate(plan, h_cols, weight.reshape(-1))
    chans = dim // weight.shape[1]
    parts, offset = [], 0
    for c0, c1 in plan.layout(dim).col_ranges(plan.comm.rank):
        for head in range(c0 // chans, (c1 - 1) // chans + 1):  # heads the range overlaps
            lo, hi = max(c0, head * chans), min(c1, (head + 1) * chans)
            parts.append(_aggregate(plan, h_cols[:, offset + lo - c0:offset + hi - c0],
                                    weight[:, head]))
        offset += c1 - c0
    return torch.cat(parts, dim=1) if parts else h_cols


def _edge_plan(graph: Graph, row_counts: list[int], comm: Comm) -> EdgePlan:
    """The block of this worker's destinations and the halo of their remote sources."""
    from fullgraph.comm import primitives as prim

    offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    lo, hi = int(offsets[comm.rank]), int(offsets[comm.rank + 1])
    own = np.arange(lo, hi, dtype=np.int64)
    _, src, _ = in_edges(graph, own)
    src = np.unique(src)
    fetched = src[(src < lo) | (src >= hi)]  # ascending gid = grouped by owner
    owners = np.searchsorted(offsets, fetched, side="right") - 1
    block = build_block(graph, own, own, fetched)
    indptr = graph.indptr
    edge_counts = [int(indptr[offsets[p + 1]] - indptr[offsets[p]])
                   for p in range(comm.world_size)]
    if comm.world_size == 1:
        return EdgePlan(block, None, edge_counts)
    needed_from = [torch.from_numpy(fetched[owners == p]) for p in range(comm.world_size)]
    counts = prim.all_to_all_v([torch.tensor([t.numel()]) for t in needed_from],
                               [1] * comm.world_size, comm, "setup")
    needed_by = prim.all_to_all_v(needed_from, [int(c) for c in counts], comm, "setup")
    table = ExchangeTable(send_idx=[g - lo for g in needed_by],
                          recv_rows=[t.numel() for t in needed_from])
    return EdgePlan(block, table, edge_counts)


def _edge_weights(plan: TensorPlan, stage: EdgeTransform, h_rows: Tensor,
                  ctx: StageContext) -> Tensor:
    """Coefficients of every edge: own destinations' edges computed here, then shared."""
    edges = plan.edges
    assert edges is not None, "an E stage needs the edge plan built in setup"
    halo = None if edges.table is None else halo_fetch(h_rows, edges.table, plan.comm,
                                                       "edge-halo")
    x_src = h_rows if halo is None else torch.cat([h_rows, halo])
    local = stage(edges.block.graph, h_rows, x_src,
                  StageContext(ctx.gids, ctx.seed, ctx.training, edges.block.eids))
    return gather_rows(local, edges.edge_counts, plan.comm, "edge-share")
