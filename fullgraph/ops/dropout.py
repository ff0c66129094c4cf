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


def keyed_uniform(row_keys: Tensor, num_cols: int, seed: int) -> Tensor:
    """(R, num_cols) float32 uniforms in [0, 1) determined by (seed, key, column)."""
    keys = row_keys.to(torch.int64)
    seed32 = int(seed) & _M32
    if kernels.HAVE_NUMBA and keys.device.type == "cpu":
        out = torch.empty(keys.shape[0], num_cols, dtype=torch.float32)
        kernels.keyed_uniform(keys.contiguous().numpy(), num_cols, seed32, out.numpy())
        return out
    k = _mix32(((keys & _M32) ^ seed32) & _M32)
    k = _mix32((k + ((keys >> 32) & _M32) * 0x27D4EB2F) & _M32)
    cols = torch.arange(num_cols, dtype=torch.int64, device=keys.device) * 0x9E3779B9
    h = _mix32((k[:, None] + cols[None, :]) & _M32)
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
    out = _KeyedDropout.apply(x2, row_keys.to(x.device).to(torch.int64), int(seed) & _M32, p)
    return out[:, 0] if flat else out.view_as(x)


def _apply_mask(x: Tensor, keys: Tensor, seed: int, p: float) -> Tensor:
    scale = 1.0 / (1.0 - p)
    if kernels.HAVE_NUMBA and x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                      torch.float64):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        kernels.keyed_dropout(x.detach().contiguous().numpy(), keys.contiguous().numpy(), seed,
                              p, scale, out.numpy())
        return out
    keep = keyed_uniform(keys, x.shape[1], seed).to(x.device) >= p
    return x * keep.to(x.dtype) * scale


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
