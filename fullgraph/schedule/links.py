"""The push tables of G3's links: which rows travel between which workers in which round.

A *link* joins phase k-1 of the P2P executor to phase k: every row phase k reads
from another worker is pushed by its owner in the forward round of the bin that
computed it (``bins.PhaseBins.round_of``), and its gradient goes back in the
backward round of the last bin of phase k that reads it (``step_of``). Each round
is one ``ExchangeTable`` with receive positions: the forward round j sends rows of
the owner and writes them at their halo positions on the reader; the backward
round t is the return direction of a table, sending the reader's halo gradient
rows back to be added into the owner's gradient rows.

Pure functions of the graph, the partition and the schedule, tested without
processes; or, where each worker holds only its own vertices' in-edges (a per-part
shard), built from the reads each worker makes and one exchange per link that tells
every owner which of its rows are read.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm.exchange import ExchangeTable
from fullgraph.graph.csr import Graph


@dataclass
class Link:
    """One worker's side of the pushes from phase k-1 to phase k, round by round.

    Attributes:
        fwd: per forward round, the table of the rows pushed (``send_idx``: positions
            in my rows; ``recv_pos``: positions in my halo of the rows received).
        bwd: per backward round, the table whose return carries the halo gradients
            (``recv_pos``: positions in my halo of the gradients sent back;
            ``send_idx``: positions in my rows of the gradients received).
        num_halo: rows of the halo (remote in-neighbours, ordered by owner then id).
    """

    fwd: list[ExchangeTable]
    bwd: list[ExchangeTable]
    num_halo: int

    @property
    def fwd_send(self) -> list[list[Tensor]]:
        """[round][peer] positions in my rows of the rows pushed to the peer."""
        return [t.send_idx for t in self.fwd]

    @property
    def fwd_recv(self) -> list[list[Tensor]]:
        """[round][peer] positions in my halo of the rows received."""
        return [_positions(t) for t in self.fwd]

    @property
    def bwd_send(self) -> list[list[Tensor]]:
        """[round][peer] positions in my halo of the gradients returned."""
        return [_positions(t) for t in self.bwd]

    @property
    def bwd_recv(self) -> list[list[Tensor]]:
        """[round][peer] positions in my rows of the gradients received."""
        return [t.send_idx for t in self.bwd]

    def rows_moved(self, rank: int) -> tuple[int, int]:
        """(rows sent, rows received) by this worker in one forward pass."""
        sent = sum(n for t in self.fwd for p, n in enumerate(t.send_rows()) if p != rank)
        recv = sum(n for t in self.fwd for p, n in enumerate(t.recv_rows) if p != rank)
        return sent, recv

    def to(self, device: torch.device | str) -> Link:
        """The same tables with their index tensors on ``device``."""
        return Link([t.to(device) for t in self.fwd], [t.to(device) for t in self.bwd],
                    self.num_halo)


def _positions(table: ExchangeTable) -> list[Tensor]:
    assert table.recv_pos is not None, "link tables always carry receive positions"
    return table.recv_pos


@dataclass
class CrossReads:
    """Every (reader part, remote vertex it reads) pair of a partition, with the
    destinations of the edges behind each pair: grouped once, used by every link.

    Attributes:
        reader, vertex: (P,) the pairs, sorted by (reader, vertex).
        start: (P,) offset of each pair's edges in ``dst``.
        dst: destinations of the cross-part edges, grouped by pair.
    """

    reader: np.ndarray
    vertex: np.ndarray
    start: np.ndarray
    dst: np.ndarray

    @classmethod
    def build(cls, graph: Graph, part_of: np.ndarray, reader: int | None = None
              ) -> CrossReads:
        """The pairs of every part from the whole ``graph``, or with ``reader`` those of
        that part only, from the in-edges of its vertices."""
        src, dst = (t.numpy() for t in graph.edges())
        cross = part_of[src] != part_of[dst]
        if reader is not None:
            cross &= part_of[dst] == reader
        s, d = src[cross], dst[cross]
        n = graph.num_dst
        key = part_of[d] * n + s
        order = np.argsort(key, kind="stable")
        uniq, start = np.unique(key[order], return_index=True)
        return cls(uniq // n, uniq % n, start, d[order])

    def latest(self, step: np.ndarray) -> np.ndarray:
        """Per pair, the max of ``step`` over the reader's vertices reading the vertex."""
        return np.maximum.reduceat(step[self.dst], self.start) if self.start.size \
            else self.start.copy()


@dataclass(frozen=True)
class RowIndex:
    """Where every vertex lives.

    Attributes:
        part_of: (N,) part (worker) of each vertex.
        lid: (N,) position of each vertex in its owner's rows.
        world: the number of workers.
    """

    part_of: np.ndarray
    lid: np.ndarray
    world: int


@dataclass(frozen=True)
class LinkRounds:
    """When each row of a link travels.

    Attributes:
        send_round: (N,) forward round that pushes each vertex (phase k-1's bins).
        recv_step: (N,) backward step of each vertex's bin in phase k: a reader returns
            a row's gradient in the round of the latest step among its bins reading it.
        fwd_rounds, bwd_rounds: rounds of each direction.
    """

    send_round: np.ndarray
    recv_step: np.ndarray
    fwd_rounds: int
    bwd_rounds: int


def _split_by_round(positions: np.ndarray, rounds: np.ndarray, num_rounds: int) -> list[Tensor]:
    """``positions`` grouped by their round (order kept within a round)."""
    order = np.argsort(rounds, kind="stable")
    counts = np.bincount(rounds, minlength=num_rounds)
    return [torch.from_numpy(c.copy()) for c in np.split(positions[order], np.cumsum(counts)[:-1])]


def _empty(rounds: int, world: int) -> list[list[Tensor]]:
    empty = torch.empty(0, dtype=torch.int64)
    return [[empty] * world for _ in range(rounds)]


ReadsExchange = Callable[[list[np.ndarray], list[np.ndarray]],
                        tuple[list[np.ndarray], list[np.ndarray]]]
"""Sends, per owner p, the vertices of p this worker reads and the step of each, and
returns, per reader q, the vertices of this worker q reads and their steps (a
collective: every worker calls it once per link, in the same order)."""


def _read_by_others(reads: CrossReads, index: RowIndex, rank: int, last_step: np.ndarray
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """[reader] my vertices it reads (ascending) and their last steps, from the whole
    partition's ``reads``."""
    mine = index.part_of[reads.vertex] == rank
    sel = [mine & (reads.reader == q) for q in range(index.world)]
    return [reads.vertex[m] for m in sel], [last_step[m] for m in sel]


def _owner_side(read_by: tuple[list[np.ndarray], list[np.ndarray]], index: RowIndex,
                rounds: LinkRounds) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """[round][reader] my rows pushed forward, and my rows receiving gradients back."""
    fwd_send = _empty(rounds.fwd_rounds, index.world)
    bwd_recv = _empty(rounds.bwd_rounds, index.world)
    for q, (u, step) in enumerate(zip(*read_by)):  # u ascending: q's halo order for me
        rows = index.lid[u]
        for j, t in enumerate(_split_by_round(rows, rounds.send_round[u], rounds.fwd_rounds)):
            fwd_send[j][q] = t
        for j, t in enumerate(_split_by_round(rows, step, rounds.bwd_rounds)):
            bwd_recv[j][q] = t
    return fwd_send, bwd_recv


def _reader_side(reads: CrossReads, index: RowIndex, rounds: LinkRounds, rank: int,
                 last_step: np.ndarray, halo: np.ndarray
                 ) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """[round][owner] my halo positions receiving rows, and those returning gradients."""
    read = reads.reader == rank
    u_read, step_read = reads.vertex[read], last_step[read]
    if u_read.size != halo.size or not np.array_equal(np.sort(u_read), np.sort(halo)):
        raise RuntimeError(f"rank {rank}: the halo does not match the remote in-neighbours")
    halo_step = step_read[np.searchsorted(u_read, halo)]
    owners = index.part_of[halo]
    fwd_recv = _empty(rounds.fwd_rounds, index.world)
    bwd_send = _empty(rounds.bwd_rounds, index.world)
    positions = np.arange(halo.size, dtype=np.int64)
    for p in range(index.world):
        sel = owners == p
        pos = positions[sel]
        for j, t in enumerate(_split_by_round(pos, rounds.send_round[halo[sel]],
                                              rounds.fwd_rounds)):
            fwd_recv[j][p] = t
        for j, t in enumerate(_split_by_round(pos, halo_step[sel], rounds.bwd_rounds)):
            bwd_send[j][p] = t
    return fwd_recv, bwd_send


def _round_table(send: list[Tensor], recv_pos: list[Tensor]) -> ExchangeTable:
    return ExchangeTable(send, [int(t.numel()) for t in recv_pos], recv_pos)


def link_tables(reads: CrossReads, index: RowIndex, rounds: LinkRounds, rank: int,
                halo: np.ndarray, exchange: ReadsExchange | None = None) -> Link:
    """The push tables of one link on worker ``rank``.

    Args:
        reads: cross-part reads (``CrossReads.build``): of the whole partition, or with
            ``exchange`` at least those of this worker's vertices.
        index: the part and local position of every vertex.
        rounds: the round each row is pushed in and each gradient returned in.
        rank: this worker.
        halo: gids of this worker's remote in-neighbours, ordered by (owner, gid).
        exchange: learns from the other workers which of this worker's vertices they
            read (default: none, a pure function of the whole partition's ``reads``).
    """
    last_step = reads.latest(rounds.recv_step)
    if exchange is None:
        read_by = _read_by_others(reads, index, rank, last_step)
    else:
        read = reads.reader == rank
        u, step = reads.vertex[read], last_step[read]
        owner = index.part_of[u]
        read_by = exchange([u[owner == p] for p in range(index.world)],
                           [step[owner == p] for p in range(index.world)])
    fwd_send, bwd_recv = _owner_side(read_by, index, rounds)
    fwd_recv, bwd_send = _reader_side(reads, index, rounds, rank, last_step, halo)
    return Link([_round_table(s, r) for s, r in zip(fwd_send, fwd_recv)],
                [_round_table(s, r) for s, r in zip(bwd_recv, bwd_send)], int(halo.size))
