"""Task parallelism with a data-parallel P group (``--group-parallel data``, NeutronTask
section 4.3, Fig. 7: task parallelism between the groups, data parallelism inside them).

The T group runs T and E stages on its row blocks, as in the tensor form; every P
worker owns a contiguous row range and holds the in-edges of its rows. Entering a
run of P stages, the T group sends each P worker the source rows its first stage
reads (its halo: neighbours are replicated only in the P group), subgraph by
subgraph: the fetch of subgraph s+1 is in flight while the P worker aggregates
subgraph s, and each source row reaches a worker once and is reused by every later
subgraph (Algorithm 1); in the backward the gradient rows of subgraph s return to
the T group while the P worker runs the backward of subgraph s-1. A later P stage
of the run fetches its halo from the other P workers over the P group's own
communicator (``Comm.split``), which the T group takes no part in; a T or E stage
takes the rows back to the T blocks. An E stage's coefficients, computed by the T
worker that owns each edge's destination, go to the one P worker that owns it
(each edge once). Every exchange is a halo table (``schedule/rowfetch.py``) whose
backward scatter-adds the gradient rows to their owners in rank order, so the sums
are deterministic.

With ``--task-deps regroup`` the chunk stripes are regrouped per training epoch and
the P stages aggregate the kept blocks only, as in the tensor form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import Comm
from fullgraph.comm.halo import (
    PendingFetch,
    PendingReturn,
    halo_fetch,
    start_fetch,
    start_return,
)
from fullgraph.comm.placement import even_counts
from fullgraph.graph.csr import Graph
from fullgraph.models.stages import StageContext, StageProgram
from fullgraph.models.walk import Carry, describe, walk
from fullgraph.ops import spmm
from fullgraph.parallel.base import LocalResult, Work
from fullgraph.parallel.columns import ColumnPlan, PlacementRunner, _Depends
from fullgraph.schedule.chunks import spread_chunks
from fullgraph.schedule.regroup import ChunkGrid
from fullgraph.schedule.rowfetch import (
    RowFetch,
    exchange,
    fetch_to,
    offsets_of,
    row_fetch,
    to_rows,
)


def row_chunks_problem(chunks: int, subgraphs: int, num_p: int) -> str | None:
    """Why a P group of ``num_p`` workers cannot share the chunk grid equally (data
    form), or None where it can (``chunks`` 0: the executor's own count)."""
    if chunks and chunks % num_p:
        return (f"--chunks {chunks} with --group-parallel data: the chunk count must be a "
                f"multiple of the P group's {num_p} workers, so that every worker gets an "
                "equal share")
    if chunks and chunks // num_p < subgraphs:
        return (f"--subgraphs {subgraphs} with --group-parallel data needs at least "
                f"{subgraphs} chunks per P worker; --chunks {chunks} over {num_p} P workers "
                f"gives {chunks // num_p}")
    return None


def check_row_chunks(chunks: int, subgraphs: int, num_p: int) -> None:
    """Refuse a chunk grid the P group cannot share equally (``row_chunks_problem``).

    Raises:
        ValueError: ``chunks`` is not a multiple of the P group's size, or gives a
            P worker fewer chunks than there are subgraphs.
    """
    problem = row_chunks_problem(chunks, subgraphs, num_p)
    if problem is not None:
        raise ValueError(problem)


@dataclass
class RowGroups:
    """The data form's state on one worker.

    Attributes:
        p_counts: rows each rank owns in the P group (0 on the T group).
        back: the P-rows -> T-blocks hand-off table.
        exact: every block, the subgraphs in order.
        grid: the chunk stripes, kept (with the whole graph) only to regroup them.
        pipeline: (subgraphs, stripes) when pipelined (``--subgraphs`` > 1).
        offsets: the T blocks' and the P ranges' offsets.
        p_comm: the P group's communicator (None on the T group).
        edges_to_p: the T-edges -> P-edges exchange of E-stage coefficients (None
            without E stages), the edges of each side's rows in CSR order.
        own_edges: the in-edges of this rank's P rows, a range of the whole graph's
            CSR: the only ones it holds (their normalisations, coefficients).
        last: the last regrouping drawn, by seed.
    """

    p_counts: list[int]
    back: ExchangeTable
    exact: RowFetch
    grid: ChunkGrid | None
    offsets: tuple[np.ndarray, np.ndarray]
    p_comm: Comm | None
    edges_to_p: ExchangeTable | None
    own_edges: tuple[int, int]
    pipeline: tuple[int, int] | None = None
    last: tuple[int, RowFetch] | None = None

    def fetch(self, rank: int, device: torch.device, regroup_seed: int | None) -> RowFetch:
        """The exact grouping, or the one ``regroup_seed`` draws (cached for the last)."""
        if regroup_seed is None or self.grid is None:
            return self.exact
        if self.last is None or self.last[0] != regroup_seed:
            ranges, graph, keep = self.grid.grouping(regroup_seed)
            fetch = row_fetch(graph, ranges, *self.offsets, rank, keep)
            self.last = (regroup_seed, fetch_to(fetch, device))
        return self.last[1]


def row_groups(graph: Graph, row_counts: list[int], num_p: int, comm: Comm, subgraphs: int,
               chunks: int, device: torch.device, edge_stages: bool,
               regroup: bool) -> RowGroups:
    """Build the data form's tables for this rank; the P group's communicator is
    split off the world (collective). With ``regroup`` the chunk grid (and the whole
    graph) is kept to draw a grouping every training epoch."""
    world, rank = comm.world_size, comm.rank
    p_counts = [0] * (world - num_p) + even_counts(graph.num_dst, num_p)
    offsets = (offsets_of(row_counts), offsets_of(p_counts))
    p_comm = comm.split([list(range(world - num_p)), list(range(world - num_p, world))],
                        ["T", "P"])
    grid = None
    if subgraphs > 1:
        stripes = spread_chunks(graph.indptr, p_counts, 1,
                                num_chunks=(chunks or subgraphs * num_p) // num_p)
        grid = ChunkGrid(graph, stripes, min(subgraphs, len(stripes)))
        ranges, _, _ = grid.grouping(None)
    else:
        ranges = [[(0, graph.num_dst)]]
    exact = fetch_to(row_fetch(graph, ranges, *offsets, rank), device)
    indptr = graph.indptr.numpy().astype(np.int64)
    edges_to_p = None
    if edge_stages:
        p_edges = indptr[offsets[1]]
        needs = [np.arange(a, b, dtype=np.int64) for a, b in zip(p_edges[:-1], p_edges[1:])]
        edges_to_p = exchange(needs, indptr[offsets[0]], rank).to(device)
    own = (int(indptr[offsets[1][rank]]), int(indptr[offsets[1][rank + 1]]))
    return RowGroups(p_counts, to_rows(*offsets, rank).to(device), exact,
                     grid if regroup else None, offsets,
                     None if rank < world - num_p else p_comm, edges_to_p, own,
                     None if grid is None else (grid.num_subgraphs, grid.num_chunks))


class _Fetched(torch.autograd.Function):
    """The rows a started fetch brings (the forward waits for them); the backward
    starts returning their gradient rows to the owners and leaves the wait to
    ``_Returned``, so the return overlaps the backward of the next subgraph."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, pending: PendingFetch, table: ExchangeTable,
                comm: Comm, returns: list[PendingReturn]) -> Tensor:
        ctx.table, ctx.comm, ctx.returns, ctx.shape = table, comm, returns, anchor.shape
        return pending.wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        ctx.returns.append(start_return(grad.contiguous(), ctx.table, ctx.comm,
                                        "t-to-p-grad"))
        return grad.new_zeros(()).expand(ctx.shape), None, None, None, None


class _Returned(torch.autograd.Function):
    """The T rows, unchanged; the backward (after every ``_Fetched`` backward) waits
    for the gradient returns in the order they started and sums them, each in rank
    order, so the sums are the same on every run."""

    @staticmethod
    def forward(ctx: Any, h_rows: Tensor, returns: list[PendingReturn]) -> Tensor:
        ctx.returns = returns
        return h_rows.view_as(h_rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        into = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        for pending in ctx.returns:
            pending.wait(into)
        ctx.returns.clear()
        return into, None


def fetch_and_aggregate(h_rows: Tensor, weight: Tensor, fetch: RowFetch, comm: Comm) -> Tensor:
    """The first P stage of a run: T rows in, this P worker's aggregated rows out,
    the fetch of the next subgraph in flight while this one aggregates (and in the
    backward, the gradient return of a subgraph while the next one's runs)."""
    tables, outs, cache = fetch.fetch, [], []
    returns: list[PendingReturn] = []
    anchor = _Returned.apply(h_rows, returns)
    pending = start_fetch(h_rows.detach(), tables[0], comm, "t-to-p")
    for s, piece in enumerate(fetch.pieces):
        cache.append(_Fetched.apply(anchor, pending, tables[s], comm, returns))
        if s + 1 < len(tables):
            pending = start_fetch(h_rows.detach(), tables[s + 1], comm, "t-to-p")
        src = cache[0] if len(cache) == 1 else torch.cat(cache)
        outs.append(spmm(piece, src, weight.index_select(0, fetch.piece_edges[s])))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, fetch.order)


def own_weights(weight: Tensor, fetch: RowFetch, start: int) -> Tensor:
    """The (kept, scaled) weights of this worker's edges in the grouping ``fetch``.

    Args:
        weight: (E_own, ...) the weights of this worker's in-edges (the whole
            graph's CSR from position ``start`` on).
        fetch: the grouping in use (its ``keep``, and this worker's edges in it).
        start: see ``weight``.
    """
    if fetch.keep is None:
        return weight
    a, b = fetch.edge_range
    keep, scale = (t[a:b].to(weight.device) for t in fetch.keep)
    scale = scale.to(weight.dtype)
    return weight.index_select(0, keep - start) * (scale if weight.dim() == 1
                                                   else scale[:, None])


class RowsRunner(PlacementRunner):
    """T and E stages on the T blocks (``on_rows``), P stages on the P ranges."""

    def __init__(self, plan: ColumnPlan, groups: RowGroups, fetch: RowFetch, seed: int,
                 training: bool) -> None:
        super().__init__(plan, seed, training)
        self.groups, self.fetch = groups, fetch

    def _rows(self, h: Tensor, dim: int) -> Tensor:
        if not self.on_rows:  # P ranges -> T blocks
            h, self.on_rows = halo_fetch(h, self.groups.back, self.plan.comm, "p-to-t"), True
        return h

    def edge(self, s: int, stage: Any, h: Tensor) -> Tensor:
        """Coefficients of the in-edges of this T worker's rows, sent to the P workers
        that own them (the E-stage block and its halo as in the column form)."""
        plan, groups = self.plan, self.groups
        h = self._rows(h, stage.in_dim)
        edges = plan.edges
        assert edges is not None and groups.edges_to_p is not None, "E stage without tables"
        halo = None if edges.table is None else halo_fetch(h, edges.table, plan.comm,
                                                           "edge-halo")
        local = stage(edges.block.graph, h, h if halo is None else torch.cat([h, halo]),
                      StageContext(self.ctx.gids, self.ctx.seed, self.ctx.training,
                                   edges.block.eids))
        return halo_fetch(local, groups.edges_to_p, plan.comm, "edge-to-p")

    def propagate_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        plan, fetch, infos = self.plan, self.fetch, describe(program)
        for s in stages:
            src = infos[s].edge_weights_from
            weight = own_weights(plan.norms[program.propagate_stage(s).norm] if src is None
                                 else carry.edge_weights[src], fetch, self.groups.own_edges[0])
            if self.on_rows:
                h, self.on_rows = fetch_and_aggregate(h, weight, fetch, plan.comm), False
            elif fetch.within is None:  # a T rank (no rows): keep the weights' backward
                h = _Depends.apply(h, weight)
            else:
                assert self.groups.p_comm is not None
                halo = halo_fetch(h, fetch.within, self.groups.p_comm, "p-halo")
                h = spmm(fetch.block, halo, weight)
        return h


def rows_forward(model: StageProgram, plan: ColumnPlan, groups: RowGroups, *, training: bool,
                 seed: int, regroup: bool) -> LocalResult:
    """Run ``model`` with the P group in the data form; the output rows of this rank."""
    fetch = groups.fetch(plan.comm.rank, plan.device, seed if regroup else None)
    runner = RowsRunner(plan, groups, fetch, seed, training)
    h = walk(model, runner, plan.features)
    if runner.on_rows:
        return LocalResult(h, plan.gids)
    assert plan.out_gids is not None, "a program ending on a P stage outputs P rows"
    return LocalResult(h, plan.out_gids)


def row_work(model: StageProgram, plan: ColumnPlan, groups: RowGroups) -> Work:
    """Own edges at full width per P stage on a P worker; own edges per E stage."""
    a, b = groups.own_edges
    rank = plan.comm.rank
    edges = dims = 0
    for info, s in zip(describe(model), model.stages):
        if info.is_propagate and b > a:
            edges, dims = edges + b - a, dims + (b - a) * s.in_dim
        elif info.is_edge and plan.edges is not None:
            own = plan.edges.edge_counts[rank]
            edges, dims = edges + own, dims + own * s.in_dim
    return Work(edges, 0, dims)
