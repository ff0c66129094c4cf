"""P2P exchange tables: which local rows go from this rank to which peer, and how many come back.

A halo exchange (data parallelism's DepComm, G3's push) moves, for every pair of
ranks, an ordered list of vertex rows. Both ends must agree on the order: rank q
receives the rows it needs from p in q's halo order, so p must send exactly those
gids, in that order. ``ExchangeTable.from_needs`` builds one rank's table from the
two lists every rank can compute from a global partition.

A table may also say where the received rows go (``recv_pos``): then one table is
one round of a larger exchange (G3's per-bin pushes), whose rows land at given
positions of a halo buffer instead of filling it in peer order.

No communication happens here; this module must not import torch.distributed.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ExchangeTable:
    """One rank's side of a halo exchange.

    Attributes:
        send_idx: per peer p, int64 (S_p,) local row indices to send to p, in the
            order p expects them.
        recv_rows: per peer p, the number of rows received from p; the halo is their
            concatenation in peer order.
        recv_pos: optional, per peer p, int64 (recv_rows[p],) positions in a halo
            buffer of the rows received from p (and, in the return direction, of the
            rows sent back to p). None: the concatenation in peer order.
        recv_ids, send_ids: optional, per peer p, the global vertex ids of the rows
            received from p and sent to p, in order: they name rows across tables
            (``stale.StaleHalo`` matches historical rows by them).
    """

    send_idx: list[Tensor]
    recv_rows: list[int]
    recv_pos: list[Tensor] | None = None
    recv_ids: list[Tensor] | None = None
    send_ids: list[Tensor] | None = None

    def __post_init__(self) -> None:
        if len(self.send_idx) != len(self.recv_rows):
            raise ValueError(f"ExchangeTable: {len(self.send_idx)} send lists but "
                             f"{len(self.recv_rows)} receive counts; need one per rank")
        for p, idx in enumerate(self.send_idx):
            if idx.dtype != torch.int64 or idx.dim() != 1:
                raise ValueError(f"ExchangeTable: send_idx[{p}] must be a 1-D int64 tensor, "
                                 f"got {idx.dtype} of shape {tuple(idx.shape)}")
        self.recv_rows = [int(n) for n in self.recv_rows]
        if any(n < 0 for n in self.recv_rows):
            raise ValueError(f"ExchangeTable: recv_rows must be >= 0, got {self.recv_rows}")
        if self.recv_pos is not None:
            self._check_recv_pos(self.recv_pos)
        for name, ids, counts in (("recv_ids", self.recv_ids, self.recv_rows),
                                  ("send_ids", self.send_ids, self.send_rows())):
            if ids is not None and [int(t.numel()) for t in ids] != list(counts):
                raise ValueError(f"ExchangeTable: {name} must hold one id per row exchanged "
                                 f"with each peer ({list(counts)}), got "
                                 f"{[int(t.numel()) for t in ids]}")

    def _check_recv_pos(self, recv_pos: list[Tensor]) -> None:
        if len(recv_pos) != len(self.recv_rows):
            raise ValueError(f"ExchangeTable: {len(recv_pos)} receive position lists but "
                             f"{len(self.recv_rows)} receive counts; need one per rank")
        for p, (pos, n) in enumerate(zip(recv_pos, self.recv_rows)):
            if pos.dtype != torch.int64 or pos.dim() != 1 or pos.numel() != n:
                raise ValueError(f"ExchangeTable: recv_pos[{p}] must be a 1-D int64 tensor of "
                                 f"recv_rows[{p}]={n} positions, got {pos.dtype} of shape "
                                 f"{tuple(pos.shape)}")

    @classmethod
    def from_needs(cls, needed_from: Sequence[Tensor], needed_by: Sequence[Tensor],
                   gid_to_row: Callable[[Tensor], Tensor]) -> ExchangeTable:
        """Build this rank's table from global vertex ids.

        Args:
            needed_from: per peer p, the gids this rank needs from p, in halo order.
            needed_by: per peer p, the gids p needs from this rank, in p's halo order
                (p's ``needed_from[this rank]``).
            gid_to_row: maps gids owned by this rank to their local row indices.
        """
        if len(needed_from) != len(needed_by):
            raise ValueError(f"ExchangeTable.from_needs: {len(needed_from)} needed_from lists "
                             f"but {len(needed_by)} needed_by lists; need one per rank")
        send_idx = [gid_to_row(g).to(torch.int64).reshape(-1) for g in needed_by]
        return cls(send_idx=send_idx, recv_rows=[int(g.numel()) for g in needed_from])

    @property
    def world_size(self) -> int:
        return len(self.recv_rows)

    @functools.cached_property
    def recv_runs(self) -> list[tuple[int, int]] | None:
        """Per peer p, ``(a, b)`` where ``recv_pos[p]`` is a, a + 1, ..., b - 1, so its
        rows have one block of the halo buffer; None where some peer's positions are
        not such a run, or the table has none (its halo is the blocks in peer order)."""
        if self.recv_pos is None:
            return None
        runs = []
        for pos in self.recv_pos:
            n = int(pos.numel())
            a = int(pos[0]) if n else 0
            if n and (int(pos[-1]) - a != n - 1 or
                      (n > 1 and not bool((pos[1:] - pos[:-1] == 1).all()))):
                return None
            runs.append((a, a + n))
        return runs

    @property
    def num_halo(self) -> int:
        """H: rows in the fetched halo (self entry included)."""
        return sum(self.recv_rows)

    def send_rows(self) -> list[int]:
        """Rows sent to each peer."""
        return [int(idx.numel()) for idx in self.send_idx]

    def volume_bytes(self, dim: int, itemsize: int, rank: int | None = None) -> tuple[int, int]:
        """Bytes (sent, received) by one halo fetch of rows of ``dim`` elements.

        The backward (gradient scatter-add) moves the same bytes the other way.
        Pass ``rank`` to leave out this rank's own entry, a local copy that is never
        counted (it is empty in a normal halo).
        """
        sent = sum(n for p, n in enumerate(self.send_rows()) if p != rank)
        recv = sum(n for p, n in enumerate(self.recv_rows) if p != rank)
        return sent * dim * itemsize, recv * dim * itemsize

    def to(self, device: torch.device | str) -> ExchangeTable:
        """The same table with its index tensors on ``device``."""
        pos = None if self.recv_pos is None else [t.to(device) for t in self.recv_pos]
        return ExchangeTable([idx.to(device) for idx in self.send_idx], list(self.recv_rows), pos,
                             self.recv_ids, self.send_ids)
