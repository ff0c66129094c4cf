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


def one_loop_per_row(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Whether every row ``v`` lists ``v`` exactly once."""
    return bool(_count_loops(indptr, indices)[1] == indptr.shape[0] - 1)


def transpose(indptr: np.ndarray, indices: np.ndarray, num_src: int,
              ids_dtype: np.dtype, perm_dtype: np.dtype
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR by source: ``(t_indptr, t_indices, perm)``; edges of one source in CSR order
    (as a stable sort by source), ``perm[k]`` the forward position of edge ``k``."""
    counts = np.bincount(indices, minlength=num_src)
    t_indptr = np.zeros(num_src + 1, dtype=np.int64)
    np.cumsum(counts, out=t_indptr[1:])
    del counts
    t_indices = np.empty(indices.shape[0], dtype=ids_dtype)
    perm = np.empty(indices.shape[0], dtype=perm_dtype)
    _transpose_fill(indptr, indices, t_indptr, t_indices, perm)
    return t_indptr, t_indices, perm


def endpoint_product(indptr: np.ndarray, indices: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(E,) ``scale[dst] * scale[src]`` per edge, in ``scale``'s dtype."""
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
    def _transpose_fill(indptr, indices, t_indptr, t_indices, perm):  # pragma: no cover
        cursor = t_indptr[:-1].copy()
        for v in range(indptr.shape[0] - 1):
            for k in range(indptr[v], indptr[v + 1]):
                j = indices[k]
                p = cursor[j]
                t_indices[p] = v
                perm[p] = k
                cursor[j] = p + 1

    @njit(parallel=True, cache=True, nogil=True)
    def _endpoint_product(indptr, indices, scale, out):  # pragma: no cover - numba
        for v in prange(indptr.shape[0] - 1):
            s = scale[v]
            for k in range(indptr[v], indptr[v + 1]):
                out[k] = s * scale[indices[k]]
