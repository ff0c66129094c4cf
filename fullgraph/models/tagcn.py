"""TAGCN (Du et al., "Topology Adaptive Graph Convolutional Networks", 2017).

Layer (PyG's ``TAGConv``): ``H' = act(sum_{k=0..K} A_hat^k H W_k + b)`` with
``A_hat = D^-1/2 A D^-1/2`` over the graph *without* self-loops (``gcn_norm`` with
``add_self_loops=False``; a vertex without in-edges gets zero rows from every hop).

T stages see only their own rows and the layer input ``X`` (after dropout), so the K
hops are written with the existing stage kinds in one of two orders:

- projection first (Horner's scheme, ``K`` propagations of ``out`` columns):
  ``X W_0 + A(X W_1 + A(... + A(X W_K)))``: a T stage ``X W_K``, then K times a P
  stage followed by a T stage adding the next projection of the layer input
  (``Dense`` with a root weight, as GraphSAGE's root term);
- aggregate first (``K (K + 1) / 2`` times ``in`` columns propagated): the layer input
  is appended after each propagation, so after hop j the rows hold
  ``[A^j X, ..., A X]``; the last T stage appends ``X`` and applies all K + 1 weights
  at once.

Both give the same function; by default a layer takes the order that propagates
fewer columns (``aggregate_first`` overrides it, as for GCN and GraphSAGE).

Initialisation as PyG's ``TAGConv``: every ``W_k`` as ``torch.nn.Linear`` with fan-in
``in`` (uniform in +-1/sqrt(in)), the bias zero.

Decoupled form: the MLP, then the same polynomial filter without weights,
``sum_{k=0..K} A_hat^k H`` with K = ``num_props``, in Horner's form
(``H + A(H + A(... + A H))``) behind a dropout-free ``LayerInput`` that keeps ``H``
for the additions; no self-loops, as the coupled form.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fullgraph.models.base import GNN
from fullgraph.models.layers import Dense
from fullgraph.models.stages import LayerInput, Propagate, Stage, StageContext, Transform


class AppendInput(Transform):
    """``[x, layer_input]``: the rows so far with the layer input's columns appended."""

    uses_layer_input = True

    def __init__(self, in_dim: int, input_dim: int) -> None:
        super().__init__(in_dim, in_dim + input_dim)

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        assert layer_input is not None, "AppendInput reads the layer input"
        return torch.cat([x, layer_input], dim=1)

    def extra_repr(self) -> str:
        return f"index={self.index}, {self.in_dim}->{self.out_dim}"


class TAGCN(GNN):
    """Topology adaptive GCN; options as ``GNN`` plus:

    Args:
        hops: K, the hops of each coupled layer's filter (default: 3, as PyG).
        aggregate_first: propagate the layer input (True) or its projections (False)
            (default: None, whichever propagates fewer columns).
    """

    model_name = "tagcn"
    conv_option_names = ("aggregate_first",)
    coupled_self_loops = False
    decoupled_self_loops = False
    mlp_init = "linear"

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, *,
                 hops: int = 3, **options) -> None:
        if int(hops) < 1:
            raise ValueError(f"hops (K) must be >= 1 for TAGCN, got {hops}")
        self.hops = int(hops)
        super().__init__(in_dim, hidden, out_dim, num_layers, **options)

    def aggregate_first(self, in_dim: int, out_dim: int) -> bool:
        """The ``aggregate_first`` option, else the order that propagates fewer
        columns: ``in * K (K + 1) / 2`` against ``out * K``."""
        first = self.conv_options.get("aggregate_first")
        return in_dim * (self.hops + 1) < 2 * out_dim if first is None else bool(first)

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        k = self.hops
        if self.aggregate_first(in_dim, out_dim):
            stages: list[Stage] = [Propagate(in_dim, "gcn")]
            for hop in range(1, k):
                stages += [AppendInput(hop * in_dim, in_dim), Propagate((hop + 1) * in_dim, "gcn")]
            stages.append(Dense(k * in_dim, out_dim, root_dim=in_dim, act=act,
                                residual=residual, init="linear"))
        else:
            stages = [Dense(in_dim, out_dim, bias=False, init="linear")]
            for hop in range(k - 1, -1, -1):
                stages += [Propagate(out_dim, "gcn"),
                           Dense(out_dim, out_dim, linear=False, bias=hop == 0, root_dim=in_dim,
                                 act=act if hop == 0 else None,
                                 residual=residual and hop == 0, init="linear")]
        _init_as_pyg(stages, in_dim)
        return stages

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        stages: list[Stage] = [LayerInput(dim, 0.0)]
        for _ in range(num_props):
            stages += [Propagate(dim, "gcn"), Dense(dim, dim, linear=False, bias=False,
                                                    residual=True)]
        return stages


def _init_as_pyg(stages: list[Stage], in_dim: int) -> None:
    """Every hop weight uniform in +-1/sqrt(in_dim) (each of PyG's K + 1 ``Linear``
    layers reads ``in_dim`` columns, also where ours are concatenated), bias zero."""
    bound = 1.0 / math.sqrt(in_dim)
    with torch.no_grad():
        for s in stages:
            if isinstance(s, Dense):
                if s.lin is not None:
                    nn.init.uniform_(s.lin.weight, -bound, bound)
                if s.bias is not None:
                    s.bias.zero_()


__all__ = ["TAGCN", "AppendInput"]
