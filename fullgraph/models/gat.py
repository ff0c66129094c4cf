"""GAT (Velickovic et al., ICLR 2018): multi-head attention, LeakyReLU, attention dropout.

Layer: ``x' = x W`` viewed as (N, H, C); score of edge j -> i and head h is
``leaky_relu(a_src[h] . x'_j[h] + a_dst[h] . x'_i[h])``, softmax over the in-edges of
i (self-loop included), dropout on the coefficients, then the weighted sum of x'_j;
heads are concatenated (hidden layers) or averaged (the last layer), plus a bias.
This matches PyG's ``GATConv`` with ``add_self_loops=True``.

As stages: T (x W), E (attention), P (weighted by the E output), T (heads, bias,
activation). Decoupled form (NeutronTP §4.1): MLP, one E stage computing attention
from the MLP output, then K P stages that all reuse those coefficients.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fullgraph.graph.csr import Graph
from fullgraph.models.base import GNN
from fullgraph.models.layers import Dense, activation
from fullgraph.models.stages import (
    EdgeTransform,
    Propagate,
    Stage,
    StageContext,
    Transform,
    check_probability,
    stage_seed,
)
from fullgraph.ops import keyed_dropout
from fullgraph.ops.edge_softmax import attention_softmax
from fullgraph.ops.gemm import add_bias


class GATAttention(EdgeTransform):
    """Edge weights (E, H) from projected rows (N, H * C).

    Args:
        heads: H.
        channels: C, columns per head.
        negative_slope: LeakyReLU slope (default: 0.2).
        dropout: dropout on the coefficients, keyed by edge id and head (default: 0.0).
    """

    def __init__(self, heads: int, channels: int, negative_slope: float = 0.2,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.channels = heads, channels
        self.in_dim = self.out_dim = heads * channels
        self.negative_slope = negative_slope
        self.p = check_probability(dropout, "attn_dropout")
        self.att_src = nn.Parameter(torch.empty(heads, channels))
        self.att_dst = nn.Parameter(torch.empty(heads, channels))
        # Glorot as PyG's GATConv draws its (1, H, C) vectors: fans H and C (torch's
        # xavier_uniform_ on that view takes H * C and C, a 2-3x narrower range)
        bound = math.sqrt(6.0 / (heads + channels))
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)

    def scores(self, x: Tensor, which: str) -> Tensor:
        """(R, H) per-vertex half-scores ``a_which . x[h]``."""
        att = self.att_src if which == "src" else self.att_dst
        return (x.view(-1, self.heads, self.channels) * att).sum(-1)

    def forward(self, graph: Graph, x_dst: Tensor, x_src: Tensor, ctx: StageContext) -> Tensor:
        alpha = attention_softmax(graph, self.scores(x_src, "src"), self.scores(x_dst, "dst"),
                                  self.negative_slope)
        if ctx.eids is None and self.p and ctx.training:
            raise ValueError("attention dropout needs global edge ids (ctx.eids)")
        keys = ctx.eids if ctx.eids is not None else torch.arange(graph.num_edges)
        return keyed_dropout(alpha, self.p, keys, stage_seed(ctx.seed, self.index), ctx.training)

    def extra_repr(self) -> str:
        return f"index={self.index}, heads={self.heads}, channels={self.channels}, p={self.p}"


class GATOutput(Transform):
    """Concatenate (or average) heads, add the bias, apply the activation."""

    def __init__(self, heads: int, channels: int, *, concat: bool, act: str | None,
                 residual: bool) -> None:
        out_dim = heads * channels if concat else channels
        super().__init__(heads * channels, out_dim)
        self.heads, self.channels, self.concat = heads, channels, concat
        self.bias = nn.Parameter(torch.zeros(out_dim))
        self.residual = residual
        self.uses_layer_input = residual
        self.act_name, self.act = act, activation(act)

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        if not self.concat:
            x = x.view(-1, self.heads, self.channels).mean(1)
        y = add_bias(x, self.bias)
        if self.residual:
            assert layer_input is not None, "a residual stage reads the layer input"
            y = y + layer_input
        return self.act(y) if self.act is not None else y


class GAT(GNN):
    """Graph attention network; options as ``GNN`` plus:

    Args:
        heads: attention heads of hidden layers (default: 8); ``hidden`` is the width
            per head, so a hidden layer outputs ``heads * hidden`` columns.
        out_heads: heads of the last layer, averaged (default: 1).
        attn_dropout: dropout on attention coefficients (default: same as dropout).
        negative_slope: LeakyReLU slope (default: 0.2).
    """

    model_name = "gat"
    coupled_self_loops = True

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, *,
                 heads: int = 8, out_heads: int = 1, attn_dropout: float | None = None,
                 negative_slope: float = 0.2, dropout: float = 0.5, **options) -> None:
        self.heads, self.out_heads, self.negative_slope = heads, out_heads, negative_slope
        self.attn_dropout = dropout if attn_dropout is None else attn_dropout
        if not options.get("decoupled"):
            hidden = hidden * heads  # the template threads the concatenated width
        super().__init__(in_dim, hidden, out_dim, num_layers, dropout=dropout, **options)

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        last = layer == self.num_layers - 1
        heads = self.out_heads if last else self.heads
        channels = out_dim if last else out_dim // heads
        return [Dense(in_dim, heads * channels, bias=False),
                GATAttention(heads, channels, self.negative_slope, self.attn_dropout),
                Propagate(heads * channels, "edge"),
                GATOutput(heads, channels, concat=not last, act=act, residual=residual)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        att = GATAttention(1, dim, self.negative_slope, self.attn_dropout)
        return [att] + [Propagate(dim, "edge") for _ in range(num_props)]
