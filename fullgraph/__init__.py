"""fullgraph: full-graph GNN training across many workers.

One model definition (a stage program of transform / edge / propagate stages) and
several executors of it: single-process (the reference), data, tensor and hybrid
(peer-to-peer) parallelism. See README.md for what is planned beyond these.
"""
from __future__ import annotations

__version__ = "0.1.0"

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from fullgraph.errors import DataError, FullgraphError  # noqa: E402

if TYPE_CHECKING:
    from fullgraph.saved import SavedModel

__all__ = ["DataError", "FullgraphError", "__version__", "load_model"]


def load_model(path: str | Path) -> SavedModel:
    """The model saved by ``train --save-model PATH``, a plain ``torch.nn.Module``:
    ``model(graph, features)`` gives logits (see ``fullgraph.saved``)."""
    from fullgraph.saved import load_model as load

    return load(path)
