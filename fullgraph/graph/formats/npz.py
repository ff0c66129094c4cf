"""gnn-benchmark ``.npz`` graphs (Amazon Photo/Computers, Coauthor CS/Physics).

Two layouts are read, both as published by Shchur et al. ("Pitfalls of Graph Neural
Network Evaluation", 2018) and re-saved copies of them:

- flat arrays, as in shchur/gnn-benchmark: ``adj_data/adj_indices/adj_indptr/
  adj_shape``, ``attr_data/attr_indices/attr_indptr/attr_shape`` (or a dense
  ``attr_matrix``) and ``labels``. These members hold no pickles and are read with
  ``allow_pickle=False``; object members we do not need (names) are not read;
- pickled objects, as in EdisonLeeeee/GraphData: ``adj_matrix`` and ``node_attr``
  are 0-d object arrays holding scipy ``csr_matrix`` pickles, ``node_label`` a plain
  array. Object members go through the allow-list unpickler of :mod:`.safe_pickle`.

The stored adjacency may be directed; like PyG's ``Amazon``/``Coauthor`` (which call
``to_undirected``) the graph is symmetrised, de-duplicated, and self-loops are
removed. There is no official split: the default is the gnn-benchmark convention of
20 training and 30 validation vertices per class, the rest test, seeded.

Shapes: N = number of vertices, F = feature dimension.
"""
from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import scipy.sparse as sp
import torch

from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.graph.formats._common import (
    PathLike,
    as_features,
    as_labels,
    assemble,
    check_finite,
    check_ids,
    check_labels,
    field_locator,
)
from fullgraph.graph.formats._text import require_file
from fullgraph.graph.formats.safe_pickle import load_pickle
from fullgraph.graph.split import per_class_split

FLAT_KEYS = ("adj_data", "adj_indices", "adj_indptr", "adj_shape", "labels")
PICKLED_KEYS = ("adj_matrix", "node_attr", "node_label")


def load_npz(path: PathLike, name: str | None = None, *, seed: int = 0,
             train_per_class: int = 20, val_per_class: int = 30) -> Dataset:
    """Load a gnn-benchmark ``.npz`` with a seeded per-class split.

    Args:
        path: the ``.npz`` file.
        name: dataset name (default: the file name without ``.npz``).
        seed: seed of the split (default: 0).
        train_per_class: training vertices per class (default: 20).
        val_per_class: validation vertices per class (default: 30).

    Returns:
        A validated Dataset; the graph is symmetric without self-loops.

    Raises:
        DatasetNotFoundError: the file does not exist.
        FormatError: not an npz, a member is missing, has the wrong type or shape, or
            its pickle names a refused class.
        ValidationError: ids out of range, labels negative, non-finite features.
    """
    path = Path(path)
    require_file(path, "npz file")
    members = _read_members(path)
    if all(k in members for k in FLAT_KEYS):
        adj, x, y = _flat_layout(members, path)
    elif all(k in members for k in PICKLED_KEYS):
        adj, x, y = (members[k]() for k in PICKLED_KEYS)
    else:
        raise FormatError("not a gnn-benchmark npz: required members are missing", source=path,
                          found=sorted(members), expected=f"{list(FLAT_KEYS)} or "
                          f"{list(PICKLED_KEYS)}")
    adj = _as_csr(adj, path, "adjacency")
    features = _dense_features(x, path)
    labels = as_labels(np.asarray(y), source=path)
    num_nodes = adj.shape[0]
    _check_sizes(adj, features, labels, path)
    num_classes = check_labels(labels, None, source=path, locate=field_locator("labels[{k}]"))
    if (labels < 0).any():
        k = int(np.argmax(labels < 0))
        raise ValidationError("negative label", source=path, field=f"labels[{k}]",
                              found=int(labels[k]), expected=f"0 <= label < {num_classes}")
    graph = _graph(adj, num_nodes, path)
    masks = per_class_split(torch.from_numpy(labels), num_classes, seed=seed,
                            train_per_class=train_per_class, val_per_class=val_per_class)
    info = {"format": "npz", "source": str(path),
            "split": f"per class: {train_per_class} train, {val_per_class} val, rest test "
                     f"(seed {seed})"}
    return assemble(name or path.stem, graph, features, labels, masks, num_classes, info)


# ------------------------------------------------------------------- internals
def _read_members(path: Path) -> dict[str, Any]:
    """Member name (without ``.npy``) -> zero-argument reader, so unused ones stay unread."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FormatError("not an npz (zip) archive", source=path, found=str(exc)) from exc
    names = {info.filename[:-4]: info.filename for info in zf.infolist()
             if info.filename.endswith(".npy")}
    zf.close()
    return {key: (lambda member=member: _read_member(path, member))
            for key, member in names.items()}


def _read_member(path: Path, member: str) -> Any:
    """One ``.npy`` member: plain arrays with allow_pickle=False, object arrays safely."""
    source = f"{path}[{member}]"
    try:
        with zipfile.ZipFile(path) as zf, zf.open(member) as fh:
            read_header = _HEADER_READERS.get(np.lib.format.read_magic(fh))
            if read_header is not None and read_header(fh)[2].hasobject:
                obj = load_pickle(fh, source=source)
                if isinstance(obj, np.ndarray) and obj.shape == () and obj.dtype.hasobject:
                    return obj.item()
                return obj
        # Plain arrays (and headers of other versions): numpy's reader, pickles refused.
        with zipfile.ZipFile(path) as zf, zf.open(member) as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)
    except FormatError:  # a refused pickle class; FormatError is also a ValueError
        raise
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise FormatError("cannot read the array", source=source,
                          found=f"{type(exc).__name__}: {exc}") from exc


_HEADER_READERS: dict[tuple[int, int], Callable[[IO[bytes]], tuple[Any, bool, np.dtype]]] = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _flat_layout(members: dict[str, Any], path: Path) -> tuple[Any, Any, Any]:
    def csr(prefix: str) -> sp.csr_matrix:
        parts = [np.asarray(members[f"{prefix}_{k}"]()) for k in
                 ("data", "indices", "indptr", "shape")]
        try:
            return sp.csr_matrix(tuple(parts[:3]), shape=tuple(int(v) for v in parts[3]))
        except (ValueError, TypeError) as exc:
            raise FormatError("invalid CSR arrays", source=path, field=f"{prefix}_*",
                              found=str(exc)) from exc
    adj = csr("adj")
    if "attr_data" in members:
        x: Any = csr("attr")
    elif "attr_matrix" in members:
        x = members["attr_matrix"]()
    else:
        raise FormatError("the npz has no node attributes", source=path,
                          expected="attr_data/attr_indices/attr_indptr/attr_shape or "
                                   "attr_matrix")
    return adj, x, members["labels"]()


def _as_csr(obj: Any, path: Path, what: str) -> sp.csr_matrix:
    if isinstance(obj, np.ndarray) and obj.ndim == 2:
        obj = sp.csr_matrix(obj)
    if not sp.issparse(obj):
        raise FormatError(f"{what} must be a sparse matrix", source=path,
                          found=type(obj).__name__, expected="scipy csr_matrix")
    return sp.csr_matrix(obj)


def _dense_features(x: Any, path: Path) -> np.ndarray:
    dense = x.toarray() if sp.issparse(x) else np.asarray(x)
    features = as_features(dense, source=path, field="node attributes")
    check_finite(features, source=path, locate=lambda k: {"field": "node attributes"})
    return features


def _check_sizes(adj: sp.csr_matrix, features: np.ndarray, labels: np.ndarray,
                 path: Path) -> None:
    n = adj.shape[0]
    if adj.shape[1] != n:
        raise FormatError("adjacency matrix must be square", source=path, field="adjacency",
                          found=adj.shape)
    if n == 0 or adj.nnz == 0:
        raise ValidationError("the graph is empty", source=path, field="adjacency",
                              found=f"{n} vertices, {adj.nnz} edges",
                              expected="at least one edge")
    if features.shape[0] != n:
        raise ValidationError("feature rows do not match the number of vertices", source=path,
                              field="node attributes", found=features.shape[0], expected=n)
    if labels.shape[0] != n:
        raise ValidationError("labels do not match the number of vertices", source=path,
                              field="labels", found=labels.shape[0], expected=n)


def _graph(adj: sp.csr_matrix, num_nodes: int, path: Path) -> Graph:
    # Read the CSR arrays directly: scipy's tocoo() would raise a bare ValueError on a
    # bad column index, before we could name it.
    indptr = np.asarray(adj.indptr, dtype=np.int64)
    counts = np.diff(indptr)
    if indptr[0] != 0 or (counts < 0).any() or indptr[-1] != adj.indices.size:
        raise FormatError("adjacency indptr is not a valid CSR row pointer", source=path,
                          field="adjacency indptr", found=f"starts at {indptr[0]}, ends at "
                          f"{indptr[-1]}", expected=f"non-decreasing from 0 to {adj.indices.size}")
    src = np.repeat(np.arange(num_nodes, dtype=np.int64), counts)
    dst = np.asarray(adj.indices, dtype=np.int64)
    check_ids(dst, num_nodes, source=path, locate=field_locator("adjacency column of entry {k}"))
    return Graph.from_edges(src, dst, num_nodes, symmetrize=True, self_loops="remove")
