"""GraphSAGE with the mean aggregator and a root weight (Hamilton et al., NeurIPS 2017).

Layer: ``h_i' = act(W_l mean_{j in N(i)} h_j + b + W_r h_i)`` over a graph without
self-loops, as PyG's ``SAGEConv``. The neighbour weight is applied on the narrower
side of the mean (it commutes with it); the root term reads the layer input.
Decoupled form: MLP, then K mean steps over the graph with self-loops.

Initialisation as PyG's ``SAGEConv``: ``lin_l`` and ``lin_r`` are PyG ``Linear``
layers with its default, ``torch.nn.Linear``'s (weights and bias uniform in
+-1/sqrt(in_dim)), not Glorot; so are the decoupled form's MLP layers.
"""
from __future__ import annotations

from fullgraph.models.base import GNN
from fullgraph.models.layers import Dense
from fullgraph.models.stages import Propagate, Stage


class GraphSAGE(GNN):
    """GraphSAGE-mean; options as ``GNN`` plus ``aggregate_first`` (see GCN)."""

    model_name = "sage"
    conv_option_names = ("aggregate_first",)
    coupled_self_loops = False
    mlp_init = "linear"

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        if self.aggregate_first(in_dim, out_dim):
            return [Propagate(in_dim, "mean"),
                    Dense(in_dim, out_dim, root_dim=in_dim, act=act, residual=residual,
                          init="linear")]
        return [Dense(in_dim, out_dim, bias=False, init="linear"), Propagate(out_dim, "mean"),
                Dense(out_dim, out_dim, linear=False, root_dim=in_dim, act=act,
                      residual=residual, init="linear", fan_in=in_dim)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        return [Propagate(dim, "mean") for _ in range(num_props)]
