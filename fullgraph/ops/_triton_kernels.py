"""The Triton kernels of ``gpu_kernels``, imported by its ``_kernels()`` on the first
launch (this module imports Triton; the package never does on the CPU). One program
per CSR row where a kernel reduces over edges; see ``gpu_kernels`` for what each
computes and the wrappers that launch them."""

import triton
import triton.language as tl


@triton.jit
def _attention_row(indptr_ptr, s_dst_ptr, slope_ptr, heads, BLOCK_H: tl.constexpr,
                   ACC: tl.constexpr):
    """This program's destination row i: the slope, the row's in-edges (start, end), its
    heads (hh, mask hm) and their destination scores."""
    i = tl.program_id(0).to(tl.int64)
    slope = tl.load(slope_ptr)  # (a float argument would be float32)
    start = tl.load(indptr_ptr + i)
    end = tl.load(indptr_ptr + i + 1)
    hh = tl.arange(0, BLOCK_H)
    hm = hh < heads
    sd = tl.load(s_dst_ptr + i * heads + hh, mask=hm, other=0.0).to(ACC)
    return i, slope, start, end, hh, hm, sd


@triton.jit
def _scores(indices_ptr, s_src_ptr, e0, end, heads, hh, hm, sd, slope, BLOCK_E: tl.constexpr,
            ACC: tl.constexpr):
    """The block of in-edges from ``e0`` (e, the (edge, head) mask m) and their scores
    ``leaky_relu(s_src[src] + s_dst[i])`` (masked entries 0 before the activation)."""
    e = e0 + tl.arange(0, BLOCK_E)
    em = e < end
    j = tl.load(indices_ptr + e, mask=em, other=0).to(tl.int64)
    m = em[:, None] & hm[None, :]
    z = tl.load(s_src_ptr + j[:, None] * heads + hh[None, :], mask=m,
                other=0.0).to(ACC) + sd[None, :]
    return e, m, tl.where(z > 0, z, z * slope)


@triton.jit
def _head_columns(heads, chans, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's destination row i, its block of heads (hh, mask hm) and their
    columns in a row of H heads of C (col, mask cm)."""
    i = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cc = tl.arange(0, BLOCK_C)
    hm = hh < heads
    cm = hm[:, None] & (cc < chans)[None, :]
    col = hh[:, None] * chans + cc[None, :]
    return i, hh, hm, cm, col


@triton.jit(do_not_specialize=["seed", "least"])  # (1 would become a constant)
def _dropout_kernel(x_ptr, out_ptr, keys_ptr, seed, scale_ptr, rows, cols, stride_x,
                    stride_o, least, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rm = r < rows
    cm = c < cols
    # the row's hash (``dropout.row_hashes``): its key's low word with the seed,
    # mixed, plus its high word times a constant, mixed again
    key = tl.load(keys_ptr + r, mask=rm, other=0)
    g = (key & 0xFFFFFFFF).to(tl.uint32) ^ seed.to(tl.uint32)
    g ^= g >> 16
    g *= 0x85EBCA6B
    g ^= g >> 13
    g *= 0xC2B2AE35
    g ^= g >> 16
    g += ((key >> 32) & 0xFFFFFFFF).to(tl.uint32) * 0x27D4EB2F
    g ^= g >> 16
    g *= 0x85EBCA6B
    g ^= g >> 13
    g *= 0xC2B2AE35
    g ^= g >> 16
    # the entry's: the row's plus the column times the golden ratio, mixed
    h = g[:, None] + (c.to(tl.uint32) * 0x9E3779B9)[None, :]
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    keep = h.to(tl.int64) >= least
    r64 = r.to(tl.int64)[:, None]
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + r64 * stride_x + c[None, :], mask=m, other=0.0)
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + r64 * stride_o + c[None, :], tl.where(keep, x * scale, 0.0), mask=m)


@triton.jit
def _attention_fwd_kernel(indptr_ptr, indices_ptr, s_src_ptr, s_dst_ptr, out_ptr, heads,
                          slope_ptr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          ACC: tl.constexpr):
    i, slope, start, end, hh, hm, sd = _attention_row(indptr_ptr, s_dst_ptr, slope_ptr, heads,
                                                      BLOCK_H, ACC)
    peak = tl.full([BLOCK_H], float("-inf"), ACC)
    total = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):  # online maximum and sum
        e, m, z = _scores(indices_ptr, s_src_ptr, e0, end, heads, hh, hm, sd, slope,
                          BLOCK_E, ACC)
        z = tl.where(m, z, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(z, axis=0))
        safe = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        total = total * tl.exp(peak - safe) + tl.sum(tl.exp(z - safe[None, :]), axis=0)
        peak = new_peak
    safe = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.where(hm, total, 1.0)  # (heads past H: no division by zero)
    for e0 in range(start, end, BLOCK_E):
        e, m, z = _scores(indices_ptr, s_src_ptr, e0, end, heads, hh, hm, sd, slope,
                          BLOCK_E, ACC)
        alpha = tl.exp(z - safe[None, :]) / total[None, :]
        tl.store(out_ptr + e.to(tl.int64)[:, None] * heads + hh[None, :],
                 alpha.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _attention_bwd_kernel(indptr_ptr, indices_ptr, s_src_ptr, s_dst_ptr, alpha_ptr,
                          grad_ptr, d_pre_ptr, grad_dst_ptr, heads, slope_ptr,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          ACC: tl.constexpr):
    i, slope, start, end, hh, hm, sd = _attention_row(indptr_ptr, s_dst_ptr, slope_ptr, heads,
                                                      BLOCK_H, ACC)
    dot = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):  # sum of alpha * grad per head
        e = e0 + tl.arange(0, BLOCK_E)
        m = (e < end)[:, None] & hm[None, :]
        off = e.to(tl.int64)[:, None] * heads + hh[None, :]
        a = tl.load(alpha_ptr + off, mask=m, other=0.0).to(ACC)
        g = tl.load(grad_ptr + off, mask=m, other=0.0).to(ACC)
        dot += tl.sum(a * g, axis=0)
    acc = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < end
        m = em[:, None] & hm[None, :]
        off = e.to(tl.int64)[:, None] * heads + hh[None, :]
        a = tl.load(alpha_ptr + off, mask=m, other=0.0).to(ACC)
        g = tl.load(grad_ptr + off, mask=m, other=0.0).to(ACC)
        j = tl.load(indices_ptr + e, mask=em, other=0).to(tl.int64)
        z = tl.load(s_src_ptr + j[:, None] * heads + hh[None, :], mask=m,
                    other=0.0).to(ACC) + sd[None, :]
        d = a * (g - dot[None, :])
        d = tl.where(z > 0, d, d * slope)
        d = tl.where(m, d, 0.0)
        acc += tl.sum(d, axis=0)
        tl.store(d_pre_ptr + off, d.to(d_pre_ptr.dtype.element_ty), mask=m)
    tl.store(grad_dst_ptr + i * heads + hh, acc.to(grad_dst_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _spmm_heads_kernel(indptr_ptr, indices_ptr, perm_ptr, w_ptr, x_ptr, out_ptr, heads,
                       chans, HAS_W: tl.constexpr, HAS_PERM: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i, hh, hm, cm, col = _head_columns(heads, chans, BLOCK_H, BLOCK_C)
    width = heads * chans
    start = tl.load(indptr_ptr + i)
    end = tl.load(indptr_ptr + i + 1)
    acc = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < end
        j = tl.load(indices_ptr + e, mask=em, other=0).to(tl.int64)
        m = em[:, None, None] & cm[None, :, :]
        x = tl.load(x_ptr + j[:, None, None] * width + col[None, :, :], mask=m,
                    other=0.0).to(ACC)
        if HAS_W:
            if HAS_PERM:
                eid = tl.load(perm_ptr + e, mask=em, other=0).to(tl.int64)
            else:
                eid = e.to(tl.int64)
            w = tl.load(w_ptr + eid[:, None] * heads + hh[None, :],
                        mask=em[:, None] & hm[None, :], other=0.0).to(ACC)
            x = x * w[:, :, None]
        acc += tl.sum(x, axis=0)
    tl.store(out_ptr + i * width + col, acc.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _sddmm_heads_kernel(indptr_ptr, indices_ptr, a_ptr, b_ptr, out_ptr, heads, chans,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i, hh, hm, cm, col = _head_columns(heads, chans, BLOCK_H, BLOCK_C)
    width = heads * chans
    a = tl.load(a_ptr + i * width + col, mask=cm, other=0.0).to(ACC)
    start = tl.load(indptr_ptr + i)
    end = tl.load(indptr_ptr + i + 1)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < end
        j = tl.load(indices_ptr + e, mask=em, other=0).to(tl.int64)
        b = tl.load(b_ptr + j[:, None, None] * width + col[None, :, :],
                    mask=em[:, None, None] & cm[None, :, :], other=0.0).to(ACC)
        dot = tl.sum(b * a[None, :, :], axis=2)
        tl.store(out_ptr + e.to(tl.int64)[:, None] * heads + hh[None, :],
                 dot.to(out_ptr.dtype.element_ty), mask=em[:, None] & hm[None, :])
