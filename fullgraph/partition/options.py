"""Options shared by every strategy that splits the graph by rows."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from fullgraph.fields import option


def partitioner_names() -> tuple[str, ...]:
    """The registered partitioners (``fullgraph.partition.PARTITIONERS``)."""
    from fullgraph.partition import PARTITIONERS

    return tuple(PARTITIONERS)


@dataclass(frozen=True, kw_only=True)
class PartitionOptions:
    """How vertices are assigned to workers.

    Attributes:
        method: a registered partitioner: chunk, random, metis, ... (default: metis).
        file: a saved partition book to reuse instead (``fullgraph partition`` writes
            one) (default: None).
        seed: partitioner seed (default: 0).
    """

    method: str = option("metis", "how vertices are split over workers",
                         choices=partitioner_names)
    file: str | None = option(None, "reuse a partition book written by `fullgraph partition`; "
                                 "unset: partition at start")
    seed: int = option(0, "partitioner seed")

    def __post_init__(self) -> None:
        from fullgraph.partition import check_seed

        check_seed(self.seed)
        if self.file is not None and (self.method != "metis" or self.seed != 0):
            warnings.warn(f"--partitioner {self.method} / --partition-seed {self.seed} have no "
                          f"effect with --partition-file {self.file} (the file's partition is "
                          "used)", stacklevel=3)
        elif self.method == "chunk" and self.seed != 0:
            warnings.warn(f"--partition-seed {self.seed} has no effect with --partitioner chunk "
                          "(contiguous ranges of vertex ids: nothing is drawn)", stacklevel=3)
