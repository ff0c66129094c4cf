"""Row loops over a CSR that numpy can only vectorise through (E,) int64 temporaries.

Building the propagation inputs of a large graph (self-loops, the transposed CSR,
edge norms) the vectorised way materialises every edge's destination as int64 and
sorts keys: about 40 bytes per edge at once, 16 GB at 400M edges. These loops walk
the rows instead and allocate only their outputs. Each gives exactly what the numpy
path in ``csr`` gives (the same arrays, bit for bit); ``csr`` uses them when numba is
installed and the graph is in host memory.

This module must not import anything above the graph layer.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # numba is optional (the "fast" extra); csr falls back to numpy
    HAVE_NUMBA = False


def with_loops(indptr: np.ndarray, indices: np.ndarray,
               present: bool) -> tuple[np.ndarray, np.ndarray]:
    """The CSR with exactly one self-loop per row (``present``) or none.

    Rows must be sorted (the ``Graph`` invariant); other entries, repeated ones
    included, keep their order and the loop goes where it sorts.
    """
    n = indptr.shape[0] - 1
    counts = np.empty(n, dtype=np.int64)
    _loop_counts(indptr, indices, present, counts)
    new_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=new_indptr[1:])
    out = np.empty(int(new_indptr[-1]), dtype=indices.dtype)
    _loop_fill(indptr, indices, present, new_indptr, out)
    return new_indptr, out


def has_loops(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Whether some row ``v`` lists ``v`` among its sources."""
    return bool(_count_loops(indptr, indices)[0] > 0)


def count_loops(indptr: np.ndarray, indices: np.ndarray) -> int:
    """How many edges ``v -> v`` the rows list."""
    return _count_loops(indptr, indices)[0]


def one_loop_per_row(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Whether every row ``v`` lists ``v`` exactly once."""
    return bool(_count_loops(indptr, indices)[1] == indptr.shape[0] - 1)


def transpose(indptr: np.ndarray, indices: np.ndarray, num_src: int,
              ids_dtype: np.dtype, perm_dtype: np.dtype
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR by source: ``(t_indptr, t_indices, perm)``; edges of one source in CSR order
    (as a stable sort by source), ``perm[k]`` the forward position of edge ``k``."""
    t_indices = np.empty(indices.shape[0], dtype=ids_dtype)
    perm = np.empty(indices.shape[0], dtype=perm_dtype)
    t_indptr = transpose_into(indptr, indices, num_src, t_indices, perm, indices.shape[0])
    return t_indptr, t_indices, perm


def transpose_into(indptr: np.ndarray, indices: np.ndarray, num_src: int,
                   t_indices: np.ndarray, perm: np.ndarray, chunk_edges: int) -> np.ndarray:
    """``transpose`` into the given (E,) arrays (e.g. file mappings), holding at most
    ``chunk_edges`` of their entries in memory at once (more only where one source
    alone has more out-edges); returns ``t_indptr``.

    An external transpose: it walks the forward CSR once per range of sources whose
    out-edges fit the chunk, fills that range in memory, where its scattered writes
    land, and copies it to the outputs in order. Writing the scattered entries
    straight into a file mapping instead made the kernel write the same dirty pages
    back again and again. With one range (``chunk_edges >= E``) it fills the outputs
    in place. Besides the chunk it holds ``t_indptr`` and a cursor per source.
    """
    num_edges = indices.shape[0]
    t_indptr = np.zeros(num_src + 1, dtype=np.int64)
    _count_sources(indices, t_indptr[1:])  # not np.bincount: it copies indices as int64
    np.cumsum(t_indptr, out=t_indptr)
    if chunk_edges >= num_edges:
        _transpose_range(indptr, indices, 0, num_src, t_indptr, t_indices, perm)
        return t_indptr
    chunk_edges = max(1, int(chunk_edges))
    ids_buf = np.empty(0, dtype=t_indices.dtype)
    perm_buf = np.empty(0, dtype=perm.dtype)
    s0 = 0
    while s0 < num_src:
        first = int(t_indptr[s0])
        s1 = int(np.searchsorted(t_indptr, first + chunk_edges, side="right")) - 1
        s1 = min(num_src, max(s0 + 1, s1))
        last = int(t_indptr[s1])
        if last - first > ids_buf.shape[0]:
            ids_buf = np.empty(max(chunk_edges, last - first), dtype=t_indices.dtype)
            perm_buf = np.empty(ids_buf.shape[0], dtype=perm.dtype)
        n = last - first
        _transpose_range(indptr, indices, s0, s1, t_indptr, ids_buf[:n], perm_buf[:n])
        t_indices[first:last] = ids_buf[:n]
        perm[first:last] = perm_buf[:n]
        s0 = s1
    return t_indptr


def endpoint_product(indptr: np.ndarray, indices: np.ndarray, scale: np.ndarray,
                     out: np.ndarray | None = None) -> np.ndarray:
    """(E,) ``scale[dst] * scale[src]`` per edge, in ``scale``'s dtype (into ``out``)."""
    if out is None:
        out = np.empty(indices.shape[0], dtype=scale.dtype)
    _endpoint_product(indptr, indices, scale, out)
    return out


if HAVE_NUMBA:

    @njit(parallel=True, cache=True, nogil=True)
    def _loop_counts(indptr, indices, present, counts):  # pragma: no cover - numba
        for v in prange(indptr.shape[0] - 1):
            c = 1 if present else 0
            for k in range(indptr[v], indptr[v + 1]):
                if indices[k] != v:
                    c += 1
            counts[v] = c

    @njit(parallel=True, cache=True, nogil=True)
    def _loop_fill(indptr, indices, present, new_indptr, out):  # pragma: no cover - numba
        for v in prange(indptr.shape[0] - 1):
            o = new_indptr[v]
            placed = not present
            for k in range(indptr[v], indptr[v + 1]):
                j = indices[k]
                if j == v:
                    continue
                if not placed and j > v:
                    out[o] = v
                    o += 1
                    placed = True
                out[o] = j
                o += 1
            if not placed:
                out[o] = v

    @njit(parallel=True, cache=True, nogil=True)
    def _loops_per_row(indptr, indices, out):  # pragma: no cover - numba
        for v in prange(indptr.shape[0] - 1):
            c = 0
            for k in range(indptr[v], indptr[v + 1]):
                if indices[k] == v:
                    c += 1
            out[v] = c

    def _count_loops(indptr: np.ndarray, indices: np.ndarray) -> tuple[int, int]:
        """(loops, rows with exactly one loop). Counted per row into an array, not as
        a parallel reduction, which numba 0.68.0 fails to compile ("unexpected cycle
        in lookup()")."""
        per_row = np.empty(indptr.shape[0] - 1, dtype=np.int32)
        _loops_per_row(indptr, indices, per_row)
        return int(per_row.sum()), int(np.count_nonzero(per_row == 1))

    @njit(cache=True, nogil=True)
    def _count_sources(indices, counts):  # pragma: no cover - numba
        for k in range(indices.shape[0]):
            counts[indices[k]] += 1

    @njit(cache=True, nogil=True)
    def _transpose_range(indptr, indices, s0, s1, t_indptr, t_indices,
                         perm):  # pragma: no cover - numba
        """The transpose's entries of sources [s0, s1) into ``t_indices`` / ``perm``,
        which start at that range's first entry, ``t_indptr[s0]``."""
        base = t_indptr[s0]
        cursor = t_indptr[s0:s1] - base
        for v in range(indptr.shape[0] - 1):
            for k in range(indptr[v], indptr[v + 1]):
                j = indices[k]
                if s0 <= j < s1:
                    p = cursor[j - s0]
                    t_indices[p] = v
                    perm[p] = k
                    cursor[j - s0] = p + 1

    @njit(parallel=True, cache=True, nogil=True)
    def _endpoint_product(indptr, indices, scale, out):  # pragma: no cover - numba
        for v in prange(indptr.shape[0] - 1):
            s = scale[v]
            for k in range(indptr[v], indptr[v + 1]):
                out[k] = s * scale[indices[k]]
