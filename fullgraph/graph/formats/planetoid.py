"""Planetoid citation datasets (Cora, CiteSeer, PubMed) from the raw ``ind.*`` files.

The eight files ``ind.<name>.{x,tx,allx,y,ty,ally,graph,test.index}`` combine as in
Kipf's ``gcn/utils.py::load_data`` and PyG's ``read_planetoid_data``:

- vertex ``i < len(allx)`` has features ``allx[i]`` and label ``ally[i]``; row ``j``
  of ``tx``/``ty`` belongs to vertex ``test.index[j]`` (the file is not sorted);
- N = ``len(allx)`` plus the span of the test ids. CiteSeer's test ids leave 15
  gaps: those isolated vertices get all-zero features, as in PyG, and label -1
  (unlabelled; PyG's argmax gives them class 0). They are in no mask;
- the public split: train = the first ``len(y)`` vertices, val = the next 500,
  test = the ids in ``test.index``;
- edges come from the adjacency-list dict in ``graph``, symmetrised, de-duplicated
  and without self-loops (PyG's ``remove_self_loops`` + ``coalesce``): Cora has 10,556
  directed edges, CiteSeer 9,104, PubMed 88,648.

The pickles are read with the allow-list unpickler of :mod:`.safe_pickle`.
:func:`load_planetoid_graph` needs neither ``x``, ``tx`` nor ``allx``, so PubMed's
structure, labels and split load even without ``ind.pubmed.allx``.

Shapes: N = number of vertices, F = feature dimension, C = number of classes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.graph.formats._common import (
    PathLike,
    assemble,
    check_finite,
    check_ids,
    check_unique,
    field_locator,
    require_files,
    text_locator,
)
from fullgraph.graph.formats._text import read_table
from fullgraph.graph.formats.download import PLANETOID_SUFFIXES, PLANETOID_URL
from fullgraph.graph.formats.safe_pickle import load_pickle

NUM_VAL = 500
GRAPH_SUFFIXES = ("y", "ty", "ally", "graph", "test.index")


@dataclass
class PlanetoidGraph:
    """Everything of a Planetoid dataset except the features.

    Attributes:
        name: lower-case dataset name (``cora``, ``citeseer``, ``pubmed``).
        graph: symmetric CSR without self-loops or duplicates.
        labels: (N,) int64 class ids, -1 for the test-range gaps.
        train_mask, val_mask, test_mask: (N,) bool public split.
        num_classes: C.
        test_ids: (1000,) int64 vertex of each ``tx`` row, in file order.
        num_allx: rows of ``allx``, which are vertices ``0..num_allx-1``.
    """

    name: str
    graph: Graph
    labels: Tensor
    train_mask: Tensor
    val_mask: Tensor
    test_mask: Tensor
    num_classes: int
    test_ids: np.ndarray
    num_allx: int


def load_planetoid(raw_dir: PathLike, name: str) -> Dataset:
    """Load Cora, CiteSeer or PubMed with the public split from the raw ``ind.*`` files.

    Args:
        raw_dir: directory holding ``ind.<name>.*``.
        name: dataset name, case-insensitive (``Cora``, ``CiteSeer``, ``PubMed``).

    Returns:
        A validated Dataset named ``name.lower()``; features are the raw float32 values
        (not row-normalised).

    Raises:
        DatasetNotFoundError: a file is missing; lists them and the directory.
        FormatError: a pickle is unreadable or names a refused class, or an array has
            the wrong type or shape.
        ValidationError: ids out of range, non-finite features, inconsistent split.
    """
    raw, key = Path(raw_dir), name.lower()
    files = [f"ind.{key}.{suffix}" for suffix in PLANETOID_SUFFIXES]
    require_files(raw, files, dataset=name, url_base=PLANETOID_URL)
    structure = load_planetoid_graph(raw, name)
    y = _load_pickle_array(raw, key, "y")
    x = _load_features(raw, key, "x", rows=y.shape[0])
    allx = _load_features(raw, key, "allx", rows=structure.num_allx)
    tx = _load_features(raw, key, "tx", rows=structure.test_ids.size)
    for part, suffix in ((x, "x"), (tx, "tx")):
        if part.shape[1] != allx.shape[1]:
            raise FormatError("feature dimension differs from allx", source=raw / f"ind.{key}."
                              f"{suffix}", found=part.shape[1], expected=allx.shape[1])
    features = np.zeros((structure.graph.num_nodes, allx.shape[1]), dtype=np.float32)
    features[:structure.num_allx] = allx
    features[structure.test_ids] = tx
    s = structure
    return assemble(key, s.graph, features, s.labels.numpy(),
                    (s.train_mask, s.val_mask, s.test_mask), s.num_classes,
                    _info(raw, s))


def load_planetoid_graph(raw_dir: PathLike, name: str) -> PlanetoidGraph:
    """Load graph, labels and public split of a Planetoid dataset, without features.

    Needs only ``ind.<name>.{y,ty,ally,graph,test.index}``.

    Raises:
        DatasetNotFoundError, FormatError, ValidationError: as :func:`load_planetoid`.
    """
    raw, key = Path(raw_dir), name.lower()
    files = [f"ind.{key}.{suffix}" for suffix in GRAPH_SUFFIXES]
    require_files(raw, files, dataset=name, url_base=PLANETOID_URL)
    test_ids = _load_test_index(raw / f"ind.{key}.test.index")
    y, ally, ty = (_onehot_labels(raw, key, suffix) for suffix in ("y", "ally", "ty"))
    num_classes = ally.shape[1]
    for arr, suffix in ((y, "y"), (ty, "ty")):
        if arr.shape[1] != num_classes:
            raise FormatError("number of classes differs from ally", source=raw / f"ind.{key}."
                              f"{suffix}", found=arr.shape[1], expected=num_classes)
    if ty.shape[0] != test_ids.size:
        raise FormatError("ty needs one row per line of test.index",
                          source=raw / f"ind.{key}.ty", found=ty.shape[0], expected=test_ids.size)
    num_allx, num_train = ally.shape[0], y.shape[0]
    if num_train == 0:
        raise ValidationError("the train mask is empty", source=raw / f"ind.{key}.y",
                              field="train_mask", found="0 rows in y", expected="at least one")
    if num_train + NUM_VAL > num_allx:
        raise FormatError("too few allx rows for the public split", source=raw / f"ind.{key}.ally",
                          found=num_allx, expected=f"at least len(y) + {NUM_VAL} = "
                          f"{num_train + NUM_VAL}")
    graph_path, index_path = raw / f"ind.{key}.graph", raw / f"ind.{key}.test.index"
    adjacency = _load_adjacency(graph_path)
    # The graph lists every vertex as a key; CiteSeer's gaps make len(allx) + len(tx) short.
    num_nodes = max(num_allx + test_ids.size, adjacency[0].size)
    check_ids(test_ids, num_nodes, source=index_path, locate=text_locator(index_path))
    if int(test_ids.min()) < num_allx:
        k = int(np.argmax(test_ids < num_allx))
        raise ValidationError("test id falls inside the allx block", source=index_path,
                              found=int(test_ids[k]), expected=f"id >= len(allx) = {num_allx}",
                              **text_locator(index_path)(k))
    labels = np.full(num_nodes, -1, dtype=np.int64)
    labels[:num_allx] = _argmax_or_unlabelled(ally)
    labels[test_ids] = _argmax_or_unlabelled(ty)
    masks = [np.zeros(num_nodes, dtype=bool) for _ in range(3)]
    masks[0][:num_train] = True
    masks[1][num_train:num_train + NUM_VAL] = True
    masks[2][test_ids] = True
    graph = _build_graph(graph_path, *adjacency, num_nodes)
    train, val, test = (torch.from_numpy(m) for m in masks)
    return PlanetoidGraph(key, graph, torch.from_numpy(labels), train, val, test, num_classes,
                          test_ids, num_allx)


# ------------------------------------------------------------------- internals
def _load_test_index(path: Path) -> np.ndarray:
    ids = read_table(path, dtype=np.int64, num_cols=1, expected="one vertex id per line")[:, 0]
    if ids.size == 0:
        raise FormatError("test.index holds no vertex ids", source=path, found="0 ids",
                          expected="one id per line")
    locate = text_locator(path)
    check_ids(ids, np.iinfo(np.int64).max, source=path, locate=locate)
    check_unique(ids, source=path, locate=locate)
    return ids


def _load_pickle_array(raw: Path, key: str, suffix: str) -> Any:
    path = raw / f"ind.{key}.{suffix}"
    obj = load_pickle(path)
    if not (isinstance(obj, np.ndarray) or hasattr(obj, "toarray")):
        raise FormatError("expected an array or sparse matrix", source=path,
                          found=type(obj).__name__, expected="scipy csr_matrix or ndarray")
    if obj.ndim != 2:
        raise FormatError("expected a 2-D array", source=path, found=obj.shape)
    return obj


def _onehot_labels(raw: Path, key: str, suffix: str) -> np.ndarray:
    path = raw / f"ind.{key}.{suffix}"
    obj = _load_pickle_array(raw, key, suffix)
    arr: np.ndarray = obj.toarray() if hasattr(obj, "toarray") else np.asarray(obj)
    bad = ~np.isin(arr, (0, 1)).all(axis=1) | (arr.sum(axis=1) > 1)
    if bad.any():
        r = int(np.argmax(bad))
        raise FormatError("label row is not one-hot", source=path, field=f"row {r}",
                          found=arr[r].tolist(), expected="at most one 1, zeros elsewhere")
    return arr


def _argmax_or_unlabelled(onehot: np.ndarray) -> np.ndarray:
    labels: np.ndarray = onehot.argmax(axis=1).astype(np.int64)
    labels[onehot.sum(axis=1) == 0] = -1
    return labels


def _load_features(raw: Path, key: str, suffix: str, rows: int) -> np.ndarray:
    path = raw / f"ind.{key}.{suffix}"
    obj = _load_pickle_array(raw, key, suffix)
    x = obj.toarray() if hasattr(obj, "toarray") else np.asarray(obj)
    if x.dtype.kind not in "fiub":
        raise FormatError("features must be numbers", source=path, found=x.dtype)
    if x.shape[0] != rows:
        raise FormatError("feature rows do not match the label rows", source=path,
                          found=x.shape[0], expected=rows)
    x = x.astype(np.float32, copy=False)
    check_finite(x, source=path, locate=field_locator(suffix))
    return x


def _load_adjacency(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys, number of neighbours of each key, concatenated neighbour lists)."""
    adjacency = load_pickle(path)
    if not isinstance(adjacency, dict):
        raise FormatError("expected a dict of adjacency lists", source=path,
                          found=type(adjacency).__name__, expected="collections.defaultdict")
    try:
        keys = np.fromiter(adjacency.keys(), dtype=np.int64, count=len(adjacency))
        lengths = np.fromiter(map(len, adjacency.values()), dtype=np.int64,
                              count=len(adjacency))
        dst = np.fromiter(itertools.chain.from_iterable(adjacency.values()), dtype=np.int64,
                          count=int(lengths.sum()))
    except (TypeError, ValueError) as exc:
        raise FormatError("adjacency lists must map vertex ids to lists of vertex ids",
                          source=path, found=str(exc)) from exc
    if dst.size == 0:
        raise ValidationError("the graph has no edges", source=path, found="0 edges",
                              expected="at least one edge")
    return keys, lengths, dst


def _build_graph(path: Path, keys: np.ndarray, lengths: np.ndarray, dst: np.ndarray,
                 num_nodes: int) -> Graph:
    src = np.repeat(keys, lengths)
    check_ids(keys, num_nodes, source=path, locate=lambda k: {"field": f"key #{k}"})
    check_ids(dst, num_nodes, source=path,
              locate=lambda k: {"field": f"neighbours of vertex {int(src[k])}"})
    return Graph.from_edges(src, dst, num_nodes, symmetrize=True, self_loops="remove")


def _info(raw: Path, s: PlanetoidGraph) -> dict[str, Any]:
    return {"format": "planetoid", "source": str(raw),
            "split": f"public: first {int(s.train_mask.sum())} train, next {NUM_VAL} val, "
                     "test.index test",
            "unlabelled": int((s.labels < 0).sum()),
            "upstream": "https://github.com/kimiyoung/planetoid (MIT)"}
