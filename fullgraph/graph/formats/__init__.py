"""Loaders of real on-disk dataset formats, each returning a validated Dataset.

One module per format: :mod:`.planetoid` (Cora/CiteSeer/PubMed ``ind.*`` pickles),
:mod:`.npz` (gnn-benchmark Amazon/Coauthor), :mod:`.ogb` (OGB node-property CSV
layout), :mod:`.edgelist` (text/binary edge list + ``.npy`` arrays),
:mod:`.neutronstar` (NeutronStar's four files) and :mod:`.pyg` (PyG ``Data``).
:mod:`.download` fetches upstream files; :mod:`.safe_pickle` is the allow-list
unpickler every pickle goes through.

Bad input raises one :class:`~fullgraph.errors.DataError` subclass naming the file,
the line or field, what was found and what was expected. This package imports only
the graph layer (and torch_geometric lazily, in :mod:`.pyg`). The ``download``
function is deliberately not re-exported here: it would shadow the submodule, which
callers import as ``from fullgraph.graph.formats import download``.
"""
from __future__ import annotations

from fullgraph.graph.formats.edgelist import load_edgelist
from fullgraph.graph.formats.neutronstar import load_neutronstar
from fullgraph.graph.formats.npz import load_npz
from fullgraph.graph.formats.ogb import load_ogb
from fullgraph.graph.formats.planetoid import load_planetoid, load_planetoid_graph
from fullgraph.graph.formats.pyg import from_pyg, to_pyg

__all__ = ["from_pyg", "load_edgelist", "load_neutronstar", "load_npz",
           "load_ogb", "load_planetoid", "load_planetoid_graph", "to_pyg"]
