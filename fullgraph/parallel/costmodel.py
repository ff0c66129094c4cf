"""The DepComm / DepCache cost model: unit costs measured at start, and pure decisions.

NeutronCloud section 4.1 prices each remote dependency ``v`` of worker i two ways:
- DepComm (formula 7): every P / E stage that fetches ``v`` moves its row forward and
  its gradient backward: ``sum_s d_s x itemsize x 2 x byte_cost``;
- DepCache (formulas 5 and 12): ``v``'s row is recomputed locally, recursively through
  its multi-hop in-neighbourhood. A stage ``s`` with ``m`` propagations after its own
  must then compute the ball ``B_{m-1}(v)`` (``v`` and every vertex within ``m - 1``
  in-hops of it): ``sum_s (|B(v)| x vertex_cost + |E(B(v))| x edge_cost) x d_s``,
  where ``E(B)`` are the in-edges of the ball (a P / E stage aggregates them all).
  The ball grows only through vertices ``v`` introduces: rows the worker owns are
  computed anyway, and other direct dependencies are fetched or cached on their own
  account, so both stop the walk.

The unit costs (seconds per byte moved, per edge x column aggregated, per vertex x
column transformed) are given or measured on this machine at start (``measure_*``);
everything else here is a pure function of (program, graph, partition), tested
without processes. Any strategy or planner may use it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe
from fullgraph.ops.spmm import aggregate

SEED_CHUNK = 2048
"""Dependencies whose neighbourhoods are walked together (bounds the walk's memory)."""


@dataclass(frozen=True)
class Rates:
    """Unit costs in seconds.

    Attributes:
        byte: per byte moved between two workers.
        edge: per edge x column aggregated.
        vertex: per vertex x column computed.
        measured: names of the rates measured on this machine (the others were given).
    """

    byte: float
    edge: float
    vertex: float
    measured: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("byte", "edge", "vertex"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} cost must be a finite number >= 0, got {value}")

    def describe(self) -> str:
        given = [n for n in ("byte", "edge", "vertex") if n not in self.measured]
        how = f"measured {', '.join(self.measured)}" if self.measured else "all given"
        if self.measured and given:
            how += f"; given {', '.join(given)}"
        return (f"byte {self.byte:.3g} s/B, edge {self.edge:.3g} s, vertex {self.vertex:.3g} s "
                f"({how})")


@dataclass(frozen=True)
class StageCost:
    """What one P / E stage costs a dependency.

    Attributes:
        stage: index in the program.
        dim: columns the stage aggregates (its input width).
        radius: DepCache computes the ball of this radius around the dependency at
            this stage (-1: nothing, the last propagation reads only owned rows).
        fetches: whether DepComm fetches the dependency here (False when the stage
            reuses the rows fetched for the E stage just before it).
    """

    stage: int
    dim: int
    radius: int
    fetches: bool


def stage_costs(program: StageProgram) -> list[StageCost]:
    """One StageCost per P / E stage of ``program``, in program order."""
    infos = describe(program)
    props = [i.index for i in infos if i.is_propagate]
    out = []
    for info, stage in zip(infos, program.stages):
        if not info.reads_neighbours:
            continue
        s = info.index
        # an E stage computes weights for the destinations of the next P stage
        p = next((q for q in props if q >= s), None)
        after = sum(1 for q in props if p is not None and q > p)
        shares = info.is_propagate and s > 0 and infos[s - 1].is_edge
        out.append(StageCost(s, int(stage.in_dim), after - 1, not shares))
    return out


def neighbourhood_sizes(graph: Graph, seeds: np.ndarray, radius: int,
                        stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sizes of the in-hop balls around each seed, walking only through non-stop vertices.

    Args:
        graph: CSR by destination (in-edges).
        seeds: (R,) vertex ids.
        radius: largest ball radius wanted (>= 0).
        stop: (N,) bool; these vertices are neither counted nor walked through (a
            seed itself is always in its ball).

    Returns:
        (R, radius + 1) int64 arrays: vertices in ``B_r(seed)`` and the sum of their
        in-degrees (the in-edges of the ball), for r = 0..radius.
    """
    indptr = graph.indptr.numpy().astype(np.int64)
    indices = graph.indices.numpy()
    deg = np.diff(indptr)
    n = graph.num_dst
    verts = np.zeros((seeds.size, radius + 1), dtype=np.int64)
    edges = np.zeros_like(verts)
    for lo in range(0, seeds.size, SEED_CHUNK):
        chunk = seeds[lo: lo + SEED_CHUNK].astype(np.int64)
        count = chunk.size
        owner, vertex = np.arange(count, dtype=np.int64), chunk
        visited = owner * n + vertex  # (seed position, vertex) pairs as one sorted key
        verts[lo: lo + count, 0], edges[lo: lo + count, 0] = 1, deg[chunk]
        for r in range(1, radius + 1):
            counts = deg[vertex]
            starts = np.repeat(indptr[vertex] - np.cumsum(counts) + counts, counts)
            src = indices[starts + np.arange(int(counts.sum()), dtype=np.int64)]
            owner = np.repeat(owner, counts)
            keep = ~stop[src]
            keys = np.unique(owner[keep] * n + src[keep])
            keys = keys[~np.isin(keys, visited, assume_unique=True)]
            visited = np.union1d(visited, keys)
            owner, vertex = keys // n, keys % n
            verts[lo: lo + count, r] = verts[lo: lo + count, r - 1] + np.bincount(
                owner, minlength=count)
            edges[lo: lo + count, r] = edges[lo: lo + count, r - 1] + np.bincount(
                owner, weights=deg[vertex], minlength=count).astype(np.int64)
    return verts, edges


@dataclass(frozen=True)
class DependencyWork:
    """Rate-free work of each direct remote dependency, from which costs follow.

    Attributes:
        vertex: (R,) float64, sum over P / E stages of ``|B(v)| x d_s``: vertex x
            columns DepCache computes for it (formula 5's vertex term, unit-free).
        edge: (R,) float64, the same for the ball's in-edges (formula 5's edge term).
        storage: (R,) float64, formula 12: ``sum_s (|B(v)| + |E(B(v))|) x d_s``
            elements, times ``itemsize``: bytes DepCache keeps for it.
        comm_bytes: bytes DepComm moves per dependency per epoch (formula 7: every
            fetching stage's row forward and its gradient backward), the same for all.
    """

    vertex: np.ndarray
    edge: np.ndarray
    storage: np.ndarray
    comm_bytes: float

    def cache_cost(self, rates: Rates) -> np.ndarray:
        """(R,) seconds DepCache costs each dependency at ``rates``."""
        return self.vertex * rates.vertex + self.edge * rates.edge

    def comm_cost(self, rates: Rates) -> float:
        """Seconds DepComm costs any one dependency at ``rates``."""
        return self.comm_bytes * rates.byte


def dependency_work(program: StageProgram, graph: Graph, owned: Tensor, direct: Tensor,
                    itemsize: int) -> DependencyWork:
    """The work of each direct remote dependency (see ``DependencyWork``).

    Args:
        program: the stage program.
        graph: the propagation graph (self-loops as the program wants).
        owned: (|V_i|,) gids this worker owns.
        direct: (R,) gids of its direct remote dependencies (in-neighbours of ``owned``
            owned elsewhere).
        itemsize: bytes per element of the vertex rows.
    """
    stages = stage_costs(program)
    comm_bytes = float(sum(c.dim for c in stages if c.fetches) * itemsize * 2)
    radius = max((c.radius for c in stages), default=-1)
    vertex = np.zeros(direct.numel(), dtype=np.float64)
    edge, storage = np.zeros_like(vertex), np.zeros_like(vertex)
    if radius < 0 or direct.numel() == 0:
        return DependencyWork(vertex, edge, storage, comm_bytes)
    stop = np.zeros(graph.num_dst, dtype=bool)
    stop[owned.numpy()] = True
    stop[direct.numpy()] = True
    verts, edges = neighbourhood_sizes(graph, direct.numpy(), radius, stop)
    for c in stages:
        if c.radius >= 0:
            vertex += verts[:, c.radius] * c.dim
            edge += edges[:, c.radius] * c.dim
    storage = (vertex + edge) * itemsize
    return DependencyWork(vertex, edge, storage, comm_bytes)


def dependency_costs(program: StageProgram, graph: Graph, owned: Tensor, direct: Tensor,
                     rates: Rates, itemsize: int) -> tuple[Tensor, Tensor]:
    """Per direct remote dependency: (DepCache cost, DepComm cost) in seconds.

    Args as ``dependency_work``, with the unit costs ``rates``.

    Returns:
        Two (R,) float64 tensors, see the module docstring.
    """
    work = dependency_work(program, graph, owned, direct, itemsize)
    comm = torch.full((direct.numel(),), work.comm_cost(rates), dtype=torch.float64)
    return torch.from_numpy(work.cache_cost(rates)), comm


def choose_cached(cache_cost: Tensor, comm_cost: Tensor) -> Tensor:
    """DepCache where recomputing is strictly cheaper than moving (bool, per dependency)."""
    if cache_cost.shape != comm_cost.shape:
        raise ValueError(f"cost shapes differ: {tuple(cache_cost.shape)} and "
                         f"{tuple(comm_cost.shape)}")
    return cache_cost < comm_cost


# ------------------------------------------------------------------ measuring

WARMUP_CALLS, TIMED_CALLS = 4, 3
"""``measure_edge_cost``: untimed calls first (on a fresh graph the first three took
10-450 ms on Cora, 0.1 ms from the fourth on); every ``measure_*``: the least of
``TIMED_CALLS`` timed calls (one call is one scheduler time slice away from 100x)."""


def measure_edge_cost(graph: Graph, dim: int = 32) -> float:
    """Seconds per edge x column of an aggregation over up to 20,000 of ``graph``'s rows
    that have in-edges (a shard's graph holds the in-edges of some rows only)."""
    return measure_edge_costs(graph, (dim,))[0]


def measure_edge_costs(graph: Graph, dims: tuple[int, ...]) -> list[float]:
    """``measure_edge_cost`` at each width of ``dims``, on one sample of rows."""
    rows = torch.nonzero(graph.indptr[1:] > graph.indptr[:-1]).flatten()[:20_000]
    sub_indptr, src, _ = in_edges(graph, rows.numpy())
    sub = Graph(torch.from_numpy(sub_indptr), torch.from_numpy(src).to(graph.indices.dtype),
                num_src=graph.num_src, validate=False)
    out = []
    for i, dim in enumerate(dims):
        x = torch.randn(graph.num_src, dim)
        for _ in range(WARMUP_CALLS if i == 0 else 1):  # a graph's first calls build the
            aggregate(sub, x, None, "sum")  # kernel's structures
        best = float("inf")
        for _ in range(TIMED_CALLS):
            t0 = time.perf_counter()
            aggregate(sub, x, None, "sum")
            best = min(best, time.perf_counter() - t0)
        out.append(best / max(1, sub.num_edges * dim))
    return out


def measure_vertex_cost(rows: int = 4096, dim: int = 32) -> float:
    """Seconds per vertex x column of a dense ``dim x dim`` transform."""
    x, w = torch.randn(rows, dim), torch.randn(dim, dim)
    x @ w  # warm-up
    best = float("inf")
    for _ in range(TIMED_CALLS):
        t0 = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t0)
    return best / (rows * dim)


def measure_byte_cost(comm: Comm, rows: int = 4096, dim: int = 64) -> float:
    """Seconds per byte of an all-to-all between the workers, the same on every worker
    (the slowest's; collective). 1e-9 on one worker, where nothing is ever moved."""
    if comm.world_size == 1:
        return 1e-9
    send = [torch.zeros(rows, dim) for _ in range(comm.world_size)]
    prim.all_to_all_v(send, [rows] * comm.world_size, comm, "setup")  # warm-up: buffers
    best = float("inf")
    for _ in range(TIMED_CALLS):  # every worker makes the same calls
        t0 = time.perf_counter()
        prim.all_to_all_v(send, [rows] * comm.world_size, comm, "setup")
        best = min(best, time.perf_counter() - t0)
    elapsed = torch.tensor([best], dtype=torch.float64)
    prim.all_reduce_(elapsed, comm, "setup", op="max")
    return float(elapsed) / (rows * dim * 4 * (comm.world_size - 1))


def resolve_rates(comm: Comm, graph: Graph, byte: float | None, edge: float | None,
                  vertex: float | None) -> Rates:
    """The given rates, the missing ones measured here (collective when ``byte`` is None)."""
    measured: list[str] = []
    if byte is None:
        byte, measured = measure_byte_cost(comm), measured + ["byte"]
    if edge is None:
        edge, measured = measure_edge_cost(graph), measured + ["edge"]
    if vertex is None:
        vertex, measured = measure_vertex_cost(), measured + ["vertex"]
    return Rates(byte, edge, vertex, tuple(measured))
