"""Chunks of contiguous destination ids sized to fit a device-memory budget.

NeutronTP §4.2.1 schedules propagation chunk by chunk: a chunk is a range of
destination vertices with all their in-edges, so every chunk aggregates
independently, and the graph only has to be cut logically (CSR row ranges). A chunk
is streamed to the device with the source rows it reads and its output rows, and in
the backward with its transposed CSR, output gradients and source gradients. With
S <= E distinct sources, itemsize s and 8-byte offsets, every step holds at most

    rows x (8 + D x s)              offsets, output rows / output gradients
    + edges x (12 + s + D x s) + 8  indices and offsets of the transpose, weights,
                                    source rows / source gradients (at most one per edge)

so chunks built under that bound fit the budget whatever the sources' overlap.
``MemoryAccount`` records what is resident, so the peak can be checked against the
budget on any device (on the CPU the budget is enforced by this accounting alone).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1.5G"`` or an integer -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; expected e.g. 512MB, 2GiB, 1.5G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def chunk_footprint(rows: int, edges: int, dim: int, itemsize: int = 4) -> int:
    """Upper bound of the device bytes one chunk needs (see the module docstring)."""
    return rows * (8 + dim * itemsize) + edges * (12 + itemsize + dim * itemsize) + 8


def chunk_ranges(indptr: Tensor, budget: int, dim: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Contiguous destination ranges, each as large as the budget allows.

    Raises:
        ValueError: when a single destination (with its in-edges) exceeds the budget.
    """
    ptr = indptr.cpu().numpy().astype(np.int64)
    n = ptr.size - 1
    row_cost = 8 + dim * itemsize
    edge_cost = 12 + itemsize + dim * itemsize
    # cumulative footprint of rows [0, i): a chunk [a, b) costs cum[b] - cum[a] + 8
    cum = ptr * edge_cost + np.arange(n + 1, dtype=np.int64) * row_cost
    ranges, start = [], 0
    while start < n:
        stop = int(np.searchsorted(cum, cum[start] + budget - 8, side="right")) - 1
        if stop <= start:
            need = int(cum[start + 1] - cum[start]) + 8
            raise ValueError(f"device memory budget of {budget} bytes cannot hold vertex "
                             f"{start} with its {int(ptr[start + 1] - ptr[start])} in-edges "
                             f"({need} bytes at {dim} columns); raise --device-memory")
        ranges.append((start, min(stop, n)))
        start = min(stop, n)
    return ranges


def even_ranges(num_rows: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_chunks`` contiguous ranges of near-equal row counts."""
    bounds = np.linspace(0, num_rows, max(1, num_chunks) + 1).round().astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@dataclass
class MemoryAccount:
    """Bytes resident on the compute device during chunked propagation."""

    budget: int | None = None
    current: int = 0
    peak: int = 0
    events: list[int] = field(default_factory=list)

    def hold(self, *tensors: Tensor) -> int:
        nbytes = sum(int(t.numel() * t.element_size()) for t in tensors)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.current -= nbytes
