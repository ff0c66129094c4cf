"""GIN (Xu et al., ICLR 2019) with the sum aggregator and a 2-layer MLP.

Layer: ``h_i' = act(MLP((1 + eps) h_i + sum_{j in N(i)} h_j))`` over a graph without
self-loops, eps fixed (PyG ``GINConv`` with ``train_eps=False``; default eps = 0).
MLP = Linear, ReLU, Linear, or with ``batch_norm`` Linear, BatchNorm, ReLU, Linear
(PyG's ``MLP`` as its GIN example builds it). The linear layers are initialised as
``torch.nn.Linear`` (PyG's GIN wraps torch's). Batch normalisation uses statistics
over all vertices (``GlobalBatchNorm``). Decoupled form: MLP, then K sum steps over
the graph with self-loops (which is the eps = 0 update without the MLP).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.models.base import GNN
from fullgraph.models.layers import activation
from fullgraph.models.norm import GlobalBatchNorm
from fullgraph.models.stages import Propagate, Stage, StageContext, Transform


class GINUpdate(Transform):
    """``act(lin2(relu(norm(lin1(x + (1 + eps) * layer_input)))))``; ``norm`` is the
    identity unless ``batch_norm``."""

    uses_layer_input = True

    def __init__(self, in_dim: int, out_dim: int, hidden: int, eps: float,
                 act: str | None, batch_norm: bool = False) -> None:
        super().__init__(in_dim, out_dim)
        self.eps = float(eps)
        self.lin1 = nn.Linear(in_dim, hidden)
        self.norm = GlobalBatchNorm(hidden) if batch_norm else None
        self.lin2 = nn.Linear(hidden, out_dim)
        self.reduces_rows = batch_norm
        self.act_name, self.act = act, activation(act)

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        assert layer_input is not None, "GIN's update reads the layer input"
        h = self.lin1(torch.add(x, layer_input, alpha=1.0 + self.eps))  # one pass
        if self.norm is not None:
            h = self.norm(h, ctx)
        y = self.lin2(F.relu(h))
        return self.act(y) if self.act is not None else y

    def extra_repr(self) -> str:
        return (f"index={self.index}, {self.in_dim}->{self.out_dim}, eps={self.eps}, "
                f"batch_norm={self.norm is not None}, act={self.act_name}")


class GIN(GNN):
    """Graph isomorphism network; options as ``GNN`` plus:

    Args:
        eps: the fixed self weight (default: 0.0).
        batch_norm: batch normalisation inside each layer's MLP, statistics over all
            vertices (default: False); coupled form only.
    """

    model_name = "gin"
    coupled_self_loops = False
    mlp_init = "linear"

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, *,
                 batch_norm: bool = False, **options) -> None:
        if batch_norm and options.get("decoupled"):
            raise ValueError("GIN batch_norm=True needs the coupled form (decoupled=False): "
                             "the decoupled MLP has no batch normalisation")
        self.batch_norm = bool(batch_norm)
        super().__init__(in_dim, hidden, out_dim, num_layers, **options)

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        if residual:
            raise ValueError("GIN does not take residual=True (its update already adds h_i)")
        eps = float(self.conv_options.get("eps", 0.0))
        return [Propagate(in_dim, "sum"),
                GINUpdate(in_dim, out_dim, self.hidden, eps, act, self.batch_norm)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        return [Propagate(dim, "sum") for _ in range(num_props)]


__all__ = ["GIN", "GINUpdate"]
