"""GIN (Xu et al., ICLR 2019) with the sum aggregator and a 2-layer MLP.

Layer: ``h_i' = act(MLP((1 + eps) h_i + sum_{j in N(i)} h_j))``, eps fixed (PyG
``GINConv`` with ``train_eps=False``; default eps = 0). The sum runs over the graph
with one self-loop per vertex, so ``(A + I) h`` already holds ``h_i + sum_j h_j``; an
eps other than 0 adds ``eps * h_i`` from the layer input.
MLP = Linear, ReLU, Linear, or with ``batch_norm`` Linear, BatchNorm, ReLU, Linear
(PyG's ``MLP`` as its GIN example builds it). The MLP's first weight commutes with the
sum when eps = 0 (``(A + I)(h W) = ((A + I) h) W``), so a layer whose input is wider
than ``hidden`` applies it first and propagates ``hidden`` columns, not the input's
(``aggregate_first`` overrides the choice). The linear layers are initialised as
``torch.nn.Linear`` (PyG's GIN wraps torch's). Batch normalisation uses statistics
over all vertices (``GlobalBatchNorm``); the first linear's bias, which the norm
cancels, gets its exact gradient, 0 (autograd's is 0 up to rounding, which Adam would
turn into steps that differ by strategy and reach the norm's running mean, so the
saved model would depend on the strategy). Decoupled form: MLP, then K sum steps over
the graph with self-loops (which is the eps = 0 update without the MLP).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from fullgraph.models.base import GNN
from fullgraph.models.layers import Dense, activation, affine, init_bias, own_relu
from fullgraph.models.norm import GlobalBatchNorm
from fullgraph.models.stages import Propagate, Stage, StageContext, Transform
from fullgraph.ops.gemm import add_bias


class _Cancelled(torch.autograd.Function):
    """The identity, whose gradient is 0: a bias that the batch norm after it cancels."""

    @staticmethod
    def forward(ctx, bias: Tensor) -> Tensor:
        return bias.view_as(bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


class GINUpdate(Transform):
    """The MLP after the sum: ``act(lin2(relu(norm(h))))``, ``norm`` the identity
    unless ``batch_norm``, with

    - ``h = lin1(x + eps * layer_input)`` where the layer aggregated first
      (``x = (A + I) h_in``; the layer input is read only when eps != 0), or
    - ``h = x + bias1`` where the first weight was applied before the sum
      (``first_linear=False``, ``x = (A + I)(h_in W1)``; ``fan_in`` is W1's input
      width, which ``bias1``'s initialisation belongs to).
    """

    def __init__(self, in_dim: int, out_dim: int, hidden: int, eps: float,
                 act: str | None, batch_norm: bool = False, *, first_linear: bool = True,
                 fan_in: int | None = None) -> None:
        super().__init__(in_dim, out_dim)
        self.eps = float(eps)
        if first_linear:
            self.lin1: nn.Linear | None = nn.Linear(in_dim, hidden)
            self.bias1: nn.Parameter | None = None
        else:
            if in_dim != hidden or self.eps != 0.0:
                raise ValueError("a GIN update after the first weight takes hidden columns "
                                 f"and eps = 0, got {in_dim} columns (hidden {hidden}), "
                                 f"eps {self.eps}")
            self.lin1, self.bias1 = None, init_bias(hidden, fan_in or in_dim, "linear")
        self.norm = GlobalBatchNorm(hidden) if batch_norm else None
        self.lin2 = nn.Linear(hidden, out_dim)
        self.reduces_rows = batch_norm
        self.uses_layer_input = self.eps != 0.0
        self.act_name, self.act = act, activation(act)

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        if self.lin1 is None:
            assert self.bias1 is not None
            h = add_bias(x, self._before_norm(self.bias1))
        else:
            if self.eps != 0.0:
                assert layer_input is not None, "GIN's update reads the layer input"
                x = torch.add(x, layer_input, alpha=self.eps)
            bias = self.lin1.bias
            h = affine(x, self.lin1.weight, None if bias is None else self._before_norm(bias))
        if self.norm is not None:
            h = self.norm(h, ctx)
        y = self.lin2(own_relu(h))  # h and y are fresh: their ReLU reuses them
        if self.act is None:
            return y
        return own_relu(y) if self.act_name == "relu" else self.act(y)

    def _before_norm(self, bias: Tensor) -> Tensor:
        """``bias``, whose gradient is exactly 0 where a batch norm follows: the norm
        takes the batch mean away, so its gradient is 0 but for rounding, which Adam
        would scale to full steps (a random walk that differs by strategy, carried into
        the running mean and so into the saved model); weight decay still applies."""
        return bias if self.norm is None else _Cancelled.apply(bias)

    def extra_repr(self) -> str:
        return (f"index={self.index}, {self.in_dim}->{self.out_dim}, eps={self.eps}, "
                f"first_linear={self.lin1 is not None}, "
                f"batch_norm={self.norm is not None}, act={self.act_name}")


class GIN(GNN):
    """Graph isomorphism network; options as ``GNN`` plus:

    Args:
        eps: the fixed self weight (default: 0.0).
        aggregate_first: sum the layer input before the MLP's first weight (default:
            where the input is at most ``hidden`` wide, or eps != 0).
        batch_norm: batch normalisation inside each layer's MLP, statistics over all
            vertices (default: False); coupled form only.
    """

    model_name = "gin"
    conv_option_names = ("eps", "aggregate_first")
    coupled_self_loops = True
    mlp_init = "linear"

    def stored_self_loops_note(self) -> str | None:
        if self.decoupled:  # (sums over A + I, as a decoupled GCN propagates)
            return None
        return ("sums over exactly one self-loop per vertex (its (1 + eps) h_i term), "
                "whatever the graph stores; PyG's GINConv would count a stored self-loop "
                "again, as a neighbour")

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
        first = self.conv_options.get("aggregate_first")
        if first is None:
            first = eps != 0.0 or in_dim <= self.hidden
        elif not first and eps != 0.0:
            raise ValueError(f"GIN with eps = {eps} aggregates first (its update adds "
                             "eps * h_i to the sum): aggregate_first=False needs eps = 0")
        if first:
            return [Propagate(in_dim, "sum"),
                    GINUpdate(in_dim, out_dim, self.hidden, eps, act, self.batch_norm)]
        return [Dense(in_dim, self.hidden, bias=False, init="linear"),
                Propagate(self.hidden, "sum"),
                GINUpdate(self.hidden, out_dim, self.hidden, 0.0, act, self.batch_norm,
                          first_linear=False, fan_in=in_dim)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        return [Propagate(dim, "sum") for _ in range(num_props)]


__all__ = ["GIN", "GINUpdate"]
