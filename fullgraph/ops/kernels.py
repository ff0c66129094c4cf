"""CPU kernels compiled with numba, used when numba is installed.

Each kernel works on plain numpy arrays (views of torch CPU tensors) and writes into
an output array that the caller allocates, so torch owns every buffer. The SpMM
kernels overwrite every row of theirs (a row is zeroed while it is in the cache, so
the caller allocates it with ``torch.empty``, not in a zero-filling pass of its own). Rows are
processed in parallel (``prange``); a row's in-edges are summed in CSR order, so the
result of a row does not depend on the thread count or on which rows share a call.
The kernels over a CSR split its rows into blocks of about equal edge counts
(``_row_blocks``), not of equal row counts: on a power-law graph whose hubs have low
ids, the first half of the rows can hold three quarters of the edges.

The number of numba threads follows ``torch.get_num_threads()`` (set by the caller
through ``set_threads``) so that a worker's thread budget covers both libraries.

Shapes: N_dst rows, N_src source rows, E edges, H heads, C channels per head.
"""
from __future__ import annotations

import math
import os

try:  # numba is optional: ops fall back to torch kernels without it
    if os.environ.get("FULLGRAPH_NO_NUMBA"):
        raise ImportError("numba disabled by FULLGRAPH_NO_NUMBA")
    import numba
    import numpy as np
    from numba import njit, prange
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised in the no-numba CI job
    numba = None  # type: ignore[assignment]
    HAVE_NUMBA = False


def scalar_of(value: float, dtype: object) -> object:
    """``value`` as a scalar of the torch ``dtype`` the kernel computes in (a numpy
    float32 for float32 rows, so a product with it stays in float32, as torch's own
    tensor-scalar product does, instead of widening every element to float64)."""
    import torch

    return np.float32(value) if HAVE_NUMBA and dtype == torch.float32 else float(value)


def set_threads(num_threads: int) -> None:
    """Use ``num_threads`` numba threads (clamped to what numba was started with)."""
    if HAVE_NUMBA:
        limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        numba.set_num_threads(max(1, min(num_threads, limit)))


def get_threads() -> int | None:
    """The number of numba threads in use (None without numba)."""
    return numba.get_num_threads() if HAVE_NUMBA else None


ROW_BLOCKS = 256
"""Row blocks of the CSR kernels (see ``_row_blocks``). ``prange`` hands each thread
a contiguous run of about ``ROW_BLOCKS / threads`` blocks, so with up to a few dozen
threads no thread gets more than a few percent above its share of the edges. (A
constant rather than a multiple of the thread count: numba cannot cache a kernel
that asks for the thread count.)"""

SUM_CHUNKS = 16
"""Row ranges of ``column_sums``, summed in parallel: fixed, so that the sums' bits do
not depend on the thread count (numba cannot cache a kernel that asks for it)."""

PREFETCH_EDGES = 16
"""The SpMM kernels ask the CPU for the source row of the edge this many edges ahead
while they sum the current one: a row gathered from a graph far larger than the
caches then arrives from memory in the shadow of the work on earlier ones. On R-MAT
1M vertices / 20M edges, 128 columns, 2 threads, it took a weighted SpMM from 19.8
to 29.9 GB/s (distances 8 to 32 within 5 % of each other; BENCHMARKS.md)."""


def _prefetch_intrinsic_name() -> str:
    """LLVM's prefetch intrinsic as this llvmlite spells it: ``llvm.prefetch.p0`` with
    opaque pointers (LLVM 17 on), ``llvm.prefetch.p0i8`` with typed ones (before)."""
    from llvmlite import binding

    return "llvm.prefetch.p0" if binding.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"


if HAVE_NUMBA:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    _PREFETCH = _prefetch_intrinsic_name()

    @_intrinsic
    def _prefetch(typingctx, arr, row, col):  # pragma: no cover - numba
        """Ask for the cache line of ``arr[row, col]`` (read, every cache level): a
        hint with no effect on any result."""
        sig = _types.void(arr, row, col)

        def codegen(context, builder, signature, args):
            arrty = signature.args[0]
            ary = context.make_array(arrty)(context, builder, args[0])
            idx = [context.cast(builder, v, t, _types.intp)
                   for v, t in zip(args[1:], signature.args[1:])]
            ptr = _cgutils.get_item_pointer(context, builder, arrty, ary, idx,
                                            wraparound=False)
            i8p, i32 = _ir.IntType(8).as_pointer(), _ir.IntType(32)
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                _PREFETCH)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return sig, codegen

    @njit(inline="always", cache=True)
    def _prefetch_row(x, indices, k):  # pragma: no cover - numba
        """Prefetch the source row of edge ``k + PREFETCH_EDGES`` (when there is one)."""
        ahead = k + PREFETCH_EDGES
        if ahead < indices.shape[0]:
            j = indices[ahead]
            for c in range(0, x.shape[1], max(1, 64 // x.itemsize)):
                _prefetch(x, j, c)

    @njit(cache=True)
    def _row_blocks(indptr):  # pragma: no cover - numba
        """Bounds of ``ROW_BLOCKS`` blocks of consecutive rows of about equal cost (a
        row costs its in-edges plus one): ``prange`` over the blocks then gives every
        thread about the same number of edges."""
        n = indptr.shape[0] - 1
        count = max(1, min(n, ROW_BLOCKS))
        total = (indptr[n] - indptr[0]) + n
        bounds = np.empty(count + 1, dtype=np.int64)
        bounds[0] = 0
        for b in range(1, count):
            target = (total * b) // count
            lo, hi = bounds[b - 1], n
            while lo < hi:  # the least row whose cost before it reaches the target
                mid = (lo + hi) // 2
                if (indptr[mid] - indptr[0]) + mid < target:
                    lo = mid + 1
                else:
                    hi = mid
            bounds[b] = lo
        bounds[count] = n
        return bounds

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_weighted(indptr, indices, weight, x, out, perm=None):  # pragma: no cover
        """out[i, h*C:(h+1)*C] = sum_e weight[e, h] * x[indices[e], h*C:(h+1)*C]; with
        ``perm``, edge k's weight is weight[perm[k]] (the transposed CSR of a backward
        pass reads the forward's weights in place; numba compiles each case apart)."""
        heads = weight.shape[1]
        chans = x.shape[1] // heads
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                for c in range(x.shape[1]):
                    out[i, c] = 0.0
                for k in range(indptr[i], indptr[i + 1]):
                    _prefetch_row(x, indices, k)
                    j = indices[k]
                    e = k if perm is None else perm[k]
                    for h in range(heads):
                        w = weight[e, h]
                        base = h * chans
                        for c in range(base, base + chans):
                            out[i, c] += w * x[j, c]

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_scalar(indptr, indices, weight, x, out, perm=None, add=False):  # pragma: no cover
        """out[i] = sum_e weight[e] * x[indices[e]] (single head, 1-D weights), or
        ``out[i] +=`` it with ``add``; ``perm`` as for ``spmm_weighted``."""
        d = x.shape[1]
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                if not add:
                    for c in range(d):
                        out[i, c] = 0.0
                for k in range(indptr[i], indptr[i + 1]):
                    _prefetch_row(x, indices, k)
                    j = indices[k]
                    w = weight[k if perm is None else perm[k]]
                    for c in range(d):
                        out[i, c] += w * x[j, c]

    def _line_step(x):  # pragma: no cover - numba
        """Elements of ``x`` per cache line, a constant where the kernels compile."""
        return max(1, 64 // x.itemsize)

    @_overload(_line_step, inline="always")
    def _line_step_typed(x):  # pragma: no cover - numba
        step = max(1, 512 // x.dtype.bitwidth)  # 64 bytes
        return lambda x: step

    @njit(inline="always", cache=True)
    def _prefetch_split(x, halo, indices, k):  # pragma: no cover - numba
        """``_prefetch_row`` over two sources: below ``x.shape[0]`` a row of ``x``,
        from there one of ``halo``."""
        ahead = k + PREFETCH_EDGES
        if ahead < indices.shape[0]:
            j = indices[ahead]
            n = x.shape[0]
            step = _line_step(x)
            if j < n:
                for c in range(0, x.shape[1], step):
                    _prefetch(x, j, c)
            else:
                for c in range(0, x.shape[1], step):
                    _prefetch(halo, j - n, c)

    @njit(inline="always", cache=True)
    def _add_row(out, i, src, j, weight, k, d):  # pragma: no cover - numba
        """out[i, :d] += src[j, :d], times ``weight[k]`` unless ``weight`` is None
        (numba compiles the two cases apart)."""
        if weight is None:
            for c in range(d):
                out[i, c] += src[j, c]
        else:
            w = weight[k]
            for c in range(d):
                out[i, c] += w * src[j, c]

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_split(indptr, split, indices, weight, x, halo, out):  # pragma: no cover
        """``spmm_scalar`` (``spmm_unweighted``'s sum for ``weight`` None) over the
        sources ``[x | halo]`` without joining them: row i's in-edges from ``x`` come
        first, ``indptr[i]`` to ``split[i]``, those from ``halo`` after (source
        ``x.shape[0] + j`` is ``halo[j]``). The same sums in the same order as over the
        joined rows. The columns are ``out``'s: ``x``'s rows may be longer (padded
        rows, ``ops.padded``)."""
        n, d = x.shape[0], out.shape[1]
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                for c in range(d):
                    out[i, c] = 0.0
                for k in range(indptr[i], split[i]):
                    _prefetch_split(x, halo, indices, k)
                    _add_row(out, i, x, indices[k], weight, k, d)
                for k in range(split[i], indptr[i + 1]):
                    _prefetch_split(x, halo, indices, k)
                    _add_row(out, i, halo, indices[k] - n, weight, k, d)

    @njit(cache=True, nogil=True)
    def source_split(indptr, indices, n):  # pragma: no cover - numba
        """Per row, the end of its in-edges from sources below ``n``, where every row
        lists those before the others; an empty array where some row does not."""
        rows = indptr.shape[0] - 1
        split = np.empty(rows, dtype=np.int64)
        for i in range(rows):
            k = indptr[i]
            while k < indptr[i + 1] and indices[k] < n:
                k += 1
            split[i] = k
            for e in range(k, indptr[i + 1]):
                if indices[e] < n:
                    return np.empty(0, dtype=np.int64)
        return split

    @njit(parallel=True, cache=True, nogil=True)
    def spmm_unweighted(indptr, indices, x, out, mean):  # pragma: no cover - numba
        """out[i] = sum (or mean when ``mean``) of x over the in-edges of i."""
        d = x.shape[1]
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                start, stop = indptr[i], indptr[i + 1]
                for c in range(d):
                    out[i, c] = 0.0
                for e in range(start, stop):
                    _prefetch_row(x, indices, e)
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
        heads = out.shape[1]
        chans = a.shape[1] // heads
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                for e in range(indptr[i], indptr[i + 1]):
                    _prefetch_row(b, indices, e)
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
        n = row_keys.shape[0]
        per, blocks = _mask_blocks(n, num_cols)
        for b in prange(blocks):
            h = np.empty(num_cols, dtype=np.uint32)
            for r in range(b * per, min(n, (b + 1) * per)):
                _column_hashes(_row_hash(row_keys[r], seed), h)
                for c in range(num_cols):
                    out[r, c] = h[c] * 2.3283064365386963e-10

    @njit(parallel=True, cache=True, nogil=True)
    def keyed_dropout(x, row_keys, seed, p, scale, out, g=None,
                      over_x=False):  # pragma: no cover - numba
        """out = x * scale where keyed_uniform >= p, else 0 (``scale`` of the rows'
        precision, see ``scalar_of``); ``out`` may be ``x``.

        With ``g`` (an array of x's shape), one mask for both, hashed once: g =
        dropout(g) in place too (a product's backward needs the dropped input for the
        weight's gradient and the masked input gradient). With ``over_x`` as well, x
        is a ReLU's output and the gradient of the ReLU's input, dropout(g) where x > 0
        and 0 elsewhere, is written over x instead (``g`` is left as it was): the
        ReLU's backward folded into the dropout's."""
        n, num_cols = x.shape
        keep_from, none = _keep_threshold_u32(p)
        per, blocks = _mask_blocks(n, num_cols)
        for b in prange(blocks):
            h = np.empty(num_cols, dtype=np.uint32)
            for r in range(b * per, min(n, (b + 1) * per)):
                _column_hashes(_row_hash(row_keys[r], seed), h)
                for c in range(num_cols):
                    v = x[r, c]
                    keep = h[c] >= keep_from and not none
                    out[r, c] = v * scale if keep else 0.0
                    if g is None:
                        continue
                    if over_x:
                        x[r, c] = g[r, c] * scale if keep and v > 0 else 0.0
                    else:
                        g[r, c] = g[r, c] * scale if keep else 0.0

    @njit(parallel=True, cache=True, nogil=True)
    def keyed_dropout_csr(indptr, indices, values, row_keys, seed, p, scale,
                          out):  # pragma: no cover - numba
        """``keyed_dropout`` of a CSR matrix's stored entries: out[e] = values[e] * scale
        where the key of (row, indices[e]) keeps it, else 0 (the dense kernel's bits)."""
        keep_from = _keep_threshold(p)
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for r in range(blocks[blk], blocks[blk + 1]):
                k = _row_hash(row_keys[r], seed)
                for e in range(indptr[r], indptr[r + 1]):
                    h = _mix32_u32(np.uint32(k + np.uint32(np.uint32(indices[e]) * _GOLDEN)))
                    out[e] = values[e] * scale if np.int64(h) >= keep_from else 0.0

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

    @njit(parallel=True, cache=True, nogil=True)
    def attention_softmax(indptr, indices, s_src, s_dst, slope, out):  # pragma: no cover
        """GAT's attention in one pass per row: out[e, h] = softmax over the in-edges
        of i of leaky_relu(s_src[indices[e], h] + s_dst[i, h]); no (E, H) temporary
        but ``out`` (the scores are written there, then turned into weights). Heads
        innermost: each source row is read once, contiguously."""
        heads = out.shape[1]
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                lo, hi = indptr[i], indptr[i + 1]
                peak = np.full(heads, -np.inf, dtype=out.dtype)
                total = np.zeros(heads, dtype=np.float64)
                for e in range(lo, hi):
                    _prefetch_row(s_src, indices, e)
                    j = indices[e]
                    for h in range(heads):
                        v = s_src[j, h] + s_dst[i, h]
                        if v <= 0:
                            v = v * slope
                        out[e, h] = v
                        if v > peak[h]:
                            peak[h] = v
                for e in range(lo, hi):
                    for h in range(heads):
                        v = np.exp(out[e, h] - peak[h])
                        out[e, h] = v
                        total[h] += v
                for e in range(lo, hi):
                    for h in range(heads):
                        out[e, h] = out[e, h] / total[h]

    @njit(parallel=True, cache=True, nogil=True)
    def attention_softmax_backward(indptr, indices, s_src, s_dst, slope, alpha, grad,
                                   d_pre, grad_dst):  # pragma: no cover - numba
        """Backward of ``attention_softmax``: d_pre[e, h], the gradient of the score
        before the LeakyReLU (the softmax's Jacobian times ``grad``, times the slope
        where the score was not positive), and grad_dst[i, h] = its sum over the row;
        the gradient of s_src is d_pre summed over each source's out-edges."""
        heads = alpha.shape[1]
        blocks = _row_blocks(indptr)
        for blk in prange(blocks.shape[0] - 1):
            for i in range(blocks[blk], blocks[blk + 1]):
                lo, hi = indptr[i], indptr[i + 1]
                dot = np.zeros(heads, dtype=np.float64)
                for e in range(lo, hi):
                    for h in range(heads):
                        dot[h] += alpha[e, h] * grad[e, h]
                for h in range(heads):
                    grad_dst[i, h] = 0.0
                for e in range(lo, hi):
                    _prefetch_row(s_src, indices, e)
                    j = indices[e]
                    for h in range(heads):
                        d = alpha[e, h] * (grad[e, h] - dot[h])
                        if s_src[j, h] + s_dst[i, h] <= 0:
                            d = d * slope
                        d_pre[e, h] = d
                        grad_dst[i, h] += d

    _GOLDEN = np.uint32(0x9E3779B9)

    @njit(inline="always", cache=True)
    def _row_hash(key, seed):  # pragma: no cover - numba
        """The per-row part of a dropout hash (``ops.dropout.row_hashes``), as uint32."""
        m32 = 0xFFFFFFFF
        k = _mix32(((key & m32) ^ seed) & m32)
        return np.uint32(_mix32((k + ((key >> 32) & m32) * 0x27D4EB2F) & m32))

    @njit(inline="always", cache=True)
    def _keep_threshold(p):  # pragma: no cover - numba
        """The least 32-bit hash h that keeps an entry: ``h * 2**-32 >= p`` exactly (both
        sides are exact in float64), so the dropout kernels compare integers."""
        return np.int64(math.ceil(p * 4294967296.0))

    @njit(inline="always", cache=True)
    def _keep_threshold_u32(p):  # pragma: no cover - numba
        """``_keep_threshold`` as a uint32 and whether no hash reaches it (p within
        2**-32 of 1): the masks' loops compare 32-bit integers, which vectorise."""
        least = _keep_threshold(p)
        return np.uint32(min(least, 0xFFFFFFFF)), least > 0xFFFFFFFF

    @njit(inline="always", cache=True)
    def _mask_blocks(num_rows, num_cols):  # pragma: no cover - numba
        """Rows per block and blocks of a dense mask kernel: about 16k entries a block,
        so that one hash buffer per block costs nothing against its rows."""
        per = max(1, 16384 // max(num_cols, 1))
        return per, (num_rows + per - 1) // per

    @njit(inline="always", cache=True)
    def _column_hashes(k, h):  # pragma: no cover - numba
        """h[c] = ``_mix32_u32(k + c * golden)`` for every column c of a row whose row
        hash is ``k``: the same bits, in two loops of one 32-bit product each, which
        LLVM vectorises (one loop with both products it left scalar, 4x slower)."""
        for c in range(h.shape[0]):
            v = np.uint32(k + np.uint32(np.uint32(c) * _GOLDEN))
            v = np.uint32(v ^ (v >> np.uint32(16)))
            h[c] = np.uint32(v * np.uint32(0x85EBCA6B))
        for c in range(h.shape[0]):
            v = h[c]
            v = np.uint32(v ^ (v >> np.uint32(13)))
            v = np.uint32(v * np.uint32(0xC2B2AE35))
            h[c] = np.uint32(v ^ (v >> np.uint32(16)))

    @njit(inline="always", cache=True)
    def _mix32_u32(h):  # pragma: no cover - numba
        """``_mix32`` in uint32 arithmetic (the same bits, with 32-bit products)."""
        h = np.uint32(h ^ (h >> np.uint32(16)))
        h = np.uint32(h * np.uint32(0x85EBCA6B))
        h = np.uint32(h ^ (h >> np.uint32(13)))
        h = np.uint32(h * np.uint32(0xC2B2AE35))
        return np.uint32(h ^ (h >> np.uint32(16)))

    @njit(inline="always", cache=True)
    def _mix32(h):  # pragma: no cover - numba
        m32 = 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m32
        h ^= h >> 16
        return h

    @njit(parallel=True, cache=True, nogil=True)
    def column_sums(x, out, rows_per_sum):  # pragma: no cover - numba
        """out[c] += the sum of x[:, c] over the rows of the 2-D ``x``, for the first
        ``out.shape[0]`` columns (x's rows may be longer: padded rows, passed whole so
        that numba compiles the contiguous case). The rows fall into ``SUM_CHUNKS``
        equal ranges summed in parallel, each in runs of ``rows_per_sum`` rows whose
        sums are added in turn; the ranges' sums are then added to ``out`` in order.
        The chunks do not depend on the thread count, so neither do the bits."""
        n = x.shape[0]
        d = out.shape[0]
        chunks = SUM_CHUNKS
        step = (n + chunks - 1) // chunks
        parts = np.zeros((chunks, d), dtype=x.dtype)
        for b in prange(chunks):
            acc = parts[b]
            run = np.empty(d, dtype=x.dtype)
            for lo in range(b * step, min(n, (b + 1) * step), rows_per_sum):
                for c in range(d):
                    run[c] = 0
                for r in range(lo, min(n, (b + 1) * step, lo + rows_per_sum)):
                    for c in range(d):
                        run[c] += x[r, c]
                for c in range(d):
                    acc[c] += run[c]
        for b in range(chunks):
            for c in range(d):
                out[c] += parts[b, c]

    @njit(parallel=True, cache=True, nogil=True)
    def masked_cross_entropy(logits, labels, mask, grad, partial,
                             classes):  # pragma: no cover - numba
        """The cross-entropy of the rows where ``mask`` is set, summed, and its gradient,
        in one pass over the logits: grad[r] = softmax(logits[r]) - onehot(labels[r])
        for those rows and 0 elsewhere. Row block b's share of the sum goes to
        partial[b] (float64; ``partial`` has ``ROW_BLOCKS`` entries). Returns how many
        masked rows have a label outside [0, C) (their terms are left out). The
        classes are the first ``classes`` columns; the gradient's columns past them
        (padded rows, ``ops.padded``) are set to 0."""
        n, width = logits.shape
        count = partial.shape[0]
        step = (n + count - 1) // count
        bad = 0
        for b in prange(count):
            total = 0.0
            for r in range(b * step, min(n, (b + 1) * step)):
                lab = labels[r]
                if not mask[r] or lab < 0 or lab >= classes:
                    if mask[r]:
                        bad += 1
                    for c in range(width):
                        grad[r, c] = 0.0
                    continue
                peak = logits[r, 0]
                for c in range(1, classes):
                    if logits[r, c] > peak:
                        peak = logits[r, c]
                s = 0.0
                for c in range(classes):
                    v = np.exp(logits[r, c] - peak)
                    grad[r, c] = v
                    s += v
                inv = 1.0 / s
                for c in range(classes):
                    grad[r, c] = grad[r, c] * inv
                grad[r, lab] -= 1.0
                for c in range(classes, width):
                    grad[r, c] = 0.0
                total += np.log(s) + peak - logits[r, lab]
            partial[b] = total
        return bad
