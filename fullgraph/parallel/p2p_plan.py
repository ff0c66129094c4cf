"""The P2P (G3) executor's plan: phases, their bins on this worker, and their links.

Built once by ``P2PParallel.setup`` from the program, the partition and the
schedule (``schedule.bins.build_schedule``); ``p2p_run`` executes it. See
``fullgraph.parallel.p2p`` for the execution model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Shard
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe, out_dim
from fullgraph.parallel.base import Plan
from fullgraph.parallel.rowplan import RowPlan
from fullgraph.partition import PartitionBook
from fullgraph.schedule.bins import PhaseBins, ReduceMax, ScheduleMode
from fullgraph.schedule.links import (
    CrossReads,
    Link,
    LinkRounds,
    ReadsExchange,
    RowIndex,
    link_tables,
)

Key = tuple[str, int]
"""A value carried between phases: ("rows", s) the rows output by stage s (a layer
input), ("edges", s) the edge weights of E stage s."""

Pos = Tensor | slice
"""Positions of a bin's rows or edges in a buffer: an index tensor, or a slice where
they are one increasing run (then reading them is a view and writing them one
contiguous copy; a phase of one bin has only runs)."""


def as_run(t: Tensor) -> Pos:
    """``t`` (1-D, int64) as ``slice(a, a + n)`` when it is a, a + 1, ..., a + n - 1."""
    n = t.numel()
    if n == 0:
        return slice(0, 0)
    a = int(t[0])
    if int(t[-1]) - a != n - 1 or (n > 1 and not bool((t[1:] - t[:-1] == 1).all())):
        return t
    return slice(a, a + n)


def pos_len(pos: Pos) -> int:
    """How many positions ``pos`` holds."""
    return pos.stop - pos.start if isinstance(pos, slice) else pos.numel()


def take(x: Tensor, pos: Pos) -> Tensor:
    """The rows of ``x`` at ``pos``: ``x`` itself for all of them, a view for a run,
    a gathered copy otherwise."""
    if not isinstance(pos, slice):
        return x.index_select(0, pos)
    return x if whole(pos, x.shape[0]) else x[pos]


def add_at(buf: Tensor, pos: Pos, rows: Tensor) -> None:
    """``buf[pos] += rows`` (``index_add_`` for an index tensor)."""
    if isinstance(pos, slice):
        buf[pos].add_(rows)
    else:
        buf.index_add_(0, pos, rows)


def whole(pos: Pos | None, n: int) -> bool:
    """Whether ``pos`` is every position 0..n-1 in order."""
    return isinstance(pos, slice) and pos.start == 0 and pos.stop == n


@dataclass
class BinBlock:
    """One bin of one phase on this worker.

    The positions (``Pos``) are slices where they form one run: a bin's rows are
    kept in ascending order (the order within a bin changes no result), so a phase
    of one bin reads and writes whole buffers without gathering or scattering.

    Attributes:
        rows: (b,) positions of the bin's vertices in this worker's rows, ascending.
        gids: (b,) their global ids (dropout keys).
        src_local, src_halo: positions, in the previous phase's rows and in the halo,
            of the rows the phase's first stage reads (None in phase 0).
        graph: (b x sources) CSR of the bin's in-edges, sources = local then halo.
        dst_pos: (b,) positions of the bin's own rows among the sources.
        edge_pos: positions of the bin's edges in the phase's block.
        eids: global ids of those edges.
    """

    rows: Pos
    gids: Tensor
    src_local: Pos | None = None
    src_halo: Pos | None = None
    graph: Graph | None = None
    dst_pos: Pos | None = None
    edge_pos: Pos | None = None
    eids: Tensor | None = None
    taken: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def edge_weights(self, s: int, weight: Tensor) -> Tensor:
        """The bin's part of P stage s's fixed edge weights ``weight``, taken once: the
        same tensor every pass, so the SpMM's backward keeps them in its transposed
        order (``Transposed.weights_in_order``) instead of gathering them again."""
        got = self.taken.get(s)
        if got is None or got[0] is not weight:
            assert self.edge_pos is not None
            got = self.taken[s] = (weight, take(weight, self.edge_pos))
        return got[1]

    def index(self, key: Key) -> Pos:
        """Where this bin's part of a carried value lies: its rows or its edges."""
        pos = self.rows if key[0] == "rows" else self.edge_pos
        assert pos is not None, "edge-carried values need the bin's edge positions"
        return pos

    def to(self, device: torch.device) -> None:
        """Move the bin's tensors to ``device`` (in place)."""
        for name in ("rows", "gids", "src_local", "src_halo", "dst_pos", "edge_pos", "eids"):
            t = getattr(self, name)
            if isinstance(t, Tensor):
                setattr(self, name, t.to(device))
        self.taken.clear()
        if self.graph is not None:
            self.graph = self.graph.to(device)


@dataclass
class Phase:
    """The stages [start, stop) of the program and their bins on this worker.

    Attributes:
        link: the pushes this phase reads (None for phase 0).
        imports: values of earlier phases read here (``Key``).
        exports: keys of values from this phase that later phases import.
        needs_grad: whether the output depends on a trained parameter.
    """

    start: int
    stop: int
    bins: list[BinBlock]
    fwd_wait: list[int]
    bwd_order: list[int]
    bwd_wait: list[int]
    rounds: int
    out_dim: int
    link: Link | None = None
    imports: list[Key] = field(default_factory=list)
    exports: list[Key] = field(default_factory=list)
    needs_grad: bool = True


@dataclass
class P2PPlan(Plan):
    """A worker's state for P2P execution."""

    comm: Comm
    graph: Graph
    book: PartitionBook
    rows: RowPlan
    features: Tensor
    phases: list[Phase]
    weights: list[Tensor | None]
    mode: ScheduleMode
    schedule: str
    limits: list[int]
    shard: Shard | None = None
    """The dataset's part when it is a per-part shard (``partition.shards``)."""


def phase_bounds(program: StageProgram, shares: list[bool]) -> list[tuple[int, int]]:
    """[start, stop) of each phase: a new phase at every P / E stage with its own input."""
    starts = [0] + [s for s, info in enumerate(describe(program))
                    if info.reads_neighbours and not shares[s]]
    return list(zip(starts, starts[1:] + [len(program.stages)]))


def _imports(program: StageProgram, start: int, stop: int) -> list[Key]:
    """Values of earlier phases that stages [start, stop) read: ("rows", s) the layer
    input made by LayerInput stage s, ("edges", s) the weights of E stage s."""
    keys: list[Key] = []
    for info in describe(program)[start:stop]:
        for kind, src in (("rows", info.layer_input_from), ("edges", info.edge_weights_from)):
            if src is not None and src < start and (kind, src) not in keys:
                keys.append((kind, src))
    return keys


def _has_params(program: StageProgram, start: int, stop: int) -> bool:
    return any(p.requires_grad for st in program.stages[start:stop] for p in st.parameters())


def bin_block(block_graph: Graph, block_eids: Tensor, rows: np.ndarray, num_local: int,
              with_dst: bool) -> tuple[Pos, Pos, Graph, Pos, Pos, Tensor]:
    """A bin's sources and CSR from the phase's block (rows = local positions).

    Returns (src_local, src_halo, graph, dst_pos, edge_pos, eids).
    """
    sub_indptr, src, edge_pos = in_edges(block_graph, rows)
    used = np.unique(np.concatenate([src, rows]) if with_dst else src)
    local = used[used < num_local]
    halo = used[used >= num_local] - num_local
    graph = Graph(torch.from_numpy(sub_indptr), torch.from_numpy(np.searchsorted(used, src)),
                  num_src=used.size, validate=False)
    dst_pos = torch.from_numpy(np.searchsorted(used, rows))
    edge_t = torch.from_numpy(edge_pos)
    return (as_run(torch.from_numpy(local)), as_run(torch.from_numpy(halo)), graph,
            as_run(dst_pos), as_run(edge_t), block_eids[edge_t])


def row_index(graph: Graph, book: PartitionBook, world: int) -> RowIndex:
    """Every vertex's part and position in its owner's rows."""
    lid = np.zeros(graph.num_dst, dtype=np.int64)
    for p in range(world):
        gids = book.part_to_gids(p).numpy()
        lid[gids] = np.arange(gids.size)
    return RowIndex(book.part_of.numpy().astype(np.int64), lid, world)


def _bins(program: StageProgram, rows: RowPlan, start: int, stop: int, first: bool,
          gids_per_bin: list[np.ndarray], lid: np.ndarray) -> list[BinBlock]:
    """This worker's bins of phase [start, stop), with their CSRs past phase 0."""
    has_edge = any(info.is_edge for info in describe(program)[start:stop])
    block = None if first else rows.blocks[start]
    num_local = rows.owned.numel()
    bins = []
    for gids in gids_per_bin:
        order = np.argsort(lid[gids], kind="stable")
        gids = gids[order]
        local = lid[gids]
        b = BinBlock(as_run(torch.from_numpy(local)), torch.from_numpy(gids))
        if block is not None:
            (b.src_local, b.src_halo, b.graph, b.dst_pos, b.edge_pos,
             b.eids) = bin_block(block.graph, block.eids, local, num_local, has_edge)
        bins.append(b)
    return bins


def reduce_max(comm: Comm) -> ReduceMax:
    """``schedule.bins.ReduceMax`` over the workers of ``comm`` (collective)."""
    def reduce(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(comm.device)
        return prim.all_reduce_(t, comm, "setup", op="max").cpu().numpy()
    return reduce


def reads_exchange(comm: Comm) -> ReadsExchange:
    """``schedule.links.ReadsExchange`` between the workers of ``comm`` (collective)."""
    def exchange(vertices: list[np.ndarray], steps: list[np.ndarray]
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        # one message per peer: the vertices, then their steps
        send = [torch.from_numpy(np.concatenate([v, s]).astype(np.int64))
                for v, s in zip(vertices, steps)]
        got = prim.all_to_all_sized(send, comm, "setup")
        halves = [t.numpy().reshape(2, -1) for t in got]
        return [h[0] for h in halves], [h[1] for h in halves]
    return exchange


def build_phases(program: StageProgram, graph: Graph, book: PartitionBook, rows: RowPlan,
                 bounds: list[tuple[int, int]], schedule: list[PhaseBins],
                 comm: Comm) -> list[Phase]:
    """This worker's phases: bins, waits, links and carried values. ``graph`` needs
    the in-edges of this worker's vertices only; which of its rows the others read
    comes from them (``reads_exchange``)."""
    rank = comm.rank
    index = row_index(graph, book, comm.world_size)
    reads = CrossReads.build(graph, index.part_of, reader=rank)
    exchange = reads_exchange(comm)
    phases: list[Phase] = []
    exported: set[Key] = set()
    for k, ((start, stop), sched) in enumerate(zip(bounds, schedule)):
        bins = _bins(program, rows, start, stop, k == 0, sched.bins[rank], index.lid)
        link = None
        if k:
            prev = schedule[k - 1]
            rounds = LinkRounds(prev.round_of, sched.step_of, prev.rounds, sched.rounds)
            link = link_tables(reads, index, rounds, rank, rows.fetched[start].numpy(),
                               exchange)
        imports = _imports(program, start, stop)
        exported.update(imports)
        phases.append(Phase(
            start, stop, bins, [int(w) for w in sched.fwd_wait[rank]],
            [int(o) for o in sched.bwd_order[rank]], [int(w) for w in sched.bwd_wait[rank]],
            sched.rounds, out_dim(program, start, stop), link, imports,
            needs_grad=_has_params(program, 0, stop)))
    for ph in phases:
        ph.exports = [key for key in sorted(exported) if ph.start <= key[1] < ph.stop]
    _check_edge_blocks(program, rows, phases)
    return phases


def _check_edge_blocks(program: StageProgram, rows: RowPlan, phases: list[Phase]) -> None:
    """A P stage weighted by an earlier phase's E stage must have the same edges."""
    for ph in phases:
        for kind, e in ph.imports:
            if kind != "edges":
                continue
            p = next(s for s in range(ph.start, ph.stop) if describe(program)[s].is_propagate)
            if not torch.equal(rows.block(p).eids, rows.block(e).eids):
                raise RuntimeError(f"stage {p}: its edges differ from those of E stage {e}")


def plan_to_device(plan: P2PPlan, device: torch.device) -> None:
    """Move the bins and link tables of ``plan`` to ``device`` (in place)."""
    for ph in plan.phases:
        for b in ph.bins:
            b.to(device)
        if ph.link is not None:
            ph.link = ph.link.to(device)
