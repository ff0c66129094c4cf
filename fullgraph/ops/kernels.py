"""CPU kernels compiled with numba, used when numba is installed.

Each kernel works on plain numpy arrays (views of torch CPU tensors) and writes into
an output array that the caller allocates, so torch owns every buffer. Rows are
processed in parallel (``prange``); a row's in-edges are summed in CSR order, so the
result of a row does not depend on the thread count or on which rows share a call.

The number of numba threads follows ``torch.get_num_threads()`` (set by the caller
through ``set_threads``) so that a worker's thread budget covers both libraries.

Shapes: N_dst rows, N_src source rows, E edges, H heads, C channels per head.
"""
from __future__ import annotations

import os

try:  # numba is optional: ops fall back to torch kernels without it
    if os.environ.get("FULLGRAPH_NO_NUMBA"):
        raise ImportError("numba disabled by FULLGRAPH_NO_NUMBA")
    import numba
    from numba import njit, prange
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised in the no-numba CI job
    numba = None  # type: ignore[assignment]
    HAVE_NUMBA = False


def set_threads(num_threads: int) -> None:
    """Use ``num_threads`` numba threads (clamped to what numba was started with)."""
    if HAVE_NUMBA:
        limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        numba.set_num_threads(max(1, min(num_threads, limit)))


if HAVE_NUMBA:

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_weighted(indptr, indices, weight, x, out):  # pragma: no cover - numba
        """out[i, h*C:(h+1)*C] = sum_e weight[e, h] * x[indices[e], h*C:(h+1)*C]."""
        n_dst = out.shape[0]
        heads = weight.shape[1]
        chans = x.shape[1] // heads
        for i in prange(n_dst):
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
                for h in range(heads):
                    w = weight[e, h]
                    base = h * chans
                    for c in range(base, base + chans):
                        out[i, c] += w * x[j, c]

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_scalar(indptr, indices, weight, x, out):  # pragma: no cover - numba
        """out[i] = sum_e weight[e] * x[indices[e]] (single head, 1-D weights)."""
        n_dst = out.shape[0]
        d = x.shape[1]
        for i in prange(n_dst):
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
                w = weight[e]
                for c in range(d):
                    out[i, c] += w * x[j, c]

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_unweighted(indptr, indices, x, out, mean):  # pragma: no cover - numba
        """out[i] = sum (or mean when ``mean``) of x over the in-edges of i."""
        n_dst = out.shape[0]
        d = x.shape[1]
        for i in prange(n_dst):
            start, stop = indptr[i], indptr[i + 1]
            for e in range(start, stop):
                j = indices[e]
                for c in range(d):
                    out[i, c] += x[j, c]
            if mean and stop > start:
                inv = 1.0 / (stop - start)
                for c in range(d):
                    out[i, c] *= inv

    @njit(parallel=True, cache=True, nogil=True)
    def sddmm(indptr, indices, a, b, out):  # pragma: no cover - numba
        """out[e, h] = <a[dst_e, head h], b[src_e, head h]> for every edge e."""
        n_dst = a.shape[0]
        heads = out.shape[1]
        chans = a.shape[1] // heads
        for i in prange(n_dst):
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
                for h in range(heads):
                    s = 0.0
                    base = h * chans
                    for c in range(base, base + chans):
                        s += a[i, c] * b[j, c]
                    out[e, h] = s

    @njit(parallel=True, cache=True, nogil=True)
    def keyed_uniform(row_keys, num_cols, seed, out):  # pragma: no cover - numba
        """out[r, c] = hash(seed, row_keys[r], c) mapped to [0, 1); see ops.dropout."""
        m32 = 0xFFFFFFFF
        for r in prange(row_keys.shape[0]):
            k = _mix32(((row_keys[r] & m32) ^ seed) & m32)
            k = _mix32((k + ((row_keys[r] >> 32) & m32) * 0x27D4EB2F) & m32)
            for c in range(num_cols):
                h = _mix32((k + c * 0x9E3779B9) & m32)
                out[r, c] = h * 2.3283064365386963e-10

    @njit(parallel=True, cache=True, nogil=True)
    def keyed_dropout(x, row_keys, seed, p, scale, out):  # pragma: no cover - numba
        """out = x * scale where keyed_uniform >= p, else 0 (one fused pass)."""
        m32 = 0xFFFFFFFF
        num_cols = x.shape[1]
        for r in prange(row_keys.shape[0]):
            k = _mix32(((row_keys[r] & m32) ^ seed) & m32)
            k = _mix32((k + ((row_keys[r] >> 32) & m32) * 0x27D4EB2F) & m32)
            for c in range(num_cols):
                h = _mix32((k + c * 0x9E3779B9) & m32)
                if h * 2.3283064365386963e-10 >= p:
                    out[r, c] = x[r, c] * scale
                else:
                    out[r, c] = 0.0

    @njit(parallel=True, cache=True, nogil=True)
    def keyed_dropout_csr(indptr, indices, values, row_keys, seed, p, scale,
                          out):  # pragma: no cover - numba
        """``keyed_dropout`` of a CSR matrix's stored entries: out[e] = values[e] * scale
        where the key of (row, indices[e]) keeps it, else 0 (the dense kernel's bits)."""
        m32 = 0xFFFFFFFF
        for r in prange(row_keys.shape[0]):
            k = _mix32(((row_keys[r] & m32) ^ seed) & m32)
            k = _mix32((k + ((row_keys[r] >> 32) & m32) * 0x27D4EB2F) & m32)
            for e in range(indptr[r], indptr[r + 1]):
                h = _mix32((k + indices[e] * 0x9E3779B9) & m32)
                if h * 2.3283064365386963e-10 >= p:
                    out[e] = values[e] * scale
                else:
                    out[e] = 0.0

    @njit(cache=True, nogil=True)
    def csr_t_matmul(indptr, indices, values, g, out):  # pragma: no cover - numba
        """out += A^T g for the CSR matrix A (R, K): out[indices[e]] += values[e] * g[r]
        (serial: rows of ``out`` are shared between rows of A)."""
        d = g.shape[1]
        for r in range(indptr.shape[0] - 1):
            for e in range(indptr[r], indptr[r + 1]):
                j = indices[e]
                v = values[e]
                for c in range(d):
                    out[j, c] += v * g[r, c]

    @njit(inline="always", cache=True)
    def _mix32(h):  # pragma: no cover - numba
        m32 = 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m32
        h ^= h >> 16
        return h
