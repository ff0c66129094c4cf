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
from torch import Tensor

from fullgraph.graph.csr import Graph


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
