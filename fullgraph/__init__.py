"""fullgraph: full-graph GNN training across many workers.

One model definition (a stage program of transform / edge / propagate stages) and
several executors of it: single-process (the reference), data, tensor and hybrid
(peer-to-peer) parallelism. See README.md for what is planned beyond these.
"""
from __future__ import annotations

__version__ = "0.1.0"

from fullgraph.errors import DataError, FullgraphError  # noqa: E402

__all__ = ["DataError", "FullgraphError", "__version__"]
