"""Dropout whose mask is a function of (seed, global id, column), not of call order.

Every executor of a stage program must drop the same entries as the single-process
executor, whatever rows a worker holds and in whatever order it computes them. So
the keep/drop decision for entry (row r, column c) is a hash of the step seed, the
row's global key (vertex id, or edge id for attention) and c: a counter-based
generator in the spirit of Philox, here the 32-bit finaliser of MurmurHash3 applied
twice. The numba kernel and the torch fallback compute the same bits.

Shapes: R rows, D columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fullgraph.ops import kernels

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


def keyed_uniform(row_keys: Tensor, num_cols: int, seed: int) -> Tensor:
    """(R, num_cols) float32 uniforms in [0, 1) determined by (seed, key, column)."""
    keys = row_keys.to(torch.int64)
    seed32 = int(seed) & _M32
    if kernels.HAVE_NUMBA and keys.device.type == "cpu":
        out = torch.empty(keys.shape[0], num_cols, dtype=torch.float32)
        kernels.keyed_uniform(keys.contiguous().numpy(), num_cols, seed32, out.numpy())
        return out
    cols = torch.arange(num_cols, dtype=torch.int64, device=keys.device)
    h = entry_hashes(row_hashes(keys, seed32)[:, None], cols[None, :])
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
    x2 = x[:, None] if flat else x.reshape(x.shape[0], math.prod(x.shape[1:]))
    keys = row_keys.to(x.device).to(torch.int64)
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
    rows, cols = x.shape
    step = max(1, MASK_BLOCK // max(1, cols))
    if rows <= step:
        keep = keyed_uniform(keys, cols, seed).to(x.device) >= p
        if inplace:
            return x.mul_(keep.to(x.dtype)).mul_(scale)
        if out is not None:
            return torch.mul(x, keep.to(x.dtype), out=out).mul_(scale)
        return x * keep.to(x.dtype) * scale
    # the hash works in int64: a block of rows at a time bounds its temporaries
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


_DROPPED_ATTR = "_fullgraph_dropped"


def dropped_from(t: Tensor) -> Dropped | None:
    """The ``Dropped`` record of a ``keyed_dropout`` output, or None for other tensors."""
    return getattr(t, _DROPPED_ATTR, None)


def dropout_matmul(src: Dropped, weight: Tensor, add: Tensor | None = None,
                   dropped: Tensor | None = None) -> Tensor:
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
    """
    return _DropoutMatmul.apply(src.x, weight, add, src.keys, src.seed, src.p,
                                None if dropped is None else dropped.detach())


ROW_BLOCK = 1 << 13
"""Rows of the dropped input rebuilt at once by ``dropout_matmul``'s backward on the
CPU: a block of 256 float32 columns (8 MiB) stays in a last-level cache between the
mask and the product that reads it."""

MASK_BLOCK = 1 << 25
"""Entries (rows x columns) of the mask computed at once by the torch path (GPUs, or
no numba), whose hash holds several int64 temporaries of that size (256 MiB each);
on a GPU it is also the size of the backward's row blocks, so an epoch launches a
few large kernels rather than thousands of small ones. Not yet measured on a GPU."""


def _block_rows(cols: int, device: torch.device) -> int:
    """Rows per block of ``dropout_matmul``'s backward on ``device``."""
    if device.type == "cpu":
        return ROW_BLOCK
    return max(ROW_BLOCK, MASK_BLOCK // max(1, cols))


def _masked_pair(x: Tensor, g: Tensor, keys: Tensor, seed: int, p: float,
                 out: Tensor) -> None:
    """out = keyed dropout of ``x`` and ``g`` masked in place, with one mask."""
    if kernels.HAVE_NUMBA and x.device.type == "cpu" and x.dtype in (
            torch.float32, torch.float64) and g.dtype == x.dtype and g.is_contiguous():
        kernels.keyed_dropout_pair(x.detach().contiguous().numpy(), g.numpy(),
                                   keys.contiguous().numpy(), seed, p,
                                   kernels.scalar_of(1.0 / (1.0 - p), x.dtype),
                                   out.numpy())
        return
    out.copy_(_apply_mask(x, keys, seed, p))
    _apply_mask(g, keys, seed, p, inplace=True)


class _DropoutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, add: Tensor | None, keys: Tensor, seed: int,
                p: float, dropped: Tensor | None) -> Tensor:
        ctx.seed, ctx.p = seed, p
        ctx.add_shape = None if add is None else add.shape
        ctx.save_for_backward(x, weight, keys)
        if dropped is None:
            dropped = _apply_mask(x, keys, seed, p)
        if add is None:
            return torch.mm(dropped, weight.t())
        return torch.addmm(add, dropped, weight.t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        """Per block of ``ROW_BLOCK`` rows: the input gradient's rows (grad @ weight,
        masked), the dropped input's rows (into one buffer reused by every block) and
        their share of the weight's gradient. One hash pass serves both masks, and no
        (R, D) tensor is allocated but the input gradient."""
        x, weight, keys = ctx.saved_tensors
        grad_x = grad_w = grad_add = None
        rows_total, cols = x.shape
        block = _block_rows(cols, x.device)
        w = weight.to(grad.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty(rows_total, cols, dtype=grad.dtype, device=grad.device)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)
            buf = torch.empty(min(block, rows_total), cols, dtype=x.dtype, device=x.device)
        for lo in range(0, rows_total if grad_x is not None or grad_w is not None else 0,
                        block):
            hi = min(lo + block, rows_total)
            g, k = grad[lo:hi], keys[lo:hi]
            gx = None if grad_x is None else torch.mm(g, w, out=grad_x[lo:hi])
            if grad_w is None:
                assert gx is not None
                _apply_mask(gx, k, ctx.seed, ctx.p, inplace=True)
                continue
            rows = buf[:hi - lo]
            if gx is None:
                _apply_mask(x[lo:hi], k, ctx.seed, ctx.p, out=rows)
            else:
                _masked_pair(x[lo:hi], gx, k, ctx.seed, ctx.p, rows)
            grad_w.addmm_(g.t(), rows)
        if ctx.needs_input_grad[2]:
            assert ctx.add_shape is not None
            grad_add = grad.sum(0) if len(ctx.add_shape) == 1 else grad
        return grad_x, grad_w, grad_add, None, None, None, None


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
