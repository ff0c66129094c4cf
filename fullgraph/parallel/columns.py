"""Rows for T / E stages, columns for P stages: the placement machinery that tensor
parallelism (NeutronTP) and task parallelism (NeutronTask) share.

A ``ColumnPlan`` says which rows each rank holds for T and E stages
(``row_counts``) and which ranks hold column slices of every vertex for P stages
(``col_ranks``: every rank in tensor parallelism, the P group in task
parallelism). ``PlacementRunner`` walks a program keeping track of the current
placement and changes it only when the next stage needs the other one:
- before a P stage on rows: ``split`` (rows -> columns, all-to-all);
- before a T or E stage on columns: ``gather`` (columns -> rows, all-to-all).
With disjoint row and column ranks every split and gather is a hand-off between the
two groups.

E stages (GAT attention) need whole rows of both endpoints: each row rank computes
the coefficients of the in-edges of the destinations it owns, fetching the source
rows it does not own (a halo exchange), and the coefficients are then shared with
every rank (all-gather; its backward sums the coefficient gradients back to the
owner), so each column rank can propagate its slice.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import Comm
from fullgraph.comm.halo import halo_fetch
from fullgraph.comm.placement import (
    RowColLayout,
    cols_to_rows,
    even_counts,
    gather_rows,
    rows_to_cols,
    share_counts,
)
from fullgraph.comm.reduce import row_sum
from fullgraph.graph.blocks import Block, build_block, in_edges
from fullgraph.graph.csr import Graph, same_device
from fullgraph.memory import MemoryAccount
from fullgraph.models.stages import EdgeTransform, StageContext, StageProgram
from fullgraph.models.walk import (
    Carry,
    Runner,
    blocked_transform_run,
    describe,
    recomputed_transform_run,
    walk,
)
from fullgraph.ops import spmm
from fullgraph.ops.chunked import Chunk, chunked_spmm
from fullgraph.ops.sparse import nbytes
from fullgraph.ops.spill import Spill, spilled_spmm
from fullgraph.parallel.base import LocalResult, Plan, Work
from fullgraph.schedule.pipeline import Segment, pipelined_propagation


@dataclass
class EdgePlan:
    """What an E stage needs on this worker: its block and the halo of source rows."""

    block: Block
    table: ExchangeTable | None
    edge_counts: list[int]


@dataclass
class ColumnPlan(Plan):
    """A worker's state when T / E stages run on row blocks and P stages on column
    slices of every vertex.

    Attributes (besides ``Plan``'s):
        row_counts: rows each rank holds for T / E stages (0 on a rank that runs none).
        gids: (R,) global ids of this rank's rows.
        col_ranks: the ranks that hold column slices for P stages, or None for every
            rank (tensor parallelism). With a subset, columns are split evenly among
            them and none is shared.
        out_rows: when a program ends on a P stage, the rows each rank outputs (None:
            ``row_counts``), and ``out_gids`` their global ids on this rank.
        recompute: keep no activations of runs of T stages; recompute them in the
            backward pass (``recomputed_transform_run``).
        row_block: run T stages this many rows at a time, recomputing them in the
            backward pass (``blocked_transform_run``); None: all rows at once.
        row_dtype: with ``row_block``, the dtype the runs compute in when the input
            rows are kept in another (memory-mapped features in their stored dtype).
        shares: relative speed of each rank (tensor parallelism): every P stage's
            columns are split in proportion (``share_counts``, no shared columns);
            None: ``column_split``.
        col_counts: given column counts per P-stage width (override ``shares``).
        source: the dataset's vertex data, from which rows are re-taken when the
            row blocks change (``TensorParallel.replan``).
        edge_keep: when ``chunks`` hold only some edges (task parallelism's regroup
            mode), the CSR positions of those edges, which select the edge weights,
            and the factor each selected weight is scaled by.
        spill: keep the P stages' (N, D) column slices, the blocked T runs' outputs
            and their gradients in files, propagated a column chunk at a time
            (``ops.spill``); None: in memory.
    """

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
    prefetch: bool = False
    _device_graph: Graph | None = None

    column_split: str = "balanced"
    col_ranks: tuple[int, ...] | None = None
    recompute: bool = False
    row_block: int | None = None
    row_dtype: torch.dtype | None = None
    out_rows: list[int] | None = None
    out_gids: Tensor | None = None
    shares: tuple[float, ...] | None = None
    col_counts: dict[int, list[int]] = field(default_factory=dict)
    source: Any = None
    edge_keep: tuple[Tensor, Tensor] | None = None
    spill: Spill | None = None

    def matrix_maker(self) -> Callable[[int, int, torch.dtype], Tensor] | None:
        return None if self.spill is None else self.spill.empty

    def device_graph(self) -> Graph:
        """The graph on the propagation device (cached)."""
        if self._device_graph is None:
            self._device_graph = self.graph.to(self.device)
        return self._device_graph

    def layout(self, dim: int) -> RowColLayout:
        """Rows as ``row_counts``, ``dim`` columns over the column ranks."""
        if dim not in self.layouts:
            if self.col_ranks is not None:
                cols = [0] * len(self.row_counts)
                for r, count in zip(self.col_ranks, even_counts(dim, len(self.col_ranks))):
                    cols[r] = count
                self.layouts[dim] = RowColLayout(self.row_counts, cols)
            elif dim in self.col_counts:
                self.layouts[dim] = RowColLayout(self.row_counts, self.col_counts[dim])
            elif self.shares is not None:
                self.layouts[dim] = RowColLayout(self.row_counts, share_counts(dim, self.shares))
            elif self.column_split == "balanced":
                self.layouts[dim] = RowColLayout.balanced(self.row_counts, dim)
            else:
                self.layouts[dim] = RowColLayout.for_rows(self.row_counts, dim)
        return self.layouts[dim]

    def out_layout(self, dim: int) -> RowColLayout:
        """The layout of the gather that ends a program on a P stage."""
        cols = self.layout(dim)
        if self.out_rows is None:
            return cols
        return RowColLayout(self.out_rows, cols.col_counts, cols.shared_cols)


class PlacementRunner(Runner):
    """Stage hooks that keep track of the placement: T and E stages on this worker's
    rows (``Shard(0)``), P stages on every vertex's column slice (``Shard(1)``), with
    a gather or a split only when the next stage needs the other placement. A run of
    P stages entered from rows is one pipelined segment when chunks are pipelined."""

    passes_rows_through = True

    def __init__(self, plan: ColumnPlan, seed: int, training: bool) -> None:
        self.plan, self.on_rows = plan, True
        self.ctx = StageContext(plan.gids, seed, training,
                                row_sum=partial(row_sum, comm=plan.comm, phase="row-sum"))

    def _rows(self, h: Tensor, dim: int) -> Tensor:
        if not self.on_rows:  # gather: Shard(1) -> Shard(0)
            h, self.on_rows = cols_to_rows(h, self.plan.layout(dim), self.plan.comm), True
        return h

    def transform(self, s: int, stage: Any, h: Tensor, layer_input: Tensor | None) -> Tensor:
        # rows already: transform_run gathers before a run (and a recomputed run must
        # not look at the placement, which has moved on by the backward pass)
        return stage(h, self.ctx, layer_input)

    def transform_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        h = self._rows(h, program.stages[stages[0]].in_dim)  # the gather is not recomputed
        if self.plan.row_block is not None:
            return blocked_transform_run(self, stages, program, h, carry, self.ctx,
                                         self.plan.row_block, self.plan.row_dtype,
                                         self.plan.matrix_maker())
        if self.plan.recompute:
            return recomputed_transform_run(self, stages, program, h, carry)
        return super().transform_run(stages, program, h, carry)

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
            weights.append(_kept(plan, plan.norms[program.propagate_stage(s).norm]
                                 if src is None else carry.edge_weights[src]))
        assert plan.chunks is not None
        return pipelined_propagation(h, weights, Segment(
            plan.comm, plan.layout(program.stages[stages[0]].in_dim), plan.chunks,
            plan.first_reads, plan.device, plan.account))


def column_forward(model: StageProgram, plan: ColumnPlan, *, training: bool,
                   seed: int, runner: PlacementRunner | None = None) -> LocalResult:
    """Run ``model`` on ``plan``'s placements (through ``runner``, default a fresh
    ``PlacementRunner``); the output rows this rank holds."""
    runner = PlacementRunner(plan, seed, training) if runner is None else runner
    h = walk(model, runner, plan.features)
    if runner.on_rows:
        return LocalResult(h, plan.gids)
    h = cols_to_rows(h, plan.out_layout(model.out_dim), plan.comm)
    return LocalResult(h, plan.gids if plan.out_gids is None else plan.out_gids)


def column_work(model: StageProgram, plan: ColumnPlan) -> Work:
    """Every edge on this rank's column slice per P; own edges for E stages."""
    n_edges, rank = plan.graph.num_edges, plan.comm.rank
    edges = dims = 0
    for info, s in zip(describe(model), model.stages):
        if info.is_propagate:
            cols = plan.layout(s.in_dim).local_cols(rank)
            if cols:
                edges, dims = edges + n_edges, dims + n_edges * cols
        elif info.is_edge:
            own = plan.edges.edge_counts[rank] if plan.edges else n_edges
            edges, dims = edges + own, dims + own * s.in_dim
    return Work(edges, 0, dims)


def count_resident(program: StageProgram, plan: ColumnPlan, dtype: torch.dtype) -> None:
    """What stays on the compute device beside the streamed chunks when the transform
    stages run there too: their parameters (and gradients), this worker's feature rows,
    the activations autograd keeps (an estimate: every stage's output, rows for T / E,
    the column slice of all vertices for P) and the E stages' edge block."""
    account, itemsize = plan.account, torch.empty(0, dtype=dtype).element_size()
    assert account is not None
    rows, n = int(plan.gids.numel()), plan.graph.num_dst
    account.reside("feature rows", nbytes(plan.features))
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


def _aggregate(plan: ColumnPlan, h_cols: Tensor, weight: Tensor) -> Tensor:
    """One weighted SpMM over the whole graph, chunk by chunk on the device, or column
    chunk by column chunk from and to files (``plan.spill``)."""
    if plan.spill is not None:
        return spilled_spmm(plan.graph, h_cols, weight, plan.spill)
    if plan.chunks is None:
        if not same_device(h_cols.device, plan.device):  # rows elsewhere (nn_device): go and back
            graph = plan.device_graph()
            return spmm(graph, h_cols.to(plan.device), weight.to(plan.device)).to(h_cols.device)
        return spmm(plan.graph, h_cols, weight)
    return chunked_spmm(plan.chunks, plan.graph.num_dst, h_cols, _kept(plan, weight),
                        plan.device, plan.account, plan.prefetch)


def _kept(plan: ColumnPlan, weight: Tensor) -> Tensor:
    """The (scaled) weights of the edges the plan's chunks hold."""
    if plan.edge_keep is None:
        return weight
    keep, scale = (t.to(weight.device) for t in plan.edge_keep)
    scale = scale.to(weight.dtype)
    return weight.index_select(0, keep) * (scale if weight.dim() == 1 else scale[:, None])


def _propagate_cols(plan: ColumnPlan, h_cols: Tensor, weight: Tensor, dim: int) -> Tensor:
    """P on this worker's column slice of all vertices; multi-head weights per head."""
    if weight.dim() == 1:  # the plan's own tensor: the backward keeps it in the
        # transpose's order once (``Transposed.weights_in_order`` knows it by identity)
        return _aggregate(plan, h_cols, weight)
    if weight.shape[1] == 1:
        return _aggregate(plan, h_cols, weight.reshape(-1))
    chans = dim // weight.shape[1]
    parts, offset = [], 0
    for c0, c1 in plan.layout(dim).col_ranges(plan.comm.rank):
        for head in range(c0 // chans, (c1 - 1) // chans + 1):  # heads the range overlaps
            lo, hi = max(c0, head * chans), min(c1, (head + 1) * chans)
            parts.append(_aggregate(plan, h_cols[:, offset + lo - c0:offset + hi - c0],
                                    weight[:, head]))
        offset += c1 - c0
    # a rank without columns (a T-group rank in task parallelism) uses no weight, but
    # its gradient must still reach the collective that shared the weights
    return torch.cat(parts, dim=1) if parts else _Depends.apply(h_cols, weight)


class _Depends(torch.autograd.Function):
    """``x``, made to depend on ``other`` with a zero gradient, so that every rank runs
    the backward of the collective that produced ``other`` (collectives in a backward
    must be called by every rank, also by one that did not use the value)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, other: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = other.shape, other.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def edge_plan(graph: Graph, row_counts: list[int], comm: Comm) -> EdgePlan:
    """The block of this worker's destinations and the halo of their remote sources."""
    from fullgraph.comm import primitives as prim

    graph = graph.to("cpu")  # planned on the host; the caller moves the block
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
    needed_by = prim.all_to_all_sized(needed_from, comm, "setup")
    table = ExchangeTable(send_idx=[g - lo for g in needed_by],
                          recv_rows=[t.numel() for t in needed_from])
    return EdgePlan(block, table, edge_counts)


def _edge_weights(plan: ColumnPlan, stage: EdgeTransform, h_rows: Tensor,
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
