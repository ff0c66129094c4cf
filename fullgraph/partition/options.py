"""Options shared by every strategy that splits the graph by rows."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PartitionOptions:
    """How vertices are assigned to workers.

    Attributes:
        method: a registered partitioner: chunk, random, metis, ... (default: metis).
        file: a saved partition book to reuse instead (``fullgraph partition`` writes
            one) (default: None).
        seed: partitioner seed (default: 0).
    """

    method: str = "metis"
    file: str | None = None
    seed: int = 0
