"""fullgraph: full-graph GNN training across many workers.

One model definition (a stage program of transform / edge / propagate stages) and
several executors of it: single-process (the reference), data, tensor, task and
hybrid parallelism. See DESIGN.md in the shared notes for the architecture.
"""
from __future__ import annotations

__version__ = "0.1.0"

from fullgraph.errors import DataError, FullgraphError  # noqa: E402

__all__ = ["DataError", "FullgraphError", "__version__"]
