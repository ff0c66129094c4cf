"""Executors of stage programs, one per strategy, behind one interface."""
from __future__ import annotations

from fullgraph.parallel import data, p2p, single, task, tensor  # noqa: F401  (registers them)
from fullgraph.parallel.base import (
                                     STRATEGIES,
                                     LocalResult,
                                     Plan,
                                     StepStats,
                                     Strategy,
                                     build_strategy,
                                     get_strategy,
)

__all__ = ["STRATEGIES", "LocalResult", "Plan", "StepStats", "Strategy", "build_strategy",
           "get_strategy"]
