"""Hybrid parallelism (G3): row partitions that push layer outputs peer to peer, in bins.

Worker i computes every stage for the rows V_i of a partition (the data-parallel
dimension). A P or E stage reads the rows of remote in-neighbours; they are never
replicated or recomputed: their owners push them, peer to peer, as soon as they are
computed (the model-parallel dimension), along send / receive tables built once from
the partition (for each peer, which of my vertices it reads, in its order). The
backward pushes the gradients of those rows back to their owners along the same
tables reversed, and parameter gradients are all-reduced once per step (G3 §3.1).

The program is cut into *phases* at the stages that read remote rows: phase 0 is
the stages before the first P / E stage, phase k >= 1 starts at the k-th such stage
(an E stage and the P stage reusing its rows count as one) and runs the T stages
after it. Inside a phase the vertices are processed in *bins* (G3 §5.1): for a bin,
the stage inputs are loaded (its rows and its in-neighbours' rows, local or
pushed), its stages run, and its output rows go to the peers that read them.
``schedule.bins.build_schedule`` fixes the bins, their order, and the exchange round
every row travels in, from the graph and the partition alone, so every worker
knows what arrives when (G3 §5.3):

- bins follow the priority list (BFS order, boundary vertices first) and hold at
  most half the device budget (``bin_memory``) over a vertex's input + output bytes
  of that phase, or ``bin_size`` vertices;
- each bin's output is pushed in its own round as soon as it is computed
  (per-bin asynchronous all-to-all-v, the same rounds on every worker);
- eager computation (inter-layer pipeline): a receiver computes a bin as soon as the
  rounds it reads from have arrived, ready bins first;
- prefetch (intra-layer pipeline): the next bin's inputs are loaded while the
  current one is computed (a side CUDA stream on GPU, a loader thread on CPU);
- ``sequential`` turns it all off: bins in vertex-id order, one blocking exchange
  per phase after its last bin.

The backward walks the phases and bins in reverse, each bin's stages
differentiated on their own (``torch.autograd.grad`` on the graph kept from the
forward), pushing a remote row's gradient in the round of the last bin that reads
it. Every schedule computes the same sums as the single-process executor, only in
another order: the results match it to float tolerance.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.comm.primitives import PendingExchange
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.memory import parse_bytes
from fullgraph.models.stages import StageContext, StageProgram, propagation_inputs
from fullgraph.models.walk import Carry, Runner, describe, out_dim, walk
from fullgraph.parallel.base import LocalResult, Plan, Work, register
from fullgraph.parallel.rowplan import RowPlan, plan_rows, stage_weights
from fullgraph.parallel.rows import RowPartitioned, partition_book
from fullgraph.partition import PartitionBook
from fullgraph.schedule.bins import SCHEDULES, PhaseBins, ScheduleMode, bin_limit, build_schedule

DEFAULT_BIN_SIZE = 5000  # G3's initial bin size for graphs that fit (§7 setup)


# ---------------------------------------------------------------- exchange tables
@dataclass
class Link:
    """One worker's side of the pushes from phase k-1 to phase k, round by round.

    Attributes:
        fwd_send: [round][peer] positions in my rows of the rows pushed to the peer.
        fwd_recv: [round][peer] positions in my halo of the rows received.
        bwd_send: [round][peer] positions in my halo of the gradients returned.
        bwd_recv: [round][peer] positions in my rows of the gradients received.
        num_halo: rows of the halo (remote in-neighbours, ordered by owner then id).
    """

    fwd_send: list[list[Tensor]]
    fwd_recv: list[list[Tensor]]
    bwd_send: list[list[Tensor]]
    bwd_recv: list[list[Tensor]]
    num_halo: int

    def rows_moved(self, rank: int) -> tuple[int, int]:
        """(rows sent, rows received) by this worker in one forward pass."""
        sent = sum(int(t.numel()) for rnd in self.fwd_send for p, t in enumerate(rnd) if p != rank)
        recv = sum(int(t.numel()) for rnd in self.fwd_recv for p, t in enumerate(rnd) if p != rank)
        return sent, recv


def _split_by_round(positions: np.ndarray, rounds: np.ndarray, num_rounds: int) -> list[Tensor]:
    """``positions`` grouped by their round (order kept within a round)."""
    order = np.argsort(rounds, kind="stable")
    counts = np.bincount(rounds, minlength=num_rounds)
    return [torch.from_numpy(c.copy()) for c in np.split(positions[order], np.cumsum(counts)[:-1])]


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
    def build(cls, graph: Graph, part_of: np.ndarray) -> CrossReads:
        src, dst = (t.numpy() for t in graph.edges())
        cross = part_of[src] != part_of[dst]
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


def link_tables(reads: CrossReads, part_of: np.ndarray, rank: int, world: int,
                halo: np.ndarray, lid: np.ndarray, send_round: np.ndarray,
                recv_step: np.ndarray, fwd_rounds: int, bwd_rounds: int) -> Link:
    """The push tables of one link on worker ``rank`` (a pure function).

    Args:
        reads: the partition's cross-part reads (``CrossReads.build``).
        part_of: (N,) part of each vertex.
        rank, world: this worker and the number of workers.
        halo: gids of this worker's remote in-neighbours, ordered by (owner, gid).
        lid: (N,) position of each vertex in its owner's rows.
        send_round: (N,) forward round that pushes each vertex (phase k-1's bins).
        recv_step: (N,) backward step of each vertex's bin in phase k: a reader returns
            a row's gradient in the round of the latest step among its bins reading it.
        fwd_rounds, bwd_rounds: rounds of each direction.
    """
    reader, vertex, last_step = reads.reader, reads.vertex, reads.latest(recv_step)
    empty = torch.empty(0, dtype=torch.int64)
    fwd_send = [[empty] * world for _ in range(fwd_rounds)]
    bwd_recv = [[empty] * world for _ in range(bwd_rounds)]
    mine = part_of[vertex] == rank
    for q in range(world):
        sel = mine & (reader == q)
        u = vertex[sel]  # ascending: the reader's halo order for this owner
        for j, t in enumerate(_split_by_round(lid[u], send_round[u], fwd_rounds)):
            fwd_send[j][q] = t
        for j, t in enumerate(_split_by_round(lid[u], last_step[sel], bwd_rounds)):
            bwd_recv[j][q] = t
    read = reader == rank
    u_read, step_read = vertex[read], last_step[read]
    if u_read.size != halo.size or not np.array_equal(np.sort(u_read), np.sort(halo)):
        raise RuntimeError(f"rank {rank}: the halo does not match the remote in-neighbours")
    halo_step = step_read[np.searchsorted(u_read, halo)]
    owners = part_of[halo]
    fwd_recv = [[empty] * world for _ in range(fwd_rounds)]
    bwd_send = [[empty] * world for _ in range(bwd_rounds)]
    positions = np.arange(halo.size, dtype=np.int64)
    for p in range(world):
        sel = owners == p
        for j, t in enumerate(_split_by_round(positions[sel], send_round[halo[sel]], fwd_rounds)):
            fwd_recv[j][p] = t
        for j, t in enumerate(_split_by_round(positions[sel], halo_step[sel], bwd_rounds)):
            bwd_send[j][p] = t
    return Link(fwd_send, fwd_recv, bwd_send, bwd_recv, int(halo.size))


# ---------------------------------------------------------------- bins and phases
@dataclass
class BinBlock:
    """One bin of one phase on this worker.

    Attributes:
        rows: (b,) positions of the bin's vertices in this worker's rows.
        gids: (b,) their global ids (dropout keys).
        src_local, src_halo: positions, in the previous phase's rows and in the halo,
            of the rows the phase's first stage reads (None in phase 0).
        graph: (b x sources) CSR of the bin's in-edges, sources = local then halo.
        dst_pos: (b,) positions of the bin's own rows among the sources.
        edge_pos: positions of the bin's edges in the phase's block.
        eids: global ids of those edges.
    """

    rows: Tensor
    gids: Tensor
    src_local: Tensor | None = None
    src_halo: Tensor | None = None
    graph: Graph | None = None
    dst_pos: Tensor | None = None
    edge_pos: Tensor | None = None
    eids: Tensor | None = None


@dataclass
class Phase:
    """The stages [start, stop) of the program and their bins on this worker.

    Attributes:
        link: the pushes this phase reads (None for phase 0).
        imports: values of earlier phases read here: ("rows", s) the rows output by
            stage s (a layer input), ("edges", s) the edge weights of E stage s.
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
    imports: list[tuple[str, int]] = field(default_factory=list)
    exports: list[tuple[str, int]] = field(default_factory=list)
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


def phase_bounds(program: StageProgram, shares: list[bool]) -> list[tuple[int, int]]:
    """[start, stop) of each phase: a new phase at every P / E stage with its own input."""
    starts = [0] + [s for s, info in enumerate(describe(program))
                    if info.reads_neighbours and not shares[s]]
    return list(zip(starts, starts[1:] + [len(program.stages)]))


def _imports(program: StageProgram, start: int, stop: int) -> list[tuple[str, int]]:
    """Values of earlier phases that stages [start, stop) read: ("rows", s) the layer
    input made by LayerInput stage s, ("edges", s) the weights of E stage s."""
    keys: list[tuple[str, int]] = []
    for info in describe(program)[start:stop]:
        for kind, src in (("rows", info.layer_input_from), ("edges", info.edge_weights_from)):
            if src is not None and src < start and (kind, src) not in keys:
                keys.append((kind, src))
    return keys


def _has_params(program: StageProgram, start: int, stop: int) -> bool:
    return any(p.requires_grad for st in program.stages[start:stop] for p in st.parameters())


def bin_block(block_graph: Graph, block_eids: Tensor, rows: np.ndarray, num_local: int,
              with_dst: bool) -> tuple[Tensor, Tensor, Graph, Tensor, Tensor, Tensor]:
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
    return (torch.from_numpy(local), torch.from_numpy(halo), graph, dst_pos, edge_t,
            block_eids[edge_t])


# ---------------------------------------------------------------- the strategy
@register
class P2PParallel(RowPartitioned[P2PPlan]):
    """G3 hybrid parallelism: row partitions, peer-to-peer pushes, bins, pipelines."""

    name = "p2p"
    section = "p2p"
    flags = {"schedule": "p2p-schedule"}

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of P2P (G3) execution.

        Attributes:
            schedule: ``multi-level`` (inter- and intra-layer pipelines),
                ``inter-layer``, ``intra-layer`` or ``sequential`` (G3 Fig. 17)
                (default: ``multi-level``).
            bin_memory: device memory for bins, e.g. ``"2GB"``: a bin of phase k holds
                half of it over a vertex's input + output bytes (G3 §5.3 step 2)
                (default: None, then ``bin_size``).
            bin_size: vertices per bin when no ``bin_memory`` is given (default: None:
                on a CUDA device from its free memory as ``bin_memory``, else 5000,
                G3's initial bin size).
        """

        schedule: str = "multi-level"
        bin_memory: str | None = None
        bin_size: int | None = None

        def __post_init__(self) -> None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"p2p schedule {self.schedule!r}; expected one of "
                                 f"{', '.join(SCHEDULES)}")
            if self.bin_memory is not None:
                parse_bytes(self.bin_memory)  # raises on a bad size
            if self.bin_size is not None and self.bin_size < 1:
                raise ValueError(f"bin_size must be >= 1, got {self.bin_size}")

    options: Options

    # ------------------------------------------------------------------ setup
    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> P2PPlan:
        if program.reduces_rows:
            raise ValueError(f"strategy p2p cannot run model {program.name!r} with batch "
                             "normalisation (batch_norm=True): p2p computes T stages in bins "
                             "of rows, and the statistics need all rows at once; use strategy "
                             "single, data or tensor")
        if comm is None:
            from fullgraph.comm.group import single_comm

            comm = single_comm()
        graph, norms = propagation_inputs(program, dataset.graph, dtype)
        book = partition_book(dataset, comm, self.partition)
        owned = book.part_to_gids(comm.rank)
        fetch = torch.ones(graph.num_dst, dtype=torch.bool)  # every remote row is pushed
        rows = plan_rows(program, graph, owned, fetch, owner=book.part_of)
        bounds = phase_bounds(program, rows.shares_halo)
        mode = SCHEDULES[self.options.schedule]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        limits = [self._limit(program, a, b, itemsize, device) for a, b in bounds]
        schedule = build_schedule(graph, book.part_of, comm.world_size, limits, mode)
        phases = self._phases(program, graph, book, rows, bounds, schedule, comm)
        weights, _ = stage_weights(program, rows, norms, torch.device("cpu"))
        plan = P2PPlan(
            **self.owned_targets(dataset, owned, device), comm=comm, graph=graph, book=book,
            rows=rows, features=dataset.data.features[owned].to(dtype).to(device), phases=phases,
            weights=[None if w is None else w.to(device) for w in weights], mode=mode,
            schedule=self.options.schedule, limits=limits)
        if device.type != "cpu":
            _to_device(plan, device)
        return plan

    def _limit(self, program: StageProgram, start: int, stop: int, itemsize: int,
               device: torch.device) -> int:
        """Vertices per bin of phase [start, stop): from ``bin_memory``, else
        ``bin_size``, else the free memory of a CUDA device, else 5000."""
        opts = self.options
        in_dim = program.stages[start].in_dim
        width = out_dim(program, start, stop)
        if opts.bin_memory is not None:
            return bin_limit(parse_bytes(opts.bin_memory), in_dim, width, itemsize)
        if opts.bin_size is not None:
            return opts.bin_size
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return bin_limit(free, in_dim, width, itemsize)
        return DEFAULT_BIN_SIZE

    def _phases(self, program: StageProgram, graph: Graph, book: PartitionBook, rows: RowPlan,
                bounds: list[tuple[int, int]], schedule: list[PhaseBins],
                comm: Comm) -> list[Phase]:
        rank, world = comm.rank, comm.world_size
        part_np = book.part_of.numpy().astype(np.int64)
        owned = rows.owned.numpy()
        lid = np.zeros(graph.num_dst, dtype=np.int64)
        for p in range(world):
            gids = book.part_to_gids(p).numpy()
            lid[gids] = np.arange(gids.size)
        reads = CrossReads.build(graph, part_np)
        num_local = owned.size
        phases: list[Phase] = []
        exported: set[tuple[str, int]] = set()
        for k, ((start, stop), sched) in enumerate(zip(bounds, schedule)):
            bins = []
            has_edge = any(info.is_edge for info in describe(program)[start:stop])
            block = rows.blocks[start] if k else None
            for gids in sched.bins[rank]:
                local = lid[gids]
                b = BinBlock(torch.from_numpy(local.copy()), torch.from_numpy(gids.copy()))
                if block is not None:
                    (b.src_local, b.src_halo, b.graph, b.dst_pos, b.edge_pos,
                     b.eids) = bin_block(block.graph, block.eids, local, num_local, has_edge)
                bins.append(b)
            link = None
            if k:
                prev = schedule[k - 1]
                link = link_tables(reads, part_np, rank, world, rows.fetched[start].numpy(),
                                   lid, prev.round_of, sched.step_of, prev.rounds, sched.rounds)
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

    # ---------------------------------------------------------------- execute
    def forward(self, model: StageProgram, plan: P2PPlan, *, training: bool,
                seed: int) -> LocalResult:
        params = [p for p in model.parameters() if p.requires_grad]
        run = _Run(model, plan, seed, training)
        if torch.is_grad_enabled() and params:
            logits = _P2PFunction.apply(run, *params)
        else:
            logits = run.forward(keep=False)
        return LocalResult(logits, plan.rows.owned)

    def describe(self, model: StageProgram, plan: P2PPlan) -> list[str]:
        spans = " | ".join(f"{ph.start}-{ph.stop - 1}" for ph in plan.phases)
        limits = "/".join(str(n) for n in plan.limits)
        rounds = "/".join(str(ph.rounds) for ph in plan.phases)
        source = (f"partition file {self.partition.file}" if self.partition.file
                  else f"partitioner {self.partition.method}")
        line = (f"p2p      schedule {plan.schedule}, {source}; phases (stages) {spans}; "
                f"vertices per bin at most {limits}; exchange rounds per phase {rounds}")
        return [line]

    def work(self, model: StageProgram, plan: P2PPlan) -> Work:
        edges = dims = 0
        for s, block in enumerate(plan.rows.blocks):
            if block is not None:
                edges += block.graph.num_edges
                dims += block.graph.num_edges * model.stages[s].in_dim
        return Work(edges, 0, dims)


def _check_edge_blocks(program: StageProgram, rows: RowPlan, phases: list[Phase]) -> None:
    """A P stage weighted by an earlier phase's E stage must have the same edges."""
    for ph in phases:
        for kind, e in ph.imports:
            if kind != "edges":
                continue
            p = next(s for s in range(ph.start, ph.stop) if describe(program)[s].is_propagate)
            if not torch.equal(rows.blocks[p].eids, rows.blocks[e].eids):
                raise RuntimeError(f"stage {p}: its edges differ from those of E stage {e}")


def _to_device(plan: P2PPlan, device: torch.device) -> None:
    for ph in plan.phases:
        for b in ph.bins:
            b.rows = b.rows.to(device)
            for name in ("src_local", "src_halo", "dst_pos", "edge_pos", "eids"):
                t = getattr(b, name)
                if t is not None:
                    setattr(b, name, t.to(device))
            if b.graph is not None:
                b.graph = b.graph.to(device)
        if ph.link is not None:
            link = ph.link
            for tables in (link.fwd_send, link.fwd_recv, link.bwd_send, link.bwd_recv):
                for rnd in tables:
                    rnd[:] = [t.to(device) for t in rnd]


# ---------------------------------------------------------------- one step's execution
class _Incoming:
    """The rounds pushed into a buffer: wait for them in order, placing each as it lands."""

    def __init__(self, pending: list[PendingExchange], positions: list[list[Tensor]],
                 target: Tensor | None, add: bool) -> None:
        self.pending, self.positions, self.target, self.add = pending, positions, target, add
        self.done = 0

    def through(self, last: int) -> None:
        """Make rounds 0..last (inclusive) present in the target."""
        while self.done <= min(last, len(self.pending) - 1):
            parts = self.pending[self.done].wait()
            if self.target is not None:
                for p, part in enumerate(parts):  # fixed peer order: deterministic sums
                    idx = self.positions[self.done][p]
                    if idx.numel():
                        if self.add:
                            self.target.index_add_(0, idx, part)
                        else:
                            self.target[idx] = part
            self.done += 1

    def all(self) -> None:
        self.through(len(self.pending) - 1)


class _Loader:
    """Loads a bin's input rows, the next one ahead of time when prefetching."""

    def __init__(self, prefetch: bool, device: torch.device) -> None:
        self.prefetch = prefetch
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1) if prefetch and self.stream is None else None
        self.ahead: tuple[int, Any] | None = None

    def start(self, key: int, fn: Any) -> None:
        """Begin loading ``fn()`` for bin ``key`` in the background (when prefetching)."""
        if self.stream is not None:
            event = torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                value = fn()
                event.record(self.stream)
            self.ahead = (key, (value, event))
        elif self.pool is not None:
            self.ahead = (key, self.pool.submit(fn))

    def get(self, key: int, fn: Any) -> Any:
        """Bin ``key``'s inputs: the prefetched ones if they were started, else ``fn()``."""
        if self.ahead is None or self.ahead[0] != key:
            return fn()
        _, handle = self.ahead
        self.ahead = None
        if self.stream is not None:
            value, event = handle
            torch.cuda.current_stream().wait_event(event)
            for t in value:
                t.record_stream(torch.cuda.current_stream())
            return value
        return handle.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _Run:
    """One forward (and backward) of the program over phases and bins."""

    def __init__(self, model: StageProgram, plan: P2PPlan, seed: int, training: bool) -> None:
        self.model, self.plan, self.seed, self.training = model, plan, seed, training
        self.comm, self.mode = plan.comm, plan.mode
        self.saved: list[list[dict[str, Any]]] = []
        self.buffers: dict[tuple[str, int], Tensor] = {}
        self.outputs: list[Tensor] = []

    # -------------------------------------------------------------- forward
    def forward(self, keep: bool) -> Tensor:
        plan, mode = self.plan, self.mode
        h_prev = plan.features
        pending: list[PendingExchange] = []
        loader = _Loader(mode.prefetch, plan.device)
        try:
            for k, ph in enumerate(plan.phases):
                halo = None
                incoming = None
                if ph.link is not None:
                    halo = h_prev.new_empty(ph.link.num_halo, h_prev.shape[1])
                    incoming = _Incoming(pending, ph.link.fwd_recv, halo, add=False)
                    if not mode.eager:
                        incoming.all()
                nxt = plan.phases[k + 1] if k + 1 < len(plan.phases) else None
                out = h_prev.new_empty(h_prev.shape[0], ph.out_dim)
                issued: list[PendingExchange] = []
                saved: list[dict[str, Any]] = []
                grad_in = keep and k > 0 and plan.phases[k - 1].needs_grad
                for b, blk in enumerate(ph.bins):
                    if incoming is not None and mode.eager:
                        incoming.through(ph.fwd_wait[b])
                    x = loader.get(b, lambda blk=blk, h=h_prev, hl=halo: self._load(blk, h, hl))
                    self._prefetch(loader, ph, b + 1, incoming, h_prev, halo)
                    entry = self._compute(ph, blk, x, keep and ph.needs_grad, grad_in)
                    out[blk.rows] = entry["out"].detach()
                    for key, value in entry["exports"].items():
                        self._store(key, blk, value.detach())
                    if keep and ph.needs_grad:
                        saved.append(entry)
                    if nxt is not None and mode.per_bin:
                        issued.append(self._push(out, nxt.link, b))
                if nxt is not None:  # rounds past my last bin (all of them if sequential)
                    for j in range(len(issued), len(nxt.link.fwd_send)):
                        issued.append(self._push(out, nxt.link, j))
                if incoming is not None:
                    incoming.all()  # rounds that carried nothing for this worker
                self.saved.append(saved)
                self.outputs.append(out)
                h_prev, pending = out, issued
        finally:
            loader.close()
        return h_prev

    def _prefetch(self, loader: _Loader, ph: Phase, b: int, incoming: _Incoming | None,
                  h_prev: Tensor, halo: Tensor | None) -> None:
        """Start loading bin ``b`` if its pushed rows are already here."""
        if not loader.prefetch or b >= len(ph.bins):
            return
        if incoming is not None and ph.fwd_wait[b] >= incoming.done:
            return  # it reads rows not received yet: loaded when its turn comes
        blk = ph.bins[b]
        loader.start(b, lambda: self._load(blk, h_prev, halo))

    def _load(self, blk: BinBlock, h_prev: Tensor, halo: Tensor | None) -> Tensor:
        if blk.src_local is None:
            return h_prev.index_select(0, blk.rows)
        parts = [h_prev.index_select(0, blk.src_local)]
        if blk.src_halo.numel():
            parts.append(halo.index_select(0, blk.src_halo))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _store(self, key: tuple[str, int], blk: BinBlock, value: Tensor) -> None:
        index = blk.rows if key[0] == "rows" else blk.edge_pos
        buf = self.buffers.get(key)
        if buf is None:
            total = self.plan.rows.owned.numel() if key[0] == "rows" else \
                self.plan.rows.blocks[key[1]].graph.num_edges
            buf = value.new_zeros((total, *value.shape[1:]))
            self.buffers[key] = buf
        buf[index] = value

    def _compute(self, ph: Phase, blk: BinBlock, x: Tensor, keep: bool,
                 grad_in: bool) -> dict[str, Any]:
        """Run the phase's stages on one bin; with ``keep`` the autograd graph is kept
        (``grad_in``: also towards the input rows)."""
        with torch.set_grad_enabled(keep):
            leaf = x.detach().requires_grad_(keep and grad_in)
            imports = {}
            for key in ph.imports:
                index = blk.rows if key[0] == "rows" else blk.edge_pos
                imports[key] = self.buffers[key][index].detach().requires_grad_(keep)
            carry = Carry({s: v for (kind, s), v in imports.items() if kind == "rows"},
                          {s: v for (kind, s), v in imports.items() if kind == "edges"})
            runner = _BinRunner(blk, self.plan.weights, self.seed, self.training)
            out = walk(self.model, runner, leaf, start=ph.start, stop=ph.stop, carry=carry)
            exports = {key: (carry.layer_inputs if key[0] == "rows" else
                             carry.edge_weights)[key[1]] for key in ph.exports}
        return {"leaf": leaf, "imports": imports, "out": out, "exports": exports}

    def _push(self, out: Tensor, link: Link, j: int) -> PendingExchange:
        send = [out.index_select(0, idx) for idx in link.fwd_send[j]]
        recv = [int(idx.numel()) for idx in link.fwd_recv[j]]
        return prim.all_to_all_v_start(send, recv, self.comm, "push")

    # ------------------------------------------------------------- backward
    def backward(self, grad_logits: Tensor, params: list[torch.nn.Parameter]) -> list[Tensor]:
        plan, mode = self.plan, self.mode
        grads = [torch.zeros_like(p) for p in params]
        where = {id(p): i for i, p in enumerate(params)}
        g_out = grad_logits
        g_exports = {key: torch.zeros_like(buf) for key, buf in self.buffers.items()}
        pending: list[PendingExchange] = []
        for k in range(len(plan.phases) - 1, -1, -1):
            ph = plan.phases[k]
            if not ph.needs_grad:
                break  # nothing earlier has parameters: no gradient to return
            nxt = plan.phases[k + 1] if k + 1 < len(plan.phases) else None
            incoming = None
            if nxt is not None:
                incoming = _Incoming(pending, nxt.link.bwd_recv, g_out, add=True)
                if not mode.eager:
                    incoming.all()
            prev_needs = k > 0 and plan.phases[k - 1].needs_grad
            g_prev = self.outputs[k - 1].new_zeros(self.outputs[k - 1].shape) if prev_needs \
                else None
            g_halo = g_out.new_zeros(ph.link.num_halo, self.outputs[k - 1].shape[1]) \
                if prev_needs and ph.link is not None else None
            issued: list[PendingExchange] = []
            saved = self.saved[k]
            own = [p for p in params if _used(p, ph, self.model)]
            for t, b in enumerate(ph.bwd_order):
                if incoming is not None and mode.eager:
                    incoming.through(ph.bwd_wait[b])
                self._bin_backward(ph, ph.bins[b], saved[b], g_out, g_prev, g_halo, g_exports,
                                   own, grads, where, prev_needs)
                if g_halo is not None and mode.per_bin:
                    issued.append(self._push_grad(g_halo, ph.link, t))
            if g_halo is not None:
                for j in range(len(issued), len(ph.link.bwd_send)):
                    issued.append(self._push_grad(g_halo, ph.link, j))
            if incoming is not None:
                incoming.all()
            g_out, pending = g_prev, issued
        return grads

    def _bin_backward(self, ph: Phase, blk: BinBlock, entry: dict[str, Any], g_out: Tensor,
                      g_prev: Tensor | None, g_halo: Tensor | None,
                      g_exports: dict[tuple[str, int], Tensor], own: list[Tensor],
                      grads: list[Tensor], where: dict[int, int], prev_needs: bool) -> None:
        outs: list[Tensor] = []
        outs_grad: list[Tensor] = []

        def add_output(value: Tensor, grad: Tensor) -> None:
            if not value.requires_grad:
                return
            for i, o in enumerate(outs):
                if o is value:
                    outs_grad[i] = outs_grad[i] + grad
                    return
            outs.append(value)
            outs_grad.append(grad)

        add_output(entry["out"], g_out[blk.rows])
        for key, value in entry["exports"].items():
            index = blk.rows if key[0] == "rows" else blk.edge_pos
            add_output(value, g_exports[key][index])
        if not outs:
            return
        inputs: list[Tensor] = []
        if prev_needs:
            inputs.append(entry["leaf"])
        import_keys = list(entry["imports"])
        inputs += [entry["imports"][key] for key in import_keys]
        result = torch.autograd.grad(outs, inputs + own, outs_grad, allow_unused=True)
        pos = 0
        if prev_needs:
            g_leaf = result[0]
            pos = 1
            if g_leaf is not None:
                n_local = blk.src_local.numel()
                g_prev.index_add_(0, blk.src_local, g_leaf[:n_local])
                if g_halo is not None and blk.src_halo.numel():
                    g_halo.index_add_(0, blk.src_halo, g_leaf[n_local:])
        for key in import_keys:
            g = result[pos]
            pos += 1
            if g is not None:
                index = blk.rows if key[0] == "rows" else blk.edge_pos
                g_exports[key].index_add_(0, index, g)
        for p, g in zip(own, result[pos:]):
            if g is not None:
                grads[where[id(p)]] += g

    def _push_grad(self, g_halo: Tensor, link: Link, t: int) -> PendingExchange:
        send = [g_halo.index_select(0, idx) for idx in link.bwd_send[t]]
        recv = [int(idx.numel()) for idx in link.bwd_recv[t]]
        return prim.all_to_all_v_start(send, recv, self.comm, "push-grad")


def _used(p: Tensor, ph: Phase, model: StageProgram) -> bool:
    return any(p is q for s in range(ph.start, ph.stop) for q in model.stages[s].parameters())


class _BinRunner(Runner):
    """Stage hooks over one bin: its rows, its CSR (sources local then pushed) and
    the edge weights of its edges."""

    def __init__(self, blk: BinBlock, weights: list[Tensor | None], seed: int,
                 training: bool) -> None:
        self.blk, self.weights = blk, weights
        self.ctx = StageContext(blk.gids, seed, training)
        self.edge_ctx = StageContext(blk.gids, seed, training, blk.eids)

    def transform(self, s: int, stage: Any, h: Tensor, layer_input: Tensor | None) -> Tensor:
        return stage(h, self.ctx, layer_input)

    def edge(self, s: int, stage: Any, h: Tensor) -> Tensor:
        return stage(self.blk.graph, h[self.blk.dst_pos], h, self.edge_ctx)

    def propagate(self, s: int, stage: Any, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        if edge_weights is None:
            weight = self.weights[s]
            assert weight is not None
            edge_weights = weight[self.blk.edge_pos]
        return stage(self.blk.graph, h, edge_weights)


class _P2PFunction(torch.autograd.Function):
    """The whole program as one autograd node: forward and backward run the schedule."""

    @staticmethod
    def forward(ctx: Any, run: _Run, *params: Tensor) -> Tensor:
        ctx.run = run
        ctx.params = params
        return run.forward(keep=True)

    @staticmethod
    def backward(ctx: Any, grad_logits: Tensor) -> tuple[Any, ...]:
        grads = ctx.run.backward(grad_logits.contiguous(), list(ctx.params))
        ctx.run = None
        return (None, *grads)

