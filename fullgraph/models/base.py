"""Template GNN: layers, dropout, activation and the coupled / decoupled forms.

A subclass only says how one of its layers looks as stages (``conv``) and how its
decoupled propagation looks (``propagation``); the template adds a ``LayerInput``
(dropout) stage at the start of every layer, threads dimensions, activation and
residual options through, and builds the StageProgram. [PyG BasicGNN]

Coupled form (L layers): ``[LayerInput, conv]`` x L, activation after every layer but
the last. Decoupled form (NeutronTP §4.1, NeutronTask §5.1): an L-layer MLP of T
stages, then (for attention models) one E stage, then K parameter-free P stages
over a graph with self-loops (TAGCN: its own parameter-free filter, see ``tagcn``).
"""
from __future__ import annotations

from torch import nn

from fullgraph.models.layers import Dense
from fullgraph.models.stages import LayerInput, Stage, StageProgram


class GNN(StageProgram):
    """Base of every model.

    Args:
        in_dim: input feature columns.
        hidden: hidden columns.
        out_dim: output columns (classes).
        num_layers: number of layers L (default: 2).
        dropout: dropout probability on each hidden layer's input (default: 0.5).
        input_dropout: dropout on the input features (default: same as ``dropout``).
        activation: activation between layers (default: ``"relu"``).
        residual: add the layer input to the output of layers whose width does not
            change (default: False).
        decoupled: build the decoupled form (default: False).
        num_props: K, the number of propagation steps of the decoupled form
            (default: 2).
    """

    model_name = "gnn"
    coupled_self_loops = True
    # the decoupled form's propagation graph; every model but TAGCN adds self-loops
    decoupled_self_loops = True
    # the decoupled form's MLP layers: "glorot" or "linear" (see layers.init_linear),
    # as the coupled layers of the model's reference implementation
    mlp_init = "glorot"
    # the options ``conv`` reads from ``self.conv_options`` (beyond those ``__init__``
    # names): ``--model-options`` refuses any other
    conv_option_names: tuple[str, ...] = ()

    def stored_self_loops_note(self) -> str | None:
        """How this model treats the self-loops a graph stores, where PyG's layer of
        the same name would differ (the run warns on such a graph), else None."""
        if self.self_loops:
            return None
        return ("propagates without self-loops and leaves out the ones the graph stores "
                "(its own term is the root weight); PyG's SAGEConv and TAGConv would "
                "aggregate them")

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, *,
                 dropout: float = 0.5, input_dropout: float | None = None,
                 activation: str = "relu", residual: bool = False, decoupled: bool = False,
                 num_props: int = 2, **conv_options) -> None:
        # the module first: conv() may keep a module on self (one shared by several
        # layers, weights tied), which nn.Module allows only once it is set up
        nn.Module.__init__(self)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if decoupled and num_props < 1:
            raise ValueError(f"num_props (K) must be >= 1 for a decoupled model, got {num_props}")
        self.hidden, self.num_layers, self.activation = hidden, num_layers, activation
        self.residual, self.decoupled, self.num_props = residual, decoupled, num_props
        self.conv_options = conv_options
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        stages: list[Stage] = []
        starts: list[int] = []  # the LayerInput opening each layer (conv() may add more)
        for layer in range(num_layers):
            p = dropout if layer or input_dropout is None else input_dropout
            starts.append(len(stages))
            stages.append(LayerInput(dims[layer], p))
            last = layer == num_layers - 1
            act = None if last else activation
            res = residual and dims[layer] == dims[layer + 1]
            if decoupled:
                stages.append(Dense(dims[layer], dims[layer + 1], act=act, residual=res,
                                    init=self.mlp_init))
            else:
                stages.extend(self.conv(layer, dims[layer], dims[layer + 1], act=act, residual=res))
        if decoupled:
            stages.extend(self.propagation(out_dim, num_props))
        # a user's class without a model_name of its own is named by its class
        base = type(self).__name__ if self.model_name == GNN.model_name else self.model_name
        name = f"{base}{'-decoupled' if decoupled else ''}"
        super().__init__(stages, self_loops=(self.decoupled_self_loops if decoupled
                                             else self.coupled_self_loops),
                         name=name)
        self.layer_starts = starts  # the LayerInput opening each of the num_layers layers

    def conv(self, layer: int, in_dim: int, out_dim: int, *, act: str | None,
             residual: bool) -> list[Stage]:
        """Stages of coupled layer ``layer`` after its LayerInput."""
        raise NotImplementedError(f"{type(self).__name__} defines no conv(layer, in_dim, "
                                  "out_dim, *, act, residual): a model returns each layer's "
                                  "stages from it")

    def aggregate_first(self, in_dim: int, out_dim: int) -> bool:
        """Whether a linear layer propagates before its weight: the ``aggregate_first``
        option, else on the narrower side (``A (H W) = (A H) W``, fewer columns move)."""
        first = self.conv_options.get("aggregate_first")
        return in_dim <= out_dim if first is None else bool(first)

    def propagation(self, dim: int, num_props: int) -> list[Stage]:
        """Stages of the decoupled form after the MLP."""
        raise NotImplementedError(f"{type(self).__name__} defines no propagation(dim, "
                                  "num_props), the stages of its decoupled form: it trains "
                                  "without --decoupled")
