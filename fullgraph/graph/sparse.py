"""Sparse (CSR) feature matrices: bag-of-words rows held as their non-zeros.

A ``VertexData.features`` may be a torch CSR tensor (``torch.sparse_csr``) instead of
a dense one; these helpers are what the data layer and the executors need of it
(``fullgraph.ops.sparse`` has the kernels of the first layer). Shapes: R rows, K
columns.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

SPARSE_DENSITY = 0.05
"""``--sparse-features auto`` keeps features sparse at or below this share of non-zeros
(a CSR entry costs 12 bytes against 4 dense, and the first layer's time follows the
non-zeros)."""
SPARSE_MIN_COLUMNS = 64
"""... and with at least this many columns."""


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a CSR tensor (sparse features)."""
    return isinstance(x, Tensor) and x.layout == torch.sparse_csr


def csr(indptr: Tensor, indices: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    """A CSR tensor (R, K) from its three arrays (not copied)."""
    return torch.sparse_csr_tensor(indptr.to(torch.int64), indices.to(torch.int64), values,
                                   size=shape, check_invariants=False)


def to_sparse(x: Tensor) -> Tensor:
    """The dense (R, K) ``x`` as CSR, row block by row block (a memory-mapped ``x`` is
    never read whole)."""
    ptrs, cols, vals = [torch.zeros(1, dtype=torch.int64)], [], []
    offset, block = 0, max(1, (1 << 24) // max(1, x.shape[1]))
    for start in range(0, x.shape[0], block):
        part = torch.as_tensor(x[start:start + block])
        nz = part != 0
        counts = nz.sum(dim=1)
        ptrs.append(counts.cumsum(0) + offset)
        offset += int(counts.sum())
        cols.append(nz.nonzero()[:, 1])
        vals.append(part[nz])
    indices = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64)
    values = torch.cat(vals) if vals else torch.zeros(0, dtype=x.dtype)
    return csr(torch.cat(ptrs), indices, values, (int(x.shape[0]), int(x.shape[1])))


def density(x: Tensor) -> float:
    """The share of non-zero entries of ``x`` (dense or CSR)."""
    total = x.shape[0] * x.shape[1]
    if not total:
        return 0.0
    nnz = x.values().numel() if is_sparse(x) else int(torch.count_nonzero(x))
    return nnz / total


def nbytes(x: Tensor) -> int:
    """The bytes ``x`` holds (for CSR: its three arrays)."""
    if is_sparse(x):
        return sum(t.numel() * t.element_size()
                   for t in (x.crow_indices(), x.col_indices(), x.values()))
    return x.numel() * x.element_size()


def take_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` for dense or CSR ``x``; ``rows`` int64 ids or a bool mask."""
    if not is_sparse(x):
        return x[rows]
    if rows.dtype == torch.bool:
        rows = rows.nonzero()[:, 0]
    ptr = x.crow_indices()
    r = rows.to(device=ptr.device, dtype=torch.int64)  # on the features' device (CUDA too)
    starts, counts = ptr[r], ptr[r + 1] - ptr[r]
    indptr = torch.zeros(r.numel() + 1, dtype=torch.int64, device=ptr.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    total = int(indptr[-1])
    pos = torch.repeat_interleave(starts - indptr[:-1], counts, output_size=total) + \
        torch.arange(total, dtype=torch.int64, device=ptr.device)
    return csr(indptr, x.col_indices()[pos], x.values()[pos], (r.numel(), int(x.shape[1])))


def row_range(x: Tensor, lo: int, hi: int) -> Tensor:
    """``x[lo:hi]`` for dense or CSR ``x`` (a CSR tensor cannot be sliced by rows in
    torch); for CSR, views of the stored entries with the row offsets shifted."""
    if not is_sparse(x):
        return x[lo:hi]
    ptr = x.crow_indices()
    start, stop = int(ptr[lo]), int(ptr[hi])
    return csr(ptr[lo:hi + 1] - start, x.col_indices()[start:stop], x.values()[start:stop],
               (hi - lo, int(x.shape[1])))


def convert(x: Tensor, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``x.to(dtype).to(device)`` for dense or CSR ``x``."""
    if not is_sparse(x):
        return x.to(dtype).to(device)
    return csr(x.crow_indices(), x.col_indices(), x.values().to(dtype),
               (int(x.shape[0]), int(x.shape[1]))).to(device)


def densify(x: Tensor) -> Tensor:
    return x.to_dense() if is_sparse(x) else x


def sampled_density(x: Tensor, rows: int = 4096) -> float:
    """The share of non-zeros of ``x`` (exact for CSR; for a dense ``x``, over up to
    ``rows`` evenly spaced rows, so a memory-mapped matrix is not read whole)."""
    if is_sparse(x) or x.shape[0] <= rows:
        return density(x)
    # integer spacing: a float32 linspace rounds its last point past the end at 20M rows
    return density(x[torch.arange(rows) * (x.shape[0] - 1) // (rows - 1)])


def choose_layout(x: Tensor, mode: str) -> Tensor:
    """``x`` as ``--sparse-features mode`` asks: ``on`` CSR, ``off`` dense, ``auto`` CSR
    when it has ``SPARSE_MIN_COLUMNS`` columns or more and at most ``SPARSE_DENSITY``
    of its entries are non-zero, else as it is."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"sparse features: expected auto, on or off, got {mode!r}")
    if mode == "off":
        return densify(x)
    if is_sparse(x):
        return x
    if mode == "on" or sparse_enough(x):
        return to_sparse(x)
    return x


def sparse_enough(x: Tensor) -> bool:
    """Whether dense ``x`` is what ``auto`` holds as CSR: ``SPARSE_MIN_COLUMNS``
    columns or more, at most ``SPARSE_DENSITY`` of its entries non-zero (sampled)."""
    return x.shape[1] >= SPARSE_MIN_COLUMNS and sampled_density(x) <= SPARSE_DENSITY


def cat_rows(parts: list[Tensor]) -> Tensor:
    """The CSR ``parts`` stacked by rows (on their device)."""
    ptrs, offset = [torch.zeros(1, dtype=torch.int64, device=parts[0].crow_indices().device)], 0
    for p in parts:
        ptrs.append(p.crow_indices()[1:] + offset)
        offset += int(p.crow_indices()[-1])
    return csr(torch.cat(ptrs), torch.cat([p.col_indices() for p in parts]),
               torch.cat([p.values() for p in parts]),
               (sum(int(p.shape[0]) for p in parts), int(parts[0].shape[1])))


def row_blocks(x: Tensor, block_rows: int | None = None) -> Any:
    """(start, dense rows) blocks of ``x``, dense or CSR, in row order, never the whole
    matrix dense at once (default: blocks of about 2^24 entries, 64 MiB of float32)."""
    block_rows = block_rows or max(1, (1 << 24) // max(1, int(x.shape[1])))
    for start in range(0, x.shape[0], block_rows):
        stop = min(start + block_rows, x.shape[0])
        if is_sparse(x):
            yield start, take_rows(x, torch.arange(start, stop)).to_dense()
        else:
            yield start, x[start:stop]


__all__ = ["SPARSE_DENSITY", "SPARSE_MIN_COLUMNS", "cat_rows", "choose_layout", "convert", "csr",
           "densify", "density", "is_sparse", "nbytes", "row_blocks", "sampled_density",
           "take_rows", "to_sparse"]
