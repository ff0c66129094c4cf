"""The four-file input format of NeutronStar / NeutronTask.

- edge file: binary, headerless little-endian uint32 ``(src, dst)`` pairs;
- feature file: text, ``id f1 ... fd`` per line, one line per vertex;
- label file: text, ``id label`` per line (vertices not listed are unlabelled, -1);
- mask file: text, ``id train|val|test`` per line (``eval`` is accepted for ``val``,
  as NeutronStar's ``readFeature_Label_Mask`` does; vertices not listed are in no
  mask). Any other word is refused.

Ids are explicit, so lines may come in any order; every id is checked for range and
repeats, and every vertex needs exactly one feature line. Text is parsed in large
blocks with numpy (no Python loop per line); the split words are turned into numeric
codes by regular expressions on each block. Error messages name the file and line.

Shapes: N = number of vertices, F = feature dimension.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fullgraph.errors import FormatError, ValidationError
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
from fullgraph.graph.formats._text import iter_rows, line_of_row, read_table
from fullgraph.graph.formats.edgelist import read_edges

#: Split word -> numeric code written in its place before parsing: far below any
#: number a mask file holds, so that a number in the file (``-1``, say) is never
#: mistaken for a split and is refused as an unknown split name.
_CODE_BASE = -(2**62)
SPLIT_CODES = {b"train": _CODE_BASE - 1, b"val": _CODE_BASE - 2, b"eval": _CODE_BASE - 2,
               b"test": _CODE_BASE - 3}
_SPLIT_WORD = {word: re.compile(rb"(?<![^\s])" + word + rb"(?![^\s])") for word in SPLIT_CODES}


def load_neutronstar(edge_file: PathLike, feature_file: PathLike, label_file: PathLike,
                     mask_file: PathLike, *, num_nodes: int | None = None,
                     symmetrize: bool = False, num_classes: int | None = None,
                     name: str = "neutronstar") -> Dataset:
    """Load a NeutronStar dataset from its edge, feature, label and mask files.

    Args:
        edge_file: binary uint32 ``(src, dst)`` pairs.
        feature_file: text ``id f1 ... fd`` lines.
        label_file: text ``id label`` lines.
        mask_file: text ``id train|val|eval|test`` lines.
        num_nodes: N (default: the number of feature lines).
        symmetrize: add ``dst -> src`` for every edge (default: False; the graph keeps
            the direction and self-loops of the file, duplicates are dropped).
        num_classes: C (default: ``max(label) + 1``).
        name: dataset name (default: ``"neutronstar"``).

    Raises:
        DatasetNotFoundError: a file does not exist.
        FormatError: a token is not a number or split word, a line has the wrong number
            of values, the edge file is truncated.
        ValidationError: ids out of range, negative or repeated, feature lines missing,
            NaN/inf features, labels out of range, empty or inconsistent masks, no edges.
    """
    features = read_features(feature_file, num_nodes)
    n = features.shape[0]
    try:
        labels, num_classes = read_labels(label_file, n, num_classes)
        masks = read_masks(mask_file, n)
        src, dst = read_edges(edge_file, n, binary_dtype=np.uint32, fixed_width=True)
    except ValidationError as exc:
        if num_nodes is not None or exc.hint or exc.problem != "vertex id out of range":
            raise
        raise ValidationError(exc.problem, source=exc.source, line=exc.line, field=exc.field,
                              found=exc.found, expected=exc.expected,
                              hint=f"N = {n}, the vertices of the feature file {feature_file}: "
                                   "is a vertex missing there?") from None
    check_masks(masks, labels, [str(mask_file)] * 3)
    graph = Graph.from_edges(src, dst, n, symmetrize=symmetrize)
    warn_repeated_edges(src.size, graph, edge_file, symmetrize=symmetrize)
    info = {"format": "neutronstar", "source": str(Path(edge_file).parent),
            "split": f"mask file {mask_file}"}
    return assemble(name, graph, features, labels, masks, num_classes, info)


def read_features(path: PathLike, num_nodes: int | None = None) -> np.ndarray:
    """(N, F) float32 features from ``id f1 ... fd`` lines, placed by id.

    Raises:
        ValidationError: an id is not a whole number, out of range or repeated, the
            number of lines differs from ``num_nodes``, or a value is NaN/inf.
    """
    ids_parts, rows_parts = [], []
    for block in iter_rows(path, dtype=np.float64, num_cols=None,
                           expected="a vertex id followed by the same number of features"):
        ids_parts.append(block[:, 0])
        rows_parts.append(block[:, 1:].astype(np.float32))
    if not rows_parts or rows_parts[0].shape[1] == 0:
        raise ValidationError("the feature file holds no features", source=path,
                              expected="lines 'id f1 ... fd' with d >= 1")
    ids_f = np.concatenate(ids_parts)
    rows = np.concatenate(rows_parts) if len(rows_parts) > 1 else rows_parts[0]
    locate = text_locator(path, column="id")
    n = ids_f.size if num_nodes is None else int(num_nodes)
    with np.errstate(invalid="ignore"):
        whole = ids_f == np.floor(ids_f)
    if not whole.all():
        k = int(np.argmax(~whole))
        raise FormatError("vertex id is not an integer", source=path, found=float(ids_f[k]),
                          expected="an integer", **locate(k))
    beyond = np.abs(ids_f) >= 2.0**62  # where the cast to int64 would wrap: named as read
    if beyond.any():
        k = int(np.argmax(beyond))
        raise ValidationError("vertex id out of range", source=path, found=float(ids_f[k]),
                              expected=f"0 <= id < {n}", **locate(k))
    ids = ids_f.astype(np.int64)
    check_ids(ids, n, source=path, locate=locate)
    check_unique(ids, source=path, locate=locate)
    if ids.size != n:
        raise ValidationError("feature rows do not match the number of vertices", source=path,
                              found=ids.size, expected=n, hint="every vertex needs one line")
    check_finite(rows, source=path, locate=text_locator(path))
    if np.array_equal(ids, np.arange(n)):
        return rows
    features = np.empty_like(rows)
    features[ids] = rows
    return features


def read_labels(path: PathLike, num_nodes: int,
                num_classes: int | None = None) -> tuple[np.ndarray, int]:
    """(N,) int64 labels from ``id label`` lines (-1 where not listed) and C.

    Raises:
        ValidationError: ids out of range or repeated, labels out of range.
    """
    table = read_table(path, dtype=np.int64, num_cols=2,
                       expected="two integers 'id label'")
    ids, values = table[:, 0], table[:, 1]
    locate = text_locator(path, column="id")
    check_ids(ids, num_nodes, source=path, locate=locate)
    check_unique(ids, source=path, locate=locate)
    num_classes = check_labels(values, num_classes, source=path,
                               locate=text_locator(path, column="label"))
    labels = np.full(num_nodes, -1, dtype=np.int64)
    labels[ids] = values
    return labels, num_classes


def read_masks(path: PathLike, num_nodes: int) -> list[np.ndarray]:
    """Train, val and test masks, each (N,) bool, from ``id train|val|eval|test`` lines.

    Raises:
        FormatError: a split word is unknown.
        ValidationError: ids out of range or repeated.
    """
    table = read_table(path, dtype=np.int64, num_cols=2, transform=_split_words_to_codes,
                       expected="an integer id followed by train, val, eval or test")
    ids, codes = table[:, 0], table[:, 1]
    unknown = ~np.isin(codes, list(SPLIT_CODES.values()))
    if unknown.any():
        k = int(np.argmax(unknown))
        raise FormatError("unknown split name", source=path, line=line_of_row(path, k),
                          found=int(codes[k]), expected="train, val, eval or test")
    locate = text_locator(path, column="id")
    check_ids(ids, num_nodes, source=path, locate=locate)
    check_unique(ids, source=path, locate=locate)
    masks = []
    for code in (SPLIT_CODES[b"train"], SPLIT_CODES[b"val"], SPLIT_CODES[b"test"]):
        mask = np.zeros(num_nodes, dtype=bool)
        mask[ids[codes == code]] = True
        masks.append(mask)
    return masks


def _split_words_to_codes(block: bytes) -> bytes:
    for word, pattern in _SPLIT_WORD.items():
        if word in block:
            block = pattern.sub(str(SPLIT_CODES[word]).encode(), block)
    return block
