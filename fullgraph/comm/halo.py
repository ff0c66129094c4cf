"""Halo exchanges over an ``ExchangeTable``, started now and finished later.

One mechanism (``primitives.all_to_all_v_start`` and its ``PendingExchange``)
serves every exchange that can overlap with computation: the data-parallel halo
fetch (``halo_fetch``, which is ``start_fetch(...).wait()``), its conjugate gradient
scatter-add, G3's per-bin pushes, each round of which is a table with receive
positions (``ExchangeTable.recv_pos``), and the tensor-parallel chunk pipeline's
block exchanges (``start_blocks``).

- ``start_fetch(x_rows, table, comm, phase)`` sends ``x_rows[table.send_idx[p]]`` to
  every peer p; ``wait()`` returns the (H, *F) halo in peer order, or
  ``wait(into)`` writes each peer's rows at ``table.recv_pos[p]`` of ``into``.
- ``start_return(x_halo, table, comm, phase)`` sends halo rows back to their owners
  (the rows at ``recv_pos[p]``, or the p-th block in peer order); ``wait(into)``
  adds them (``index_add_``) at ``table.send_idx[p]`` of the owner rows ``into``, in
  peer order, so the sums are the same on every run.

- ``start_blocks(send, recv_shapes, comm, phase)`` sends one 2-D block to each peer
  (blocks of different widths); ``wait()`` returns the received blocks.
- ``halo_fetch`` / ``halo_scatter_add`` are the synchronous conjugate autograd pair
  (the backward of each is the forward of the other), as in ``placement``;
  ``halo_join`` is ``cat([rows, halo_fetch(rows)])`` in one buffer that the halo rows
  arrive in (``start_fetch(..., into=)``), as data parallelism's P stages read it.

- ``windowed(table, comm, x)``: the same exchanges through the group's shared-memory
  window, where its ranks share one host (``WindowedHalo``): each row is written
  once, straight where its reader reads it.

Bytes are counted under ``phase`` when ``wait`` completes (``PendingExchange``);
with ``world_size == 1`` only the local copy is made and nothing is counted.
Shape legend as in ``placement``.

Imports only ``primitives`` and ``exchange`` from fullgraph.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.primitives import PendingExchange, all_to_all_v_start

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm


def check_table(table: ExchangeTable, comm: Comm) -> None:
    """Raise if ``table`` is not for ``comm``'s world size."""
    if table.world_size != comm.world_size:
        raise ValueError(f"halo exchange: table is for {table.world_size} ranks, comm has "
                         f"{comm.world_size}")


class PendingFetch:
    """A halo fetch in flight (``start_fetch``)."""

    def __init__(self, exchange: PendingExchange, table: ExchangeTable,
                 placed: Tensor | None = None, target: Tensor | None = None) -> None:
        self._exchange, self._table, self._placed = exchange, table, placed
        self._target = target

    def wait(self, into: Tensor | None = None) -> Tensor:
        """Finish the fetch.

        Args:
            into: the halo buffer; each peer p's rows are written at
                ``table.recv_pos[p]`` (or at its block in peer order). None: the
                buffer given to ``start_fetch``, else a new (H, *F) halo in peer order
                (tables without ``recv_pos`` only).

        Returns:
            ``into``, or the new halo.
        """
        parts = self._exchange.wait()
        if self._placed is not None:  # the rows went to their places as they came
            if into is not None and not _same(into, self._placed):
                into.copy_(self._placed)
            return self._placed if into is None else into
        into = self._target if into is None else into
        if into is None:
            if self._table.recv_pos is not None:
                raise ValueError("PendingFetch.wait: the table has receive positions; pass "
                                 "the halo buffer to write them into (into=...)")
            return torch.cat(parts, dim=0)
        positions = self._table.recv_pos
        offset = 0
        for p, part in enumerate(parts):
            n = self._table.recv_rows[p]
            if positions is None:
                into[offset:offset + n] = part
            elif n:
                into[positions[p]] = part
            offset += n
        return into


class PendingReturn:
    """Halo rows in flight back to their owners (``start_return``)."""

    def __init__(self, exchange: PendingExchange, table: ExchangeTable) -> None:
        self._exchange, self._table = exchange, table

    def wait(self, into: Tensor) -> Tensor:
        """Finish the return: add the rows from each peer p at ``table.send_idx[p]``
        of the owner rows ``into``, in peer order. Returns ``into``."""
        parts = self._exchange.wait()
        for idx, rows in zip(self._table.send_idx, parts):
            if idx.numel():
                into.index_add_(0, idx.to(into.device), rows)
        return into


class PendingBlocks:
    """2-D blocks in flight (``start_blocks``)."""

    def __init__(self, exchange: PendingExchange, shapes: list[tuple[int, int]]) -> None:
        self._exchange, self._shapes = exchange, shapes

    def wait(self) -> list[Tensor]:
        """Finish the exchange: the block from each peer, in peer order."""
        return [t.view(shape) for t, shape in zip(self._exchange.wait(), self._shapes)]


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def start_blocks(send: list[Tensor], recv_shapes: list[tuple[int, int]], comm: Comm,
                 phase: str) -> PendingBlocks:
    """Start sending ``send[p]`` (a 2-D block) to every peer p.

    ``recv_shapes[p]`` is the shape of the block peer p sends here. The blocks are
    flattened for one ``all_to_all_v``. Bytes per rank: sent sum_{p != r}
    numel(send[p]) s, received sum_{p != r} prod(recv_shapes[p]) s.
    """
    flat = [t.contiguous().reshape(-1) for t in send]
    return PendingBlocks(all_to_all_v_start(flat, [a * b for a, b in recv_shapes], comm, phase),
                         list(recv_shapes))


def start_fetch(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str,
                into: Tensor | None = None) -> PendingFetch:
    """Start fetching the rows peers need from this rank's ``x_rows`` (N_r, *F).

    ``into``: the halo buffer, and ``wait()`` returns it: for a table without receive
    positions the (H, *F) halo, for one with them the buffer they index. Each peer's
    rows are written straight into their block of it as they arrive where they have
    one (no receive positions, or positions that are runs: ``table.recv_runs``); else
    ``wait`` places them.

    Bytes per rank: sent sum_{p != r} S_p prod(F) s, received sum_{p != r}
    recv_rows[p] prod(F) s (``table.volume_bytes``).
    """
    check_table(table, comm)
    send = [x_rows.index_select(0, idx.to(x_rows.device)) for idx in table.send_idx]
    places = None
    if into is not None:
        runs = table.recv_runs
        if table.recv_pos is None:
            if into.shape[0] != table.num_halo:
                raise ValueError(f"start_fetch: into must be the ({table.num_halo}, ...) halo "
                                 f"of the table, got {tuple(into.shape)}")
            places = list(torch.split(into, table.recv_rows))
        elif runs is not None:
            if max((b for _, b in runs), default=0) > into.shape[0]:
                raise ValueError(f"start_fetch: the table's receive positions reach past "
                                 f"into's {into.shape[0]} rows")
            places = [into[a:b] for a, b in runs]
    return PendingFetch(all_to_all_v_start(send, table.recv_rows, comm, phase, into=places),
                        table, None if places is None else into, into)


def start_return(x_halo: Tensor, table: ExchangeTable, comm: Comm,
                 phase: str) -> PendingReturn:
    """Start sending halo rows (e.g. gradients) back to the ranks that own them.

    ``x_halo`` holds the halo (H, *F) in peer order, or, for a table with
    ``recv_pos``, a buffer the positions index. Bytes: the reverse of
    ``start_fetch`` on the same table.
    """
    check_table(table, comm)
    if table.recv_pos is None:
        if x_halo.dim() == 0 or x_halo.shape[0] != table.num_halo:
            raise ValueError(f"halo return: rank {comm.rank} expected {table.num_halo} halo "
                             f"rows from the table, got shape {tuple(x_halo.shape)}")
        send = list(torch.split(x_halo.contiguous(), table.recv_rows))
    elif table.recv_runs is not None and comm.shm is not None and x_halo.device.type == "cpu":
        # blocks of the buffer, copied into the arena as they lie when the exchange starts
        # (this rank's own block, kept until ``wait``, is a copy)
        send = [x_halo[a:b].clone() if p == comm.rank else x_halo[a:b]
                for p, (a, b) in enumerate(table.recv_runs)]
    else:
        send = [x_halo.index_select(0, pos.to(x_halo.device)) for pos in table.recv_pos]
    return PendingReturn(all_to_all_v_start(send, table.send_rows(), comm, phase), table)


# ---------------------------------------------------------------- through windows
class WindowedHalo:
    """``table``'s exchanges through the group's shared-memory window
    (``primitives.window``): each rank writes its rows straight into its peers'
    windows and reads what it received in place, in its own, as one contiguous buffer
    in peer order. One window per group serves every table in turn, so it holds the
    largest exchange, not all of them. Made by ``windowed``.

    - ``fetch(x_rows)``: the halo of ``x_rows`` (N_r, D), a view of this rank's
      window: read it, then ``release``;
    - ``give_back(fill, into)``: the conjugate: ``fill(p, block)`` writes the rows
      going back to each peer p (its halo rows' gradient, (recv_rows[p], D)) straight
      into p's window; the rows from the peers are then added into ``into`` at
      ``send_idx[p]`` (``index_add_``), in peer order, as ``PendingReturn.wait`` does.
    Either returns None, on every rank, where no window could be opened (use the
    exchanges above). Bytes are those of ``start_fetch`` and ``start_return``.

    ``recv[r][p]``: the rows rank r receives from rank p (every rank's table, gathered
    once).
    """

    def __init__(self, table: ExchangeTable, comm: Comm, recv: list[list[int]],
                 phase: str) -> None:
        self.table, self.comm, self.recv, self.phase = table, comm, recv, phase
        self._win: Any = None

    def _use(self, into_rows: list[int], out_rows: list[int], rb: int, phase: str) -> Any:
        """Begin a use of the window (``into_rows[r]``: the rows rank r receives;
        ``out_rows[q]``: the rows this rank writes to q), or None."""
        win = prim.window(self.comm, max(into_rows) * rb)
        if win is not None:
            prim.window_begin(win, [q for q, n in enumerate(out_rows) if n], self.comm, phase)
        self._win = win
        return win

    def fetch(self, x_rows: Tensor) -> Tensor | None:
        """Write the rows each peer needs into its window; return this rank's halo
        (H, D), a view of its own window (None: no window)."""
        table, recv, me, world = self.table, self.recv, self.comm.rank, self.comm.world_size
        d, dtype = x_rows.shape[1], x_rows.dtype
        rb = d * x_rows.element_size()
        out = [0 if q == me else recv[q][me] for q in range(world)]
        win = self._use([sum(r) for r in recv], out, rb, self.phase)
        if win is None:
            return None
        for q, idx in enumerate(table.send_idx):
            if out[q]:
                at = sum(recv[q][:me]) * rb  # q's halo: its peers' rows in rank order
                torch.index_select(x_rows, 0, idx,
                                   out=win.slot(q, at, out[q] * rb).view(dtype).view(-1, d))
        prim.window_fence(win, self.comm, self.phase, sum(out) * rb, table.num_halo * rb)
        return win.inbox(table.num_halo * rb).view(dtype).view(table.num_halo, d)

    def release(self) -> None:
        """The halo ``fetch`` returned is read."""
        if self._win is not None:
            self._win.release()
            self._win = None

    def give_back(self, fill: Any, into: Tensor) -> Tensor | None:
        """``fill(p, block)`` writes the (recv_rows[p], D) rows going back to each
        peer p into its window; the rows from the peers are then added into ``into``
        (N_r, D). Returns ``into`` (None: no window, nothing done)."""
        table, recv, me, world = self.table, self.recv, self.comm.rank, self.comm.world_size
        phase = f"{self.phase}-grad"
        d, dtype = into.shape[1], into.dtype
        rb = d * into.element_size()
        back = [[recv[p][q] for p in range(world)] for q in range(world)]  # [q][p]: q gets from p
        out = [0 if q == me else table.recv_rows[q] for q in range(world)]
        win = self._use([sum(r) for r in back], out, rb, phase)
        if win is None:
            return None
        for q in range(world):
            if out[q]:
                at = sum(back[q][:me]) * rb
                fill(q, win.slot(q, at, out[q] * rb).view(dtype).view(-1, d))
        got_rows = sum(back[me])
        prim.window_fence(win, self.comm, phase, sum(out) * rb, got_rows * rb)
        got = win.inbox(got_rows * rb).view(dtype).view(got_rows, d)
        at = 0
        for p, idx in enumerate(table.send_idx):
            if p != me and idx.numel():
                into.index_add_(0, idx, got[at:at + idx.numel()])
                at += idx.numel()
        self.release()
        return into


def windowed(table: ExchangeTable, comm: Comm, like: Tensor,
             phase: str = "halo") -> WindowedHalo | None:
    """``table``'s exchanges of rows like ``like`` through the group's shared-memory
    window (``WindowedHalo``), or None where the group has no shared memory (another
    host, ``FULLGRAPH_SHM=0``), ``like`` is not 2-D in host memory, the table has
    receive positions, or some rank's table sends rows to that rank itself. The first
    call for a table gathers every rank's counts (collective, like the exchange
    itself), so every rank decides alike."""
    check_table(table, comm)
    shm = comm.shm
    if (shm is None or comm.world_size == 1 or like.device.type != "cpu" or like.dim() != 2
            or table.recv_pos is not None):
        return None
    if id(table) not in shm.layouts:
        mine = (table.recv_rows, [int(i.numel()) for i in table.send_idx])
        everyone = prim.all_gather_object(mine, comm, "comm-init")
        for q, (_, sends) in enumerate(everyone):
            if sends[comm.rank] != table.recv_rows[q] and q != comm.rank:
                raise ValueError(f"halo exchange: rank {q} sends {sends[comm.rank]} rows to "
                                 f"rank {comm.rank}, whose table expects {table.recv_rows[q]}")
        # a rank that sends rows to itself takes the exchanges above, so every rank does
        own = any(recv[q] or sends[q] for q, (recv, sends) in enumerate(everyone))
        shm.layouts[id(table)] = None if own else [list(r) for r, _ in everyone]
        weakref.finalize(table, shm.layouts.pop, id(table), None)
    recv = shm.layouts[id(table)]
    return None if recv is None else WindowedHalo(table, comm, recv, phase)


# ---------------------------------------------------------------- conjugate autograd pair
def _halo_fetch(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str) -> Tensor:
    into = None
    if table.recv_pos is None:  # the rows arrive in their places: no concatenation
        into = x_rows.new_empty((table.num_halo, *x_rows.shape[1:]))
    return start_fetch(x_rows, table, comm, phase, into=into).wait()


def _halo_scatter_add(x_halo: Tensor, table: ExchangeTable, num_rows: int, comm: Comm,
                      phase: str) -> Tensor:
    check_table(table, comm)
    if x_halo.dim() == 0 or x_halo.shape[0] != table.num_halo:
        raise ValueError(f"halo_scatter_add: rank {comm.rank} expected {table.num_halo} halo "
                         f"rows from the table, got shape {tuple(x_halo.shape)}")
    pending = start_return(x_halo, table, comm, phase)
    return pending.wait(x_halo.new_zeros((num_rows, *x_halo.shape[1:])))


def halo_join(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str = "halo") -> Tensor:
    """``torch.cat([x_rows, halo_fetch(x_rows, table, comm, phase)])`` in one buffer: the
    halo rows arrive straight after the own rows (copied there while the exchange is
    in flight). Differentiable: the backward returns the halo rows' gradient to their
    owners (under ``phase + "-grad"``) and adds it to the own rows' gradient.

    Shapes: x_rows (N_r, *F) -> (N_r + H, *F). A table with receive positions is
    refused (its halo is a buffer the positions index: use ``start_fetch``).
    """
    return _HaloJoin.apply(x_rows, table, comm, phase)


def join_rows(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str) -> Tensor:
    """``halo_join``'s forward without autograd: a new (N_r + H, *F) tensor, the own
    rows copied in while the halo is in flight."""
    check_table(table, comm)
    n = x_rows.shape[0]
    out = x_rows.new_empty((n + table.num_halo, *x_rows.shape[1:]))
    pending = start_fetch(x_rows, table, comm, phase, into=out[n:])
    out[:n] = x_rows
    pending.wait()
    return out


class _HaloJoin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_rows: Tensor, table: ExchangeTable, comm: Comm,
                phase: str) -> Tensor:
        ctx.table, ctx.comm, ctx.phase = table, comm, phase
        return join_rows(x_rows, table, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        table = ctx.table
        n = grad.shape[0] - table.num_halo
        pending = start_return(grad[n:], table, ctx.comm, f"{ctx.phase}-grad")
        g = grad[:n].clone(memory_format=torch.contiguous_format)
        return pending.wait(g), None, None, None


class _HaloFetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_rows: Tensor, table: ExchangeTable, comm: Comm,
                phase: str) -> Tensor:
        ctx.table, ctx.comm, ctx.phase, ctx.num_rows = table, comm, phase, x_rows.shape[0]
        return _halo_fetch(x_rows, table, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None, None]:
        grad = _halo_scatter_add(grad_halo, ctx.table, ctx.num_rows, ctx.comm,
                                 f"{ctx.phase}-grad")
        return grad, None, None, None


class _HaloScatterAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_halo: Tensor, table: ExchangeTable, num_rows: int, comm: Comm,
                phase: str) -> Tensor:
        ctx.table, ctx.comm, ctx.phase = table, comm, phase
        return _halo_scatter_add(x_halo, table, num_rows, comm, phase)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[Tensor, None, None, None, None]:
        grad = _halo_fetch(grad_rows, ctx.table, ctx.comm, f"{ctx.phase}-grad")
        return grad, None, None, None, None


def halo_fetch(x_rows: Tensor, table: ExchangeTable, comm: Comm, phase: str = "halo") -> Tensor:
    """Fetch the remote rows this rank needs (data parallelism's DepComm, G3 push).

    Placement: owner rows (Shard(0)) -> halo copies. Forward: all-to-all-v sending
    ``x_rows[table.send_idx[p]]`` to each p; backward: the halo gradient rows go back
    to their owners and are scatter-added (``index_add_``) into the gradient of
    ``x_rows`` (``halo_scatter_add``, under ``phase + "-grad"``).

    Shapes:
        x_rows: (N_r, *F) rows this rank owns.
        returns: (H, *F), H = sum(table.recv_rows): table.recv_rows[p] rows from
        each peer p, concatenated in peer order.

    Bytes per rank: sent sum_{p != r} S_p prod(F) s, received sum_{p != r}
    recv_rows[p] prod(F) s (``table.volume_bytes``); the backward swaps them.
    With ``world_size == 1`` the (normally empty) local gather is done without
    communication.
    """
    return _HaloFetch.apply(x_rows, table, comm, phase)


def halo_scatter_add(x_halo: Tensor, table: ExchangeTable, num_rows: int, comm: Comm,
                     phase: str = "halo-push") -> Tensor:
    """Send halo rows back to their owners and sum them there (conjugate of halo_fetch).

    Placement: halo copies -> owner rows (Shard(0)), partial sums added. Forward:
    all-to-all-v then ``index_add_`` at ``table.send_idx[p]`` in peer order;
    backward: ``halo_fetch`` of the gradient (under ``phase + "-grad"``).

    Shapes:
        x_halo: (H, *F) in the order ``halo_fetch`` returns.
        returns: (num_rows, *F), zero where no halo row maps.

    Bytes per rank: the reverse of ``halo_fetch``: sent sum_{p != r} recv_rows[p]
    prod(F) s, received sum_{p != r} S_p prod(F) s.
    """
    return _HaloScatterAdd.apply(x_halo, table, num_rows, comm, phase)
