"""Triton kernels for the GPU: keyed dropout, GAT's attention and multi-head SpMM.

On a GPU the CPU's numba kernels do not run, and the same work from torch ops costs
many passes over (R, D) or (E, H) temporaries: the dropout hash took 11 elementwise
kernels per mask, and GAT's attention and its weighted SpMM gathered (E, D) rows
and scattered their gradients with atomics (not deterministic, and sorted in the
backward of an index). Each kernel here makes one pass, per row of the CSR by
destination where it reduces over edges, so the sums are in a fixed order and a run
is reproducible:

- ``dropout_into``: the keyed mask (``ops.dropout``'s hash, the same bits) applied to
  x in one read and one write;
- ``attention_forward`` / ``attention_backward``: GAT's softmax over each
  destination's in-edges of ``leaky_relu(s_src[src] + s_dst[dst])``, with an online
  maximum, and its backward (the source side's sums as segments of the transposed
  CSR, ``segment_rows``);
- ``spmm_heads``: ``out[i, h] = sum over in-edges e of w[e, h] * x[src(e), h]`` for
  H heads of C columns each, in place of H sparse products of C columns; over the
  transposed CSR it reads the forward's weights through the edge permutation;
- ``sddmm_heads``: ``out[e, h] = <a[dst(e), h], b[src(e), h]>``, the weights' gradient.

Triton is optional (it comes with torch's CUDA builds). ``available(device)`` says
whether these run: on CUDA tensors where Triton imports, unless
``FULLGRAPH_TRITON=0`` (or off). A kernel that fails to compile or launch warns once,
and the torch ops take over from all of them for the rest of the process.
``FULLGRAPH_TRITON=interpret`` with ``TRITON_INTERPRET=1`` (set before the first
import) runs them on CPU tensors through Triton's interpreter: the tests check them so
on a machine without a GPU.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

HAVE_TRITON = importlib.util.find_spec("triton") is not None
"""Triton ships with torch's CUDA builds; the CPU build has none. It is imported on
the first kernel's launch, never by a run on the CPU."""

_FAILED: list[str] = []

FP_FUSION = True
"""Whether the compiler may fuse a product and a sum into one rounding (FMA), passed to
every launch. Triton 3.9 warns when neither a launch nor ``TRITON_DEFAULT_FP_FUSION``
says, and its default is to turn off in 3.10; the kernels were measured and checked
on the GPU with fusion on (Triton 3.6's default), so they ask for it and keep the same
rounding whatever Triton's version."""


def available(device: torch.device) -> bool:
    """Whether the kernels here serve tensors on ``device`` (see the module's doc)."""
    mode = os.environ.get("FULLGRAPH_TRITON", "auto").strip().lower()
    if not HAVE_TRITON or mode in ("0", "off", "false", "no") or _FAILED:
        return False
    if device.type == "cuda":
        return True
    return mode == "interpret" and device.type == "cpu"


def describe(device: torch.device) -> str:
    """What serves GAT's attention, its multi-head SpMM and dropout on ``device``, for a
    run's header: Triton with its version, or the torch ops and why."""
    if available(device):
        version = "(version unknown)"
        for dist in ("triton", "pytorch-triton"):  # (the second: torch's nightly builds)
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        return f"Triton {version}" + (" (interpreter)" if device.type == "cpu" else "")
    if not HAVE_TRITON:
        return "torch ops (Triton is not installed)"
    if _FAILED:
        return f"torch ops (Triton kernel {_FAILED[0]} failed)"
    mode = os.environ.get("FULLGRAPH_TRITON", "auto").strip()
    if mode.lower() in ("0", "off", "false", "no"):
        return f"torch ops (FULLGRAPH_TRITON={mode})"
    return "torch ops (Triton kernels run on CUDA devices)"


def guarded(name: str, fn: Callable[[], Any], device: torch.device) -> Any:
    """``fn()`` with ``device`` current (Triton launches on the current CUDA device, not
    on its tensors'); None (and every kernel here off from now on, with one warning)
    where Triton fails to compile or launch it. Errors of torch (a device out of
    memory, say) pass."""
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                return fn()
        return fn()
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # the compiler or driver refused: the torch ops still work
        _FAILED.append(name)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        warnings.warn(f"Triton kernel {name} failed ({type(err).__name__}: {first}); "
                      "torch ops from now on", RuntimeWarning, stacklevel=3)
        return None


def _acc(t: Tensor) -> Any:
    """The accumulation type of the kernels for ``t``: float64 for float64, else float32."""
    import triton.language as tl

    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# The column blocks of the per-row kernels: BLOCK_H heads of BLOCK_C (a power of two
# at least C) columns, at most MAX_WIDTH columns per program.
MAX_WIDTH = 128
EDGES = 32
"""Edges per step of the per-row loops."""


def _head_blocks(heads: int, chans: int) -> tuple[int, int]:
    block_c = _pow2(chans)
    block_h = max(1, min(_pow2(heads), MAX_WIDTH // block_c))
    return block_h, block_c


def fits(heads: int, chans: int) -> bool:
    """Whether ``spmm_heads`` / ``sddmm_heads`` take heads of ``chans`` columns."""
    return heads > 0 and 0 < chans <= MAX_WIDTH


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernels (``_triton_kernels``), imported with Triton on first use."""
    from fullgraph.ops import _triton_kernels as k

    return SimpleNamespace(dropout=k._dropout_kernel, attention_fwd=k._attention_fwd_kernel,
                           attention_bwd=k._attention_bwd_kernel, spmm=k._spmm_heads_kernel,
                           sddmm=k._sddmm_heads_kernel)


_scales: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}


def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``scale`` as a one-entry tensor of ``dtype`` on ``device``, made once (a host to
    device copy per call would wait for the device). Kernels read float constants so:
    a float argument is float32, which rounds a float64 run's constants."""
    key = (scale, dtype, device)
    if key not in _scales:
        _scales[key] = torch.tensor([scale], dtype=dtype, device=device)
    return _scales[key]


def dropout_into(x: Tensor, keys: Tensor, seed: int, least: int, scale: float,
                 out: Tensor) -> bool:
    """``out = x * scale`` where the hash of (``seed``, the row's key, the column)
    reaches ``least``, else 0 (x (R, D) with unit column stride, ``keys`` (R,) int64,
    ``seed`` in [0, 2**32); the hash of ``ops.dropout``); False where the kernel failed
    (see ``guarded``)."""
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return True
    scale_t = _scale_tensor(scale, x.dtype, x.device)
    block_c = min(128, _pow2(cols))
    block_r = max(1, 4096 // block_c)
    grid = (_cdiv(rows, block_r), _cdiv(cols, block_c))

    def launch() -> bool:
        k = _kernels()
        k.dropout[grid](x, out, keys, seed, scale_t, rows, cols, x.stride(0), out.stride(0),
                        least, BLOCK_R=block_r, BLOCK_C=block_c, enable_fp_fusion=FP_FUSION)
        return True

    return bool(guarded("dropout", launch, x.device))


def attention_forward(indptr: Tensor, indices: Tensor, s_src: Tensor, s_dst: Tensor,
                      slope: float) -> Tensor | None:
    """(E, H) softmax weights of ``leaky_relu(s_src[src] + s_dst[dst])`` over each
    destination's in-edges; None where the kernel failed."""
    heads = s_src.shape[1]
    out = torch.empty(indices.numel(), heads, dtype=s_src.dtype, device=s_src.device)
    rows = indptr.numel() - 1
    if rows == 0 or out.numel() == 0:
        return out

    def launch() -> Tensor:
        k = _kernels()
        k.attention_fwd[(rows,)](indptr, indices, s_src, s_dst, out, heads,
                                 _scale_tensor(slope, s_src.dtype, s_src.device),
                                 BLOCK_E=EDGES, BLOCK_H=_pow2(heads), ACC=_acc(s_src),
                                 enable_fp_fusion=FP_FUSION)
        return out

    return guarded("attention", launch, s_src.device)


def attention_backward(indptr: Tensor, indices: Tensor, s_src: Tensor, s_dst: Tensor,
                       alpha: Tensor, grad: Tensor, slope: float
                       ) -> tuple[Tensor, Tensor] | None:
    """(d_pre (E, H), grad_dst (N_dst, H)): the gradient of the pre-activation scores
    and its sums per destination; None where the kernel failed."""
    heads = s_src.shape[1]
    d_pre = torch.empty_like(alpha)
    grad_dst = torch.zeros_like(s_dst)
    rows = indptr.numel() - 1
    if rows == 0 or alpha.numel() == 0:
        return d_pre, grad_dst

    def launch() -> tuple[Tensor, Tensor]:
        k = _kernels()
        k.attention_bwd[(rows,)](indptr, indices, s_src, s_dst, alpha, grad, d_pre,
                                 grad_dst, heads, _scale_tensor(slope, s_src.dtype, s_src.device),
                                 BLOCK_E=EDGES, BLOCK_H=_pow2(heads), ACC=_acc(s_src),
                                 enable_fp_fusion=FP_FUSION)
        return d_pre, grad_dst

    return guarded("attention backward", launch, s_src.device)


def spmm_heads(indptr: Tensor, indices: Tensor, x: Tensor, weight: Tensor | None,
               heads: int, perm: Tensor | None = None) -> Tensor | None:
    """(N_dst, H * C): per row i, the sum over its edges e of ``weight[e', h]`` times
    ``x[indices[e], h]`` (H heads of C columns; e' = ``perm[e]`` where given, the
    weights being in another CSR's edge order; no weight: a plain sum). None where the
    kernel failed."""
    width = x.shape[1]
    chans = width // heads
    rows = indptr.numel() - 1
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    block_h, block_c = _head_blocks(heads, chans)
    grid = (rows, _cdiv(heads, block_h))
    w = weight if weight is not None else x  # (unread without HAS_W)
    p = perm if perm is not None else indices

    def launch() -> Tensor:
        k = _kernels()
        k.spmm[grid](indptr, indices, p, w, x, out, heads, chans,
                     HAS_W=weight is not None, HAS_PERM=perm is not None, BLOCK_E=EDGES,
                     BLOCK_H=block_h, BLOCK_C=block_c, ACC=_acc(x), enable_fp_fusion=FP_FUSION)
        return out

    return guarded("spmm", launch, x.device)


def sddmm_heads(indptr: Tensor, indices: Tensor, a: Tensor, b: Tensor,
                heads: int) -> Tensor | None:
    """(E, H): ``<a[i, h], b[indices[e], h]>`` for each edge e of row i and head h (H
    heads of C columns); None where the kernel failed."""
    width = a.shape[1]
    chans = width // heads
    rows = indptr.numel() - 1
    out = torch.empty(indices.numel(), heads, dtype=a.dtype, device=a.device)
    if rows == 0 or out.numel() == 0:
        return out
    block_h, block_c = _head_blocks(heads, chans)
    grid = (rows, _cdiv(heads, block_h))

    def launch() -> Tensor:
        k = _kernels()
        k.sddmm[grid](indptr, indices, a, b, out, heads, chans, BLOCK_E=EDGES,
                      BLOCK_H=block_h, BLOCK_C=block_c, ACC=_acc(a), enable_fp_fusion=FP_FUSION)
        return out

    return guarded("sddmm", launch, a.device)
