"""Models as a user writes them: ``GNN`` subclasses outside fullgraph, one with a
transform of its own (parameters, the layer input, a per-column gate) and a
``conv()`` option, one with attention of its own (an ``EdgeTransform``).
The tests name it by file (``tests/models/user_gnn.py:GatedGCN``) and by module."""
from __future__ import annotations

import torch
from torch import nn

from fullgraph.models import GNN, EdgeTransform, Propagate, Transform
from fullgraph.models.layers import Dense, activation
from fullgraph.ops.edge_softmax import edge_softmax


class Gate(Transform):
    """``a * x + (1 - a) * (h W_self + b)``, ``a = sigmoid(g)`` per column: the
    aggregated neighbours against the vertex's own projection, then the activation."""

    uses_layer_input = True

    def __init__(self, in_dim: int, out_dim: int, act: str | None) -> None:
        super().__init__(out_dim, out_dim)
        self.self_weight = nn.Linear(in_dim, out_dim)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, out_dim))
        self.act = activation(act)

    def forward(self, x, ctx, layer_input=None):
        a = torch.sigmoid(self.gate)
        out = a * x + (1 - a) * self.self_weight(layer_input)
        return out if self.act is None else self.act(out)


class GatedGCN(GNN):
    """Each layer: ``Dense`` (no bias), a propagation (``norm``: gcn, mean or sum, a
    conv option), then the gate."""

    model_name = "gated-gcn"
    conv_option_names = ("norm",)

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        norm = self.conv_options.get("norm", "gcn")
        return [Dense(in_dim, out_dim, bias=False), Propagate(out_dim, norm),
                Gate(in_dim, out_dim, act)]

    def propagation(self, dim, num_props):
        return [Propagate(dim, self.conv_options.get("norm", "gcn")) for _ in range(num_props)]


class DotAttention(EdgeTransform):
    """One head: each in-edge's weight is the softmax over the destination's in-edges
    of ``t * (x_dst . x_src) / sqrt(d)``, ``t`` a learned temperature."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = dim
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, graph, x_dst, x_src, ctx):
        src, dst = graph.indices.long(), graph.dst_index().long()
        scores = (x_dst[dst] * x_src[src]).sum(-1) * self.temperature / x_src.shape[1] ** 0.5
        return edge_softmax(graph, scores[:, None])


class DotGNN(GNN):
    """Attention of its own: Dense, DotAttention, the weighted sum, bias and activation."""

    model_name = "dot-gnn"

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [Dense(in_dim, out_dim, bias=False), DotAttention(out_dim),
                Propagate(out_dim, "edge"), Dense(out_dim, out_dim, linear=False, act=act)]

    def propagation(self, dim, num_props):
        return [DotAttention(dim), *(Propagate(dim, "edge") for _ in range(num_props))]


class AttendFirstGNN(GNN):
    """Attention over the layer's input rows, then a projection, then the weighted sum
    (E T P): a T stage between the attention and the sum that reads its weights."""

    model_name = "attend-first-gnn"

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [DotAttention(in_dim), Dense(in_dim, out_dim, bias=False),
                Propagate(out_dim, "edge"), Dense(out_dim, out_dim, linear=False, act=act)]


class Centre(Transform):
    """Subtracts the column means of the rows it is given: the mean of every vertex in
    one process, of a block of rows on a worker. It breaks the rule that a transform
    maps each row on its own (``ctx.sum_rows`` is the way to all rows' statistics)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim)

    def forward(self, x, ctx, layer_input=None):
        return x - x.mean(0)


class RowMixingGCN(GatedGCN):
    """``GatedGCN`` with ``Centre`` after each gate: not exact when rows are split."""

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [*super().conv(layer, in_dim, out_dim, act=act, residual=residual),
                Centre(out_dim)]


class CentreWhenEvaluating(Centre):
    """``Centre`` in evaluation only: the training losses agree, the accuracies do not."""

    def forward(self, x, ctx, layer_input=None):
        return x if ctx.training else super().forward(x, ctx, layer_input)


class EvalMixingGCN(GatedGCN):
    """``GatedGCN`` with ``CentreWhenEvaluating`` after each gate."""

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [*super().conv(layer, in_dim, out_dim, act=act, residual=residual),
                CentreWhenEvaluating(out_dim)]


class NotAModel(nn.Module):
    """A torch module that is no ``GNN``: refused as a model."""


if __name__ == "__main__":  # importing this file only defines the classes
    raise SystemExit("not a script")


class GlobalCentre(Transform):
    """Subtracts the column means over every vertex, as the README says a stage reads
    statistics over all rows: ``ctx.sum_rows`` with ``reduces_rows = True``."""

    reduces_rows = True

    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim)

    def forward(self, x, ctx, layer_input=None):
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        sums = ctx.sum_rows(torch.cat([x, ones], 1))
        return x - sums[:-1] / sums[-1]


class CentredGCN(GatedGCN):
    """``GatedGCN`` with ``GlobalCentre`` after each gate: exact where the executor sums
    over all rows, which a run over blocks of rows cannot."""

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [*super().conv(layer, in_dim, out_dim, act=act, residual=residual),
                GlobalCentre(out_dim)]
