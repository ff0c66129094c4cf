"""Vertex partitioners, the partition book they return, and partition quality.

Every partitioner is a function ``fn(graph, num_parts, *, seed=0, **opts) ->
PartitionBook`` registered under a name; ``partition(graph, num_parts, method)`` is
the one entry point the layers above call (the CLI's ``--partitioner`` value is the
registry key). Built in: ``"chunk"`` (contiguous id ranges, NeutronStar), ``"random"``
(seeded, equal sizes) and ``"metis"`` (pymetis, weighted by work by default).
``register_partitioner`` adds another, e.g. G3's iterative re-partitioner::

    @register_partitioner("g3")
    def g3_partition(graph, num_parts, *, seed=0, **opts) -> PartitionBook: ...

This package must not import torch.distributed or anything above the partition layer.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

from fullgraph.fields import SEED_RANGE, is_seed
from fullgraph.graph.csr import Graph
from fullgraph.partition.book import PartitionBook, check_num_parts
from fullgraph.partition.chunk import chunk_partition
from fullgraph.partition.metis import metis_partition
from fullgraph.partition.metrics import PartitionQuality, format_report, quality
from fullgraph.partition.options import PartitionOptions
from fullgraph.partition.random import random_partition

Partitioner = Callable[..., PartitionBook]
F = TypeVar("F", bound=Partitioner)

PARTITIONERS: dict[str, Partitioner] = {
    "chunk": chunk_partition,
    "random": random_partition,
    "metis": metis_partition,
}


def register_partitioner(name: str) -> Callable[[F], F]:
    """Decorator registering ``fn(graph, num_parts, *, seed=0, **opts)`` as ``name``.

    Raises:
        ValueError: ``name`` is already registered (names are never silently replaced).
    """
    def register(fn: F) -> F:
        if name in PARTITIONERS:
            raise ValueError(f"a partitioner named {name!r} is already registered "
                             f"({PARTITIONERS[name].__module__}.{PARTITIONERS[name].__name__})")
        PARTITIONERS[name] = fn
        return fn
    return register


def check_seed(seed: int) -> None:
    """Refuse (ValueError) a partitioner seed that is not a seed every partitioner takes
    (``fields.is_seed``: numpy's generators refuse negative seeds)."""
    if not is_seed(seed):
        raise ValueError(f"partition seed: got {seed!r}; expected {SEED_RANGE}")


def partition(graph: Graph, num_parts: int, method: str, *, seed: int = 0,
              **opts: Any) -> PartitionBook:
    """Partition ``graph`` into ``num_parts`` parts with the partitioner ``method``.

    Args:
        graph: a square graph.
        num_parts: P, with ``1 <= P <= N``.
        method: a key of ``PARTITIONERS`` (``"chunk"``, ``"random"``, ``"metis"``, ...).
        seed: seed handed to the partitioner (default: 0).
        **opts: the partitioner's own options (e.g. ``balance="edges"`` for chunk).

    Returns:
        The partition book. A warning is issued when some part is empty.

    Raises:
        ValueError: unknown ``method`` (the message lists the known ones),
            ``num_parts`` out of range or a negative ``seed``.
        TypeError: an option the partitioner does not take.
    """
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {method!r}; known: "
                         f"{', '.join(sorted(PARTITIONERS))}")
    check_num_parts(num_parts, graph.num_nodes)
    check_seed(seed)
    book = PARTITIONERS[method](graph, num_parts, seed=seed, **opts)
    if book.num_parts != num_parts or book.num_nodes != graph.num_nodes:
        raise RuntimeError(f"partitioner {method!r} returned {book!r} for {num_parts} "
                           f"parts of {graph.num_nodes} vertices")
    empty = int((book.part_sizes() == 0).sum())
    if empty:
        warnings.warn(f"partitioner {method!r} left {empty} of {num_parts} parts empty; "
                      "their workers will own no vertices", stacklevel=2)
    return book


__all__ = ["PARTITIONERS", "PartitionBook", "PartitionOptions", "PartitionQuality", "Partitioner",
           "check_num_parts", "chunk_partition", "format_report", "metis_partition",
           "partition", "quality", "random_partition", "register_partitioner"]

from fullgraph.partition import g3  # noqa: E402,F401  registers "g3"; needs register_partitioner
