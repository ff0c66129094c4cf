"""Row-wise T stages shared by the models: dense layers and activations.

Shapes: R rows, D_in / D_out columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.models.stages import StageContext, Transform

ACTIVATIONS = {
    "relu": F.relu,
    "elu": F.elu,
    "gelu": F.gelu,
    "leaky_relu": F.leaky_relu,
    "tanh": torch.tanh,
    "none": None,
}


def activation(name: str | None):
    """The activation function called ``name`` (None or "none" for identity)."""
    if name is None or name == "none":
        return None
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def glorot_linear(in_dim: int, out_dim: int) -> nn.Linear:
    """A bias-free linear map with Glorot-uniform weights (as GCN and GAT use)."""
    lin = nn.Linear(in_dim, out_dim, bias=False)
    nn.init.xavier_uniform_(lin.weight)
    return lin


class Dense(Transform):
    """``y = act(lin(x) + bias + root(layer_input) + layer_input if residual)``.

    Every part is optional, which covers a plain linear layer, the post-aggregation
    step of GCN (bias, activation), GraphSAGE's root weight and residual connections.

    Args:
        in_dim: columns of x.
        out_dim: columns of y.
        linear: apply a weight matrix to x (default: True); otherwise in_dim == out_dim.
        bias: add a bias (default: True).
        root_dim: when given, add ``root(layer_input)`` with a bias-free (root_dim,
            out_dim) weight (default: None).
        residual: add the layer input itself; needs its width to equal out_dim
            (default: False).
        act: activation name (default: None).
    """

    def __init__(self, in_dim: int, out_dim: int, *, linear: bool = True, bias: bool = True,
                 root_dim: int | None = None, residual: bool = False,
                 act: str | None = None) -> None:
        super().__init__(in_dim, out_dim)
        if not linear and in_dim != out_dim:
            raise ValueError(f"Dense without a weight keeps the width: {in_dim} != {out_dim}")
        self.lin = glorot_linear(in_dim, out_dim) if linear else None
        self.bias = nn.Parameter(nn.init.zeros_(Tensor(out_dim))) if bias else None
        self.root = glorot_linear(root_dim, out_dim) if root_dim else None
        self.residual = residual
        self.act_name = act
        self.act = activation(act)
        self.uses_layer_input = self.root is not None or residual

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        y = self.lin(x) if self.lin is not None else x
        if self.bias is not None:
            y = y + self.bias
        if self.root is not None:
            y = y + self.root(layer_input)
        if self.residual:
            y = y + layer_input
        return self.act(y) if self.act is not None else y

    def extra_repr(self) -> str:
        parts = [f"index={self.index}", f"{self.in_dim}->{self.out_dim}"]
        parts += [n for n, on in (("linear", self.lin is not None), ("bias", self.bias is not None),
                                  ("root", self.root is not None), ("residual", self.residual))
                  if on]
        return ", ".join(parts + [f"act={self.act_name}"])
