"""Rows padded to whole cache lines.

A float32 row of 47 columns takes 188 bytes, so consecutive rows start at every
offset modulo the 64-byte cache line and most rows straddle one line more than
their bytes need. The SpMM gathers whole rows at random, so it pays for every
line a row touches. On a 2-core Xeon (torch 2.13, R-MAT 1M vertices / 20M edges, 2
threads) the SpMM over 47 contiguous columns took 216 ms, over 48 columns 152 ms,
and over 64 columns 172 ms (BENCHMARKS.md).

A *padded* matrix is an (R, D) view, strides (S, 1), of an (R, S) tensor whose rows
are whole cache lines (S * itemsize a multiple of ``LINE_BYTES``) and whose columns
D..S-1 hold zeros. Its producers write it so: a dense stage's product at a width the
layout pads (``dropout.matmul_t`` / ``dropout_matmul``, with zero rows appended to
the weight), the bias added after a propagation (``gemm.add_bias``), and the loss's
gradient (``loss.masked_cross_entropy``). The SpMM and its transpose
(``spmm.aggregate``, ``spmm.transposed_aggregate``) run over the whole (R, S) rows of
a padded input (``widen``) and return a padded output; the padding's columns stay
zero, since a column's sums never read another column. Everything else sees an
ordinary strided (R, D) tensor (torch's operators take it as it is; a kernel that
needs contiguous rows copies it). The values are those of the unpadded run, bit for
bit: each real column is computed by the same operations in the same order.

Only float32 and float64 rows on the CPU are padded, and only where the padding
adds at most an eighth of the columns (47 -> 48, 100 -> 112, 172 -> 176 float32
columns; 40 or 41 stay as they are). ``FULLGRAPH_PAD_ROWS=0`` switches it off.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

ENV = "FULLGRAPH_PAD_ROWS"
LINE_BYTES = 64
MAX_SHARE = 8
"""Pad only where the padding is at most 1/MAX_SHARE of the columns."""


def enabled() -> bool:
    """Whether padded rows are made (not switched off with ``FULLGRAPH_PAD_ROWS=0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def width(cols: int, dtype: torch.dtype, device: torch.device) -> int:
    """The row stride (in elements) at which a producer writes (R, ``cols``) rows: a
    whole number of cache lines where that pads little (module doc), else ``cols``."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.float64) or not enabled():
        return cols
    line = LINE_BYTES // dtype.itemsize
    wide = -(-cols // line) * line
    if cols < line or wide == cols or (wide - cols) * MAX_SHARE > cols:
        return cols
    return wide


def rows_of(full: Tensor, cols: int) -> Tensor:
    """The first ``cols`` columns of the contiguous (R, S) ``full``, as an (R, cols)
    tensor over its storage that is not a view of it: a custom autograd function may
    return it, and its consumers may then modify it in place (autograd refuses that on
    a view made inside the function)."""
    if cols == full.shape[1]:
        return full
    out = torch.empty(0, dtype=full.dtype, device=full.device)
    return out.set_(full.untyped_storage(), full.storage_offset(), (full.shape[0], cols),
                    (full.shape[1], 1))


def widen(x: Tensor) -> Tensor | None:
    """The (R, S) rows under a padded (R, D) matrix ``x`` (module doc), or None where
    ``x`` is not one: 2-D rows on the CPU whose stride S pads D to whole cache lines
    (as ``width`` would) within ``x``'s own storage."""
    if x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 or x.shape[0] == 0:
        return None
    rows, cols = x.shape
    wide = x.stride(0)
    if wide <= cols or wide != width(cols, x.dtype, x.device):
        return None
    if (x.storage_offset() + rows * wide) * x.element_size() > x.untyped_storage().nbytes():
        return None  # the last row's padding lies past the storage
    return x.as_strided((rows, wide), (wide, 1))


