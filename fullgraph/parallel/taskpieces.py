"""Task parallelism with the T and P groups working at once: hand-offs in row pieces
(``--task-pieces K``, tensor form).

Without it, the T group transforms every row, hands the result to the P group, and
waits while the P group aggregates; the P group waited while the T group worked. So
on 1 + 1 workers an epoch takes the sum of the two groups' times.

With K pieces, each T worker cuts its row block into K contiguous pieces. A run of
T stages followed by a P stage runs piece by piece: piece k's rows are transformed,
handed to the P group (``rows_to_cols`` on the piece's layout) and aggregated there
at once over the edges whose source lies in piece k (the graph's *source* block k,
``Pieces.graphs``), the partial sums added up over the pieces. While the P group
aggregates piece k, the T group transforms piece k+1. No P output row is complete
before the last piece, so the next hand-off back to the T group is whole.

The backward overlaps the same way without a schedule of its own: both groups build
the same sequence of exchanges, the autograd engine runs the most recent ready node
first, so the P group returns the gradient of piece K-1, then computes that of piece
K-2, while the T group runs the backward of piece K-1's transform.

Exact up to the order of float additions: a destination's in-edges are summed per
source block, then the blocks in turn (the tests compare in float64 with the single
process). Every T stage is row-wise and its dropout keyed by global row ids, so a
piece computes what the whole run computes for its rows. Runs that are not followed
by a fixed-weight P stage (attention's edge weights) or that sum over all rows
(batch normalisation) take the whole path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.placement import RowColLayout, even_counts, rows_to_cols
from fullgraph.graph.csr import Graph
from fullgraph.graph.sparse import cat_rows, is_sparse, row_range
from fullgraph.models.stages import StageContext, StageProgram
from fullgraph.models.walk import (
    BlockRows,
    Carry,
    Runner,
    describe,
    last_readers,
    needs_row_sums,
    run_at,
)
from fullgraph.ops.spmm import spmm, spmm_add_
from fullgraph.parallel.columns import ColumnPlan, PlacementRunner, _Depends


@dataclass
class Pieces:
    """A worker's row pieces.

    Attributes:
        count: K.
        row_counts: per piece, the rows each rank hands off in it (0 on the P group).
        local: per piece, this rank's rows in it, a range of its row block.
        graphs: on a P worker, per piece, the edges whose source is in the piece: all
            destinations, sources numbered in the piece's hand-off order (rank by rank).
            None on a T worker.
        weights: per piece, the fixed edge weights of those edges, by norm name.
    """

    count: int
    row_counts: list[list[int]]
    local: list[tuple[int, int]]
    graphs: list[Graph] | None
    weights: list[dict[str, Tensor]] | None

    def layout(self, k: int, whole: RowColLayout) -> RowColLayout:
        """Piece k's hand-off: its rows, ``whole``'s columns."""
        return RowColLayout(self.row_counts[k], whole.col_counts, whole.shared_cols)


def build_pieces(graph: Graph, norms: dict[str, Tensor], row_counts: list[int], count: int,
                 rank: int, holds_columns: bool, device: torch.device) -> Pieces:
    """Cut every rank's row block into ``count`` pieces; on a P worker, the source
    blocks of the graph and their edge weights (built once)."""
    per_rank = [even_counts(n, count) for n in row_counts]
    pieces = [[per_rank[r][k] for r in range(len(row_counts))] for k in range(count)]
    mine = np.concatenate([[0], np.cumsum(per_rank[rank])]).astype(np.int64)
    local = [(int(mine[k]), int(mine[k + 1])) for k in range(count)]
    if not holds_columns:
        return Pieces(count, pieces, local, None, None)
    # every vertex's piece and its place in the piece's hand-off order
    n = graph.num_dst
    piece_of = np.empty(n, dtype=np.int64)
    place = np.empty(n, dtype=np.int64)
    offset = 0
    filled = [0] * count
    for r, n_r in enumerate(row_counts):
        bounds = np.concatenate([[0], np.cumsum(per_rank[r])]).astype(np.int64)
        for k in range(count):
            lo, hi = offset + bounds[k], offset + bounds[k + 1]
            piece_of[lo:hi] = k
            place[lo:hi] = filled[k] + np.arange(hi - lo)
            filled[k] += int(hi - lo)
        offset += n_r
    indptr = graph.indptr.numpy().astype(np.int64)
    src = graph.indices.numpy().astype(np.int64)
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    edge_piece = piece_of[src]
    graphs, weights = [], []
    for k in range(count):
        eids = np.flatnonzero(edge_piece == k)  # CSR order: by destination, then as stored
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(dst[eids], minlength=n), out=ptr[1:])
        block = Graph(torch.from_numpy(ptr), torch.from_numpy(place[src[eids]]),
                      num_src=filled[k], validate=False)
        graphs.append(block.to(device))
        picked = torch.from_numpy(eids)
        weights.append({name: w.index_select(0, picked.to(w.device)).to(device)
                        for name, w in norms.items()})
    return Pieces(count, pieces, local, graphs, weights)


class PiecesRunner(PlacementRunner):
    """``PlacementRunner`` whose hand-offs into the P group go piece by piece, each
    piece aggregated by the first P stage as it arrives (module doc)."""

    def __init__(self, plan: ColumnPlan, pieces: Pieces, seed: int, training: bool) -> None:
        super().__init__(plan, seed, training)
        self.pieces = pieces
        self.first_done: int | None = None  # the P stage run with the last hand-off

    def transform_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        if not goes_in_pieces(program, stages):
            return super().transform_run(stages, program, h, carry)
        infos = describe(program)
        nxt = stages[-1] + 1
        h = self._rows(h, program.stages[stages[0]].in_dim)
        plan, pieces = self.plan, self.pieces
        norm = program.propagate_stage(nxt).norm
        last_read = last_readers(infos)
        outside = sorted({src for s in stages if (src := infos[s].layer_input_from) is not None
                          and src not in stages})
        kept = [s for s in stages if infos[s].opens_layer and last_read.get(s, s) > stages[-1]]
        made: dict[int, list[Tensor]] = {s: [] for s in kept}
        total: Tensor | None = None
        handed: list[Tensor] = []
        for k, (lo, hi) in enumerate(pieces.local):
            rows = BlockRows(StageContext(plan.gids[lo:hi], self.ctx.seed, self.ctx.training,
                                           row_sum=self.ctx.row_sum))
            local = Carry(layer_inputs={s: row_range(carry.layer_inputs[s], lo, hi)
                                         for s in outside})
            y = Runner.transform_run(rows, stages, program, row_range(h, lo, hi), local)
            for s in kept:
                made[s].append(local.layer_inputs[s])
            cols = rows_to_cols(y, pieces.layout(k, plan.layout(y.shape[1])), plan.comm)
            if pieces.graphs is None:  # a T worker: no columns to aggregate
                handed.append(cols)
                continue
            assert pieces.weights is not None
            graph, weight = pieces.graphs[k], pieces.weights[k][norm]
            total = (spmm(graph, cols, weight) if total is None
                     else spmm_add_(total, graph, cols, weight))
        for s, parts in made.items():  # layer inputs read after the P stage: whole again
            carry.layer_inputs[s] = cat_rows(parts) if is_sparse(parts[0]) else torch.cat(parts)
        self.on_rows, self.first_done = False, nxt
        if total is None:  # keep every hand-off in the graph: its backward is collective
            return _Depends.apply(torch.cat(handed), plan.norms[norm])
        return total

    def propagate_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        if self.first_done is not None and stages[0] == self.first_done:
            self.first_done = None
            stages = stages[1:]
            if not stages:
                return h
            return Runner.propagate_run(self, stages, program, h, carry)
        return super().propagate_run(stages, program, h, carry)


def goes_in_pieces(program: StageProgram, stages: list[int]) -> bool:
    """Whether the T run ``stages`` hands off piece by piece: into a propagation with
    fixed edge weights (attention's need every row's scores first), and without a sum
    over every row (global batch norm) of its own."""
    infos = describe(program)
    nxt = stages[-1] + 1
    return (nxt < len(infos) and infos[nxt].is_propagate
            and infos[nxt].edge_weights_from is None and not needs_row_sums(program, stages))


def piecewise_runs(program: StageProgram) -> list[list[int]]:
    """The T runs of ``program`` (as ``walk`` groups them) that hand off in pieces."""
    infos, runs, s = describe(program), [], 0
    while s < len(infos):
        run = run_at(infos, s, len(infos))
        if infos[s].is_transform and goes_in_pieces(program, run):
            runs.append(run)
        s = run[-1] + 1
    return runs


def describe_pieces(pieces: Pieces, program: StageProgram) -> str:
    """The header line: how the hand-offs are cut."""
    runs = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0])
                     for r in piecewise_runs(program))
    return (f"task     T/P hand-offs in {pieces.count} row pieces, each aggregated as it "
            "arrives (the T group transforms a piece while the P group aggregates the one "
            f"before): T stages {runs}")
