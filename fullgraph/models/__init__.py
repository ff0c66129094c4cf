"""Models as stage programs (T / E / P); single-device, no torch.distributed."""
from __future__ import annotations

from fullgraph.models.base import GNN
from fullgraph.models.gat import GAT
from fullgraph.models.gcn import GCN
from fullgraph.models.gin import GIN
from fullgraph.models.sage import GraphSAGE
from fullgraph.models.stages import (
    EdgeTransform,
    LayerInput,
    Propagate,
    StageContext,
    StageKind,
    StageProgram,
    Transform,
    propagation_inputs,
)
from fullgraph.models.tagcn import TAGCN

MODELS: dict[str, type[GNN]] = {"gcn": GCN, "sage": GraphSAGE, "gat": GAT, "gin": GIN,
                               "tagcn": TAGCN}


def build_model(name: str, in_dim: int, hidden: int, out_dim: int, **options) -> GNN:
    """Build the model called ``name`` with ``options``: a built-in (gcn, sage, gat, gin,
    tagcn) or a user's ``GNN`` subclass as ``module:Class`` or ``file.py:Class``
    (``fullgraph.models.custom``).

    Raises:
        ConfigError: ``name`` names no model (a ``ValueError``), or a user's class lacks
            a method or an argument the options need.
    """
    from fullgraph.errors import ConfigError
    from fullgraph.models.custom import resolve

    try:
        return resolve(name)(in_dim, hidden, out_dim, **options)
    except (NotImplementedError, TypeError) as exc:  # a user's class lacks a method or
        if name in MODELS:                            # an argument: one line
            raise
        raise ConfigError(f"model {name}: {exc}") from exc


__all__ = ["GAT", "GCN", "GIN", "GNN", "TAGCN", "GraphSAGE", "MODELS", "EdgeTransform",
           "LayerInput", "Propagate", "StageContext", "StageKind", "StageProgram", "Transform",
           "build_model", "propagation_inputs"]
