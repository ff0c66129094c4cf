"""GCN (Kipf & Welling, ICLR 2017) as a stage program.

Layer: ``H' = act(A_hat H W + b)`` with ``A_hat = D^-1/2 (A + I) D^-1/2``. Because the
propagation is linear, ``A_hat (H W) = (A_hat H) W``: each layer propagates on the
narrower side (before the weight when it widens, after it when it narrows), as DGL's
GraphConv does. Both orders give the same numbers to float tolerance; the narrower
one moves and aggregates fewer columns. Decoupled form: MLP, then K steps of A_hat.
"""
from __future__ import annotations

from fullgraph.models.base import GNN
from fullgraph.models.layers import Dense
from fullgraph.models.stages import Propagate, Stage


class GCN(GNN):
    """Graph convolutional network; options as ``GNN`` plus ``aggregate_first``.

    Args:
        aggregate_first: propagate before the weight (True), after it (False), or on
            the narrower side (None, default).
    """

    model_name = "gcn"
    conv_option_names = ("aggregate_first",)
    coupled_self_loops = True

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        if self.aggregate_first(in_dim, out_dim):
            return [Propagate(in_dim, "gcn"), Dense(in_dim, out_dim, act=act, residual=residual)]
        return [Dense(in_dim, out_dim, bias=False), Propagate(out_dim, "gcn"),
                Dense(out_dim, out_dim, linear=False, act=act, residual=residual)]

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        return [Propagate(dim, "gcn") for _ in range(num_props)]
