"""Weighted sparse-dense matrix product over a CSR by destination, with its backward.

``spmm(graph, x, weight)`` computes, for every destination row i,
``out[i] = sum over in-edges e = (j -> i) of weight[e] * x[j]``. With ``H`` heads the
weight is (E, H) and x is viewed as (N_src, H, C): head h of the output uses column
block h of x and weight column h (multi-head attention). ``reduce="mean"`` without
weights divides each row by its in-degree.

Backward goes through the graph's cached transposed CSR: ``grad_x = A^T grad_out``
is the same kernel on the transpose with permuted weights, and the weight gradient
is a sampled dense-dense product (SDDMM) ``grad_w[e] = <grad_out[i], x[j]>``. We do
not use torch's generic sparse autograd, which measured about 2x slower than forward.

Backends: ``torch`` (``torch.sparse.mm`` on a CSR tensor: CPU and CUDA) and ``numba``
(parallel CSR loops, CPU). ``auto`` is torch on GPU and, on CPU, whichever measured
faster on this machine (``fullgraph.ops.select``: timed once, remembered in the
user cache directory). The SDDMM of the weight gradient uses numba on CPU when
installed (torch's fallback materialises an (E, D) product). On a GPU with Triton,
weights with several heads (GAT) take ``gpu_kernels``' SpMM, forward and transposed,
and the SDDMM is its kernel too.

Shapes: N_dst, N_src vertices, E edges, D = H * C feature columns.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from fullgraph.extras import MissingExtraError, missing_message
from fullgraph.graph.csr import Graph, Transposed
from fullgraph.ops import gpu_kernels, kernels, padded

if TYPE_CHECKING:
    from fullgraph.ops.select import Choice

Reduce = Literal["sum", "mean"]
Backend = Literal["auto", "numba", "torch"]
_BACKEND: list[str] = ["auto"]  # process-wide choice, set once by the runtime
_AUTO: list[Choice | None] = [None]  # what auto means on CPU, chosen on first use
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def set_backend(name: str) -> None:
    """Choose the SpMM backend for this process (``auto``, ``numba`` or ``torch``)."""
    if name not in ("auto", "numba", "torch"):
        raise ValueError(f"unknown SpMM backend {name!r}; expected auto, numba or torch")
    if name == "numba" and not kernels.HAVE_NUMBA:
        raise MissingExtraError(missing_message("numba", "SpMM backend 'numba'") +
                                " (or use --spmm-backend torch)")
    _BACKEND[0] = name


def current_backend() -> str:
    """The backend set for this process (``auto``, ``numba`` or ``torch``)."""
    return _BACKEND[0]


def resolve_backend(device: torch.device) -> str:
    """The backend in use on ``device`` (``auto`` resolved)."""
    name = _BACKEND[0]
    if device.type != "cpu":
        return "torch"
    return auto_choice().name if name == "auto" else name


def auto_choice() -> Choice:
    """What ``auto`` means on CPU in this process (measured or read on first use)."""
    choice = _AUTO[0]
    if choice is None:
        from fullgraph.ops.select import choose

        choice = _AUTO[0] = choose()
    return choice


def set_auto(choice: Choice) -> None:
    """Make ``auto`` mean ``choice`` in this process (workers take rank 0's)."""
    _AUTO[0] = choice


def describe_backend(device: torch.device) -> str:
    """The backend in use on ``device``, with why when ``auto`` chose it."""
    if device.type == "cpu" and _BACKEND[0] == "auto":
        return auto_choice().describe()
    return resolve_backend(device)


def spmm(graph: Graph, x: Tensor, weight: Tensor | None = None, reduce: Reduce = "sum") -> Tensor:
    """Aggregate ``x`` over the in-edges of every destination of ``graph``.

    Args:
        graph: CSR by destination with ``num_src == x.shape[0]``.
        x: (N_src, D) source rows.
        weight: None, (E,) or (E, H) edge weights; with H heads, D must be divisible by H.
        reduce: ``"sum"`` or ``"mean"`` (mean only without weights) (default: ``"sum"``).

    Returns:
        (N_dst, D) aggregated rows, differentiable in ``x`` and ``weight``.
    """
    if x.dim() != 2 or x.shape[0] != graph.num_src:
        raise ValueError(f"spmm: x must be (num_src={graph.num_src}, D), got {tuple(x.shape)}")
    if weight is not None:
        if reduce != "sum":
            raise ValueError("spmm: reduce='mean' takes no weights (fold 1/deg into them)")
        if weight.shape[0] != graph.num_edges or weight.dim() not in (1, 2):
            raise ValueError(f"spmm: weight must be (E={graph.num_edges},) or (E, H), "
                             f"got {tuple(weight.shape)}")
        if weight.dim() == 2 and x.shape[1] % weight.shape[1]:
            raise ValueError(f"spmm: {x.shape[1]} columns do not split into "
                             f"{weight.shape[1]} heads")
    return _SpMM.apply(x, weight, graph, reduce)


class _SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, graph: Graph, reduce: str) -> Tensor:
        ctx.graph, ctx.reduce = graph, reduce
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None, weight)
        return aggregate(graph, x, weight, reduce)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        graph = ctx.graph
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = transposed_aggregate(graph, grad_out, weight, ctx.reduce)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = edge_dot(graph, grad_out.contiguous(), x, heads=_heads(weight))
            if weight.dim() == 1:
                grad_w = grad_w[:, 0]
        return grad_x, grad_w, None, None


def spmm_add_(out: Tensor, graph: Graph, x: Tensor, weight: Tensor) -> Tensor:
    """``out += spmm(graph, x, weight)`` in place, differentiable in ``out`` and ``x``:
    sums over several graphs that share destinations (a graph cut by source blocks)
    without a new (N_dst, D) tensor per block. ``weight`` (E,) is fixed (no gradient).
    """
    if out.dim() != 2 or out.shape != (graph.num_dst, x.shape[1]):
        raise ValueError(f"spmm_add_: out must be (num_dst={graph.num_dst}, {x.shape[1]}), "
                         f"got {tuple(out.shape)}")
    if x.dim() != 2 or x.shape[0] != graph.num_src:
        raise ValueError(f"spmm_add_: x must be (num_src={graph.num_src}, D), got "
                         f"{tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != graph.num_edges or weight.requires_grad:
        raise ValueError(f"spmm_add_: weight must be fixed (E={graph.num_edges},) weights, "
                         f"got {tuple(weight.shape)} (requires_grad={weight.requires_grad})")
    return _SpMMAdd.apply(out, x, weight, graph)


class _SpMMAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, weight: Tensor, graph: Graph) -> Tensor:
        ctx.graph = graph
        ctx.save_for_backward(weight)
        if resolve_backend(x.device) == "numba" and out.is_contiguous():
            kernels.spmm_scalar(graph.indptr.numpy(), graph.indices.numpy(),
                                weight.detach().to(x.dtype).contiguous().numpy(),
                                x.detach().contiguous().numpy(), out.detach().numpy(), None, True)
        else:
            out.add_(aggregate(graph, x, weight, "sum"))
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = transposed_aggregate(ctx.graph, grad, weight, "sum")
        return grad, grad_x, None, None


def transposed_aggregate(graph: Graph, grad_out: Tensor, weight: Tensor | None,
                         reduce: str) -> Tensor:
    """The gradient of ``aggregate(graph, x, weight, reduce)`` in ``x``: the SpMM over
    the transposed CSR (built once per graph), without autograd."""
    t = graph.transpose()
    if weight is None and reduce == "mean":
        inv_deg = 1.0 / graph.in_degrees().clamp(min=1).to(grad_out.dtype)
        return aggregate(t.graph, grad_out * inv_deg[:, None], None, "sum")
    if weight is not None and (ordered := t.weights_in_order(weight)) is not None:
        return aggregate(t.graph, grad_out, ordered, "sum")
    if weight is not None and resolve_backend(grad_out.device) == "numba":
        wide = _widened(grad_out, weight)
        if wide is not None:
            return padded.rows_of(_transposed_numba(t, wide, weight), grad_out.shape[1])
        return _transposed_numba(t, grad_out.contiguous(), weight)
    if weight is not None and (heads := _heads(weight)) > 1 \
            and _triton_takes(grad_out, heads):
        # the forward's weights read through the permutation, all heads in one pass
        out = gpu_kernels.spmm_heads(t.graph.indptr, t.graph.indices, grad_out.contiguous(),
                                     weight.detach().to(grad_out.dtype).contiguous(), heads,
                                     perm=t.perm)
        if out is not None:
            return out
    w_t = None if weight is None else weight[t.perm]
    return aggregate(t.graph, grad_out, w_t, "sum")


def _triton_takes(x: Tensor, heads: int) -> bool:
    """Whether ``gpu_kernels``' multi-head kernels take ``x``'s columns in ``heads``."""
    return (gpu_kernels.available(x.device) and x.dim() == 2 and x.shape[1] % heads == 0
            and gpu_kernels.fits(heads, x.shape[1] // heads))


def transposed_rows_into(graph: Graph, grad_out: Tensor, weight: Tensor | None, lo: int,
                         hi: int, out: Tensor) -> Tensor:
    """Rows ``lo`` to ``hi`` of ``transposed_aggregate(graph, grad_out, weight, "sum")``
    written into ``out`` ((hi - lo, D), any memory: a shared-memory window, say), the
    same values to the bit; with the numba kernels only those rows are computed."""
    g = grad_out.contiguous()
    if resolve_backend(g.device) != "numba" or (weight is not None and weight.dim() != 1):
        return out.copy_(transposed_aggregate(graph, g, weight, "sum")[lo:hi])
    t = graph.transpose()
    # the row range of the transposed CSR: its offsets index the whole edge arrays
    indptr, indices = t.graph.indptr[lo:hi + 1].numpy(), t.graph.indices.numpy()
    if weight is None:
        kernels.spmm_unweighted(indptr, indices, g.numpy(), out.numpy(), False)
    elif (ordered := t.weights_in_order(weight)) is not None:
        kernels.spmm_scalar(indptr, indices, ordered.detach().to(g.dtype).contiguous().numpy(),
                            g.numpy(), out.numpy())
    else:  # the same weights read through the permutation: the same sums
        kernels.spmm_scalar(indptr, indices, weight.detach().to(g.dtype).contiguous().numpy(),
                            g.numpy(), out.numpy(), t.perm.numpy())
    return out


def _heads(weight: Tensor | None) -> int:
    return 1 if weight is None or weight.dim() == 1 else int(weight.shape[1])


def aggregate(graph: Graph, x: Tensor, weight: Tensor | None, reduce: str) -> Tensor:
    """Forward SpMM without autograd (the kernel dispatch). Padded rows
    (``ops.padded``) are aggregated whole, into padded rows."""
    if resolve_backend(x.device) == "numba":
        wide = _widened(x, weight)
        if wide is not None:
            return padded.rows_of(_aggregate_numba(graph, wide, weight, reduce), x.shape[1])
        return _aggregate_numba(graph, x.contiguous(), weight, reduce)
    return _aggregate_torch(graph, x.contiguous(), weight, reduce)


def _widened(x: Tensor, weight: Tensor | None) -> Tensor | None:
    """The whole rows under padded ``x``, where a kernel may read them: one weight per
    edge at most (heads split the columns)."""
    return None if weight is not None and weight.dim() != 1 else padded.widen(x)


def edge_dot(graph: Graph, a: Tensor, b: Tensor, heads: int = 1) -> Tensor:
    """SDDMM: (E, heads) with ``out[e, h] = <a[dst_e, h], b[src_e, h]>``."""
    if kernels.HAVE_NUMBA and a.device.type == "cpu" and _BACKEND[0] != "torch":
        out = torch.empty(graph.num_edges, heads, dtype=a.dtype)
        kernels.sddmm(graph.indptr.numpy(), graph.indices.numpy(), a.detach().numpy(),
                      b.detach().contiguous().numpy(), out.numpy())
        return out
    chans = a.shape[1] // heads
    if chans == 0:  # a worker's column slice may be empty
        return a.new_zeros(graph.num_edges, heads)
    if _triton_takes(a, heads) and b.shape == (graph.num_src, a.shape[1]) \
            and a.shape[0] == graph.num_dst and a.dtype == b.dtype:
        dots = gpu_kernels.sddmm_heads(graph.indptr, graph.indices, a.detach().contiguous(),
                                       b.detach().contiguous(), heads)
        if dots is not None:
            return dots
    src, dst = graph.edges()
    return (a[dst].view(-1, heads, chans) * b[src].view(-1, heads, chans)).sum(-1)


def splits(graph: Graph, x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``split_aggregate`` takes ``x`` as the first ``x.shape[0]`` sources of
    ``graph``: the numba kernels run, and every row lists its in-edges from them first
    (``Graph.source_split``)."""
    return (resolve_backend(x.device) == "numba" and (weight is None or weight.dim() == 1)
            and x.shape[0] <= graph.num_src and graph.source_split(x.shape[0]) is not None)


def split_aggregate(graph: Graph, x: Tensor, halo: Tensor, weight: Tensor | None) -> Tensor:
    """``aggregate(graph, cat([x, halo]), weight, "sum")`` without the concatenation:
    the same sums in the same order, where ``splits(graph, x, weight)``.

    Shapes: x (N_x, D) and halo (N_src - N_x, D), one dtype; weight None or (E,)."""
    split = graph.source_split(x.shape[0])
    if (not splits(graph, x, weight) or split is None or x.dtype != halo.dtype
            or x.shape[0] + halo.shape[0] != graph.num_src or x.shape[1:] != halo.shape[1:]):
        raise ValueError(f"split_aggregate: rows {tuple(x.shape)} {x.dtype} and halo "
                         f"{tuple(halo.shape)} {halo.dtype} for {graph}; the graph must list "
                         "each row's in-edges from the rows first, on the numba backend")
    out = torch.empty(graph.num_dst, x.shape[1], dtype=x.dtype)  # every row written
    wide = padded.widen(x.detach())  # padded rows are read at their stride
    x, halo = x.detach().contiguous() if wide is None else wide, halo.detach().contiguous()
    w = None if weight is None else weight.detach().to(x.dtype).contiguous().numpy()
    kernels.spmm_split(graph.indptr.numpy(), split.numpy(), graph.indices.numpy(), w,
                       x.numpy(), halo.numpy(), out.numpy())
    return out


def _aggregate_numba(graph: Graph, x: Tensor, weight: Tensor | None, reduce: str) -> Tensor:
    out = torch.empty(graph.num_dst, x.shape[1], dtype=x.dtype)  # the kernels write every row
    indptr, indices, xs = graph.indptr.numpy(), graph.indices.numpy(), x.detach().numpy()
    if weight is None:
        kernels.spmm_unweighted(indptr, indices, xs, out.numpy(), reduce == "mean")
    elif weight.dim() == 1:
        kernels.spmm_scalar(indptr, indices, weight.detach().to(x.dtype).contiguous().numpy(),
                            xs, out.numpy())
    else:
        kernels.spmm_weighted(indptr, indices, weight.detach().to(x.dtype).contiguous().numpy(),
                              xs, out.numpy())
    return out


def _transposed_numba(t: Transposed, g: Tensor, weight: Tensor) -> Tensor:
    """The weighted SpMM over the transposed CSR ``t``, reading the forward's edge
    weights through ``t.perm`` in place (no (E, H) gather per backward pass)."""
    out = torch.empty(t.graph.num_dst, g.shape[1], dtype=g.dtype)
    w = weight.detach().to(g.dtype).contiguous().numpy()
    args = (t.graph.indptr.numpy(), t.graph.indices.numpy(), w, g.numpy(), out.numpy(),
            t.perm.numpy())
    if weight.dim() == 1:
        kernels.spmm_scalar(*args)
    else:
        kernels.spmm_weighted(*args)
    return out


def _aggregate_torch(graph: Graph, x: Tensor, weight: Tensor | None, reduce: str) -> Tensor:
    heads = _heads(weight)
    if heads > 1 and reduce == "sum" and _triton_takes(x, heads):  # not H products
        assert weight is not None
        out = gpu_kernels.spmm_heads(graph.indptr, graph.indices, x.detach(),
                                     weight.detach().to(x.dtype).contiguous(), heads)
        if out is not None:
            return out
    if weight is None:
        values = torch.ones(graph.num_edges, 1, dtype=x.dtype, device=x.device)
    else:
        values = weight.detach().to(x.dtype).reshape(graph.num_edges, heads)
    chans = x.shape[1] // heads
    outs = []
    for h in range(heads):
        adj = torch.sparse_csr_tensor(graph.indptr, graph.indices_int64(),
                                      values[:, h].contiguous(),
                                      size=(graph.num_dst, graph.num_src),
                                      check_invariants=False)
        outs.append(torch.sparse.mm(adj, x[:, h * chans:(h + 1) * chans].detach()))
    out = outs[0] if heads == 1 else torch.cat(outs, dim=1)
    if reduce == "mean":
        out = out / graph.in_degrees().clamp(min=1).to(x.dtype)[:, None]
    return out
