"""Inter-chunk pipelining of tensor-parallel propagation (NeutronTP §4.2.2).

A propagation segment is ``split -> P_1 ... P_K -> gather`` on one column layout.
With the graph cut into destination chunks, the split and the gather are cut into
per-chunk pieces: chunk k's split sends only the rows its aggregation reads that no
earlier chunk read (``first_reads``: every vertex is split once), and runs while the
previous chunk aggregates; chunk k's gather sends its destination rows while the
next chunk aggregates. P_1 needs the split pieces, P_K feeds the gather pieces;
P_2..P_{K-1} run chunk by chunk without communication (each needs all of the
previous step's rows). The backward mirrors it in reverse chunk order: the gradient
rows of chunk k are split to the column owners ahead of its transposed aggregation,
and after P_1's chunk k the gradient of the rows first read by chunk k is complete
(only chunks >= k read them) and is gathered back to their owners.

Schedules are data: ``forward_steps`` and ``backward_steps`` return the step lists,
which tests check without processes; ``PipelinedPropagation`` executes them.
The exchanges run asynchronously (gloo's own thread on CPU), so a piece of
communication overlaps the aggregation issued after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.group import Comm
from fullgraph.comm.halo import PendingBlocks, start_blocks
from fullgraph.comm.placement import RowColLayout
from fullgraph.memory import MemoryAccount
from fullgraph.ops.chunked import (
    Chunk,
    Ranges,
    chunk_aggregate,
    chunk_backward,
    put_ranges,
    take_ranges,
)


@dataclass(frozen=True)
class Step:
    """One step: ``op`` on chunk ``chunk`` (and P stage ``stage`` for aggregations)."""

    op: str
    chunk: int
    stage: int = -1


def forward_steps(num_props: int, num_chunks: int) -> list[Step]:
    """split / aggregate / gather steps of one segment's forward pass."""
    last, steps = num_props - 1, [Step("split", 0)]
    for k in range(num_chunks):
        steps.append(Step("wait-split", k))
        if k + 1 < num_chunks:
            steps.append(Step("split", k + 1))
        steps += _aggregate_then_gather(0, k, last)
    for stage in range(1, num_props):
        for k in range(num_chunks):
            steps += _aggregate_then_gather(stage, k, last)
    steps.append(Step("wait-gather", num_chunks - 1))
    return steps


def _aggregate_then_gather(stage: int, k: int, last: int) -> list[Step]:
    out = [Step("aggregate", k, stage)]
    if stage == last:
        out.append(Step("gather", k))
        if k:
            out.append(Step("wait-gather", k - 1))
    return out


def backward_steps(num_props: int, num_chunks: int) -> list[Step]:
    """The mirror: split of gradient rows, transposed aggregation, gather back."""
    last, order = num_props - 1, list(range(num_chunks - 1, -1, -1))
    steps = [Step("split", order[0])]
    for i, k in enumerate(order):
        steps.append(Step("wait-split", k))
        if i + 1 < num_chunks:
            steps.append(Step("split", order[i + 1]))
        steps += _transpose_then_gather(last, k, i, order)
    for stage in range(last - 1, -1, -1):
        for i, k in enumerate(order):
            steps += _transpose_then_gather(stage, k, i, order)
    steps.append(Step("wait-gather", order[-1]))
    return steps


def _transpose_then_gather(stage: int, k: int, i: int, order: list[int]) -> list[Step]:
    out = [Step("aggregate", k, stage)]
    if stage == 0:
        out.append(Step("gather", k))
        if i:
            out.append(Step("wait-gather", order[i - 1]))
    return out


def first_reads(chunks: list[Chunk]) -> list[Tensor]:
    """Per chunk, the sources no earlier chunk reads (ascending): what its split sends."""
    seen = np.zeros(max((int(c.src.max()) + 1 for c in chunks if c.src.numel()), default=0),
                    dtype=bool)
    out = []
    for c in chunks:
        src = c.src.numpy()
        fresh = src[~seen[src]]
        seen[fresh] = True
        out.append(torch.from_numpy(fresh.copy()))
    return out


@dataclass
class Segment:
    """Everything a pipelined segment needs besides its input and weights.

    Attributes:
        comm: the communication handle.
        layout: the column layout of the propagated width D.
        chunks: destination chunks of the graph.
        new_rows: ``first_reads(chunks)``.
        device: where chunks are aggregated.
        account: device-memory accounting (default: None).
    """

    comm: Comm
    layout: RowColLayout
    chunks: list[Chunk]
    new_rows: list[Tensor]
    device: torch.device
    account: MemoryAccount | None = None

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.layout.row_counts)]).astype(np.int64)

    def rows_of(self, rows: Tensor, rank: int) -> Tensor:
        """The entries of sorted ``rows`` that rank ``rank`` owns."""
        off = self.offsets
        lo, hi = np.searchsorted(rows.numpy(), [off[rank], off[rank + 1]])
        return rows[int(lo):int(hi)]

    def chunk_rows(self, c: Chunk, rank: int) -> Ranges:
        """Chunk ``c``'s destination ranges inside rank ``rank``'s block."""
        off = self.offsets
        return c.parts_in(int(off[rank]), int(off[rank + 1]))

    def num_chunk_rows(self, c: Chunk, rank: int) -> int:
        return sum(b - a for a, b in self.chunk_rows(c, rank))


def pipelined_propagation(h_rows: Tensor, weights: list[Tensor], segment: Segment) -> Tensor:
    """split -> K propagations -> gather, pipelined over chunks (see module docstring).

    Args:
        h_rows: (N_r, D) this worker's rows.
        weights: per P stage, the (E,) or (E, H) edge weights of the whole graph.
        segment: layout, chunks and communication.

    Returns:
        (N_r, D) the propagated rows, differentiable in ``h_rows`` and the weights.
    """
    return _Pipelined.apply(h_rows, segment, *weights)


class _Pipelined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_rows: Tensor, seg: Segment, *weights: Tensor) -> Tensor:
        run = _Run(seg, weights, h_rows.dtype)
        keep = any(ctx.needs_input_grad[2:])  # weight gradients need the stage inputs
        out = run.forward(h_rows.detach(), keep_inputs=keep)
        ctx.seg, ctx.run = seg, run
        ctx.save_for_backward(*weights)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        weights = ctx.saved_tensors
        need_w = [w.requires_grad and ctx.needs_input_grad[2 + i] for i, w in enumerate(weights)]
        grad_h, grad_ws = ctx.run.backward(grad_out.contiguous(), need_w)
        return (grad_h, None, *grad_ws)


class _Run:
    """One segment's forward and backward, step list by step list."""

    def __init__(self, seg: Segment, weights: tuple[Tensor, ...], dtype: torch.dtype) -> None:
        self.seg, self.weights, self.dtype = seg, [w.detach() for w in weights], dtype
        self.rank, self.world = seg.comm.rank, seg.comm.world_size
        lay = seg.layout
        self.dim, self.shared = lay.num_cols, lay.shared_cols
        self.local = lay.local_cols(self.rank)
        self.own_cols = lay.col_counts[self.rank]
        self.lo = int(seg.offsets[self.rank])
        self.inputs: list[Tensor] = []

    # -------------------------------------------------------------- forward
    def forward(self, h_rows: Tensor, keep_inputs: bool) -> Tensor:
        seg, n = self.seg, self.seg.layout.num_rows
        props = len(self.weights)
        x = h_rows.new_zeros(n, self.local)
        outs = [h_rows.new_zeros(n, self.local) for _ in range(props)]
        y = h_rows.new_empty(h_rows.shape)
        pending: dict[tuple[str, int], PendingBlocks] = {}
        for step in forward_steps(props, len(seg.chunks)):
            k = step.chunk
            if step.op == "split":
                pending["split", k] = self._split(h_rows, seg.new_rows[k])
            elif step.op == "wait-split":
                self._place_split(x, seg.new_rows[k], pending.pop(("split", k)).wait())
            elif step.op == "aggregate":
                src = x if step.stage == 0 else outs[step.stage - 1]
                c = seg.chunks[k]
                c.put(outs[step.stage], self._aggregate(c, src, step.stage))
            elif step.op == "gather":
                pending["gather", k] = self._gather(outs[-1], seg.chunks[k])
            else:
                self._place_gather(y, outs[-1], seg.chunks[k], pending.pop(("gather", k)).wait())
        self.inputs = [x] + outs[:-1] if keep_inputs else []
        return y

    def _split(self, h_rows: Tensor, rows: Tensor) -> PendingBlocks:
        mine = h_rows[self.seg.rows_of(rows, self.rank) - self.lo]
        shared = mine[:, self.dim - self.shared:]
        lay = self.seg.layout
        send = [torch.cat([mine[:, lay.col_slice(p)], shared], dim=1)
                for p in range(self.world)]
        recv = [(self.seg.rows_of(rows, q).numel(), self.local) for q in range(self.world)]
        return start_blocks(send, recv, self.seg.comm, "rows-to-cols")

    def _place_split(self, x: Tensor, rows: Tensor, parts: list[Tensor]) -> None:
        for q, part in enumerate(parts):
            x[self.seg.rows_of(rows, q)] = part

    def _gather(self, out: Tensor, c: Chunk) -> PendingBlocks:
        send = [take_ranges(out, self.seg.chunk_rows(c, p))[:, :self.own_cols]
                for p in range(self.world)]
        mine = self.seg.num_chunk_rows(c, self.rank)
        recv = [(mine, n) for n in self.seg.layout.col_counts]
        return start_blocks(send, recv, self.seg.comm, "cols-to-rows")

    def _place_gather(self, y: Tensor, out: Tensor, c: Chunk, parts: list[Tensor]) -> None:
        own = self.seg.chunk_rows(c, self.rank)
        for q, part in enumerate(parts):
            put_ranges(y[:, self.seg.layout.col_slice(q)], own, part, self.lo)
        if self.shared:
            put_ranges(y[:, self.dim - self.shared:], own,
                       take_ranges(out, own)[:, self.own_cols:], self.lo)

    # ----------------------------------------------------------- aggregation
    def _segments(self, weight: Tensor) -> list[tuple[slice, int | None]]:
        """(local column slice, head) pieces; head None for single-head weights."""
        if weight.dim() == 1 or weight.shape[1] == 1:
            return [(slice(0, self.local), None)]
        chans = self.dim // weight.shape[1]
        pieces: list[tuple[slice, int | None]] = []
        offset = 0
        for c0, c1 in self.seg.layout.col_ranges(self.rank):
            for head in range(c0 // chans, (c1 - 1) // chans + 1):
                lo, hi = max(c0, head * chans), min(c1, (head + 1) * chans)
                pieces.append((slice(offset + lo - c0, offset + hi - c0), head))
            offset += c1 - c0
        return pieces

    def _aggregate(self, c: Chunk, src: Tensor, stage: int) -> Tensor:
        w = self.weights[stage]
        parts = [chunk_aggregate(c, src[:, cols].contiguous(),
                                 w.reshape(-1) if head is None else w[:, head].contiguous(),
                                 self.seg.device, self.seg.account)
                 for cols, head in self._segments(w)]
        if not parts:  # no columns on this rank (task parallelism's T group)
            return src.new_zeros(c.graph.num_dst, 0)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    # ------------------------------------------------------------- backward
    def backward(self, grad_y: Tensor, need_w: list[bool]) -> tuple[Tensor, list[Tensor | None]]:
        seg, n, props = self.seg, self.seg.layout.num_rows, len(self.weights)
        g_out = [grad_y.new_zeros(n, self.local) for _ in range(props)]  # grads of outputs
        g_in0 = grad_y.new_zeros(n, self.local)                            # grad of x
        grad_h = grad_y.new_zeros(grad_y.shape)
        grad_w = [torch.zeros_like(w) if need else None for w, need in zip(self.weights, need_w)]
        pending: dict[tuple[str, int], PendingBlocks] = {}
        for step in backward_steps(props, len(seg.chunks)):
            k, c = step.chunk, seg.chunks[step.chunk]
            if step.op == "split":
                pending["split", k] = self._split_grad(grad_y, c)
            elif step.op == "wait-split":
                self._place_split_grad(g_out[-1], grad_y, c, pending.pop(("split", k)).wait())
            elif step.op == "aggregate":
                target = g_in0 if step.stage == 0 else g_out[step.stage - 1]
                self._transpose(c, c.take(g_out[step.stage]), step.stage, target,
                                grad_w[step.stage])
            elif step.op == "gather":
                pending["gather", k] = self._gather_grad(g_in0, seg.new_rows[k])
            else:
                self._place_gather_grad(grad_h, seg.new_rows[k], pending.pop(("gather", k)).wait())
        return grad_h, grad_w

    def _split_grad(self, grad_y: Tensor, c: Chunk) -> PendingBlocks:
        mine = take_ranges(grad_y, self.seg.chunk_rows(c, self.rank), self.lo)
        send = [mine[:, self.seg.layout.col_slice(p)] for p in range(self.world)]
        recv = [(self.seg.num_chunk_rows(c, q), self.own_cols) for q in range(self.world)]
        return start_blocks(send, recv, self.seg.comm, "cols-to-rows-grad")

    def _place_split_grad(self, g: Tensor, grad_y: Tensor, c: Chunk, parts: list[Tensor]) -> None:
        for q, part in enumerate(parts):
            put_ranges(g[:, :self.own_cols], self.seg.chunk_rows(c, q), part)
        if self.shared:  # the shared columns' gradient exists on own rows only
            own = self.seg.chunk_rows(c, self.rank)
            put_ranges(g[:, self.own_cols:], own,
                       take_ranges(grad_y, own, self.lo)[:, self.dim - self.shared:])

    def _transpose(self, c: Chunk, g_rows: Tensor, stage: int, target: Tensor,
                   grad_w: Tensor | None) -> None:
        """target[src] += A_k^T g_rows; grad_w[chunk edges] += <g_rows, input> (if wanted)."""
        w = self.weights[stage]
        src = self.inputs[stage] if grad_w is not None else None
        for cols, head in self._segments(w):
            wk = w.reshape(-1) if head is None else w[:, head].contiguous()
            gw = None
            if grad_w is not None:
                gw = grad_w.view(-1) if head is None else grad_w[:, head]
            chunk_backward(c, g_rows[:, cols], None if src is None else src[:, cols].contiguous(),
                           wk, target[:, cols], gw, self.seg.device, self.seg.account)

    def _gather_grad(self, g_in0: Tensor, rows: Tensor) -> PendingBlocks:
        send = [g_in0[self.seg.rows_of(rows, p)] for p in range(self.world)]
        mine = self.seg.rows_of(rows, self.rank).numel()
        recv = [(mine, self.seg.layout.local_cols(q)) for q in range(self.world)]
        return start_blocks(send, recv, self.seg.comm, "rows-to-cols-grad")

    def _place_gather_grad(self, grad_h: Tensor, rows: Tensor, parts: list[Tensor]) -> None:
        idx = self.seg.rows_of(rows, self.rank) - self.lo
        lay = self.seg.layout
        for q, part in enumerate(parts):  # fixed rank order: deterministic sums
            ev = lay.col_counts[q]
            grad_h[idx, lay.col_slice(q)] = part[:, :ev]
            if self.shared:
                grad_h[idx, self.dim - self.shared:] += part[:, ev:]
