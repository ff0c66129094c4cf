"""Output widths a CPU's GEMM handles badly, padded where that measures faster.

On the 2-core AMD EPYC machine with torch 2.13's MKL, the product of 1M rows of 256
columns with a weight to 47 columns ran at 90 GFLOP/s, and to 48 columns at 137:
an odd width falls off the library's fast kernels. The weight-gradient product
``g.T @ x`` of that layer lost about as much. Computing the product with the weight
padded by zero rows to a multiple of ``PAD_TO`` (and copying the real columns out of
a block small enough to stay in the cache) gains 30 % there, about 8 % at 41 or 121
columns, and loses about as much at some even widths (100 or 172 columns from 64).
Another library or CPU may behave otherwise, so the choice is measured, not assumed:
once per shape on a machine, and remembered beside the SpMM backend's choice in the
user cache directory (``gemm-width.json``, keyed as ``ops.select.machine_key``), so
that later runs, a resumed one too, compute the same products the same way
(``product_width``).

``FULLGRAPH_GEMM_PAD=off`` (never pad) or ``=on`` (always pad an eligible width)
overrides the measurement.
"""
from __future__ import annotations

import os
import time

import torch

from fullgraph.ops import kernels, padded

PAD_TO = 8
"""Padded widths are multiples of this (8 float32 columns: 32 bytes)."""

MIN_COLS = 16
"""Narrower outputs are left as they are: the library's kernels for a handful of
columns are fast already, and padding 7 columns to 8 measured slower."""

MIN_ROWS = 1 << 16
"""Products over fewer rows are not padded (nor measured): they take milliseconds."""

SAMPLE_ROWS = 1 << 14
"""Rows of the measurement's sample product."""

GAIN = 0.9
"""Pad only where the padded product took at most this fraction of the plain one."""

CACHE_FILE = "gemm-width.json"

_choices: dict[tuple[int, int, torch.dtype, int], int] = {}


def product_width(rows: int, k: int, cols: int, dtype: torch.dtype,
                  device: torch.device) -> int:
    """The width at which to compute a (rows, k) x (k, cols) product: ``cols``, or
    ``cols`` rounded up to a multiple of ``PAD_TO`` where that measured at least
    ``1 / GAIN`` times faster on this machine (CPU only; measured on ``SAMPLE_ROWS``
    random rows once per k, cols, dtype and machine key, then remembered)."""
    mode = os.environ.get("FULLGRAPH_GEMM_PAD", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"FULLGRAPH_GEMM_PAD must be auto, on or off, got {mode!r}")
    if (device.type != "cpu" or cols % PAD_TO == 0 or cols < MIN_COLS or rows < MIN_ROWS
            or not dtype.is_floating_point or mode == "off"):
        return cols
    wide = -(-cols // PAD_TO) * PAD_TO
    if mode == "on":
        return wide
    key = (k, cols, dtype, torch.get_num_threads())
    if key not in _choices:
        from fullgraph.ops import select

        stored_key = f"{select.machine_key()} | {k} -> {cols} | {dtype}"
        stored = select.remembered(CACHE_FILE, stored_key)
        if stored is not None and isinstance(stored.get("padded"), bool):
            padded = stored["padded"]
        else:
            padded = _padded_faster(k, cols, wide, dtype)
            select.remember(CACHE_FILE, stored_key,
                            {"padded": padded, "date": time.strftime("%Y-%m-%d")})
        _choices[key] = wide if padded else cols
    return _choices[key]


def _padded_faster(k: int, cols: int, wide: int, dtype: torch.dtype) -> bool:
    """Whether the forward product at ``wide`` columns (blocked, as ``_DropoutMatmul``
    runs it) beat the plain one by the ``GAIN`` margin, medians of 5 alternated runs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLE_ROWS, k, generator=gen).to(dtype)
    weight = torch.randn(cols, k, generator=gen).to(dtype)
    padded = torch.zeros(wide, k, dtype=dtype)
    padded[:cols] = weight
    out = torch.empty(SAMPLE_ROWS, cols, dtype=dtype)
    buf = torch.empty(SAMPLE_ROWS, wide, dtype=dtype)

    def plain() -> None:
        torch.mm(x, weight.t(), out=out)

    def pad() -> None:
        torch.mm(x, padded.t(), out=buf)
        out.copy_(buf[:, :cols])

    times: dict[str, list[float]] = {"plain": [], "pad": []}
    for _ in range(5):
        for name, fn in (("plain", plain), ("pad", pad)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    return med["pad"] <= GAIN * med["plain"]


def pad_rows(weight: torch.Tensor, wide: int) -> torch.Tensor:
    """``weight`` (cols, k) with zero rows appended up to ``wide`` rows."""
    if weight.shape[0] == wide:
        return weight
    out = weight.new_zeros(wide, *weight.shape[1:])
    out[:weight.shape[0]] = weight
    return out


SUM_ROWS = 8192
"""Rows per run of ``column_sums`` (per GEMV without numba): each run's sum runs over
this many terms, and the runs' sums are added in turn, so no float sum runs over the
whole column."""
SUM_MIN_ROWS = 1024
"""Fewer rows are summed by torch's ``sum``: a handful of calls either way."""
_ones: dict[torch.dtype, torch.Tensor] = {}


def column_sums(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(D,) sums over the rows of a 2-D ``x``, added into ``out`` where given (a bias's
    gradient). On the CPU, for float32 / float64 rows whose columns are contiguous
    (padded rows, ``ops.padded``, too), numba's ``kernels.column_sums``: every run of
    ``SUM_ROWS`` rows summed apart, the runs' sums added in turn, in the same order for
    any thread count. On a 2-core AMD EPYC (Zen 4) with torch 2.13 it summed 1M x 256
    float32 rows in 8,192-row blocks in 39-40 ms, about 80 % of the host's read
    bandwidth, against 123-124 ms for a GEMV with a ones vector per block (which a
    2-core Xeon ran at its read bandwidth) and 63-71 ms for ``x.sum(0)``
    (BENCHMARKS.md). Without numba, the GEMV; elsewhere ``x.sum(0)``."""
    if out is not None and out.shape != (x.shape[-1],):
        raise ValueError(f"column_sums: out must be ({x.shape[-1]},) for rows of "
                         f"{tuple(x.shape)}, got {tuple(out.shape)}")
    if (x.dim() != 2 or x.device.type != "cpu" or x.shape[0] < SUM_MIN_ROWS
            or x.dtype not in (torch.float32, torch.float64) or x.stride(1) != 1
            or x.requires_grad and torch.is_grad_enabled()):
        total = x.sum(0)
        return total if out is None else out.add_(total)
    if out is None:
        out = torch.zeros(x.shape[1], dtype=x.dtype)
    if kernels.HAVE_NUMBA:
        into = out if out.dtype == x.dtype and out.is_contiguous() else torch.zeros_like(
            out, dtype=x.dtype, memory_format=torch.contiguous_format)
        kernels.column_sums(_whole_rows(x.detach()).numpy(), into.numpy(), SUM_ROWS)
        return out if into is out else out.add_(into)
    ones = _ones.get(x.dtype)
    if ones is None:
        ones = _ones[x.dtype] = torch.ones(SUM_ROWS, dtype=x.dtype)
    part = torch.empty(x.shape[1], dtype=x.dtype)
    for lo in range(0, x.shape[0], SUM_ROWS):
        block = x[lo:lo + SUM_ROWS]
        out.add_(torch.mv(block.t(), ones[:block.shape[0]], out=part))
    return out


def _whole_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (unit column stride) seen at their stride, padding included, where
    the storage holds the last row's padding too (padded rows, ``ops.padded``): a
    C-contiguous array, whose loops numba vectorises: 1M rows of 47 at stride 48 took
    8-9 ms so and 11-14 ms as a strided view (2 threads; BENCHMARKS.md). Else ``x``."""
    rows, stride = x.shape[0], x.stride(0)
    if stride <= x.shape[1] or rows == 0:
        return x
    if x.storage_offset() + rows * stride > x.untyped_storage().nbytes() // x.element_size():
        return x
    return x.as_strided((rows, stride), (stride, 1))


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        wide = padded.widen(x)
        if wide is None:
            return x + bias
        # padded rows stay padded: the bias's padding is zero, so is the sum's
        return padded.rows_of(wide + pad_rows(bias, wide.shape[1]), x.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.needs_input_grad[0] else None,
                column_sums(grad) if ctx.needs_input_grad[1] else None)


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` for (R, D) rows and a (D,) bias, whose backward sums the gradient's
    columns with ``column_sums`` (autograd's own backward of the broadcast uses
    ``sum``). Plain ``x + bias`` where the shapes or dtypes differ from that."""
    if x.dim() != 2 or bias.dim() != 1 or x.dtype != bias.dtype or x.shape[1] != bias.shape[0]:
        return x + bias
    return _AddBias.apply(x, bias)
