"""Graph topology stored as CSR by destination (in-edges grouped by destination).

Row ``i`` of the CSR lists the sources of the in-edges of vertex ``i``:
``indices[indptr[i]:indptr[i + 1]]``. This is the layout a propagate stage reads
(a pull-style weighted sum over in-neighbours), and the layout every partitioner
and executor of fullgraph slices.

A graph may be bipartite (``num_src != num_dst``): a data-parallel worker's local
block has its own vertices as destinations and local + remote vertices as sources.

Invariants: ``indptr`` is int64, starts at 0, is non-decreasing and ends at E;
``indices`` is int32 when ``num_src < 2**31`` and int64 otherwise; within a row the
sources are sorted. This module must not import torch.distributed or anything above
the graph layer.

Shapes: N = number of vertices, E = number of edges.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from fullgraph.errors import ValidationError
from fullgraph.graph import kernels as _kernels

SelfLoops = Literal["keep", "add", "remove"]
INT32_LIMIT = 2**31 - 1
_GATHER_STEP = 1 << 22  # edges per chunk of a gather into a file (16 MiB of int32 ids)
_ROW_STEP = 1 << 20  # rows per chunk of per-row weights written into a file


def index_dtype(num_vertices: int) -> torch.dtype:
    """The narrowest index dtype able to hold ids ``0..num_vertices-1``."""
    return torch.int32 if num_vertices <= INT32_LIMIT else torch.int64


@dataclass(frozen=True)
class Transposed:
    """The transposed CSR (CSR by source) and the edge permutation that builds it.

    Attributes:
        graph: CSR whose row ``j`` lists the destinations of the out-edges of ``j``.
        perm: (E,) int32 (int64 past 2**31 - 1 edges); edge ``k`` of ``graph`` is edge
            ``perm[k]`` of the original.
        mirrors: the transposed CSR is the original's, array for array (a symmetric
            graph whose rows list their sources in ascending order); ``graph`` then
            shares the original's arrays.
    """

    graph: "Graph"
    perm: Tensor
    mirrors: bool = False
    _ordered: list = field(default_factory=list, compare=False, repr=False)
    keep: Callable[[Tensor], Tensor] | None = field(default=None, compare=False, repr=False)
    """Where the weights in order are kept (e.g. ``Spill.keep``, a file); None: memory."""
    empty: Callable[[int, torch.dtype], Tensor] | None = field(default=None, compare=False,
                                                                repr=False)
    """Makes an (n,) array where the weights in order are gathered a chunk at a time
    (e.g. ``Spill.array``, a file), instead of whole in memory and then kept."""

    def weights_in_order(self, weight: Tensor) -> Tensor | None:
        """Fixed (E,) edge weights of the original (GCN's norms: not requiring a
        gradient) in this CSR's edge order, ``weight[perm]``, for a backward pass that
        reads them in order rather than through ``perm`` (3x faster at 47 columns on a
        1M-vertex R-MAT: each gathered weight missed the cache). Where the graph mirrors
        and the weights are symmetric, that is ``weight`` itself; otherwise one copy is
        kept, for the last tensor asked about. None the first time a tensor is asked
        about (and after it changes in place): only weights seen twice are taken to be
        fixed, so a tensor made afresh for every pass costs no copy. None for weights
        that need a gradient or have heads."""
        if weight.dim() != 1 or weight.requires_grad:
            return None
        for i, (ref, version, ordered) in enumerate(self._ordered):
            if ref() is weight and version == weight._version:
                if ordered is None:
                    ordered = self._gathered(weight)
                    if self.mirrors and torch.equal(ordered, weight):
                        ordered = weight
                    elif self.keep is not None and self.empty is None:
                        ordered = self.keep(ordered)
                    self._ordered[i] = (ref, version, ordered)
                return ordered
        self._ordered[:] = [(weakref.ref(weight), weight._version, None)]
        return None

    def _gathered(self, weight: Tensor) -> Tensor:
        """``weight[perm]``; into ``empty``'s array a chunk of edges at a time if given."""
        if self.empty is None:
            return weight[self.perm]
        out = self.empty(self.perm.numel(), weight.dtype)
        step = _GATHER_STEP
        for a in range(0, self.perm.numel(), step):
            torch.index_select(weight, 0, self.perm[a:a + step], out=out[a:a + step])
        return out


class Graph:
    """CSR by destination, optionally bipartite and optionally weighted.

    Args:
        indptr: (N_dst + 1,) row offsets.
        indices: (E,) source vertex of each in-edge, grouped by destination.
        num_src: number of source vertices (default: ``N_dst``, a square graph).
        edge_weight: optional (E,) weight of each edge (default: None).
        validate: check the invariants in O(N + E) (default: True).

    Raises:
        ValidationError: when the arrays do not form a valid CSR.
    """

    def __init__(self, indptr: Tensor, indices: Tensor, num_src: int | None = None,
                 edge_weight: Tensor | None = None, *, validate: bool = True) -> None:
        self.indptr = torch.as_tensor(indptr).to(torch.int64)
        num_dst = int(self.indptr.numel()) - 1
        self.num_src = num_dst if num_src is None else int(num_src)
        self.indices = torch.as_tensor(indices).to(index_dtype(self.num_src))
        self.edge_weight = edge_weight
        self._transposed: Transposed | None = None
        self._dst_index: Tensor | None = None
        self._indices64: Tensor | None = None
        self._source_split: tuple[int, Tensor | None] | None = None
        if validate:
            self.validate()

    # ------------------------------------------------------------------ shape
    @property
    def num_dst(self) -> int:
        return int(self.indptr.numel()) - 1

    @property
    def num_nodes(self) -> int:
        """Number of vertices of a square graph."""
        if self.num_src != self.num_dst:
            raise ValueError(f"num_nodes is ambiguous for a bipartite graph "
                             f"({self.num_dst} destinations, {self.num_src} sources)")
        return self.num_dst

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    def __repr__(self) -> str:
        kind = "" if self.num_src == self.num_dst else f", num_src={self.num_src}"
        return f"Graph(num_dst={self.num_dst}{kind}, num_edges={self.num_edges})"

    def validate(self) -> None:
        """Check the CSR invariants; raise ``ValidationError`` naming the first broken one."""
        if self.indptr.dim() != 1 or self.indptr.numel() < 1:
            raise ValidationError("indptr must be a non-empty 1-D array", field="indptr",
                                  found=tuple(self.indptr.shape))
        if int(self.indptr[0]) != 0:
            raise ValidationError("indptr must start at 0", field="indptr[0]",
                                  found=int(self.indptr[0]))
        if int(self.indptr[-1]) != self.num_edges:
            raise ValidationError("indptr must end at the number of edges", field="indptr[-1]",
                                  found=int(self.indptr[-1]), expected=self.num_edges)
        if self.num_dst > 0 and bool((self.indptr[1:] < self.indptr[:-1]).any()):
            bad = int(torch.nonzero(self.indptr[1:] < self.indptr[:-1])[0])
            raise ValidationError("indptr must be non-decreasing", field=f"indptr[{bad + 1}]")
        if self.num_edges:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= self.num_src:
                bad = lo if lo < 0 else hi
                raise ValidationError("source vertex id out of range", field="indices",
                                      found=bad, expected=f"0 <= id < {self.num_src}")
        if self.edge_weight is not None and self.edge_weight.shape[0] != self.num_edges:
            raise ValidationError("edge_weight needs one value per edge", field="edge_weight",
                                  found=tuple(self.edge_weight.shape), expected=self.num_edges)

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_edges(cls, src: Tensor | np.ndarray, dst: Tensor | np.ndarray, num_nodes: int, *,
                   symmetrize: bool = False, self_loops: SelfLoops = "keep",
                   dedup: bool = True) -> "Graph":
        """Build a square CSR by destination from an edge list ``src -> dst``.

        Args:
            src, dst: (E,) integer vertex ids.
            num_nodes: number of vertices N; every id must be in ``[0, N)``.
            symmetrize: also add ``dst -> src`` for every edge (default: False).
            self_loops: ``"keep"`` them as given, ``"add"`` one per vertex (existing
                ones are kept once), or ``"remove"`` all (default: ``"keep"``).
            dedup: drop repeated edges (default: True).

        Raises:
            ValidationError: an id is negative or not below ``num_nodes``.
        """
        src_np = _as_int64(src, "src")
        dst_np = _as_int64(dst, "dst")
        if src_np.shape != dst_np.shape:
            raise ValidationError("src and dst must have the same length", field="dst",
                                  found=dst_np.shape[0], expected=src_np.shape[0])
        _check_range(src_np, num_nodes, "src")
        _check_range(dst_np, num_nodes, "dst")
        if symmetrize:
            src_np, dst_np = np.concatenate([src_np, dst_np]), np.concatenate([dst_np, src_np])
        if self_loops in ("remove", "add"):
            keep = src_np != dst_np
            src_np, dst_np = src_np[keep], dst_np[keep]
        if self_loops == "add":
            loops = np.arange(num_nodes, dtype=np.int64)
            src_np, dst_np = np.concatenate([src_np, loops]), np.concatenate([dst_np, loops])
        indptr, indices = _sort_to_csr(src_np, dst_np, num_nodes, dedup)
        return cls(torch.from_numpy(indptr), torch.from_numpy(indices), num_nodes, validate=False)

    def edges(self) -> tuple[Tensor, Tensor]:
        """Return ``(src, dst)`` int64 edge lists in CSR order."""
        return self.indices.to(torch.int64), self.dst_index()

    def with_self_loops(self, present: bool) -> "Graph":
        """The graph with exactly one self-loop per vertex (``present=True``) or none.

        Other edges are kept as they are, repeated ones included. A copy, unless the
        graph is already so (then itself, where ``graph.kernels`` can check that).
        """
        n = self.num_nodes
        if self._row_loops():
            ptr, ids = self.indptr.numpy(), self.indices.numpy()
            if self.edge_weight is None and (_kernels.one_loop_per_row(ptr, ids) if present
                                             else not _kernels.has_loops(ptr, ids)):
                return self  # already so: no copy (a stored graph stays memory-mapped)
            indptr, indices = _kernels.with_loops(self.indptr.numpy(), self.indices.numpy(),
                                                  present)
            return Graph(torch.from_numpy(indptr), torch.from_numpy(indices), n,
                         validate=False)
        src, dst = self.edges()
        return Graph.from_edges(src, dst, n, dedup=False,
                                self_loops="add" if present else "remove").to(self.device)

    def has_self_loops(self) -> bool:
        if self._row_loops():
            return _kernels.has_loops(self.indptr.numpy(), self.indices.numpy())
        src, dst = self.edges()
        return bool((src == dst).any())

    def self_loop_count(self) -> int:
        """How many edges are self-loops (row by row where ``graph.kernels`` can walk
        the rows, without the whole edge list)."""
        if self._row_loops():
            return _kernels.count_loops(self.indptr.numpy(), self.indices.numpy())
        src, dst = self.edges()
        return int((src == dst).sum())

    def _row_loops(self) -> bool:
        """Whether ``graph.kernels`` can walk this graph's rows (numba, host memory)."""
        return _kernels.HAVE_NUMBA and self.indptr.device.type == "cpu"

    # ------------------------------------------------------------- derived data
    def in_degrees(self) -> Tensor:
        """(N_dst,) int64 number of in-edges of each destination."""
        return self.indptr[1:] - self.indptr[:-1]

    def out_degrees(self) -> Tensor:
        """(N_src,) int64 number of out-edges of each source."""
        return torch.bincount(self.indices.to(torch.int64), minlength=self.num_src)

    def dst_index(self) -> Tensor:
        """(E,) int64 destination of each edge, built once and cached."""
        if self._dst_index is None:
            rows = torch.arange(self.num_dst, device=self.device)
            self._dst_index = torch.repeat_interleave(rows, self.in_degrees())
        return self._dst_index

    def indices_int64(self) -> Tensor:
        """``indices`` as int64 (what torch's sparse CSR tensors take), cached."""
        if self.indices.dtype == torch.int64:
            return self.indices
        if self._indices64 is None:
            self._indices64 = self.indices.to(torch.int64)
        return self._indices64

    def source_split(self, n: int) -> Tensor | None:
        """(N_dst,) int64: where each row's in-edges from sources below ``n`` end, when
        every row lists them before its others (``graph.blocks.build_block`` with
        ``local_first``); None when some row does not. Computed once per ``n``."""
        if self._source_split is None or self._source_split[0] != n:
            indptr = self.indptr.cpu().numpy()
            below = np.concatenate([[0], np.cumsum(self.indices.cpu().numpy() < n)])
            count = below[indptr[1:]] - below[indptr[:-1]]
            split = indptr[:-1] + count
            # grouped: a row's first ``count`` edges are the ones below n
            grouped = bool(np.array_equal(below[split] - below[indptr[:-1]], count))
            self._source_split = (n, torch.from_numpy(split) if grouped else None)
        return self._source_split[1]

    def transpose(self) -> Transposed:
        """CSR by source (out-edges), built once and cached; used by backward passes."""
        if self._transposed is None:
            self._transposed = self._mirrored(self._build_transpose())
        return self._transposed

    def keep_transpose(self, keep: Callable[[Tensor], Tensor], *,
                       empty: Callable[[int, torch.dtype], Tensor] | None = None,
                       memory: int | None = None) -> None:
        """Pass the transposed CSR's arrays (built here if not yet) through ``keep``
        (e.g. ``Spill.keep``, into files), and the edge weights in its order that
        backward passes copy later (``Transposed.weights_in_order``).

        With ``empty`` (a maker of (n,) arrays, e.g. ``Spill.array``) a transpose not
        built yet is built straight into its arrays, at most ``memory`` bytes of its
        edges in memory at once (``kernels.transpose_into``), and the weights in order
        are gathered into them too: no (E,) array of setup is then held in memory.
        """
        in_files = self._transposed is None and empty is not None and self._row_loops()
        t = self._mirrored(self._transpose_into(empty, memory)) \
            if in_files and empty is not None else self.transpose()
        if not t.mirrors:  # a mirror shares the forward arrays, which stay as they are
            indices = t.graph.indices if in_files else keep(t.graph.indices)
            t = dataclasses.replace(t, graph=Graph(keep(t.graph.indptr), indices,
                                                   num_src=t.graph.num_src, validate=False))
        if not in_files:
            t = dataclasses.replace(t, perm=keep(t.perm))
        self._transposed = dataclasses.replace(t, keep=keep, empty=empty)

    def _transpose_into(self, empty: Callable[[int, torch.dtype], Tensor],
                        memory: int | None) -> Transposed:
        ids = torch.int32 if self.num_dst <= INT32_LIMIT else torch.int64
        perm_dtype = torch.int32 if self.num_edges <= INT32_LIMIT else torch.int64
        t_indices, perm = empty(self.num_edges, ids), empty(self.num_edges, perm_dtype)
        per_edge = t_indices.element_size() + perm.element_size()
        chunk = self.num_edges if memory is None else max(1, memory // per_edge)
        t_indptr = _kernels.transpose_into(self.indptr.numpy(), self.indices.numpy(),
                                           self.num_src, t_indices.numpy(), perm.numpy(), chunk)
        return Transposed(Graph(torch.from_numpy(t_indptr), t_indices, num_src=self.num_dst,
                                validate=False), perm)

    def _build_transpose(self) -> Transposed:
        if self._row_loops():
            ids = np.int32 if self.num_dst <= INT32_LIMIT else np.int64
            t_indptr, t_ids, perm = _kernels.transpose(
                self.indptr.numpy(), self.indices.numpy(), self.num_src, np.dtype(ids),
                np.dtype(np.int32 if self.num_edges <= INT32_LIMIT else np.int64))
            return Transposed(Graph(torch.from_numpy(t_indptr), torch.from_numpy(t_ids),
                                    num_src=self.num_dst, validate=False),
                              torch.from_numpy(perm))
        if self.indptr.device.type != "cpu":
            return self._transpose_on_device()
        src = self.indices.cpu().numpy()
        perm = np.argsort(src, kind="stable")
        counts = np.bincount(src, minlength=self.num_src)
        t_indptr = np.zeros(self.num_src + 1, dtype=np.int64)
        np.cumsum(counts, out=t_indptr[1:])
        # ids in the narrowest dtype that holds them, as the forward CSR's: at 20M
        # edges, int32 instead of int64 saves 160 MB for each of the two arrays
        t_indices = self.dst_index().cpu().numpy()[perm].astype(
            np.int32 if self.num_dst <= INT32_LIMIT else np.int64)
        perm_t = torch.from_numpy(perm.astype(
            np.int32 if self.num_edges <= INT32_LIMIT else np.int64)).to(self.device)
        graph = Graph(torch.from_numpy(t_indptr).to(self.device),
                      torch.from_numpy(t_indices).to(self.device),
                      num_src=self.num_dst, validate=False)
        return Transposed(graph, perm_t)

    def _mirrored(self, t: Transposed) -> Transposed:
        """``t`` marked as mirroring this CSR where its arrays equal this graph's (then
        sharing this graph's, when their dtypes match, so only one copy is held)."""
        if self.num_src != self.num_dst or not torch.equal(t.graph.indptr.to(self.indptr.dtype),
                                                            self.indptr):
            return t
        if not torch.equal(t.graph.indices.to(self.indices.dtype), self.indices):
            return t
        graph = t.graph
        if graph.indices.dtype == self.indices.dtype and graph.indptr.dtype == self.indptr.dtype:
            graph = Graph(self.indptr, self.indices, num_src=self.num_dst, validate=False)
        return Transposed(graph, t.perm, mirrors=True)

    def _transpose_on_device(self) -> Transposed:
        """The transpose built where the CSR lives (a GPU) with a stable sort."""
        perm = torch.argsort(self.indices, stable=True)
        counts = torch.bincount(self.indices, minlength=self.num_src)
        t_indptr = torch.zeros(self.num_src + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(counts, 0, out=t_indptr[1:])
        ids = torch.int32 if self.num_dst <= INT32_LIMIT else torch.int64
        t_indices = self.dst_index()[perm].to(ids)
        perm = perm.to(torch.int32 if self.num_edges <= INT32_LIMIT else torch.int64)
        return Transposed(Graph(t_indptr, t_indices, num_src=self.num_dst, validate=False), perm)

    def to(self, device: torch.device | str) -> "Graph":
        """A copy on ``device`` (self if already there); caches are not carried."""
        device = torch.device(device)
        if same_device(self.indptr.device, device):
            return self
        weight = None if self.edge_weight is None else self.edge_weight.to(device)
        return Graph(self.indptr.to(device), self.indices.to(device), self.num_src, weight,
                     validate=False)

    def nbytes(self) -> int:
        """Bytes held by the CSR arrays (not counting caches)."""
        total = self.indptr.numel() * 8 + self.indices.numel() * self.indices.element_size()
        if self.edge_weight is not None:
            total += self.edge_weight.numel() * self.edge_weight.element_size()
        return int(total)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (``cuda`` without an index is the current GPU)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a == b
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == \
        (b.index if b.index is not None else current)


# ---------------------------------------------------------------- normalisation
def gcn_norm(graph: Graph, dtype: torch.dtype = torch.float32,
             degrees: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Symmetric GCN edge weights ``1 / sqrt(deg(dst) * deg(src))``.

    ``deg`` is the in-degree, counting the self-loops the graph holds (Kipf & Welling
    add them before normalising; build the graph with ``self_loops="add"`` for that).
    Vertices of degree 0 get weight 0 on their (absent) edges. For a bipartite block
    pass a square graph: degrees of both endpoints come from the same vertex set.
    ``degrees``: the (N,) in-degrees to use instead of the graph's own (a shard's
    graph holds only some in-edges; its whole graph's degrees are recorded apart).
    ``out``: an (E,) tensor of ``dtype`` to write the weights into (e.g. a file's).
    """
    deg = (graph.in_degrees() if degrees is None else degrees).to(dtype)
    inv_sqrt = torch.where(deg > 0, deg.rsqrt(), torch.zeros_like(deg))
    if graph._row_loops() and inv_sqrt.device.type == "cpu":  # no (E,) int64 ids
        return torch.from_numpy(_kernels.endpoint_product(
            graph.indptr.numpy(), graph.indices.numpy(), inv_sqrt.numpy(),
            None if out is None else out.numpy()))
    src, dst = graph.edges()
    return _into(inv_sqrt[dst] * inv_sqrt[src], out)


def mean_norm(graph: Graph, dtype: torch.dtype = torch.float32,
              degrees: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Edge weights ``1 / in_degree(dst)``: a weighted sum with them is the mean
    (``degrees``, ``out``: as for ``gcn_norm``)."""
    deg = (graph.in_degrees() if degrees is None else degrees).to(dtype)
    inv = torch.where(deg > 0, 1.0 / deg, torch.zeros_like(deg))
    if out is None:
        return torch.repeat_interleave(inv, graph.in_degrees().to(inv.device),
                                       output_size=graph.num_edges)
    step = _ROW_STEP  # rows at a time: no (E,) temporary besides ``out``
    counts = graph.in_degrees().to(inv.device)
    for v in range(0, graph.num_dst, step):
        lo, hi = int(graph.indptr[v]), int(graph.indptr[min(graph.num_dst, v + step)])
        out[lo:hi] = torch.repeat_interleave(inv[v:v + step], counts[v:v + step],
                                             output_size=hi - lo)
    return out


def sum_norm(graph: Graph, dtype: torch.dtype = torch.float32,
             degrees: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Edge weights of 1 (plain sum aggregation; ``out`` as for ``gcn_norm``)."""
    if out is not None:
        return out.fill_(1)
    return torch.ones(graph.num_edges, dtype=dtype, device=graph.device)


def _into(t: Tensor, out: Tensor | None) -> Tensor:
    return t if out is None else out.copy_(t)


NORMS = {"gcn": gcn_norm, "mean": mean_norm, "sum": sum_norm}


# ------------------------------------------------------------------- internals
def _as_int64(ids: Tensor | np.ndarray, name: str) -> np.ndarray:
    arr = ids.cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
    if arr.ndim != 1:
        raise ValidationError("edge endpoint array must be 1-D", field=name, found=arr.shape)
    if arr.dtype.kind not in "iu":
        raise ValidationError("edge endpoints must be integers", field=name, found=arr.dtype)
    return arr.astype(np.int64, copy=False)


def _check_range(ids: np.ndarray, num_nodes: int, name: str) -> None:
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        pos = int(np.argmax(ids < 0))
        raise ValidationError("negative vertex id", field=f"{name}[{pos}]", found=lo,
                              expected=f"0 <= id < {num_nodes}")
    if hi >= num_nodes:
        pos = int(np.argmax(ids >= num_nodes))
        raise ValidationError("vertex id out of range", field=f"{name}[{pos}]", found=hi,
                              expected=f"0 <= id < {num_nodes}")


def _sort_to_csr(src: np.ndarray, dst: np.ndarray, num_nodes: int,
                 dedup: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sort edges by (dst, src), optionally de-duplicate, and build indptr."""
    key = dst * np.int64(num_nodes) + src
    key.sort()  # np.unique is ~100x slower than sort + mask on 20M keys (numpy 2.4)
    if dedup and key.size:
        keep = np.empty(key.size, dtype=bool)
        keep[0] = True
        np.not_equal(key[1:], key[:-1], out=keep[1:])
        key = key[keep]
    dst_sorted = key // num_nodes
    indices = (key - dst_sorted * num_nodes).astype(
        np.int32 if num_nodes <= INT32_LIMIT else np.int64)
    counts = np.bincount(dst_sorted, minlength=num_nodes)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, indices
