"""Sparse input features through the first layer: CSR rows, kernels on the non-zeros.

Datasets such as Coauthor CS (6,805 columns, 0.9 % non-zero) or Amazon Photo store
their features as word counts; held dense they cost N x F floats and a dense GEMM in
the first layer. Kept as a torch CSR tensor (``fullgraph.graph.sparse``) they cost
their non-zeros, and the first layer's ``dropout -> linear`` runs on the non-zeros:

- ``sparse_dropout``: ``ops.dropout.keyed_dropout`` evaluated at the stored entries
  only; the kept entries and their scale are the dense run's bit for bit (a zero
  stays zero whether dropped or not);
- ``sparse_linear``: ``x @ W^T`` for a CSR ``x`` that needs no gradient, with the
  weight's gradient ``(x^T g)^T``.

Everything after the first transform is dense, so every strategy handles sparse
features by taking its rows with ``take_rows``; a model whose first stage cannot read
CSR rows (one that propagates the raw features first, as GIN does) gets them dense
(``parallel.base.feature_rows``).

Shapes: R rows, K columns (features), H output columns, Z stored entries.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fullgraph.graph.sparse import (
    convert,
    csr,
    densify,
    density,
    is_sparse,
    nbytes,
    take_rows,
    to_sparse,
)
from fullgraph.ops import gemm, kernels

_M32 = 0xFFFFFFFF


def sparse_dropout(x: Tensor, p: float, row_keys: Tensor, seed: int) -> Tensor:
    """Inverted keyed dropout of the CSR ``x``'s stored entries (see the module
    docstring); the same pattern, dropped entries stored as zeros."""
    indptr, indices, values = x.crow_indices(), x.col_indices(), x.values()
    keys = row_keys.to(device=values.device, dtype=torch.int64).contiguous()
    seed32, scale = int(seed) & _M32, 1.0 / (1.0 - p)
    if kernels.HAVE_NUMBA and values.device.type == "cpu" and values.dtype in (
            torch.float32, torch.float64):
        out = torch.empty_like(values)
        kernels.keyed_dropout_csr(indptr.numpy(), indices.numpy(), values.contiguous().numpy(),
                                  keys.numpy(), seed32, p,
                                  kernels.scalar_of(scale, values.dtype), out.numpy())
    else:
        from fullgraph.ops.dropout import entry_hashes, keep_threshold, row_hashes

        per_entry = torch.repeat_interleave(row_hashes(keys, seed32), indptr[1:] - indptr[:-1])
        h = entry_hashes(per_entry, indices.to(torch.int64))
        keep = h >= keep_threshold(p)  # as the numba kernel decides
        out = values * keep.to(values.dtype) * scale
    return csr(indptr, indices, out, (int(x.shape[0]), int(x.shape[1])))


def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T (+ bias)`` for CSR ``x`` (R, K) and ``weight`` (H, K);
    differentiable in ``weight`` and ``bias`` (features take no gradient)."""
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"sparse_linear: x has {x.shape[1]} columns, weight expects "
                         f"{weight.shape[1]}")
    y = _SparseLinear.apply(weight, x)
    return y if bias is None else gemm.add_bias(y, bias)


def _csr_matmul(x: Tensor, dense: Tensor) -> Tensor:
    """x (R, K) CSR @ dense (K, H)."""
    dense = dense.contiguous()
    if kernels.HAVE_NUMBA and dense.device.type == "cpu":
        out = torch.empty(x.shape[0], dense.shape[1], dtype=dense.dtype)
        kernels.spmm_scalar(x.crow_indices().numpy(), x.col_indices().numpy(),
                            x.values().to(dense.dtype).contiguous().numpy(), dense.numpy(),
                            out.numpy())
        return out
    return torch.sparse.mm(convert(x, dense.dtype, dense.device), dense)


def _csr_t_matmul(x: Tensor, g: Tensor) -> Tensor:
    """x^T (K, R) @ g (R, H) for CSR ``x``."""
    g = g.contiguous()
    out = torch.zeros(x.shape[1], g.shape[1], dtype=g.dtype, device=g.device)
    values = x.values().to(g.dtype)
    if kernels.HAVE_NUMBA and g.device.type == "cpu":
        kernels.csr_t_matmul(x.crow_indices().numpy(), x.col_indices().numpy(),
                             values.contiguous().numpy(), g.numpy(), out.numpy())
        return out
    ptr = x.crow_indices()
    rows = torch.repeat_interleave(torch.arange(x.shape[0], device=g.device),
                                   ptr[1:] - ptr[:-1])
    return out.index_add_(0, x.col_indices(), values[:, None] * g[rows])


class _SparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, x: Tensor) -> Tensor:
        ctx.x = x  # a CSR tensor: not saved through save_for_backward
        return _csr_matmul(x, weight.detach().t())

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_w = _csr_t_matmul(ctx.x, grad).t() if ctx.needs_input_grad[0] else None
        return grad_w, None


__all__ = ["convert", "csr", "densify", "density", "is_sparse", "nbytes", "sparse_dropout",
           "sparse_linear", "take_rows", "to_sparse"]
