"""Sparse kernels (SpMM, edge softmax) and keyed dropout; CPU and GPU behind one function."""
from __future__ import annotations

from fullgraph.ops.dropout import keyed_dropout, keyed_uniform
from fullgraph.ops.edge_softmax import edge_softmax
from fullgraph.ops.spmm import edge_dot, set_backend, spmm

__all__ = ["edge_dot", "edge_softmax", "keyed_dropout", "keyed_uniform", "set_backend", "spmm"]
