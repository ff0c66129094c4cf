"""Softmax of edge scores over the in-edges of each destination (GAT attention).

``edge_softmax(graph, scores)[e, h] = exp(s[e, h]) / sum over in-edges e' of dst(e)
of exp(s[e', h])``, computed with the per-destination maximum subtracted for
stability. A destination's in-edges must all be present in ``graph`` (they are: a
CSR-by-destination block always holds whole rows), so the softmax needs no
communication in any executor.

On a GPU with Triton, GAT's attention weights are ``gpu_kernels``' (one program per
destination row, no atomics). Without numba and without those, the
per-destination maximum and sums are torch scatters by destination, or, where
``SEGMENTED`` says so for the device, segment reductions over the CSR offsets
(``torch.segment_reduce``); GAT's attention weights then also take their backward
sums over each destination's in-edges and over each source's out-edges (the
transposed CSR) as segments.

Shapes: E edges, H heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.ops import gpu_kernels, kernels
from fullgraph.ops.spmm import current_backend


def edge_softmax(graph: Graph, scores: Tensor) -> Tensor:
    """Normalise ``scores`` (E,) or (E, H) over each destination's in-edges."""
    if scores.shape[0] != graph.num_edges:
        raise ValueError(f"edge_softmax: scores must have E={graph.num_edges} rows, "
                         f"got {tuple(scores.shape)}")
    squeeze = scores.dim() == 1
    out = _EdgeSoftmax.apply(scores[:, None] if squeeze else scores, graph)
    return out[:, 0] if squeeze else out


SEGMENTED = {"cpu": False, "cuda": False}
"""Per device type: reduce over CSR segments (True) or scatter by destination. On an
H100 (10M vertices, 200M edges, 8 heads) segments made the forward 8 % faster and
forward + backward 22 % slower, so both devices scatter (``bench.gpu --steps
attention`` measures both)."""


def _segmented(t: Tensor) -> bool:
    return SEGMENTED.get(t.device.type, False)


def _segment_sum(values: Tensor, dst: Tensor, num_dst: int,
                 indptr: Tensor | None = None) -> Tensor:
    """(num_dst, H) sums of ``values`` (E, H) by destination (CSR order when
    ``indptr`` is given and the device reduces by segments)."""
    if indptr is not None and _segmented(values):
        return torch.segment_reduce(values, "sum", offsets=indptr, axis=0, unsafe=True)
    out = values.new_zeros(num_dst, values.shape[1])
    return out.index_add_(0, dst, values)


def _segment_max(values: Tensor, graph: Graph) -> Tensor:
    """(num_dst, H) maximum of ``values`` over each destination's in-edges."""
    if _segmented(values):
        return torch.segment_reduce(values, "max", offsets=graph.indptr, axis=0, unsafe=True)
    dst = graph.dst_index()
    peak = values.new_full((graph.num_dst, values.shape[1]), float("-inf"))
    return peak.scatter_reduce(0, dst[:, None].expand_as(values), values, reduce="amax",
                               include_self=True)


class _EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, graph: Graph) -> Tensor:
        dst = graph.dst_index()
        exp = (scores - _segment_max(scores, graph)[dst]).exp()
        out = exp / _segment_sum(exp, dst, graph.num_dst, graph.indptr)[dst]
        ctx.graph = graph
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (out,) = ctx.saved_tensors
        graph = ctx.graph
        dst = graph.dst_index()
        weighted = grad_out * out
        dot = _segment_sum(weighted, dst, graph.num_dst, graph.indptr)
        return out * (grad_out - dot[dst]), None


def attention_softmax(graph: Graph, s_src: Tensor, s_dst: Tensor,
                      negative_slope: float) -> Tensor:
    """GAT's attention weights: ``edge_softmax(leaky_relu(s_src[src] + s_dst[dst]))``.

    Args:
        graph: CSR by destination.
        s_src: (N_src, H) half-scores of the sources; s_dst: (N_dst, H) of the
            destinations.
        negative_slope: the LeakyReLU slope.

    Returns:
        (E, H) weights, differentiable in ``s_src`` and ``s_dst``. On CPU with numba
        (unless ``--spmm-backend torch``) one fused pass per row forward and backward,
        holding no (E, H) array but the output (and the backward's gradient);
        elsewhere the same from torch ops.
    """
    if s_src.shape[0] != graph.num_src or s_dst.shape[0] != graph.num_dst \
            or s_src.dim() != 2 or s_src.shape[1] != s_dst.shape[1]:
        raise ValueError(f"attention_softmax: s_src must be (num_src={graph.num_src}, H) and "
                         f"s_dst (num_dst={graph.num_dst}, H), got {tuple(s_src.shape)} and "
                         f"{tuple(s_dst.shape)}")
    if kernels.HAVE_NUMBA and s_src.device.type == "cpu" and s_dst.device.type == "cpu" \
            and current_backend() != "torch":
        return _AttentionSoftmax.apply(s_src, s_dst, graph, float(negative_slope))
    if gpu_kernels.available(s_src.device) and s_src.dtype == s_dst.dtype:
        return _TritonAttention.apply(s_src, s_dst, graph, float(negative_slope))
    if _segmented(s_src):
        return _SegmentedAttention.apply(s_src, s_dst, graph, float(negative_slope))
    src, dst = graph.edges()
    return edge_softmax(graph, F.leaky_relu(s_src[src] + s_dst[dst], negative_slope))


class _SegmentedAttention(torch.autograd.Function):
    """Attention weights from torch ops with segment reductions (GPU): the
    pre-activation is recomputed in the backward pass rather than kept, and the
    gradients of the half-scores are sums over CSR segments, not scatters."""

    @staticmethod
    def forward(ctx, s_src: Tensor, s_dst: Tensor, graph: Graph, slope: float) -> Tensor:
        ctx.graph, ctx.slope = graph, slope
        out = _attention_torch(s_src, s_dst, graph, slope)
        ctx.save_for_backward(s_src, s_dst, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        s_src, s_dst, alpha = ctx.saved_tensors
        return (*_attention_backward_torch(s_src, s_dst, alpha, grad_out, ctx.graph,
                                           ctx.slope), None, None)


def _attention_torch(s_src: Tensor, s_dst: Tensor, graph: Graph, slope: float) -> Tensor:
    src, dst = graph.edges()
    scores = F.leaky_relu(s_src[src] + s_dst[dst], slope)
    exp = (scores - _segment_max(scores, graph)[dst]).exp()
    del scores
    return exp.div_(_segment_sum(exp, dst, graph.num_dst, graph.indptr)[dst])


def _attention_backward_torch(s_src: Tensor, s_dst: Tensor, alpha: Tensor, grad_out: Tensor,
                              graph: Graph, slope: float) -> tuple[Tensor, Tensor]:
    """(grad of s_src, grad of s_dst) of ``_attention_torch``, from its output."""
    src, dst = graph.edges()
    d = alpha * grad_out
    dot = _segment_sum(d, dst, graph.num_dst, graph.indptr)
    d -= alpha * dot[dst]  # gradient of the softmax input
    positive = (s_src[src] + s_dst[dst]) > 0
    d = torch.where(positive, d, d * slope)  # through the LeakyReLU
    grad_dst = _segment_sum(d, dst, graph.num_dst, graph.indptr)
    t = graph.transpose()  # each source's out-edges, as segments
    grad_src = _segment_sum(d[t.perm], t.graph.dst_index(), graph.num_src, t.graph.indptr)
    return grad_src, grad_dst


class _TritonAttention(torch.autograd.Function):
    """Attention weights from Triton kernels (``gpu_kernels``): one program per
    destination computes its in-edges' weights (online maximum, then the sum and the
    weights), and in the backward pass their pre-activation gradients and its sum; the
    sources' sums are segments of the transposed CSR. No atomics: the same sums in the
    same order every run. Where a kernel fails, the torch ops above."""

    @staticmethod
    def forward(ctx, s_src: Tensor, s_dst: Tensor, graph: Graph, slope: float) -> Tensor:
        s_src, s_dst = s_src.detach().contiguous(), s_dst.detach().contiguous()
        out = gpu_kernels.attention_forward(graph.indptr, graph.indices, s_src, s_dst, slope)
        if out is None:
            out = _attention_torch(s_src, s_dst, graph, slope)
        ctx.graph, ctx.slope = graph, slope
        ctx.save_for_backward(s_src, s_dst, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        s_src, s_dst, alpha = ctx.saved_tensors
        graph = ctx.graph
        grad_out = grad_out.contiguous()
        got: tuple[Tensor, Tensor] | None = None
        grad_src: Tensor | None = None
        if gpu_kernels.available(alpha.device):  # (switched off since the forward pass?)
            got = gpu_kernels.attention_backward(graph.indptr, graph.indices, s_src, s_dst,
                                                 alpha, grad_out.to(alpha.dtype), ctx.slope)
        if got is not None:
            d_pre, grad_dst = got
            t = graph.transpose()
            # per source, the sum of d_pre over its out-edges, read through the permutation
            grad_src = gpu_kernels.spmm_heads(t.graph.indptr, t.perm, d_pre, None, 1)
        if grad_src is None:
            grad_src, grad_dst = _attention_backward_torch(s_src, s_dst, alpha, grad_out,
                                                           graph, ctx.slope)
        return grad_src, grad_dst, None, None


class _AttentionSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_src: Tensor, s_dst: Tensor, graph: Graph, slope: float) -> Tensor:
        s_src, s_dst = s_src.detach().contiguous(), s_dst.detach().contiguous()
        out = torch.empty(graph.num_edges, s_src.shape[1], dtype=s_src.dtype)
        kernels.attention_softmax(graph.indptr.numpy(), graph.indices.numpy(), s_src.numpy(),
                                  s_dst.numpy(), slope, out.numpy())
        ctx.graph, ctx.slope = graph, slope
        ctx.save_for_backward(s_src, s_dst, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        s_src, s_dst, alpha = ctx.saved_tensors
        graph = ctx.graph
        d_pre = torch.empty_like(alpha)
        grad_dst = torch.empty_like(s_dst)
        kernels.attention_softmax_backward(
            graph.indptr.numpy(), graph.indices.numpy(), s_src.numpy(), s_dst.numpy(),
            ctx.slope, alpha.numpy(), grad_out.contiguous().numpy(), d_pre.numpy(),
            grad_dst.numpy())
        grad_src = torch.empty_like(s_src)
        t = graph.transpose()
        # per source, the sum of d_pre over its out-edges: an unweighted SpMM over the
        # transposed CSR whose "source rows" are the edges, named by the permutation
        kernels.spmm_unweighted(t.graph.indptr.numpy(), t.perm.numpy(), d_pre.numpy(),
                                grad_src.numpy(), False)
        return grad_src, grad_dst, None, None
