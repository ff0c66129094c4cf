"""OGB node-property-prediction datasets from their raw CSV layout.

The layout of an unpacked OGB zip (``ogbn-arxiv``, ``ogbn-products``, ...)::

    <root>/raw/edge.csv.gz            "src,dst" per line, no header
    <root>/raw/node-feat.csv.gz       F comma-separated numbers per line, N lines
    <root>/raw/node-label.csv.gz      one class id per line ("nan" = unlabelled)
    <root>/raw/num-node-list.csv.gz   N (optional; else the number of feature lines)
    <root>/split/<scheme>/{train,valid,test}.csv.gz   one vertex id per line

Uncompressed ``.csv`` files are accepted too. Text is parsed in large blocks by
numpy's C ``loadtxt`` (see :mod:`._text`): on 80 MB of integer pairs this took about
half the time of splitting tokens with numpy plus ``np.fromstring``, and a Python loop
per line is far slower still. Multi-label datasets (``ogbn-proteins``), heterogeneous
ones (``ogbn-mag``) and the binary ``data.npz`` layout (``ogbn-papers100M``) are
refused with a clear error.

The graph keeps the self-loops of the file and drops duplicates; with
``symmetrize=True`` (the default, as PyG's ``to_undirected`` is usually applied to
OGB node datasets) the reverse of every edge is added.

Shapes: N = number of vertices, F = feature dimension.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.graph.formats._common import (
    PathLike,
    assemble,
    check_finite,
    check_ids,
    check_labels,
    check_masks,
    check_unique,
    text_locator,
    warn_repeated_edges,
)
from fullgraph.graph.formats._text import read_table
from fullgraph.graph.formats.download import OGB_FILES, OGB_URL

COMMA = b","
REQUIRED = ("edge", "node-feat", "node-label")
SPLITS = ("train", "valid", "test")


def load_ogb(root_dir: PathLike, name: str, *, split_scheme: str | None = None,
             symmetrize: bool = True, num_classes: int | None = None) -> Dataset:
    """Load an OGB node dataset from ``root_dir/raw`` and ``root_dir/split``.

    Args:
        root_dir: dataset root holding ``raw/`` and ``split/``.
        name: dataset name, e.g. ``"ogbn-arxiv"``.
        split_scheme: sub-directory of ``split/`` (default: None, the only one there).
        symmetrize: add the reverse of every edge (default: True).
        num_classes: C (default: ``max(label) + 1``).

    Raises:
        DatasetNotFoundError: required files or the split scheme are missing.
        FormatError: a token is not a number, a line has the wrong number of values,
            labels have several columns.
        ValidationError: ids out of range or repeated, row counts differ from N,
            NaN/inf features, labels out of range, empty or overlapping splits, no edges.
    """
    root = Path(root_dir)
    raw = root / "raw"
    found = {stem: _find(raw, stem) for stem in REQUIRED}
    _require(root, name, [stem for stem, path in found.items() if path is None])
    files = {stem: path for stem, path in found.items() if path is not None}
    num_nodes = _read_num_nodes(_find(raw, "num-node-list"))
    feat_path = files["node-feat"]
    features = read_table(feat_path, dtype=np.float32, num_cols=None, delimiter=COMMA)
    if features.shape[0] == 0:
        raise ValidationError("the feature file holds no rows", source=feat_path,
                              found="0 lines", expected="one line of features per vertex")
    n = features.shape[0] if num_nodes is None else num_nodes
    _check_rows(features.shape[0], n, feat_path)
    check_finite(features, source=feat_path, locate=text_locator(feat_path, delimiter=COMMA))
    labels, num_classes = _read_labels(files["node-label"], n, num_classes)
    graph = _read_graph(files["edge"], n, symmetrize)
    scheme_dir = _split_dir(root, split_scheme)
    masks, sources = _read_splits(scheme_dir, n)
    check_masks(masks, labels, sources)
    info = {"format": "ogb", "source": str(root), "split": f"{scheme_dir.name} (official)"}
    return assemble(name, graph, features, labels, masks, num_classes, info)


# ------------------------------------------------------------------- internals
def _find(directory: Path, stem: str) -> Path | None:
    for suffix in (".csv.gz", ".csv"):
        if (directory / f"{stem}{suffix}").is_file():
            return directory / f"{stem}{suffix}"
    return None


def _require(root: Path, name: str, missing: list[str]) -> None:
    if not missing:
        return
    names = ", ".join(f"raw/{stem}.csv.gz" for stem in missing)
    hint = f"place them under {root}"
    if (root / "raw" / "data.npz").is_file():
        hint = "this is OGB's binary data.npz layout, which is not supported; " + hint
    if name in OGB_FILES:
        hint += f" (unzip {OGB_URL}/{OGB_FILES[name]})"
    raise DatasetNotFoundError(f"OGB dataset {name!r} is missing {names}", source=root,
                               hint=hint)


def _read_num_nodes(path: Path | None) -> int | None:
    if path is None:
        return None
    counts = read_table(path, dtype=np.int64, num_cols=1, expected="one vertex count")[:, 0]
    if counts.size != 1:
        raise FormatError("expected the vertex count of a single graph", source=path,
                          found=f"{counts.size} lines", expected="1 line")
    if counts[0] < 1:
        raise ValidationError("the graph is empty", source=path, found=int(counts[0]),
                              expected="at least one vertex")
    return int(counts[0])


def _check_rows(rows: int, num_nodes: int, path: Path) -> None:
    if rows != num_nodes:
        raise ValidationError("rows do not match the number of vertices", source=path,
                              found=rows, expected=num_nodes)


def _read_labels(path: Path, num_nodes: int,
                 num_classes: int | None = None) -> tuple[np.ndarray, int]:
    table = read_table(path, dtype=np.float64, num_cols=None, delimiter=COMMA,
                       expected="one class id per line")
    if table.shape[0] and table.shape[1] != 1:
        raise FormatError("multi-label node labels are not supported", source=path,
                          found=f"{table.shape[1]} columns", expected="1 column")
    _check_rows(table.shape[0], num_nodes, path)
    values = table[:, 0] if table.size else np.zeros(0)
    labelled = ~np.isnan(values)
    whole = ~labelled | (np.isfinite(values) & (values == np.floor(values)))
    if not whole.all():
        k = int(np.argmax(~whole))
        raise FormatError("label is not a class id", source=path, found=float(values[k]),
                          expected="an integer or nan", **text_locator(path)(k))
    labels = np.where(labelled, values, -1).astype(np.int64)
    num_classes = check_labels(labels, num_classes, source=path, locate=text_locator(path))
    return labels, num_classes


def _read_graph(path: Path, num_nodes: int, symmetrize: bool) -> Graph:
    pairs = read_table(path, dtype=np.int64, num_cols=2, delimiter=COMMA,
                       expected="two vertex ids 'src,dst'")
    if pairs.shape[0] == 0:
        raise ValidationError("the edge file holds no edges", source=path, found="0 edges",
                              expected="at least one 'src,dst' line")
    for col, column in enumerate(("src", "dst")):
        check_ids(pairs[:, col], num_nodes, source=path,
                  locate=text_locator(path, delimiter=COMMA, column=column))
    graph = Graph.from_edges(pairs[:, 0], pairs[:, 1], num_nodes, symmetrize=symmetrize)
    warn_repeated_edges(pairs.shape[0], graph, path, symmetrize=symmetrize)
    return graph


def _split_dir(root: Path, scheme: str | None) -> Path:
    split_root = root / "split"
    schemes = sorted(p.name for p in split_root.iterdir() if p.is_dir()) \
        if split_root.is_dir() else []
    if scheme is None:
        if len(schemes) != 1:
            raise DatasetNotFoundError("cannot pick the split scheme", source=split_root,
                                       found=schemes or "no scheme directories",
                                       expected="exactly one, or choose one with --split-scheme "
                                       "(split_scheme=)")
        scheme = schemes[0]
    if scheme not in schemes:
        raise DatasetNotFoundError("split scheme not found", source=split_root, found=schemes,
                                   expected=scheme)
    return split_root / scheme


def _read_splits(scheme_dir: Path, num_nodes: int) -> tuple[list[np.ndarray], list[str]]:
    missing = [s for s in SPLITS if _find(scheme_dir, s) is None]
    if missing:
        raise DatasetNotFoundError(f"split files are missing: {', '.join(missing)}",
                                   source=scheme_dir,
                                   hint="expected train, valid and test .csv.gz files")
    masks, sources = [], []
    for split in SPLITS:
        path = _find(scheme_dir, split)
        assert path is not None
        ids = read_table(path, dtype=np.int64, num_cols=1, delimiter=COMMA,
                         expected="one vertex id per line")[:, 0]
        locate = text_locator(path, delimiter=COMMA)
        check_ids(ids, num_nodes, source=path, locate=locate)
        check_unique(ids, source=path, locate=locate)
        mask = np.zeros(num_nodes, dtype=bool)
        mask[ids] = True
        masks.append(mask)
        sources.append(str(path))
    return masks, sources

