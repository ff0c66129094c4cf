"""Halo exchanges that go on without late peers: partial computation (NeutronCloud §5.2).

``halo.halo_fetch`` is an all-to-all: every rank waits for every peer at every P / E
stage. ``StaleHalo.fetch`` moves the same rows as tagged point-to-point messages
(``tagged``), one per peer and direction, and waits for each only until a deadline
the caller sets per exchange point. A peer whose rows have not arrived by then is
replaced by the last rows received from it at that point (its *historical*
embeddings forward, gradients backward), as long as they are at most ``staleness``
epochs old; past that the worker waits for the current ones. A message that misses
its deadline stays posted: when it completes (checked at every later exchange at
the same point) it refreshes the historical rows, so nothing is lost, and no
message of one epoch is ever read as another's (the tag holds the epoch, the stage
and the direction). Historical rows are matched by the global ids of the rows
(``ExchangeTable.recv_ids`` / ``send_ids``) when the table carries them, so they
survive a change of plan that still fetches those rows from that peer.

An epoch in ``sync`` mode waits for every message (exact). ``drain`` completes
every receive still in flight; call it when every rank is known to reach the same
point (a full synchronisation), so the historical rows are then current and no
receive is left behind.

Shapes: ``x_rows`` (N_r, *F) owned rows; the halo (H, *F) in peer order as
``halo.halo_fetch`` returns it. Bytes are counted under ``phase`` (forward) and
``phase + "-grad"`` (backward) as each message completes.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.tagged import TAG_BASE, Outbox, Tagged, post_recv, post_send

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

POINTS_PER_EPOCH = 1024
"""Tag space per epoch: exchange points (stage x direction) and the partial update."""

Point = tuple[int, str]
"""An exchange point: (stage index, "fwd" | "bwd")."""


@dataclass
class EpochStats:
    """What the stale exchanges of one epoch did on this worker."""

    stale_peers: int = 0
    stale_rows: int = 0
    oldest: int = 0
    forced_waits: int = 0
    blocked_s: float = 0.0
    late_refreshes: int = 0
    by_peer: dict[int, int] = field(default_factory=dict)


def point_tag(epoch: int, point: Point) -> int:
    """The tag of one exchange point's messages in ``epoch``."""
    stage, direction = point
    if not 0 <= 2 * stage + 1 < POINTS_PER_EPOCH - 64:
        raise ValueError(f"stale halo: stage {stage} is beyond the tag space")
    return TAG_BASE + epoch * POINTS_PER_EPOCH + 2 * stage + (direction == "bwd")


class StaleHalo:
    """Deadline-bounded halo exchanges with historical rows (see the module docstring).

    Args:
        comm: the world communicator (a backend that matches by tag).
        staleness: K, the oldest historical rows used, in epochs.
        deadline: point -> the ``time.perf_counter()`` until which the current
            message is awaited (``math.inf``: wait); asked only outside sync mode.
        reached: called with each point when its exchange finished (for the
            caller's per-point timings).
        phase: the byte counters' phase (default: "halo").
    """

    def __init__(self, comm: Comm, staleness: int, deadline: Callable[[Point], float],
                 reached: Callable[[Point], None], phase: str = "halo") -> None:
        if staleness < 1:
            raise ValueError(f"staleness must be >= 1 epoch, got {staleness}")
        self.comm, self.staleness, self.phase = comm, staleness, phase
        self.deadline, self.reached = deadline, reached
        self.epoch, self.sync = 0, True
        self.pending: dict[tuple[Point, int], list[tuple[int, Tagged, Any]]] = {}
        self.history: dict[tuple[Point, int], tuple[int, Tensor, Any]] = {}
        self.outbox = Outbox()
        self.stats = EpochStats()

    # ------------------------------------------------------------ epoch control
    def begin_epoch(self, epoch: int, sync: bool) -> EpochStats:
        """Start ``epoch`` (sync: wait for every message); the stats of the last one."""
        done, self.stats = self.stats, EpochStats()
        self.epoch, self.sync = epoch, sync
        return done

    def drain(self) -> None:
        """Complete every receive in flight (each within the timeout), oldest first."""
        for key, queue in self.pending.items():
            for epoch, message, ident in queue:
                message.wait()
                self._remember(key, epoch, message.buffer, ident)
            queue.clear()
        self.outbox.reap()

    def raise_failures(self) -> None:
        """Raise the ``CommError`` of any message in flight whose peer failed."""
        for queue in self.pending.values():
            for _, message, _ in queue:
                message.done()
        self.outbox.reap()

    def close(self) -> None:
        """Finish every message this worker sent or awaits (end of training)."""
        self.drain()
        self.outbox.flush()

    # --------------------------------------------------------------- exchanges
    def fetch(self, x_rows: Tensor, table: ExchangeTable, stage: int) -> Tensor:
        """The halo of ``x_rows`` at ``stage`` (differentiable: the backward returns
        the gradient rows to their owners the same way)."""
        return _StaleFetch.apply(x_rows, self, table, stage)

    def _exchange(self, send: list[Tensor | None], recv_rows: list[int], trailing: tuple,
                  dtype: torch.dtype, table: ExchangeTable, point: Point) -> list[Tensor]:
        """Send ``send[p]`` to each peer p and receive ``recv_rows[p]`` rows from it;
        a late peer's rows are its historical ones (see the module docstring)."""
        comm, tag = self.comm, point_tag(self.epoch, point)
        if recv_rows[comm.rank] or (send[comm.rank] is not None
                                    and send[comm.rank].shape[0]):  # type: ignore[union-attr]
            raise ValueError(f"stale halo: rank {comm.rank}'s table exchanges rows with "
                             "itself; a halo holds remote rows only")
        phase = self.phase if point[1] == "fwd" else f"{self.phase}-grad"
        ids = table.recv_ids if point[1] == "fwd" else table.send_ids
        for p, rows in enumerate(send):
            if rows is not None and rows.shape[0] and p != comm.rank:
                self.outbox.add(post_send(rows, p, tag, comm, phase))
        waiting = {}
        for p, n in enumerate(recv_rows):
            if n and p != comm.rank:
                message = post_recv((n, *trailing), dtype, p, tag, comm, phase)
                ident = table if ids is None else ids[p]
                self.pending.setdefault((point, p), []).append((self.epoch, message, ident))
                waiting[p] = (message, ident)
        self._refresh(point)
        deadline = math.inf if self.sync else self.deadline(point)
        self._poll([m for m, _ in waiting.values()], deadline)
        out = [torch.empty((0, *trailing), dtype=dtype, device=comm.device)
               for _ in recv_rows]
        for p, (message, ident) in waiting.items():
            out[p] = self._rows_from(point, p, message, ident)
        self.reached(point)
        return out

    def _poll(self, messages: list[Tagged], deadline: float) -> None:
        """Wait for ``messages`` until ``deadline`` (inf: each within the timeout)."""
        start = time.perf_counter()
        if math.isinf(deadline):
            for message in messages:
                message.wait()
        else:
            for message in messages:
                message.wait_until(deadline)
        self.stats.blocked_s += time.perf_counter() - start

    def _rows_from(self, point: Point, peer: int, message: Tagged, ident: Any) -> Tensor:
        """The current rows from ``peer`` if they came, else the historical ones of the
        same rows (``ident``) at most ``staleness`` epochs old, else (waiting) the
        current ones."""
        if message.done():
            self._refresh(point)
            return message.buffer
        found = self._historical((point, peer), ident)
        if found is None or self.epoch - found[0] > self.staleness:
            start = time.perf_counter()
            message.wait()
            self.stats.blocked_s += time.perf_counter() - start
            self.stats.forced_waits += 1
            self._refresh(point)
            return message.buffer
        age, rows = self.epoch - found[0], found[1]
        stats = self.stats
        stats.stale_peers += 1
        stats.stale_rows += int(rows.shape[0])
        stats.oldest = max(stats.oldest, age)
        stats.by_peer[peer] = stats.by_peer.get(peer, 0) + 1
        return rows

    def _historical(self, key: tuple[Point, int], ident: Any) -> tuple[int, Tensor] | None:
        """(epoch, rows) kept for the rows ``ident`` names: global ids (a tensor; rows of
        another table that hold all of them are picked out) or the exchange table
        itself (only its own rows match). None: not all of them are kept."""
        kept = self.history.get(key)
        if kept is None:
            return None
        epoch, rows, had = kept
        if had is ident:
            return epoch, rows
        if not isinstance(ident, Tensor) or not isinstance(had, Tensor):
            return None
        if had.shape == ident.shape and torch.equal(had, ident):
            return epoch, rows
        order = torch.argsort(had)
        pos = torch.searchsorted(had[order], ident).clamp_(max=max(had.numel() - 1, 0))
        if had.numel() == 0 or not torch.equal(had[order][pos], ident):
            return None
        return epoch, rows[order[pos]]

    def _refresh(self, point: Point) -> None:
        """Move the completed receives at ``point`` into the historical rows."""
        for (at, peer), queue in self.pending.items():
            if at != point:
                continue
            while queue and queue[0][1].done():
                epoch, message, ident = queue.pop(0)
                if epoch < self.epoch:
                    self.stats.late_refreshes += 1
                self._remember((at, peer), epoch, message.buffer, ident)

    def _remember(self, key: tuple[Point, int], epoch: int, rows: Tensor, ident: Any) -> None:
        """Keep ``rows`` (named by ``ident``) as the historical rows of ``key`` unless
        newer ones are kept."""
        kept = self.history.get(key)
        if kept is None or kept[0] <= epoch:
            self.history[key] = (epoch, rows, ident)


class _StaleFetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_rows: Tensor, halo: StaleHalo, table: ExchangeTable,
                stage: int) -> Tensor:
        ctx.halo, ctx.table, ctx.stage, ctx.num_rows = halo, table, stage, x_rows.shape[0]
        trailing = tuple(x_rows.shape[1:])
        send: list[Tensor | None] = [x_rows.index_select(0, idx.to(x_rows.device))
                                     for idx in table.send_idx]
        parts = halo._exchange(send, table.recv_rows, trailing, x_rows.dtype, table,
                               (stage, "fwd"))
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None, None]:
        halo, table = ctx.halo, ctx.table
        trailing = tuple(grad_halo.shape[1:])
        # a copy: the sends may complete after this returns, and autograd may reuse
        # the gradient buffer in place
        send: list[Tensor | None] = list(torch.split(grad_halo.clone(), table.recv_rows))
        parts = halo._exchange(send, table.send_rows(), trailing, grad_halo.dtype, table,
                               (ctx.stage, "bwd"))
        grad = grad_halo.new_zeros((ctx.num_rows, *trailing))
        for p, (idx, rows) in enumerate(zip(table.send_idx, parts)):
            if idx.numel() and p != halo.comm.rank:
                grad.index_add_(0, idx.to(grad.device), rows)
        return grad, None, None, None
