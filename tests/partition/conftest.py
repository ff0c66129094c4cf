"""Graphs shared by the partitioner tests."""
from __future__ import annotations

from pathlib import Path

import pytest

import fullgraph.graph
from fullgraph.graph.csr import Graph
from fullgraph.graph.formats.planetoid import load_planetoid
from fullgraph.graph.synthetic import rmat_edges

BUILTIN_CORA = Path(fullgraph.graph.__file__).resolve().parent / "builtin" / "cora"


@pytest.fixture(scope="module")
def cora() -> Graph:
    return load_planetoid(BUILTIN_CORA, "cora").graph


@pytest.fixture(scope="module")
def skewed() -> Graph:
    """A power-law graph (R-MAT, a = 0.57): most in-edges on low ids, and METIS leaves
    its remote counts unbalanced."""
    src, dst = rmat_edges(3000, 30000, seed=1)
    return Graph.from_edges(src, dst, 3000)
