"""Softmax of edge scores over the in-edges of each destination (GAT attention).

``edge_softmax(graph, scores)[e, h] = exp(s[e, h]) / sum over in-edges e' of dst(e)
of exp(s[e', h])``, computed with the per-destination maximum subtracted for
stability. A destination's in-edges must all be present in ``graph`` (they are: a
CSR-by-destination block always holds whole rows), so the softmax needs no
communication in any executor.

Shapes: E edges, H heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.ops import kernels
from fullgraph.ops.spmm import current_backend


def edge_softmax(graph: Graph, scores: Tensor) -> Tensor:
    """Normalise ``scores`` (E,) or (E, H) over each destination's in-edges."""
    if scores.shape[0] != graph.num_edges:
        raise ValueError(f"edge_softmax: scores must have E={graph.num_edges} rows, "
                         f"got {tuple(scores.shape)}")
    squeeze = scores.dim() == 1
    out = _EdgeSoftmax.apply(scores[:, None] if squeeze else scores, graph)
    return out[:, 0] if squeeze else out


def _segment_sum(values: Tensor, dst: Tensor, num_dst: int) -> Tensor:
    out = values.new_zeros(num_dst, values.shape[1])
    return out.index_add_(0, dst, values)


class _EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, graph: Graph) -> Tensor:
        dst = graph.dst_index()
        idx = dst[:, None].expand_as(scores)
        peak = scores.new_full((graph.num_dst, scores.shape[1]), float("-inf"))
        peak = peak.scatter_reduce(0, idx, scores, reduce="amax", include_self=True)
        exp = (scores - peak[dst]).exp()
        out = exp / _segment_sum(exp, dst, graph.num_dst)[dst]
        ctx.graph = graph
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (out,) = ctx.saved_tensors
        dst = ctx.graph.dst_index()
        weighted = grad_out * out
        return out * (grad_out - _segment_sum(weighted, dst, ctx.graph.num_dst)[dst]), None


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
    src, dst = graph.edges()
    return edge_softmax(graph, F.leaky_relu(s_src[src] + s_dst[dst], negative_slope))


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
        grad_src = torch.zeros_like(s_src)
        t = graph.transpose()
        # per source, the sum of d_pre over its out-edges: an unweighted SpMM over the
        # transposed CSR whose "source rows" are the edges, named by the permutation
        kernels.spmm_unweighted(t.graph.indptr.numpy(), t.perm.numpy(), d_pre.numpy(),
                                grad_src.numpy(), False)
        return grad_src, grad_dst, None, None
