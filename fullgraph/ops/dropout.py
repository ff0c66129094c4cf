"""Dropout whose mask is a function of (seed, global id, column), not of call order.

Every executor of a stage program must drop the same entries as the single-process
executor, whatever rows a worker holds and in whatever order it computes them. So
the keep/drop decision for entry (row r, column c) is a hash of the step seed, the
row's global key (vertex id, or edge id for attention) and c: a counter-based
generator in the spirit of Philox, here the 32-bit finaliser of MurmurHash3 applied
twice. The numba kernel and the torch fallback compute the same bits.

The dense stages' products live here too (``dropout_matmul``, ``matmul_t``): a product
that reads a dropout's output rebuilds the mask from the keys instead of keeping the
dropped rows, and on the CPU it folds in the ReLU after it and the ReLU before the
dropout (their backwards), block by block.

Shapes: R rows, D columns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fullgraph.ops import gemm, gpu_kernels, kernels, padded

_M32 = 0xFFFFFFFF


def _mix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def row_hashes(keys: Tensor, seed: int) -> Tensor:
    """The per-row part of the hash: (R,) int64 in [0, 2**32) of int64 ``keys``."""
    seed32 = int(seed) & _M32
    k = _mix32(((keys & _M32) ^ seed32) & _M32)
    return _mix32((k + ((keys >> 32) & _M32) * 0x27D4EB2F) & _M32)


def entry_hashes(row_hash: Tensor, cols: Tensor) -> Tensor:
    """The 32-bit hash of each (row, column): ``row_hash`` and ``cols`` broadcast."""
    return _mix32((row_hash + cols * 0x9E3779B9) & _M32)


def _as_i32(v: int) -> int:
    """The uint32 ``v`` as the int32 of the same bits."""
    return v - (1 << 32) if v >= 1 << 31 else v


_MIX1, _MIX2, _GOLDEN = _as_i32(0x85EBCA6B), _as_i32(0xC2B2AE35), _as_i32(0x9E3779B9)


def entry_hashes32(row_hash: Tensor, num_cols: int) -> Tensor:
    """``entry_hashes(row_hash[:, None], arange(num_cols)[None, :])`` as (R, num_cols)
    int32 holding the uint32 bits: the torch path's form (half the bytes of int64,
    every step in place on one tensor and one scratch, no float conversion), on any
    device. Products wrap modulo 2**32 as the uint32 ones do; right shifts are
    masked, since int32's are arithmetic."""
    dev = row_hash.device
    rows = torch.where(row_hash >= 1 << 31, row_hash - (1 << 32), row_hash).to(torch.int32)
    cols = (torch.arange(num_cols, dtype=torch.int64, device=dev) * 0x9E3779B9) & _M32
    cols = torch.where(cols >= 1 << 31, cols - (1 << 32), cols).to(torch.int32)
    h = rows[:, None] + cols[None, :]
    t = torch.empty_like(h)
    for shift, mult in ((16, _MIX1), (13, _MIX2), (16, None)):
        torch.bitwise_right_shift(h, shift, out=t)
        h.bitwise_xor_(t.bitwise_and_((1 << (32 - shift)) - 1))
        if mult is not None:
            h.mul_(mult)
    return h


def keep_threshold(p: float) -> int:
    """The least 32-bit hash that keeps an entry at rate ``p``: ``h * 2**-32 >= p``
    exactly (both sides are exact in float64), as ``kernels._keep_threshold``."""
    return math.ceil(p * 4294967296.0)


def keep_mask(row_keys: Tensor, num_cols: int, seed: int, p: float) -> Tensor:
    """(R, num_cols) bool: entry (r, c) is kept by keyed dropout with rate ``p``,
    exactly where hash * 2**-32 >= p, as the numba kernels decide (integers compared
    with ``ceil(p * 2**32)``)."""
    keys = row_keys.to(torch.int64)
    least = keep_threshold(p)
    h = entry_hashes32(row_hashes(keys, int(seed) & _M32), num_cols)
    if least > _M32:
        return torch.zeros(h.shape, dtype=torch.bool, device=h.device)
    # uint32 order is int32 order with the top bit flipped
    return h.bitwise_xor_(-(1 << 31)) >= least - (1 << 31)


def keyed_uniform(row_keys: Tensor, num_cols: int, seed: int) -> Tensor:
    """(R, num_cols) float32 uniforms in [0, 1) determined by (seed, key, column)."""
    keys = row_keys.to(torch.int64)
    seed32 = int(seed) & _M32
    if kernels.HAVE_NUMBA and keys.device.type == "cpu":
        out = torch.empty(keys.shape[0], num_cols, dtype=torch.float32)
        kernels.keyed_uniform(keys.contiguous().numpy(), num_cols, seed32, out.numpy())
        return out
    h = entry_hashes32(row_hashes(keys, seed32), num_cols).to(torch.int64) & _M32
    return h.to(torch.float64).mul_(2.0**-32).to(torch.float32)


def keyed_dropout(x: Tensor, p: float, row_keys: Tensor, seed: int, training: bool) -> Tensor:
    """Inverted dropout of ``x`` (R, D) with a mask keyed by ``row_keys`` and ``seed``.

    Args:
        x: (R, D) or (R,) input.
        p: drop probability in [0, 1).
        row_keys: (R,) global ids of the rows.
        seed: step seed; the same seed drops the same entries in every executor.
        training: no-op when False or ``p == 0``.
    """
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    flat = x.dim() == 1
    keys = row_keys.to(x.device).to(torch.int64)
    if _DEFER[0] and x.dim() == 2 and x.device.type == "cpu":
        # a placeholder of x's shape in one NaN entry: the next stage's product reads
        # the record, never this (``deferred_output``)
        out = x.detach().new_full((1, 1), math.nan).expand(x.shape[0], x.shape[1])
        setattr(out, _DROPPED_ATTR, Dropped(x, keys, int(seed) & _M32, p, sole=True,
                                            deferred=True))
        return out
    x2 = x[:, None] if flat else x.reshape(x.shape[0], math.prod(x.shape[1:]))
    out = _KeyedDropout.apply(x2, keys, int(seed) & _M32, p)
    if flat:
        return out[:, 0]
    out = out.view_as(x)
    if x.dim() == 2:  # a later matrix product may rebuild it from x (dropout_matmul)
        setattr(out, _DROPPED_ATTR, Dropped(x, keys, int(seed) & _M32, p))
    return out


def _apply_mask(x: Tensor, keys: Tensor, seed: int, p: float, *,
                inplace: bool = False, out: Tensor | None = None) -> Tensor:
    """``x`` with the keyed mask applied; into ``x`` itself when ``inplace`` (and x is a
    plain contiguous tensor no one else needs), or into the contiguous ``out``."""
    scale = 1.0 / (1.0 - p)
    if kernels.HAVE_NUMBA and x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                      torch.float64):
        inplace = inplace and x.is_contiguous()
        if out is None:
            out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
        kernels.keyed_dropout(x.detach().contiguous().numpy(), keys.contiguous().numpy(), seed,
                              p, kernels.scalar_of(scale, x.dtype), out.detach().numpy())
        return out
    least = keep_threshold(p)
    if gpu_kernels.available(x.device) and x.dim() == 2 and x.stride(1) == 1 \
            and x.dtype.is_floating_point and least <= _M32:
        into = x if inplace else out if out is not None else torch.empty_like(
            x, memory_format=torch.contiguous_format)
        if into.stride(1) == 1 and gpu_kernels.dropout_into(
                x.detach(), keys.to(device=x.device, dtype=torch.int64).contiguous(),
                int(seed) & _M32, least, scale, into.detach()):
            return into
    rows, cols = x.shape
    step = max(1, MASK_BLOCK // max(1, cols))
    if rows <= step:
        keep = keep_mask(keys.to(x.device), cols, seed, p)
        if inplace:
            return x.mul_(keep.to(x.dtype)).mul_(scale)
        if out is not None:
            return torch.mul(x, keep.to(x.dtype), out=out).mul_(scale)
        return x * keep.to(x.dtype) * scale
    # a block of rows at a time bounds the hashes' temporaries
    if not inplace and out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        _apply_mask(x[lo:hi], keys[lo:hi], seed, p, inplace=inplace,
                    out=None if inplace else out[lo:hi])  # type: ignore[index]
    return x if inplace else out  # type: ignore[return-value]


@dataclass(frozen=True)
class Dropped:
    """How a keyed-dropout output was made: ``keyed_dropout(x, p, keys, seed)``.

    ``keyed_dropout`` hangs it on its output (``dropped_from``), so a matrix product
    that reads the output can save ``x`` (which the layer before keeps anyway) instead
    of a second (R, D) tensor, and recompute the mask in its backward
    (``dropout_matmul``).
    """

    x: Tensor
    keys: Tensor
    seed: int
    p: float
    sole: bool = False
    """Set by the walker (``mark_sole``) when the dropout's output is read by nothing but
    the next stage's product and ``x`` by nothing but the dropout: the product's
    backward may then write ``x``'s gradient over ``x`` (``relu_output``)."""
    deferred: bool = False
    """The output is a placeholder, not the dropped rows (``deferred_output``): the
    product rebuilds them a block at a time; anything else calls ``materialized``."""


_DEFER = [False]


@contextlib.contextmanager
def deferred_output() -> Iterator[None]:
    """Within: ``keyed_dropout`` of (R, D) rows makes no (R, D) output but a placeholder
    of that shape (one NaN entry, broadcast) carrying the record. The walker uses it
    for a layer input that only the next stage's product reads (``dropout_matmul``
    rebuilds the dropped rows a block at a time, in the cache), which saves writing and
    holding one (R, D) tensor in the forward pass."""
    before, _DEFER[0] = _DEFER[0], True
    try:
        yield
    finally:
        _DEFER[0] = before


def materialized(t: Tensor) -> Tensor:
    """``t``, or the dropped rows themselves when ``t`` is a deferred placeholder."""
    rec = dropped_from(t)
    if rec is None or not rec.deferred:
        return t
    return keyed_dropout(rec.x, rec.p, rec.keys, rec.seed, True)


_DROPPED_ATTR = "_fullgraph_dropped"

_RELU_ATTR = "_fullgraph_relu_output"


def mark_relu_output(t: Tensor) -> None:
    """Mark ``t`` as a ReLU's output whose backward passes on a gradient that already
    lives in ``t``'s own storage (``models.layers.own_relu``)."""
    setattr(t, _RELU_ATTR, True)


def relu_output(t: Tensor) -> bool:
    """Whether ``t`` was marked by ``mark_relu_output``."""
    return getattr(t, _RELU_ATTR, False)


def mark_sole(t: Tensor) -> None:
    """Record that the ``keyed_dropout`` output ``t`` is read only by the next stage's
    product and its input only by the dropout (see ``Dropped.sole``); a no-op for other
    tensors."""
    rec = dropped_from(t)
    if rec is not None and not rec.sole:
        setattr(t, _DROPPED_ATTR, dataclasses.replace(rec, sole=True))


_MARKS = (_DROPPED_ATTR, _RELU_ATTR)


def marks_of(t: Tensor) -> dict[str, Any]:
    """What this module has noted on ``t`` (its ``Dropped`` record, that it is a ReLU's
    output), to be put on another tensor of the same rows with ``restore_marks``."""
    return {name: getattr(t, name) for name in _MARKS if hasattr(t, name)}


def restore_marks(t: Tensor, marks: dict[str, Any]) -> None:
    """Note ``marks`` (from ``marks_of``) on ``t``: a recomputation's inputs are new
    tensor objects (``torch.utils.checkpoint`` unpacks saved copies), without the
    attributes the stages read."""
    for name, value in marks.items():
        setattr(t, name, value)


def dropped_from(t: Tensor) -> Dropped | None:
    """The ``Dropped`` record of a ``keyed_dropout`` output, or None for other tensors."""
    return getattr(t, _DROPPED_ATTR, None)


def dropout_matmul(src: Dropped, weight: Tensor, add: Tensor | None = None,
                   dropped: Tensor | None = None, relu: bool = False) -> Tensor:
    """``add + keyed_dropout(src.x) @ weight.T`` without keeping the dropped rows.

    Equal to the unfused product (the same mask, recomputed from the keys); the
    backward rebuilds the dropped rows ``ROW_BLOCK`` at a time for the weight's
    gradient, so its (R, D) input is never held twice.

    Args:
        src: the dropout's input and mask (from ``dropped_from``).
        weight: (D_out, D) as in ``nn.Linear``.
        add: None, a (D_out,) bias or an (R, D_out) addend.
        dropped: the dropout's output, when it is at hand: the forward multiplies it
            instead of rebuilding it (it is not kept for the backward either way).
        relu: apply ReLU to the result, a block of rows at a time (``matmul_t``).
    """
    return _relu_marked(_DropoutMatmul.apply(src.x, weight, add, src.keys, src.seed, src.p,
                                             None if dropped is None else dropped.detach(),
                                             src.sole and relu_output(src.x), relu), relu)


def _relu_marked(y: Tensor, relu: bool) -> Tensor:
    if relu:
        mark_relu_output(y)
    return y


ROW_BLOCK = 1 << 13
"""Rows of the dropped input rebuilt at once by ``dropout_matmul``'s backward on the
CPU: a block of 256 float32 columns (8 MiB) stays in a last-level cache between the
mask and the product that reads it."""

MASK_BLOCK = 1 << 25
"""Entries (rows x columns) of the mask computed at once by the torch path (a GPU
without Triton, or a CPU without numba), whose hash holds two int32 temporaries of
that size (128 MiB each). On a GPU it is also the size of the backward's row blocks,
so an epoch launches a few large kernels rather than thousands of small ones (the
H200's GCN epoch of BENCHMARKS.md ran so)."""


def _block_rows(cols: int, device: torch.device) -> int:
    """Rows per block of ``dropout_matmul``'s backward on ``device``."""
    if device.type == "cpu":
        return ROW_BLOCK
    return max(ROW_BLOCK, MASK_BLOCK // max(1, cols))


def _masked_pair(x: Tensor, g: Tensor, keys: Tensor, seed: int, p: float,
                 out: Tensor, over_x: bool = False) -> None:
    """out = keyed dropout of ``x`` and ``g`` masked in place, with one mask; with
    ``over_x`` (numba only, see ``_can_fold``) the ReLU input's gradient is written over
    the ReLU output ``x`` instead of into ``g``."""
    if kernels.HAVE_NUMBA and x.device.type == "cpu" and x.dtype in (
            torch.float32, torch.float64) and g.dtype == x.dtype and g.is_contiguous():
        kernels.keyed_dropout(x.detach().contiguous().numpy(), keys.contiguous().numpy(), seed,
                              p, kernels.scalar_of(1.0 / (1.0 - p), x.dtype), out.numpy(),
                              g.numpy(), over_x)
        return
    assert not over_x, "the ReLU fold is numba's kernel"
    _apply_mask(x, keys, seed, p, out=out)
    _apply_mask(g, keys, seed, p, inplace=True)


class _DropoutMatmul(torch.autograd.Function):
    """A dense stage's product: ``add + dropout(x) @ weight.T``, then ReLU if ``relu``.

    ``keys`` None: no dropout (``matmul_t``). ``dropped``: the dropout's output where
    one was made (else the rows are rebuilt a block at a time). ``over_x``: x is a ReLU
    output nothing else reads (see ``backward``). The product runs in row blocks
    (``_blocked_product``) when it has a ReLU, rebuilds dropped rows or is computed at
    a padded width (``gemm.product_width``); otherwise it is one ``mm`` / ``addmm``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, add: Tensor | None, keys: Tensor | None,
                seed: int, p: float, dropped: Tensor | None, over_x: bool = False,
                relu: bool = False) -> Tensor:
        if relu and add is not None and add.dim() != 1:
            raise ValueError("a product with ReLU takes a (D_out,) bias, not an addend")
        ctx.seed, ctx.p = seed, p
        ctx.over_x, ctx.relu = over_x and not relu, relu
        ctx.add_shape = None if add is None else add.shape
        cols = weight.shape[0]
        # padded rows (``ops.padded``) where the layout pads the output's columns, else
        # a width the GEMM handles better, the real columns copied out
        ctx.wide = padded.width(cols, x.dtype, x.device)
        keep_wide = ctx.wide != cols
        if not keep_wide:
            ctx.wide = gemm.product_width(x.shape[0], x.shape[1], cols, x.dtype, x.device)
        if ctx.wide != cols or relu or (dropped is None and keys is not None):
            out = _blocked_product(x, weight, add, keys, seed, p, dropped, ctx.wide, relu,
                                   keep_wide)
            ctx.save_for_backward(x, weight, keys, out if relu else None)
            return out
        ctx.save_for_backward(x, weight, keys, None)
        if dropped is None:  # (no dropout here: with one, the blocked path above)
            dropped = x
        if add is None:
            return torch.mm(dropped, weight.t())
        return torch.addmm(add, dropped, weight.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        """Per block of ``ROW_BLOCK`` rows: the ReLU's backward when the product has one,
        the input gradient's rows (grad @ weight, masked), the dropped input's rows (into
        one buffer reused by every block) and their share of the weight's gradient, all
        while the block is in the cache. One hash pass serves both masks, and no (R, D)
        tensor is allocated but the input gradient. At a padded width
        (``gemm.product_width``) the weight's gradient is summed at that width, from the
        gradient's rows copied into a zero-padded block. When ``x`` is a ReLU's output
        that nothing else reads (``over_x``), that ReLU's backward is folded in and x's
        gradient is written over x itself, a block at a time after the block has served
        the weight's gradient (``kernels.keyed_dropout`` with ``g``); x is then returned as its
        own gradient, which the ReLU's backward passes on as it is."""
        x, weight, keys, out = ctx.saved_tensors
        rows_total, cols = x.shape
        block = _block_rows(cols, x.device)
        w = weight.to(grad.dtype)
        wide, real = ctx.wide, weight.shape[0]
        need_x, need_w, need_add = ctx.needs_input_grad[:3]
        # folded: x's gradient goes over x itself, through a block-sized buffer
        fold = _can_fold(ctx, x, keys, grad)
        gx_block = torch.empty(min(block, rows_total), cols, dtype=x.dtype) if fold else None
        grad_x = x if fold else (
            torch.empty(rows_total, cols, dtype=grad.dtype, device=grad.device)
            if need_x else None)
        grad_w = weight.new_zeros(wide, weight.shape[1]) if need_w else None
        grad_add = None
        if out is not None:  # ReLU: its backward into the output's own storage
            passed = grad.data_ptr() == out.data_ptr() and grad.shape == out.shape
            keep = graph_kept()
            grad_add = grad.new_zeros(real) if need_add else None
        elif need_add:
            grad_add = _grad_add(ctx, grad)
        buf = torch.empty(min(block, rows_total), cols, dtype=x.dtype, device=x.device)
        # a padded gradient (``ops.padded``) is read at that width as it is
        g_rows = padded.widen(grad) if wide != real and need_w and out is None else None
        if g_rows is not None and g_rows.shape[1] != wide:
            g_rows = None
        g_wide = (grad.new_zeros(min(block, rows_total), wide)
                  if wide != real and need_w and g_rows is None else None)
        for lo in range(0, rows_total if need_x or need_w or grad_add is not None else 0,
                        block):
            hi = min(lo + block, rows_total)
            g = grad[lo:hi]
            if out is not None:
                if not passed:  # (passed: a later product wrote it there, ``_can_fold``)
                    g = (torch.ops.aten.threshold_backward(g, out[lo:hi], 0) if keep else
                         torch.ops.aten.threshold_backward.grad_input(
                             g, out[lo:hi], 0, grad_input=out[lo:hi]))
                if grad_add is not None:
                    gemm.column_sums(g, out=grad_add)
            k = None if keys is None else keys[lo:hi]
            gx = None if grad_x is None else torch.mm(
                g, w, out=grad_x[lo:hi] if gx_block is None else gx_block[:hi - lo])
            if grad_w is None:
                if gx is not None and k is not None:
                    _apply_mask(gx, k, ctx.seed, ctx.p, inplace=True)
                continue
            if k is None:
                rows = x[lo:hi]
            elif gx is None:
                rows = _apply_mask(x[lo:hi], k, ctx.seed, ctx.p, out=buf[:hi - lo])
            else:
                rows = buf[:hi - lo]
                _masked_pair(x[lo:hi], gx, k, ctx.seed, ctx.p, rows, over_x=fold)
            if g_rows is not None:
                g = g_rows[lo:hi]
            elif g_wide is not None:
                g_wide[:hi - lo, :real] = g
                g = g_wide[:hi - lo]
            grad_w.addmm_(g.t(), rows)
        if grad_w is not None and wide != real:
            grad_w = grad_w[:real].contiguous()
        return grad_x, grad_w, grad_add, None, None, None, None, None, None


def _grad_add(ctx, grad: Tensor) -> Tensor | None:
    if not ctx.needs_input_grad[2]:
        return None
    assert ctx.add_shape is not None
    return gemm.column_sums(grad) if len(ctx.add_shape) == 1 else grad


def _can_fold(ctx, x: Tensor, keys: Tensor | None, grad: Tensor) -> bool:
    """Whether ``_DropoutMatmul``'s backward may write x's gradient over x (see there)."""
    return (ctx.over_x and keys is not None and ctx.needs_input_grad[0]
            and ctx.needs_input_grad[1] and kernels.HAVE_NUMBA and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64) and grad.dtype == x.dtype
            and x.is_contiguous() and not graph_kept())


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_kept() -> bool:
    """Whether the running backward pass keeps its graph (``retain_graph=True``, to run
    again), so that what it saved must stay as it is; torch's own compiled autograd
    asks the same before freeing what a backward saved. True where torch cannot say."""
    return _KEEP_GRAPH is None or bool(_KEEP_GRAPH())


def _blocked_product(x: Tensor, weight: Tensor, add: Tensor | None, keys: Tensor | None,
                     seed: int, p: float, dropped: Tensor | None, wide: int,
                     relu: bool, keep_wide: bool = False) -> Tensor:
    """``add + dropout(x) @ weight.T`` (then ReLU if ``relu``) ``ROW_BLOCK`` rows at a
    time, with the weight padded by zero rows to ``wide``: each block's product goes
    to a (block, wide) buffer that stays in the cache, and its real columns to the
    (R, D_out) output; unpadded, straight to the output, where the ReLU then finds the
    block still in the cache. With ``keep_wide`` the output is the padded rows
    themselves (``ops.padded``: an (R, wide) tensor seen as (R, D_out)), written
    straight, with no copy. Without ``dropped`` the block's dropped rows are rebuilt
    into a second buffer, so no (R, D) dropout output is made."""
    rows_total = x.shape[0]
    cols = weight.shape[0]
    w = gemm.pad_rows(weight, wide).t()
    bias = gemm.pad_rows(add, wide) if add is not None and add.dim() == 1 else None
    block = min(_block_rows(x.shape[1], x.device), max(1, rows_total))
    if keep_wide:  # the padding's columns come out zero: zero weight rows and bias
        full = torch.empty(rows_total, wide, dtype=x.dtype, device=x.device)
        out, buf = padded.rows_of(full, cols), None
        if not relu and (dropped is not None or keys is None):  # nothing to do per block
            src = x if dropped is None else dropped
            if bias is not None:  # as ``matmul_t``'s unpadded product, to the bit
                torch.addmm(bias, src, w, out=full)
            else:
                torch.mm(src, w, out=full)
                if add is not None:
                    out += add
            return out
    else:
        full = out = torch.empty(rows_total, cols, dtype=x.dtype, device=x.device)
        buf = torch.empty(block, wide, dtype=x.dtype, device=x.device) if wide != cols else None
    rebuilt = (torch.empty(block, x.shape[1], dtype=x.dtype, device=x.device)
               if dropped is None and keys is not None else None)
    for lo in range(0, rows_total, block):
        hi = min(lo + block, rows_total)
        if dropped is not None:
            src = dropped[lo:hi]
        elif keys is None or rebuilt is None:
            src = x[lo:hi]
        else:
            src = _apply_mask(x[lo:hi], keys[lo:hi], seed, p, out=rebuilt[:hi - lo])
        prod = full[lo:hi] if buf is None else buf[:hi - lo]
        torch.mm(src, w, out=prod)
        if bias is not None:  # ``addmm(out=)`` first copies the bias over the block:
            prod.add_(bias)   # 10 % slower at 256 columns (BENCHMARKS.md)
        if buf is not None:
            if add is not None and add.dim() == 2:
                torch.add(prod[:, :cols], add[lo:hi], out=out[lo:hi])
            else:
                out[lo:hi] = prod[:, :cols]
        elif add is not None and add.dim() == 2:
            out[lo:hi] += add[lo:hi]
        if relu:
            full[lo:hi].relu_()
    return out


def matmul_t(x: Tensor, weight: Tensor, add: Tensor | None = None,
             relu: bool = False) -> Tensor:
    """``add + x @ weight.T`` for dense rows ``x`` (R, D) and ``weight`` (D_out, D) as
    in ``nn.Linear``; ``add`` None, a (D_out,) bias or an (R, D_out) addend. At a width
    the CPU's GEMM handles badly it runs padded (``gemm.product_width``); with ``relu``
    (and a bias or no addend) ReLU follows each block of rows while it is in the cache,
    and the ReLU's backward is folded into the product's; otherwise it is torch's
    ``mm`` / ``addmm``."""
    cols = weight.shape[0]
    if (relu or padded.width(cols, x.dtype, x.device) != cols
            or gemm.product_width(x.shape[0], x.shape[1], cols, x.dtype, x.device) != cols):
        return _relu_marked(_DropoutMatmul.apply(x, weight, add, None, 0, 0.0, None, False,
                                                 relu), relu)
    if add is None:
        return torch.mm(x, weight.t())
    return torch.addmm(add, x, weight.t())


class _KeyedDropout(torch.autograd.Function):
    """Dropout is linear in x with a fixed mask: backward re-applies the same mask,
    recomputed from the keys rather than stored (hashing is cheaper than the memory)."""

    @staticmethod
    def forward(ctx, x: Tensor, keys: Tensor, seed: int, p: float) -> Tensor:
        ctx.seed, ctx.p = seed, p
        ctx.save_for_backward(keys)
        return _apply_mask(x, keys, seed, p)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keys,) = ctx.saved_tensors
        return _apply_mask(grad, keys, ctx.seed, ctx.p), None, None, None
