"""Short content digests of tensors and of a graph's edges.

A checkpoint, a saved model and a partition book record the digest of the graph
they belong to (``topology_digest``), and are refused for another graph.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from fullgraph.graph.csr import Graph


def digest(*tensors: Tensor) -> str:
    """A short BLAKE2 digest of the tensors' dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def topology_digest(graph: Graph) -> str:
    """``digest`` of a graph's edges (its CSR), as a checkpoint and a partition book
    record the graph they belong to."""
    return digest(graph.indptr, graph.indices)
