"""GIN (Xu et al., ICLR 2019) with the sum aggregator and a 2-layer MLP.

Layer: ``h_i' = act(MLP((1 + eps) h_i + sum_{j in N(i)} h_j))`` over a graph without
self-loops, eps fixed (PyG ``GINConv`` with ``train_eps=False``; default eps = 0).
MLP = Linear, ReLU, Linear. Decoupled form: MLP, then K sum steps over the graph
with self-loops (which is the eps = 0 update without the MLP).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.models.base import GNN
from fullgraph.models.layers import activation
from fullgraph.models.stages import Propagate, Stage, StageContext, Transform


class GINUpdate(Transform):
    """``act(lin2(relu(lin1(x + (1 + eps) * layer_input) + b1)) + b2)``."""

    uses_layer_input = True

    def __init__(self, in_dim: int, out_dim: int, hidden: int, eps: float,
                 act: str | None) -> None:
        super().__init__(in_dim, out_dim)
        self.eps = float(eps)
        self.lin1 = nn.Linear(in_dim, hidden)
        self.lin2 = nn.Linear(hidden, out_dim)
        self.act_name, self.act = act, activation(act)

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        h = x + (1.0 + self.eps) * layer_input
        y = self.lin2(F.relu(self.lin1(h)))
        return self.act(y) if self.act is not None else y

    def extra_repr(self) -> str:
        return f"index={self.index}, {self.in_dim}->{self.out_dim}, eps={self.eps}, act={self.act_name}"


class GIN(GNN):
    """Graph isomorphism network; options as ``GNN`` plus ``eps`` (default: 0.0)."""

    model_name = "gin"
    coupled_self_loops = False

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        if residual:
            raise ValueError("GIN does not take residual=True (its update already adds h_i)")
        eps = float(self.conv_options.get("eps", 0.0))
        return [Propagate(in_dim, "sum"), GINUpdate(in_dim, out_dim, self.hidden, eps, act)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        return [Propagate(dim, "sum") for _ in range(num_props)]


__all__ = ["GIN", "GINUpdate"]
