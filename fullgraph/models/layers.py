"""Row-wise T stages shared by the models: dense layers and activations.

Shapes: R rows, D_in / D_out columns.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.models.stages import StageContext, Transform
from fullgraph.ops.dropout import (
    dropout_matmul,
    dropped_from,
    graph_kept,
    mark_relu_output,
    materialized,
    matmul_t,
)
from fullgraph.ops.gemm import add_bias
from fullgraph.ops.sparse import is_sparse, sparse_linear

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


INITS = ("glorot", "linear")


def glorot_linear(in_dim: int, out_dim: int) -> nn.Linear:
    """A bias-free linear map with Glorot-uniform weights (as GCN and GAT use)."""
    return init_linear(in_dim, out_dim, "glorot")


def init_linear(in_dim: int, out_dim: int, init: str) -> nn.Linear:
    """A bias-free linear map initialised by ``init``.

    ``"glorot"``: Glorot-uniform, as PyG's ``GCNConv`` and ``GATConv``. ``"linear"``:
    ``torch.nn.Linear``'s default, uniform in +-1/sqrt(in_dim), as PyG's ``Linear``
    with no initialiser named (``SAGEConv``'s ``lin_l`` / ``lin_r``).
    """
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {', '.join(INITS)}")
    lin = nn.Linear(in_dim, out_dim, bias=False)  # torch's default is the "linear" init
    if init == "glorot":
        nn.init.xavier_uniform_(lin.weight)
    return lin


def init_bias(out_dim: int, fan_in: int, init: str) -> nn.Parameter:
    """A bias: zeros for ``"glorot"`` (as GCN / GAT), uniform in +-1/sqrt(fan_in) for
    ``"linear"`` (``torch.nn.Linear``'s default for a layer reading fan_in columns)."""
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {', '.join(INITS)}")
    bias = torch.zeros(out_dim)
    if init == "linear":
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)
    return nn.Parameter(bias)


def linear(lin: nn.Linear, x: Tensor) -> Tensor:
    """``lin(x)`` for dense or CSR (sparse input features) rows ``x``."""
    return affine(x, lin.weight, lin.bias)


def affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` for dense or CSR (sparse input features) rows ``x``."""
    return sparse_linear(x, weight, bias) if is_sparse(x) else F.linear(x, weight, bias)


def _plain(x: Tensor, lin: nn.Linear) -> bool:
    """Whether ``lin(x)`` is one GEMM that can take an addend: dense rows, no own bias."""
    return not is_sparse(x) and lin.bias is None and x.dtype == lin.weight.dtype



class _OwnRelu(torch.autograd.Function):
    """ReLU in place on a fresh tensor no other backward reads; its backward writes
    the input gradient into the output's own storage, so no third (R, D) tensor is
    allocated beside the output and its incoming gradient. Autograd runs it only
    after every consumer of the output has run its own backward, so the output is no
    longer needed then. A backward that keeps its graph (``retain_graph=True``, to
    run again) gets a new tensor instead; were the output read after all, autograd's
    in-place check would fail loudly rather than hand out gradient values."""

    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        ctx.mark_dirty(y)
        out = torch.relu_(y)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        if grad.data_ptr() == out.data_ptr() and grad.shape == out.shape:
            # its one reader wrote the ReLU input's gradient over the output already
            # (``ops.dropout.mark_relu_output``)
            return grad
        if graph_kept():
            return torch.ops.aten.threshold_backward(grad, out, 0)
        return torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=out)


def own_relu(y: Tensor) -> Tensor:
    """``relu_(y)`` for a fresh ``y`` that only this stage holds (see ``_OwnRelu``);
    plain ``relu_`` where no gradient is needed."""
    if not (torch.is_grad_enabled() and y.requires_grad):
        return torch.relu_(y)
    out = _OwnRelu.apply(y)
    mark_relu_output(out)
    return out


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
        init: ``"glorot"`` (Glorot weights, zero bias; default) or ``"linear"``
            (``torch.nn.Linear``'s default for weights and bias); see ``init_linear``.
        fan_in: the columns the layer's bias belongs to for the ``"linear"`` init
            (default: in_dim; a bias added after a propagation that follows the
            weight belongs to the weight's input width).
    """

    def __init__(self, in_dim: int, out_dim: int, *, linear: bool = True, bias: bool = True,
                 root_dim: int | None = None, residual: bool = False,
                 act: str | None = None, init: str = "glorot",
                 fan_in: int | None = None) -> None:
        super().__init__(in_dim, out_dim)
        if not linear and in_dim != out_dim:
            raise ValueError(f"Dense without a weight keeps the width: {in_dim} != {out_dim}")
        self.lin = init_linear(in_dim, out_dim, init) if linear else None
        self.bias = init_bias(out_dim, fan_in or in_dim, init) if bias else None
        self.root = init_linear(root_dim, out_dim, init) if root_dim else None
        self.residual = residual
        self.act_name = act
        self.act = activation(act)
        self.uses_layer_input = self.root is not None or residual
        # its weights take CSR rows (sparse input features); adding them does not
        self.reads_sparse = not residual

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        # dense rows: the bias and the root term are added inside the GEMMs (addmm),
        # not in passes of their own over the (R, out_dim) output
        product = self.lin is not None and _plain(x, self.lin)
        if not product:  # a deferred dropout output is read by products alone
            x = materialized(x)
        dropped = dropped_from(x) if product else None
        # on the CPU, ReLU follows the product a block of rows at a time, in the cache
        relu = (self.act_name == "relu" and self.root is None and not self.residual
                and x.device.type == "cpu")
        if dropped is not None:  # keeps x's undropped rows, not a copy (dropout_matmul)
            assert self.lin is not None
            y = dropout_matmul(dropped, self.lin.weight, self.bias,
                               None if dropped.deferred else x, relu=relu)
            if relu:
                return y
        elif self.lin is not None and _plain(x, self.lin):
            y = matmul_t(x, self.lin.weight, self.bias, relu=relu)
            if relu:
                return y
        else:
            y = linear(self.lin, x) if self.lin is not None else x
            if self.bias is not None:
                y = add_bias(y, self.bias)
        if self.root is not None or self.residual:
            assert layer_input is not None, "this stage reads the layer input"
            if self.root is not None:
                dropped = dropped_from(layer_input)
                if dropped is not None and _plain(layer_input, self.root):
                    y = dropout_matmul(dropped, self.root.weight, y, layer_input)
                elif _plain(layer_input, self.root):
                    y = matmul_t(layer_input, self.root.weight, y)
                else:
                    y = y + linear(self.root, layer_input)
            if self.residual:
                y = y + layer_input
        if self.act is None:
            return y
        if self.act_name == "relu" and y is not x:
            # y is this stage's own fresh output, which no backward reads: one (R, D_out)
            # tensor instead of two, and its backward reuses it for the gradient
            return own_relu(y)
        return self.act(y)

    @property
    def takes_dropped(self) -> bool:
        """Whether a deferred dropout output can be this stage's input (its weight
        reads it through ``dropout_matmul``; see ``walk.Runner.transform_run``)."""
        return self.lin is not None

    def extra_repr(self) -> str:
        parts = [f"index={self.index}", f"{self.in_dim}->{self.out_dim}"]
        parts += [n for n, on in (("linear", self.lin is not None), ("bias", self.bias is not None),
                                  ("root", self.root is not None), ("residual", self.residual))
                  if on]
        return ", ".join(parts + [f"act={self.act_name}"])
