"""Placement-changing collectives as conjugate autograd pairs [Megatron ``mappings.py``].

Each public function moves a vertex tensor between placements; its backward is the
forward of its conjugate, so gradients land where the inputs lived:

    rows_to_cols      Shard(0) -> Shard(1)   backward: cols_to_rows
    cols_to_rows      Shard(1) -> Shard(0)   backward: rows_to_cols
    all_reduce_grads  parameter gradients summed over ranks (not autograd)

Private ``torch.autograd.Function`` classes keep only the layout (or table), the
``Comm`` and the phase name on ``ctx``; the comm-only helpers they call are plain
functions, so ``Fn.backward(stub_ctx, g)`` can be tested directly. No compute (SpMM,
GEMM) happens here. With ``world_size == 1`` the public functions return their input
(or the equivalent local computation) and make no torch.distributed call. Phase names:
the forward counts under ``phase``, the backward under ``phase + "-grad"``.

Shape legend: R ranks, r this rank, N rows in all, N_r this rank's rows, N_p rank p's
rows, D columns, D_r this rank's column slice, H halo rows, S_p rows sent to rank p,
F trailing feature shape, s bytes per element. Byte counts are per rank per call and
leave out self-copies.

The halo pair (``halo_fetch`` / ``halo_scatter_add``) lives in ``halo``, beside
the asynchronous forms it is built on. Imports only ``primitives`` from fullgraph.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fullgraph.comm.primitives import (
    all_gather_rows,
    all_reduce_,
    all_to_all_v,
    exchange_blocks_start,
)

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm


def even_counts(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal contiguous counts (the first get one more)."""
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


def share_counts(total: int, shares: Sequence[float], minimum: int = 0) -> list[int]:
    """``total`` split into contiguous counts in proportion to ``shares``.

    Every part first gets ``minimum`` (when ``total`` allows it for all parts), the
    rest is split by the largest remainder, ties to the lower part, so the counts sum
    to ``total`` exactly and equal shares give ``even_counts``.

    Raises:
        ValueError: a share is negative or not finite, or none is positive.
    """
    weights = [float(w) for w in shares]
    if not weights or any(not w >= 0 or w == float("inf") for w in weights) \
            or sum(weights) <= 0:
        raise ValueError(f"shares must be finite, non-negative and not all zero, one per "
                         f"part; got {list(shares)}")
    base = minimum if minimum * len(weights) <= total else 0
    rest, norm = total - base * len(weights), sum(weights)
    exact = [rest * w / norm for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda p: (counts[p] - exact[p], p))
    for p in order[:rest - sum(counts)]:
        counts[p] += 1
    return [base + c for c in counts]


def check_counts(counts: Sequence[int], total: int, parts: int, what: str) -> list[int]:
    """``counts`` as ints after checking there is one per part, none negative, and
    that they sum to ``total``; the ValueError names ``what``."""
    out = [int(c) for c in counts]
    if len(out) != parts or any(c < 0 for c in out) or sum(out) != total:
        raise ValueError(f"{what}: need {parts} non-negative counts summing to {total}, "
                         f"got {list(counts)}")
    return out


@dataclass(frozen=True)
class RowColLayout:
    """Row blocks and column slices of an (N, D) tensor over R ranks.

    Rows are split into contiguous blocks (``row_counts[p]`` rows on rank p, e.g.
    a partition's part sizes), columns into contiguous slices (``col_counts[p]``).
    Neither N nor D needs to divide by R; counts may be 0.

    ``shared_cols`` more columns (the last ones) may be replicated: every rank holds
    them for all rows, after its own slice. With D % R of them and D // R columns
    per rank, every rank does the same propagation work and moves the same bytes
    (``balanced``), at the price of computing the shared columns on every rank.
    """

    row_counts: Sequence[int]
    col_counts: Sequence[int]
    shared_cols: int = 0

    def __post_init__(self) -> None:
        rows, cols = tuple(int(n) for n in self.row_counts), tuple(int(n) for n in self.col_counts)
        if len(rows) != len(cols) or not rows or min(rows + cols) < 0 or self.shared_cols < 0:
            raise ValueError(f"RowColLayout: need one non-negative row and column count per "
                             f"rank, got row_counts={list(rows)} col_counts={list(cols)} "
                             f"shared_cols={self.shared_cols}")
        object.__setattr__(self, "row_counts", rows)
        object.__setattr__(self, "col_counts", cols)

    @classmethod
    def even(cls, num_rows: int, num_cols: int, world_size: int) -> RowColLayout:
        """Near-equal contiguous blocks of rows and columns (the first ranks get one more)."""
        return cls(even_counts(num_rows, world_size), even_counts(num_cols, world_size))

    @classmethod
    def for_rows(cls, row_counts: Sequence[int], num_cols: int) -> RowColLayout:
        """Given row blocks (e.g. partition sizes) and near-equal column slices."""
        return cls(row_counts, even_counts(num_cols, len(row_counts)))

    @classmethod
    def balanced(cls, row_counts: Sequence[int], num_cols: int) -> RowColLayout:
        """D // R columns per rank and the D % R remaining ones shared by all."""
        world = len(row_counts)
        return cls(row_counts, [num_cols // world] * world, num_cols % world)

    def local_cols(self, rank: int) -> int:
        """Columns rank ``rank`` holds in Shard(1): its slice plus the shared ones."""
        return self.col_counts[rank] + self.shared_cols

    def col_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Global column intervals of a rank's Shard(1) tensor, in its column order."""
        own = self.col_slice(rank)
        out = [(own.start, own.stop)] if own.stop > own.start else []
        if self.shared_cols:
            out.append((self.num_cols - self.shared_cols, self.num_cols))
        return out

    @property
    def world_size(self) -> int:
        return len(self.row_counts)

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts)

    @property
    def num_cols(self) -> int:
        return sum(self.col_counts) + self.shared_cols

    def row_slice(self, rank: int) -> slice:
        start = sum(self.row_counts[:rank])
        return slice(start, start + self.row_counts[rank])

    def col_slice(self, rank: int) -> slice:
        start = sum(self.col_counts[:rank])
        return slice(start, start + self.col_counts[rank])


# ---------------------------------------------------------------- comm-only helpers
def _check_layout(x: Tensor, layout: RowColLayout, comm: Comm, rows: int, cols: int,
                  name: str) -> None:
    if layout.world_size != comm.world_size:
        raise ValueError(f"{name}: layout is for {layout.world_size} ranks, comm has "
                         f"{comm.world_size}")
    if x.dim() != 2 or tuple(x.shape) != (rows, cols):
        raise ValueError(f"{name}: rank {comm.rank} expected shape ({rows}, {cols}) from the "
                         f"layout, got {tuple(x.shape)}")


def _rows_to_cols(x_rows: Tensor, layout: RowColLayout, comm: Comm, phase: str) -> Tensor:
    """Shard(0) -> Shard(1); shared columns are replicated (all-gathered)."""
    r, sh = comm.rank, layout.shared_cols
    _check_layout(x_rows, layout, comm, layout.row_counts[r], layout.num_cols, "rows_to_cols")
    if comm.world_size == 1:
        return x_rows
    shared = x_rows[:, layout.num_cols - sh:]
    send = [torch.cat([x_rows[:, layout.col_slice(p)], shared], dim=1) if sh else
            x_rows[:, layout.col_slice(p)] for p in range(comm.world_size)]
    out = x_rows.new_empty(layout.num_rows, layout.local_cols(r))
    into = [out[layout.row_slice(p)] for p in range(comm.world_size)]
    exchange_blocks_start(send, into, comm, phase).wait()
    return out


def _cols_to_rows_summed(g_cols: Tensor, layout: RowColLayout, comm: Comm,
                         phase: str) -> Tensor:
    """Backward of ``_rows_to_cols``: own slices gathered back, shared columns summed."""
    r, ev = comm.rank, layout.col_counts
    _check_layout(g_cols, layout, comm, layout.num_rows, layout.local_cols(r), "cols_to_rows")
    if comm.world_size == 1:
        return g_cols
    send = [g_cols[layout.row_slice(p)] for p in range(comm.world_size)]
    if not layout.shared_cols:
        out = g_cols.new_empty(layout.row_counts[r], layout.num_cols)
        into = [out[:, layout.col_slice(q)] for q in range(comm.world_size)]
        exchange_blocks_start(send, into, comm, phase).wait()
        return out
    sizes = [(layout.row_counts[r], layout.local_cols(q)) for q in range(comm.world_size)]
    recv = [t.view(size) for t, size in zip(
        all_to_all_v([t.reshape(-1) for t in send], [a * b for a, b in sizes], comm, phase),
        sizes)]
    parts = [t[:, :ev[q]] for q, t in enumerate(recv)]
    total = recv[0][:, ev[0]:].clone()
    for q in range(1, comm.world_size):  # fixed rank order: deterministic sums
        total += recv[q][:, ev[q]:]
    parts.append(total)
    return torch.cat(parts, dim=1)


def _cols_to_rows(x_cols: Tensor, layout: RowColLayout, comm: Comm, phase: str) -> Tensor:
    """Shard(1) -> Shard(0); the shared columns of own rows are already here."""
    r = comm.rank
    _check_layout(x_cols, layout, comm, layout.num_rows, layout.local_cols(r), "cols_to_rows")
    if comm.world_size == 1:
        return x_cols
    own = layout.col_counts[r]
    send = [x_cols[layout.row_slice(p), :own] for p in range(comm.world_size)]
    out = x_cols.new_empty(layout.row_counts[r], layout.num_cols)
    into = [out[:, layout.col_slice(q)] for q in range(comm.world_size)]
    exchange_blocks_start(send, into, comm, phase).wait()
    if layout.shared_cols:
        out[:, layout.num_cols - layout.shared_cols:] = x_cols[layout.row_slice(r), own:]
    return out


def _rows_to_cols_local(g_rows: Tensor, layout: RowColLayout, comm: Comm,
                        phase: str) -> Tensor:
    """Backward of ``_cols_to_rows``: slices sent out, shared gradient only on own rows."""
    r, sh = comm.rank, layout.shared_cols
    _check_layout(g_rows, layout, comm, layout.row_counts[r], layout.num_cols, "rows_to_cols")
    if comm.world_size == 1:
        return g_rows
    own = layout.col_counts[r]
    send = [g_rows[:, layout.col_slice(p)] for p in range(comm.world_size)]
    out = g_rows.new_empty(layout.num_rows, own + sh)
    into = [out[layout.row_slice(p), :own] for p in range(comm.world_size)]
    exchange_blocks_start(send, into, comm, phase).wait()
    if sh:
        out[:, own:] = 0
        out[layout.row_slice(r), own:] = g_rows[:, layout.num_cols - sh:]
    return out


def _row_offsets(row_counts: Sequence[int]) -> list[int]:
    out = [0]
    for n in row_counts:
        out.append(out[-1] + int(n))
    return out


def _gather_rows(x_rows: Tensor, row_counts: Sequence[int], comm: Comm, phase: str) -> Tensor:
    if comm.world_size == 1:
        return x_rows
    return torch.cat(all_gather_rows(x_rows.contiguous(), row_counts, comm, phase), dim=0)


def _reduce_scatter_rows(x_full: Tensor, row_counts: Sequence[int], comm: Comm,
                         phase: str) -> Tensor:
    off = _row_offsets(row_counts)
    if comm.world_size == 1:
        return x_full
    send = [x_full[off[p]:off[p + 1]].contiguous() for p in range(comm.world_size)]
    recv = all_to_all_v(send, [row_counts[comm.rank]] * comm.world_size, comm, phase)
    out = recv[0].clone()
    for part in recv[1:]:  # fixed rank order: the same sum on every run
        out += part
    return out


# ---------------------------------------------------------------- autograd functions
class _RowsToCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_rows: Tensor, layout: RowColLayout, comm: Comm,
                phase: str) -> Tensor:
        ctx.layout, ctx.comm, ctx.phase = layout, comm, phase
        return _rows_to_cols(x_rows, layout, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad_cols: Tensor) -> tuple[Tensor, None, None, None]:
        grad = _cols_to_rows_summed(grad_cols, ctx.layout, ctx.comm, f"{ctx.phase}-grad")
        return grad, None, None, None


class _ColsToRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_cols: Tensor, layout: RowColLayout, comm: Comm,
                phase: str) -> Tensor:
        ctx.layout, ctx.comm, ctx.phase = layout, comm, phase
        return _cols_to_rows(x_cols, layout, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[Tensor, None, None, None]:
        grad = _rows_to_cols_local(grad_rows, ctx.layout, ctx.comm, f"{ctx.phase}-grad")
        return grad, None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_rows: Tensor, row_counts: tuple[int, ...], comm: Comm,
                phase: str) -> Tensor:
        ctx.row_counts, ctx.comm, ctx.phase = row_counts, comm, phase
        return _gather_rows(x_rows, row_counts, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Tensor, None, None, None]:
        return (_reduce_scatter_rows(grad_full, ctx.row_counts, ctx.comm, ctx.phase + "-grad"),
                None, None, None)


# ---------------------------------------------------------------- public wrappers
def rows_to_cols(x_rows: Tensor, layout: RowColLayout, comm: Comm,
                 phase: str = "rows-to-cols") -> Tensor:
    """Re-place a vertex tensor from row blocks to column slices (NeutronTP "split").

    Placement: Shard(0) -> Shard(1). Forward: one all-to-all; backward:
    ``cols_to_rows`` of the gradient (under ``phase + "-grad"``), where the
    gradients of shared columns are summed over ranks (they were replicated).

    Shapes:
        x_rows: (N_r, D), this rank's row block ``layout.row_slice(r)``, all columns.
        returns: (N, D_r + S), all rows, this rank's columns ``layout.col_slice(r)``
        then the S shared ones.

    Bytes per rank: sent N_r (D - D_r - S + (P - 1) S) s (each peer p gets its D_p
    columns and the S shared ones), received (N - N_r)(D_r + S) s; the backward moves
    the same volumes the other way.
    """
    if comm.world_size == 1:
        _check_layout(x_rows, layout, comm, layout.num_rows, layout.num_cols, "rows_to_cols")
        return x_rows
    return _RowsToCols.apply(x_rows, layout, comm, phase)


def cols_to_rows(x_cols: Tensor, layout: RowColLayout, comm: Comm,
                 phase: str = "cols-to-rows") -> Tensor:
    """Re-place a vertex tensor from column slices to row blocks (NeutronTP "gather").

    Placement: Shard(1) -> Shard(0). Forward: one all-to-all (shared columns of own
    rows are taken locally); backward: ``rows_to_cols`` of the gradient (under
    ``phase + "-grad"``), the shared columns' gradient kept on own rows only.

    Shapes:
        x_cols: (N, D_r + S), all rows, this rank's columns ``layout.col_slice(r)``
        then the S shared ones.
        returns: (N_r, D), this rank's row block, all columns.

    Bytes per rank: sent (N D_r - N_r D_r) s, received (N_r D - N_r D_r) s; the
    backward moves the same volumes the other way.
    """
    if comm.world_size == 1:
        _check_layout(x_cols, layout, comm, layout.num_rows, layout.num_cols, "cols_to_rows")
        return x_cols
    return _ColsToRows.apply(x_cols, layout, comm, phase)


def gather_rows(x_rows: Tensor, row_counts: Sequence[int], comm: Comm,
                phase: str = "gather-rows") -> Tensor:
    """Replicate row blocks on every rank; backward sums the gradients to the owners.

    Placement: Shard(0) (rank p holds ``row_counts[p]`` consecutive rows) -> Replicate.
    Forward: all-gather; backward: reduce-scatter (each rank sends block p of its
    gradient to rank p, which sums them in rank order), under ``phase + "-grad"``.
    Used to share per-edge attention weights in tensor parallelism.

    Shapes:
        x_rows: (row_counts[rank], *F). returns: (sum(row_counts), *F).

    Bytes per rank: sent (R - 1) N_r prod(F) s, received (N - N_r) prod(F) s; the
    backward swaps them.
    """
    return _GatherRows.apply(x_rows, tuple(int(n) for n in row_counts), comm, phase)


def all_reduce_grads(params: Iterable[torch.nn.Parameter], comm: Comm,
                     phase: str = "grad-sync") -> None:
    """Sum parameter gradients over all ranks, in place (not autograd).

    One all-reduce per (dtype, device) group of parameters, over a flat buffer of
    every gradient plus one presence flag per parameter. Rule for missing grads,
    identical on every rank without prior agreement: parameters with
    ``requires_grad=False`` are skipped (the model is the same everywhere); a
    parameter whose ``.grad`` is None here contributes zeros and afterwards holds the
    summed gradient if any rank had one, and stays None only if no rank had one.
    Parameters must come in the same order on every rank.

    Bytes per rank: the ring volume 2 (R - 1) B / R of the buffer (B bytes =
    gradients plus flags), sent and received.
    """
    params = [p for p in params if p.requires_grad]
    if comm.world_size == 1 or not params:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError("all_reduce_grads: sparse gradients are not supported")
        groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in groups.items():
        _all_reduce_group(group, dtype, device, comm, phase)


def _all_reduce_group(params: list[torch.nn.Parameter], dtype: torch.dtype,
                      device: torch.device, comm: Comm, phase: str) -> None:
    total = sum(p.numel() for p in params)
    buf = torch.zeros(total + len(params), dtype=dtype, device=device)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            buf[offset:offset + p.numel()] = p.grad.reshape(-1)
            buf[total + i] = 1
        offset += p.numel()
    all_reduce_(buf, comm, phase)
    present = (buf[total:] != 0).tolist()
    offset = 0
    for i, p in enumerate(params):
        reduced = buf[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if not present[i]:
            continue
        if p.grad is None:
            p.grad = reduced.clone()
        else:
            p.grad.copy_(reduced)
