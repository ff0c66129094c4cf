"""fullgraph: full-graph GNN training across many workers.

One model definition (a stage program of transform / edge / propagate stages) and
several executors of it: single-process (the reference), data, tensor, hybrid
(peer-to-peer) and task parallelism, with a resource-aware runtime and a planner.
"""
from __future__ import annotations

__version__ = "0.1.0"

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from fullgraph.errors import ConfigError, DataError, FullgraphError  # noqa: E402

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from fullgraph.api import FitResult, check, fit
    from fullgraph.exactness import CheckReport
    from fullgraph.graph.formats.pyg import from_pyg, to_pyg
    from fullgraph.saved import SavedModel

__all__ = ["CheckReport", "ConfigError", "DataError", "FitResult", "FullgraphError",
           "SavedModel", "__version__", "check", "fit", "from_pyg", "load_model", "to_pyg"]

_LAZY = {"fit": "fullgraph.api", "FitResult": "fullgraph.api", "check": "fullgraph.api",
         "CheckReport": "fullgraph.exactness",
         "SavedModel": "fullgraph.saved", "from_pyg": "fullgraph.graph.formats.pyg",
         "to_pyg": "fullgraph.graph.formats.pyg"}


def __getattr__(name: str) -> Any:
    """``fit``, ``SavedModel``, ``from_pyg``, ... on first use, so ``import fullgraph``
    stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fullgraph' has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every public name, the lazily loaded ones too (tab completion offers ``fit``)."""
    return sorted(set(globals()) | set(__all__))


def load_model(path: str | Path) -> SavedModel:
    """The model saved by ``train --save-model PATH``, a plain ``torch.nn.Module``:
    ``model(graph, features)`` gives logits (see ``fullgraph.saved``).

    Raises:
        ConfigError: ``path`` is missing, cut short or not a fullgraph model file, or
            its model class cannot be imported here.
    """
    from fullgraph.saved import load_model as load

    return load(path)
