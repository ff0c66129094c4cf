"""Conversion between a PyG ``torch_geometric.data.Data`` and a fullgraph Dataset.

``torch_geometric`` is an optional dependency (``pip install fullgraph[pyg]``) and is
imported only inside :func:`to_pyg`; :func:`from_pyg` reads attributes and needs no
import. PyG's ``edge_index[0]`` is the source and ``edge_index[1]`` the target of a
message (``flow="source_to_target"``), which is fullgraph's ``src -> dst``.

Shapes: N = number of vertices, F = feature dimension, E = number of edges.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import MASK_NAMES, Dataset
from fullgraph.graph.formats._common import (
    SPARSE_LAYOUTS,
    as_features,
    as_labels,
    assemble,
    check_finite,
    check_ids,
    check_labels,
    check_masks,
    field_locator,
    is_sparse_input,
    sparse_features,
)
from fullgraph.graph.sparse import densify
from fullgraph.graph.split import fraction_split


def from_pyg(data: Any, name: str = "pyg", *, split_index: int = 0, seed: int = 0,
             num_classes: int | None = None) -> Dataset:
    """Build a Dataset from a PyG ``Data`` with ``x``, ``y`` and ``edge_index``.

    Args:
        data: a ``torch_geometric.data.Data`` (any object with these attributes); a
            label of -1 marks an unlabelled vertex (it must be in no mask); a
            sparse ``x`` (torch COO, CSR or CSC, a ``torch_sparse.SparseTensor`` or a
            scipy sparse matrix) becomes CSR features, never made dense here; a mask
            may be boolean (or 0/1 uint8), or a vector of vertex ids (as OGB's split
            indices).
        name: dataset name (default: ``"pyg"``).
        split_index: column to use when the masks are (N, S) for S splits, as in
            WikiCS (default: 0).
        seed: seed of the 60/20/20 fraction split drawn when ``data`` has no
            ``train_mask`` (default: 0).
        num_classes: C (default: ``max(y) + 1``).

    Returns:
        A validated Dataset; duplicate edges are dropped, self-loops kept.

    Raises:
        FormatError: ``x``, ``y`` or ``edge_index`` is missing or has the wrong shape, or
            an integer mask of 0s and 1s (a mask, or vertex ids?).
        ValidationError: no edges, ids out of range, NaN features, labels out of range,
            empty or overlapping masks.
    """
    x, y, edge_index = (getattr(data, key, None) for key in ("x", "y", "edge_index"))
    if edge_index is None and getattr(data, "adj_t", None) is not None:
        edge_index = adjacency_edges(data.adj_t, name)  # PyG's ToSparseTensor() form
    for key, value in (("x", x), ("y", y), ("edge_index", edge_index)):
        if value is None:
            raise FormatError("the PyG data object lacks an attribute", source=name, field=key,
                              expected="x, y and edge_index (or adj_t)")
    features: Any
    if is_sparse_input(x):
        features = sparse_features(x, name)
    else:
        features = as_features(_numpy(x), source=name, field="x")
        check_finite(features, source=name, locate=lambda k: {"field": "x"})
    n = features.shape[0]
    labels = as_labels(_numpy(y), source=name, field="y")
    if labels.shape[0] != n:
        raise FormatError(f"y needs one label per vertex, a row of x (x has {n} rows)",
                          source=name, field="y", found=labels.shape[0], expected=n)
    num_classes = check_labels(labels, num_classes, source=name, locate=field_locator("y[{k}]"))
    ei = edge_index_array(edge_index, name)
    if ei.shape[1] == 0:
        raise ValidationError("the graph has no edges", source=name, field="edge_index",
                              found="0 edges", expected="at least one edge")
    src, dst = ei[0].astype(np.int64), ei[1].astype(np.int64)
    check_ids(src, n, source=name, locate=field_locator("edge_index[0, {k}]"))
    check_ids(dst, n, source=name, locate=field_locator("edge_index[1, {k}]"))
    graph = Graph.from_edges(src, dst, n)
    _warn_unused(data, ei.shape[1] - graph.num_edges, name)
    masks, how = _masks(data, labels, split_index, seed, name)
    return assemble(name, graph, features, labels, masks, num_classes,
                    {"format": "pyg", "split": how})


def adjacency_edges(adj_t: Any, name: str) -> np.ndarray:
    """The (2, E) edges (row 0 sources) of ``adj_t``, the transposed adjacency PyG's
    ``ToSparseTensor()`` leaves (row: destination, column: source): a
    ``torch_sparse.SparseTensor``, a torch sparse tensor or a scipy sparse matrix. Its
    values are not read (a warning says so where they are not all 1), but an explicitly
    stored 0 is no edge."""
    values: Any = None
    if sp.issparse(adj_t):
        coo = adj_t.tocoo()
        dst, src, values = np.asarray(coo.row), np.asarray(coo.col), np.asarray(coo.data)
    elif isinstance(adj_t, Tensor) and adj_t.layout in SPARSE_LAYOUTS and adj_t.dim() == 2:
        coo = adj_t.detach().cpu().to_sparse_coo()  # (not coalesced: a repeat is no weight)
        (dst, src), values = coo._indices().numpy(), _numpy(coo._values())
    elif hasattr(adj_t, "coo"):  # torch_sparse.SparseTensor
        row, col, value = adj_t.coo()
        dst, src = row.numpy(), col.numpy()
        values = None if value is None else _numpy(value)
    else:
        raise FormatError("adj_t must be a sparse adjacency (a torch_sparse.SparseTensor, "
                          "a torch sparse tensor or a scipy sparse matrix)", source=name,
                          field="adj_t", found=type(adj_t).__name__)
    if values is not None and values.size:
        stored = values != 0  # an explicit zero is no edge
        dst, src, values = dst[stored], src[stored], values[stored]
        if not (values == 1).all():
            import warnings

            warnings.warn(f"{name}: adj_t's values (edge weights) are not read: the models "
                          "read the structure only", stacklevel=3)
    return np.stack([src.astype(np.int64), dst.astype(np.int64)])


def edge_index_array(edge_index: Any, name: str) -> np.ndarray:
    """``edge_index`` (a tensor, array or list) as a (2, E) integer array.

    Raises:
        FormatError: it is not (2, E) or not integers (an (E, 2) array, say).
    """
    ei = _numpy(edge_index)
    if ei.ndim != 2 or ei.shape[0] != 2 or ei.dtype.kind not in "iu":
        raise FormatError("edge_index must be a (2, E) integer tensor (row 0 sources, row 1 "
                          "destinations)", source=name, field="edge_index",
                          found=f"{ei.dtype} {ei.shape}")
    return ei


def _warn_unused(data: Any, duplicates: int, name: str) -> None:
    """Warn of what the conversion leaves out: repeated edges (a fullgraph graph
    holds each edge once, where PyG's sums count a repeat again) and edge weights or
    attributes (the models read the structure only)."""
    import warnings

    if duplicates:
        warnings.warn(f"{name}: {duplicates} repeated edges in edge_index were dropped (each "
                      "edge counts once here; PyG's sums count a repeat again)", stacklevel=3)
    unused = [key for key in ("edge_weight", "edge_attr")
              if getattr(data, key, None) is not None]
    if unused:
        warnings.warn(f"{name}: {' and '.join(unused)} not used: fullgraph's models read the "
                      "graph's structure only", stacklevel=3)


def to_pyg(dataset: Dataset) -> Any:
    """A ``torch_geometric.data.Data`` with x, y, edge_index, masks and num_nodes.

    ``edge_index`` is in fullgraph's CSR order (sorted by destination, then source).

    Raises:
        MissingExtraError: torch_geometric is not installed (an ImportError).
    """
    from fullgraph.extras import require

    Data = require("torch_geometric", "to_pyg").data.Data
    src, dst = dataset.graph.edges()
    d = dataset.data
    return Data(x=densify(d.features), y=d.labels, edge_index=torch.stack([src, dst]),
                train_mask=d.train_mask, val_mask=d.val_mask, test_mask=d.test_mask,
                num_nodes=dataset.graph.num_nodes)




def feature_tensor(x: Any, name: str) -> Tensor:
    """Features given as a tensor, a numpy array or a scipy sparse matrix, as a tensor
    (sparse ones as CSR)."""
    if is_sparse_input(x):
        return sparse_features(x, name)
    if isinstance(x, Tensor):
        return x
    features = as_features(_numpy(x), source=name, field="features")  # as from_pyg reads x
    check_finite(features, source=name, locate=lambda k: {"field": "features"})
    return torch.from_numpy(np.require(features, requirements=["C", "W"]))  # (a copy where
    # the rows run backwards, or the array is read-only)


def _index_mask(ids: np.ndarray, n: int, name: str, key: str) -> np.ndarray:
    """An integer ``key`` read as the ids of its vertices (as OGB's split indices and
    PyG's ``index_to_mask`` have them), as a boolean mask. A 0/1 vector with one entry
    per vertex (not uint8, which is read as a mask) is refused: it may be a mask stored
    as integers."""
    if ids.shape[0] == n and np.isin(ids, (0, 1)).all():
        raise FormatError("an integer mask of 0s and 1s, one per vertex, is ambiguous "
                          "(a mask, or vertex ids?)", source=name, field=key,
                          found=f"{ids.dtype} {ids.shape}",
                          expected="a bool mask, or a vector of vertex ids")
    check_ids(ids, n, source=name, locate=field_locator(f"{key}[{{k}}]"))
    mask = np.zeros(n, dtype=bool)
    mask[ids] = True
    return mask


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(value)


def _masks(data: Any, labels: np.ndarray, split_index: int, seed: int,
           name: str) -> tuple[list[np.ndarray], str]:
    raw = [getattr(data, key, None) for key in MASK_NAMES]
    if raw[0] is None and any(m is not None for m in raw[1:]):
        given = " and ".join(k for k, m in zip(MASK_NAMES, raw) if m is not None)
        raise FormatError(f"{given} given without train_mask: a split is all three masks "
                          "or none (without masks a 60/20/20 split is drawn, which would "
                          f"replace the {given})", source=name, field="train_mask")
    if raw[0] is None:
        train, val, test = fraction_split(torch.from_numpy(labels), seed=seed)
        return [train.numpy(), val.numpy(), test.numpy()], f"fractions 0.6/0.2/rest (seed {seed})"
    masks = []
    for key, value in zip(MASK_NAMES, raw):
        if value is None:
            masks.append(np.zeros(labels.shape[0], dtype=bool))
            continue
        m = _numpy(value)
        if m.ndim == 2:
            m = m[:, split_index]
        if m.dtype == np.uint8 and m.shape == labels.shape and np.isin(m, (0, 1)).all():
            m = m.astype(bool)  # a mask as PyG's old ByteTensor
        elif m.ndim == 1 and m.dtype.kind in "iu":
            m = _index_mask(m, labels.shape[0], name, key)
        if m.dtype != np.bool_ or m.shape != labels.shape:
            raise FormatError("mask must be a boolean vector with one entry per vertex",
                              source=name, field=key, found=f"{m.dtype} {m.shape}",
                              expected=f"bool ({labels.shape[0]},)")
        masks.append(m)
    check_masks(masks, labels, [name] * 3)
    return masks, "masks of the PyG data" + (f" (column {split_index})"
                                             if _numpy(raw[0]).ndim == 2 else "")
