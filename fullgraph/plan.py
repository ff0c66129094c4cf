"""Plan before launch: per strategy, the memory each worker needs, the bytes each epoch
moves and a predicted epoch time (``fullgraph plan``, ``--strategy auto``).

Memory follows NeutronTask's Table 1: graph topology, features (of owned rows),
parameters and optimiser state (Adam: parameter, gradient and two moments),
intermediate data (every stage's output rows, kept for the backward) and neighbour
replicas (rows of other workers' vertices held here: fetched halos, DepCache's
replicated inputs). Counts come from the partition and the stage program exactly as
the strategies' setup builds them (``parallel.rowplan.plan_rows`` for data
parallelism, the row / column placements for tensor and task parallelism); widths
from the program. Work per worker (edge x columns aggregated, GEMM flops, bytes and
message rounds) is turned into seconds by ``predict_seconds`` with rates measured on
this machine (``fullgraph.plan_measure``). An epoch is a training step plus one evaluation
forward, as ``train`` times it: aggregation and halos count 3 times (forward,
backward, evaluation), transforms 4 times (forward, two backward GEMMs, evaluation).

Everything here is a pure function of (program, graph, partition, options), tested
without processes.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fullgraph.comm.placement import even_counts
from fullgraph.graph.csr import Graph
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe
from fullgraph.parallel import costmodel, taskmodel
from fullgraph.parallel.rowplan import RowPlan, plan_rows
from fullgraph.partition import PartitionBook

CATEGORIES = ("topology", "features", "params", "intermediate", "replicas")
"""NeutronTask Table 1's memory categories, in table order."""
AGG_PASSES, GEMM_PASSES = 3, 4
"""Per epoch: aggregations / halo transfers and GEMMs counted this many times."""
ADAM_COPIES = 4
"""Parameter, gradient, Adam's two moments."""
INDEX = 8
"""Bytes of an int64 index."""
BASE_ROUNDS = 4
"""Rounds every distributed epoch makes: barrier, gradient all-reduce, loss and
accuracy reductions."""
EDGE_BUFFERS = 2
"""(E, H) buffers an E stage holds per edge at its peak: its coefficients, kept for
the backward, and their dropout output or, in the backward, their gradient."""


@dataclass(frozen=True)
class Candidate:
    """One strategy (and mode) the planner prices.

    Attributes:
        label: as printed, e.g. ``data/hybrid``.
        strategy: the registered strategy name.
        overrides: config section -> option -> value that select the mode.
    """

    label: str
    strategy: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


CANDIDATES = (
    Candidate("data/depcomm", "data", {"data_parallel": {"mode": "depcomm"}}),
    Candidate("data/depcache", "data", {"data_parallel": {"mode": "depcache"}}),
    Candidate("data/hybrid", "data", {"data_parallel": {"mode": "hybrid"}}),
    Candidate("tensor", "tensor"),
    Candidate("tensor/chunks", "tensor", {"tensor_parallel": {"num_chunks": 4}}),
    Candidate("p2p", "p2p"),
    Candidate("task", "task"),
)


@dataclass
class RankCost:
    """One worker's needs for one epoch.

    Attributes:
        memory: category -> bytes (``CATEGORIES``).
        host_only: bytes of ``memory`` kept in host memory, not on the device
            (chunked tensor parallelism streams its topology from there).
        bytes_moved: bytes this worker receives per epoch (halos, re-placements,
            gradient all-reduce).
        aggregations: (edges, columns) of each aggregation of the forward pass: an
            aggregation costs at least ``PlanRates.edge_min`` per edge however few its
            columns (``edge_dims``: their edges x columns).
        flops: GEMM flops per forward pass.
        rounds: blocking communication rounds per epoch.
    """

    memory: dict[str, int]
    host_only: int = 0
    bytes_moved: int = 0
    aggregations: tuple[tuple[int, int], ...] = ()
    flops: int = 0
    rounds: int = 0

    @property
    def edge_dims(self) -> int:
        """Edges x columns aggregated per forward pass."""
        return sum(e * d for e, d in self.aggregations)

    @property
    def total(self) -> int:
        return sum(self.memory.values())

    @property
    def device(self) -> int:
        return self.total - self.host_only


@dataclass(frozen=True)
class PlanRates:
    """Unit costs of the time model, in seconds (measured by ``plan_rates``).

    Attributes:
        edge: per edge x column aggregated (one thread), measured on many columns.
        edge_min: per edge of an aggregation, however few its columns: below a few
            dozen columns an aggregation's time hardly depends on its width (reading
            each edge and its source row's cache lines dominates: 1.04 ms at 2 columns
            and 1.13 ms at 32 on a 386k-edge graph, 2.64 ms at 128). An aggregation of
            E edges and D columns costs ``E * max(edge_min, D * edge)``; 0 ignores it.
        flop: per GEMM flop (one thread).
        byte: per byte received from another worker.
        latency: per blocking communication round.
        slowdown: compute slowdown from sharing cores (workers / cores, at least 1).
        bandwidth: memory bytes per second (the task scheduling model's).
        overhead: per epoch, what does not grow with the graph (interpreter, autograd,
            kernel launches): the program's epoch on a tiny graph in one process,
            slowed by ``slowdown`` like the graph work.
        fixed: per epoch, the same measured at the real worker count (``plan_probe``):
            collective rounds and the scheduling of workers that share cores included,
            so neither ``slowdown`` nor ``latency`` is applied to it again.
        rounds_paid: communication rounds of the epoch that ``fixed`` already paid
            (those of the probe's tiny graph); only rounds beyond them add latency.
        calibration: factor on the graph work (aggregation and GEMMs): an epoch of the
            candidate's own executor on the whole graph in one process, less its epoch
            on the tiny ring, over the predicted work of a single-process epoch. It
            stands for what the counts leave out (dropout's random numbers,
            activations, the loss, the executor's per-row work), which grows with the
            graph like the counted work.
        worker_bytes: a launched worker's peak resident size before it loads the
            dataset (interpreter, libraries, the communicator, compiled kernels): the
            probe's workers' peak on their tiny ring (0: not measured; the planning
            process's own size stands for it).
    """

    edge: float
    flop: float
    byte: float
    latency: float
    edge_min: float = 0.0
    slowdown: float = 1.0
    overhead: float = 0.0
    bandwidth: float = 1e10
    fixed: float = 0.0
    rounds_paid: int = 0
    calibration: float = 1.0
    worker_bytes: int = 0
    busy: float | None = None
    """Cores other processes kept busy while the rates were measured (None: unknown)."""
    disagreed: tuple[str, ...] = ()
    """Strategies whose calibration met a bound: the epoch measured and the counted
    work disagree beyond x0.25 or x20 (a load spike while measuring, most often)."""


@dataclass(frozen=True)
class Features:
    """How a run holds the input features: ``dim`` columns, dense, or CSR with
    ``density`` of the entries non-zero (``sparse``: held so and read so by the first
    layer, whose dropout output is CSR too and whose product is sparse x dense)."""

    dim: int
    density: float = 1.0
    sparse: bool = False

    def row_bytes(self, itemsize: int) -> float:
        """Bytes of one row as held: values and column ids of its non-zeros and its
        offset where sparse."""
        if not self.sparse:
            return float(self.dim * itemsize)
        return self.density * self.dim * (itemsize + INDEX) + INDEX

    def rows_bytes(self, rows: int, itemsize: int) -> int:
        return int(rows * self.row_bytes(itemsize))


def as_features(feat: int | Features) -> Features:
    """A column count as dense features; ``Features`` as they are."""
    return feat if isinstance(feat, Features) else Features(int(feat))


def _first_layer(f: Features, s: int, stage: Any, rows: int, itemsize: int) -> tuple[int, int]:
    """(intermediate bytes, GEMM flops) of T stage ``s`` over ``rows`` rows, with the
    first two stages (the features' dropout, the first product) priced on the
    non-zeros where the features are sparse."""
    inter = rows * int(stage.out_dim) * itemsize
    flops = _gemm_flops(stage, rows)
    if f.sparse and s == 0:
        inter = f.rows_bytes(rows, itemsize)
    if f.sparse and s == 1:
        flops = int(flops * f.density)
    return inter, flops


def edge_buffer_bytes(stage: Any, edges: int, itemsize: int) -> int:
    """What E stage ``stage`` holds over ``edges`` edges: ``EDGE_BUFFERS`` coefficients
    per edge and head (not per column: H of them, whatever the rows' width)."""
    return EDGE_BUFFERS * edges * int(getattr(stage, "heads", 1)) * itemsize


def _mem(**values: int) -> dict[str, int]:
    return {c: int(values.get(c, 0)) for c in CATEGORIES}


def param_bytes(program: StageProgram) -> int:
    """Parameters and Adam's state, in bytes."""
    return sum(p.numel() * p.element_size() for p in program.parameters()) * ADAM_COPIES


def _grad_sync(program: StageProgram, world: int) -> int:
    """Bytes a worker receives in a ring all-reduce of the gradients."""
    size = sum(p.numel() * p.element_size() for p in program.parameters())
    return int(2 * size * (world - 1) / world) if world > 1 else 0


def _gemm_flops(stage: Any, rows: int) -> int:
    return 2 * rows * sum(p.numel() for p in stage.parameters() if p.dim() == 2)


def data_cost(program: StageProgram, graph: Graph, rows: RowPlan, world: int,
              feat_dim: int | Features, itemsize: int = 4,
              served: Sequence[int] | None = None) -> RankCost:
    """One data-parallel worker (any dependency mode) from its ``RowPlan``; ``served``:
    per stage, how many of its rows the other workers fetch (``served_rows``), whose
    gradients it receives in the backward pass (default: as many as it fetches)."""
    f = as_features(feat_dim)
    owned = rows.owned.numel()
    topo = inter = halo = flops = moved = rounds = 0
    aggs: list[tuple[int, int]] = []
    for s, (info, stage) in enumerate(zip(describe(program), program.stages)):
        width = int(stage.out_dim)
        if info.is_edge:
            width = 0  # its coefficients are counted per edge below
        block = rows.blocks[s]
        if block is None:
            bytes_, gemm = _first_layer(f, s, stage, rows.rows[s].numel(), itemsize)
            inter, flops = inter + bytes_, flops + gemm
            continue
        inter += rows.rows[s].numel() * width * itemsize
        edges = block.graph.num_edges
        topo += (block.graph.num_dst + 1 + 2 * edges) * INDEX + edges * itemsize
        aggs.append((edges, int(stage.in_dim)))
        if info.is_edge:
            inter += edge_buffer_bytes(stage, edges, itemsize)
        fetched = rows.fetched[s].numel()
        if fetched and not rows.shares_halo[s]:
            halo += fetched * int(stage.in_dim) * itemsize
            back = fetched if served is None else served[s]  # the gradients of its rows
            moved += ((AGG_PASSES - 1) * fetched + back) * int(stage.in_dim) * itemsize
            rounds += AGG_PASSES
    replicas = f.rows_bytes(rows.input_rows.numel() - owned, itemsize) + halo
    moved += _grad_sync(program, world)
    return RankCost(_mem(topology=topo, features=f.rows_bytes(owned, itemsize),
                         params=param_bytes(program), intermediate=inter, replicas=replicas),
                    bytes_moved=moved, aggregations=tuple(aggs), flops=flops,
                    rounds=rounds + (BASE_ROUNDS if world > 1 else 0))


def served_rows(plans: Sequence[RowPlan], book: PartitionBook) -> list[list[int]]:
    """Per worker and stage, how many of its rows the others fetch (``RowPlan.fetched``
    of every worker, by owner)."""
    part_of = torch.as_tensor(book.part_of)
    served = [[0] * len(plans[0].fetched) for _ in plans]
    for plan in plans:
        for s, gids in enumerate(plan.fetched):
            if gids.numel() and not plan.shares_halo[s]:
                for owner, count in enumerate(torch.bincount(part_of[gids],
                                                             minlength=len(plans)).tolist()):
                    served[owner][s] += count
    return served


def data_rows(program: StageProgram, graph: Graph, book: PartitionBook, rank: int,
              mode: str, rates: costmodel.Rates | None = None,
              itemsize: int = 4) -> RowPlan:
    """The RowPlan data parallelism builds on ``rank`` in ``mode`` (hybrid needs rates)."""
    owned = book.part_to_gids(rank)
    src = np.unique(graph.indices[_in_edge_slice(graph, owned.numpy())].numpy())
    direct = torch.from_numpy(src[book.part_of.numpy()[src] != rank])
    if mode == "depcache":
        cached = torch.ones(direct.numel(), dtype=torch.bool)
    elif mode == "hybrid":
        if rates is None:
            raise ValueError("data_rows: mode 'hybrid' needs the cost model's rates")
        cache, comm = costmodel.dependency_costs(program, graph, owned, direct, rates, itemsize)
        cached = costmodel.choose_cached(cache, comm)
    elif mode == "depcomm":
        cached = torch.zeros(direct.numel(), dtype=torch.bool)
    else:
        raise ValueError(f"data_rows: unknown mode {mode!r}")
    fetch = torch.zeros(graph.num_dst, dtype=torch.bool)
    fetch[direct[~cached]] = True
    return plan_rows(program, graph, owned, fetch, owner=book.part_of)


def _in_edge_slice(graph: Graph, rows: np.ndarray) -> np.ndarray:
    indptr = graph.indptr.numpy()
    starts, counts = indptr[rows], np.diff(indptr)[rows]
    return (np.repeat(starts - np.cumsum(counts) + counts, counts)
            + np.arange(int(counts.sum()), dtype=np.int64))


def _whole_topology(graph: Graph, itemsize: int, norms: int) -> int:
    """CSR and its transpose (the backward) plus the edge norms."""
    return 2 * (graph.num_dst + 1 + graph.num_edges) * INDEX + norms * graph.num_edges * itemsize


def tensor_cost(program: StageProgram, graph: Graph, rank: int, world: int,
                feat_dim: int | Features, chunks: int | None = None,
                itemsize: int = 4) -> RankCost:
    """One tensor-parallel worker: rows for T stages, a column slice of every vertex
    for P stages, the whole topology (in host memory when chunked)."""
    f = as_features(feat_dim)
    n, rows = graph.num_dst, even_counts(graph.num_dst, world)[rank]
    topo = _whole_topology(graph, itemsize, max(1, len(program.norms)))
    inter = flops = moved = rounds = 0
    aggs: list[tuple[int, int]] = []
    on_rows = True
    for s, (info, stage) in enumerate(zip(describe(program), program.stages)):
        d_in, cols = int(stage.in_dim), column_slice(int(stage.in_dim), world)
        if info.is_propagate:
            if on_rows:  # split: my rows' other columns out, my columns of others' rows in
                moved += AGG_PASSES * (n - rows) * cols * itemsize
                rounds += AGG_PASSES
            on_rows = False
            inter += n * cols * itemsize
            aggs.append((graph.num_edges, cols))
            continue
        if not on_rows:  # gather back to rows
            moved += AGG_PASSES * rows * (d_in - cols) * itemsize
            rounds += AGG_PASSES
        on_rows = True
        if info.is_edge:
            inter += edge_buffer_bytes(stage, graph.num_edges, itemsize)
            aggs.append((graph.num_edges, max(1, d_in // world)))
            rounds += 2 * AGG_PASSES
            moved += edge_stage_bytes(graph, even_counts(n, world), rank, d_in,
                                      int(getattr(stage, "heads", 1)), itemsize)
            continue
        bytes_, gemm = _first_layer(f, s, stage, rows, itemsize)
        inter, flops = inter + bytes_, flops + gemm
    moved += _grad_sync(program, world)
    return RankCost(_mem(topology=topo, features=f.rows_bytes(rows, itemsize),
                         params=param_bytes(program), intermediate=inter),
                    host_only=topo if chunks else 0, bytes_moved=moved,
                    aggregations=tuple(aggs), flops=flops,
                    rounds=rounds + BASE_ROUNDS + (chunks or 0))


def edge_halos(graph: Graph, row_counts: Sequence[int]
               ) -> tuple[list[int], list[int], list[int]]:
    """For workers owning consecutive destination ranges of ``row_counts`` rows, each
    worker's E-stage halo (the distinct sources of its rows' in-edges outside its
    range, ``columns.edge_plan``), how many of its own rows the others' halos hold
    (whose gradients it receives), and its rows' in-edges."""
    key = (graph.num_edges, tuple(row_counts))
    held = _HALOS.get("graph")
    if held is not None and held() is graph and _HALOS.get("key") == key:
        return _HALOS["value"]
    indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
    offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    fetched, served = [], [0] * len(row_counts)
    own = [int(indptr[offsets[r + 1]] - indptr[offsets[r]]) for r in range(len(row_counts))]
    for r in range(len(row_counts)):
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        src = np.unique(indices[indptr[lo]:indptr[hi]])
        outside = src[(src < lo) | (src >= hi)]
        fetched.append(int(outside.size))
        for p, count in enumerate(np.bincount(
                np.searchsorted(offsets, outside, side="right") - 1,
                minlength=len(row_counts))):
            served[p] += int(count)
    _HALOS.update(graph=weakref.ref(graph), key=key, value=(fetched, served, own))
    return fetched, served, own


_HALOS: dict[str, Any] = {}
"""The last ``edge_halos`` (the planner prices every worker of one split in turn)."""


def edge_stage_bytes(graph: Graph, row_counts: Sequence[int], rank: int, d_in: int,
                     heads: int, itemsize: int) -> int:
    """What worker ``rank`` receives for one E stage on consecutive row ranges
    (``columns._edge_weights``), per epoch: its halo of ``d_in`` columns in the
    training and the evaluation forward and its rows' gradients from the others'
    halos, then the other workers' edge coefficients (``heads`` per edge;
    ``gather_rows``: forward twice) and its own edges' gradients from every other
    worker (the backward)."""
    fetched, served, own = edge_halos(graph, row_counts)
    world = len(row_counts)
    return itemsize * ((2 * fetched[rank] + served[rank]) * d_in
                       + (2 * (graph.num_edges - own[rank]) + (world - 1) * own[rank]) * heads)


def column_slice(dim: int, world: int) -> int:
    """Columns a worker propagates under the ``balanced`` column split."""
    return dim // world + dim % world if dim >= world else dim


def task_costs(program: StageProgram, graph: Graph, world: int, feat_dim: int | Features,
               split: taskmodel.TaskSplit, itemsize: int = 4) -> list[RankCost]:
    """Every worker of task parallelism: the T group on rows, the P group on columns."""
    f = as_features(feat_dim)
    n, out = graph.num_dst, []
    for rank in range(world):
        on_t = rank < split.num_t
        group = split.num_t if on_t else split.num_p
        rows = even_counts(n, split.num_t)[rank] if on_t else 0
        inter = flops = moved = rounds = own_edges = 0
        aggs: list[tuple[int, int]] = []
        for s, (info, stage) in enumerate(zip(describe(program), program.stages)):
            d_in = int(stage.in_dim)
            if info.is_edge:  # the T group computes it as tensor parallelism does, then
                # sends every edge's coefficients to each P worker (and gets their
                # gradients back from each)
                heads = int(getattr(stage, "heads", 1))
                if on_t:
                    t_rows = even_counts(n, split.num_t)
                    moved += edge_stage_bytes(graph, t_rows, rank, d_in, heads, itemsize)
                    own = own_edges = edge_halos(graph, t_rows)[2][rank]
                    moved += split.num_p * own * heads * itemsize
                    inter += edge_buffer_bytes(stage, own, itemsize)
                    flops += _gemm_flops(stage, rows)
                    aggs.append((graph.num_edges, max(1, d_in // group)))
                else:
                    moved += 2 * graph.num_edges * heads * itemsize
                    inter += edge_buffer_bytes(stage, graph.num_edges, itemsize)
                continue
            if info.is_propagate and not on_t:
                cols = even_counts(d_in, group)[rank - split.num_t]
                inter += n * cols * itemsize
                aggs.append((graph.num_edges, cols))
                moved += AGG_PASSES * n * cols * itemsize
                rounds += AGG_PASSES
            elif not info.is_propagate and on_t:
                bytes_, gemm = _first_layer(f, s, stage, rows, itemsize)
                inter, flops = inter + bytes_, flops + gemm
            elif info.is_propagate:  # the T rank sends its rows and gets them back
                moved += AGG_PASSES * rows * d_in * itemsize
                rounds += AGG_PASSES
        topo = (_whole_topology(graph, itemsize, max(1, len(program.norms))) if not on_t
                else (rows + 1 + 2 * own_edges) * INDEX if own_edges else 0)  # its in-edges
        out.append(RankCost(_mem(topology=topo, features=f.rows_bytes(rows, itemsize),
                                 params=param_bytes(program), intermediate=inter),
                            bytes_moved=moved + _grad_sync(program, world),
                            aggregations=tuple(aggs), flops=flops,
                            rounds=rounds + BASE_ROUNDS))
    return out


def graph_seconds(cost: RankCost, rates: PlanRates) -> float:
    """The counted graph work of one epoch (aggregation and GEMMs), uncalibrated."""
    return AGG_PASSES * aggregation_seconds(cost, rates) + GEMM_PASSES * cost.flops * rates.flop


def aggregation_seconds(cost: RankCost, rates: PlanRates) -> float:
    """The forward pass's aggregations: each ``edges * max(edge_min, columns * edge)``."""
    return sum(e * max(rates.edge_min, d * rates.edge) for e, d in cost.aggregations)


def predict_seconds(cost: RankCost, rates: PlanRates) -> float:
    """One epoch of one worker: compute (slowed by shared cores), communication, and
    the fixed cost measured at the worker count."""
    compute = (graph_seconds(cost, rates) * rates.calibration + rates.overhead)
    rounds = max(0, cost.rounds - rates.rounds_paid)
    return (compute * rates.slowdown + cost.bytes_moved * rates.byte + rounds * rates.latency
            + rates.fixed)


def epoch_seconds(label: str, costs: list[RankCost], rates: PlanRates,
                  split: taskmodel.TaskSplit | None = None) -> float:
    """The epoch: the slowest worker; task parallelism's groups take turns, so its T and
    P groups' slowest add up (``rates.fixed`` counted once)."""
    times = [predict_seconds(c, rates) for c in costs]
    if label == "task" and split is not None:  # the fixed cost is the whole epoch's, once
        return (max(times[:split.num_t]) + max(times[split.num_t:]) - rates.fixed
                - rates.overhead * rates.slowdown)
    return max(times)
