"""Plain edge lists with features, labels and optional masks in ``.npy`` files.

Edges are either text (``src dst`` per line, whitespace separated, ``#`` comments and
blank lines allowed) or binary: no header, one record per edge, ``src`` then ``dst``,
each a little-endian integer of the stated dtype (uint32: 8 bytes per edge, as
``np.array(pairs, dtype="<u4").tofile``; int64: 16 bytes per edge). A binary file
that reads as valid pairs only at the other of these two widths is refused with a
message naming that width. Features are an (N, F) ``.npy`` array (or a sparse
matrix written by ``scipy.sparse.save_npz``, kept sparse), labels an
(N,) integer ``.npy`` array (-1 = unlabelled). Masks are either one (3, N) bool
``.npy`` (rows train, val, test) or three (N,) bool ``.npy`` files; without masks a
seeded fraction split of the labelled vertices is drawn. ``.npy`` files are read
with ``allow_pickle=False``.

The graph keeps the direction, and any self-loops, of the file (edge ``src -> dst``);
duplicates are dropped; ``symmetrize=True`` adds the reverse edges.

Shapes: N = number of vertices, F = feature dimension, E = number of edges.
"""
from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence

import numpy as np
import torch

from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.graph.formats._common import (
    Locator,
    PathLike,
    as_features,
    as_labels,
    assemble,
    check_finite,
    check_ids,
    check_labels,
    check_masks,
    field_locator,
    sparse_features,
    text_locator,
    warn_repeated_edges,
)
from fullgraph.graph.formats._text import gzip_stream, open_binary, read_table, require_file
from fullgraph.graph.split import fraction_split

MaskFiles = PathLike | Sequence[PathLike]


def load_edgelist(edges: PathLike, features: PathLike, labels: PathLike | None, *,
                  binary_dtype: str | np.dtype | type | None = None, num_nodes: int | None = None,
                  symmetrize: bool = False, masks: MaskFiles | None = None, seed: int = 0,
                  split: tuple[float, float] = (0.6, 0.2), num_classes: int | None = None,
                  name: str = "custom") -> Dataset:
    """Load an edge list plus ``.npy`` features, labels and optional masks.

    Args:
        edges: edge file, text unless ``binary_dtype`` is given.
        features: (N, F) ``.npy`` of numbers (stored as float32; float16 is kept).
        labels: (N,) integer ``.npy``; -1 marks an unlabelled vertex (float labels:
            whole numbers, NaN for an unlabelled vertex); None: every vertex unlabelled
            (data to predict on, with ``num_classes`` or 1 class).
        binary_dtype: dtype of the binary edge file, e.g. ``"uint32"`` or ``"int64"``
            (default: None, a text file).
        num_nodes: N (default: the number of feature rows).
        symmetrize: add ``dst -> src`` for every edge (default: False).
        masks: one (3, N) bool ``.npy`` (a path, or a sequence of one path) or three
            (N,) bool ``.npy`` paths, ordered train, val, test (default: None, a
            fraction split).
        seed: seed of the fraction split (default: 0).
        split: train and validation fractions of the labelled vertices (default:
            ``(0.6, 0.2)``; the rest is test).
        num_classes: C (default: ``max(label) + 1``, refused when implausible).
        name: dataset name (default: ``"custom"``).

    Raises:
        DatasetNotFoundError: a file does not exist.
        FormatError: a token is not a number, a binary file is truncated or reads as
            valid pairs only at the other width, an array has the wrong dtype or
            shape, or an ``.npy`` needs pickle.
        ValidationError: ids out of range, wrong row counts, non-finite features,
            labels out of range, an implausible inferred class count (see
            ``check_class_count``), empty or overlapping masks, no edges.
    """
    x = load_features(features)
    n = x.shape[0] if num_nodes is None else int(num_nodes)
    if x.shape[0] != n:
        raise ValidationError("feature rows do not match the number of vertices",
                              source=features, found=x.shape[0], expected=n)
    if labels is None:
        y = np.full(n, -1, dtype=np.int64)
    else:
        y = as_labels(load_npy(labels), source=labels)
        if y.shape[0] != n:
            raise ValidationError("labels do not match the number of vertices",
                                  source=labels, found=y.shape[0], expected=n)
    num_classes = check_labels(y, num_classes, source=labels or features,
                               locate=field_locator("labels[{k}]"))
    src, dst = read_edges(edges, n, binary_dtype=binary_dtype)
    graph = Graph.from_edges(src, dst, n, symmetrize=symmetrize)
    warn_repeated_edges(src.size, graph, edges, symmetrize=symmetrize)
    if masks is None:
        mask_list = [m.numpy() for m in fraction_split(torch.from_numpy(y), train=split[0],
                                                       val=split[1], seed=seed)]
        how = f"fractions {split[0]}/{split[1]}/rest of the labelled vertices (seed {seed})" \
            if labels is not None else "none: no labels (data for predict)"
    else:
        mask_list, sources = load_masks(masks, n)
        check_masks(mask_list, y, sources)
        how = "mask files"
    info = {"format": "edgelist", "source": str(edges), "split": how}
    return assemble(name, graph, x, y, mask_list, num_classes, info)


def read_edges(path: PathLike, num_nodes: int, *,
               binary_dtype: str | np.dtype | type | None = None,
               fixed_width: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Read and range-check an edge file; return ``(src, dst)`` int64 arrays.

    ``fixed_width``: the format fixes ``binary_dtype`` (NeutronStar's uint32), so the
    file is not compared with the other width.

    Raises:
        FormatError: bad token (text), truncated file or the other width (binary).
        ValidationError: no edges, or an id outside ``[0, num_nodes)``.
    """
    if binary_dtype is None:
        try:
            pairs = read_table(path, dtype=np.int64, num_cols=2, comments=True,
                               expected="two vertex ids 'src dst'")
        except FormatError as exc:
            if exc.hint is None and _looks_binary(path):
                raise FormatError(exc.problem, source=exc.source, line=exc.line,
                                  field=exc.field, found=exc.found, expected=exc.expected,
                                  hint="the file holds NUL bytes, as binary ones do: give "
                                  "--binary uint32 or --binary int64") from None
            raise
        locate_src: Locator = text_locator(path, comments=True, column="src")
        locate_dst: Locator = text_locator(path, comments=True, column="dst")
    else:
        pairs = read_binary_pairs(path, binary_dtype)
        if not fixed_width:
            check_binary_width(path, pairs, num_nodes)
        locate_src = field_locator("edge {k} (src)")
        locate_dst = field_locator("edge {k} (dst)")
    if pairs.shape[0] == 0:
        raise ValidationError("the edge file holds no edges", source=path, found="0 edges",
                              expected="at least one 'src dst' pair")
    src, dst = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    check_ids(src, num_nodes, source=path, locate=locate_src)
    check_ids(dst, num_nodes, source=path, locate=locate_dst)
    return src, dst


def _looks_binary(path: PathLike) -> bool:
    """Whether the first 4 KiB of ``path`` (decompressed where gzip) hold a NUL byte,
    which no text edge file does."""
    import zlib

    try:
        with open_binary(path) as f:
            return b"\0" in f.read(4096)
    except (OSError, EOFError, zlib.error):  # (a damaged gzip stream: no hint)
        return False


def read_binary_pairs(path: PathLike, dtype: str | np.dtype | type) -> np.ndarray:
    """(E, 2) array of a headerless binary file of ``(src, dst)`` records of ``dtype``.

    Raises:
        DatasetNotFoundError: the file does not exist.
        FormatError: the file is gzip-compressed, or its size is not a multiple of the
            record size.
    """
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise ValueError(f"binary_dtype must be an integer dtype such as 'uint32' or 'int64', "
                         f"got {dt}")
    require_file(path, "edge file")
    if gzip_stream(path):
        raise FormatError("binary edge file is gzip-compressed", source=path,
                          expected=f"raw {dt} src, dst pairs",
                          hint=f"decompress it first (gunzip {path}); text edge files may "
                          "be read compressed")
    record = 2 * dt.itemsize
    size = os.path.getsize(path)
    if size % record:
        other = _other_width(dt)
        fits = other is not None and size % (2 * other.itemsize) == 0
        raise FormatError("binary edge file is truncated", source=path, found=f"{size} bytes",
                          expected=f"a multiple of {record} bytes ({dt} src, dst pairs)",
                          hint=f"the size fits {other} pairs: is the file {other} "
                          f"(--binary {other})?" if fits else None)
    return np.fromfile(path, dtype=dt).reshape(-1, 2)


def check_binary_width(path: PathLike, pairs: np.ndarray, num_nodes: int) -> None:
    """Refuse a binary edge file that reads right only at the other integer width.

    Little-endian int64 pairs of ids below 2**32 read as uint32 give a zero high word
    in every second 32-bit word, i.e. every edge points to vertex 0; uint32 pairs
    read as int64 give ids of ``src + dst * 2**32``, far beyond ``num_nodes``. Either
    way the file also reads as valid pairs of the other width, which names it. (A real
    uint32 file whose edges all point to vertex 0 reads as int64 pairs too: it is
    refused with both readings named, as such a graph is far less likely than the
    mix-up; as text it is read.)

    Args:
        path: the edge file (for the message).
        pairs: (E, 2) records as read with the given width.
        num_nodes: N; valid ids are ``[0, N)``.

    Raises:
        FormatError: the records fit the other width and not the given one.
    """
    other = _other_width(pairs.dtype)
    if other is None or pairs.size == 0 or pairs.nbytes % (2 * other.itemsize):
        return
    as_other = pairs.reshape(-1).view(other).reshape(-1, 2)
    if not _ids_in_range(as_other, num_nodes):
        return
    if pairs.dtype.itemsize < other.itemsize:
        if (pairs[:, 1] != 0).any():
            return
        found = f"every destination id (every second {pairs.dtype} word) is 0"
        star = ("; if every edge really points to vertex 0, write the edges as text "
                "'src dst' lines")
    else:
        if _ids_in_range(pairs, num_nodes):
            return
        found = f"ids up to {int(pairs.max())} for {num_nodes} vertices"
        star = ""
    raise FormatError(f"binary edge file does not look like {pairs.dtype} pairs", source=path,
                      found=found, expected=f"{pairs.dtype} src, dst pairs",
                      hint=f"it reads as valid {other} pairs: convert with --binary {other} "
                      f"(binary_dtype={str(other)!r}){star}")


def _other_width(dt: np.dtype) -> np.dtype | None:
    """The width a 32-bit/64-bit binary edge file is most likely confused with."""
    other: dict[int, np.dtype] = {4: np.dtype(np.int64), 8: np.dtype(np.uint32)}
    return other.get(np.dtype(dt).itemsize)


def _ids_in_range(pairs: np.ndarray, num_nodes: int) -> bool:
    return bool((pairs >= 0).all() and (pairs < num_nodes).all())


def load_features(path: PathLike) -> np.ndarray | torch.Tensor:
    """(N, F) features from an ``.npy`` (dense, float32; float16 kept) or from a
    ``scipy.sparse.save_npz`` archive (CSR, its non-zeros only: bag-of-words features
    need never be written or held dense).

    Raises:
        DatasetNotFoundError: the file does not exist.
        FormatError: neither form, a shape other than (N, F), values not real numbers.
        ValidationError: a value is not finite.
    """
    require_file(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            members = set(archive.namelist())
        if {"format.npy", "shape.npy", "data.npy"} <= members:
            import scipy.sparse as sp

            try:
                matrix = sp.load_npz(path)
            except (ValueError, OSError, KeyError, NotImplementedError) as exc:
                raise FormatError("not a readable scipy sparse .npz", source=path,
                                  found=str(exc)) from exc
            return sparse_features(matrix, path, "features")
    x = as_features(load_npy(path), source=path)
    check_finite(x, source=path, locate=lambda k: {})
    return x


def load_npy(path: PathLike) -> np.ndarray:
    """``np.load`` with ``allow_pickle=False`` and errors naming the file.

    Raises:
        DatasetNotFoundError: the file does not exist.
        FormatError: not an ``.npy`` file, or it holds Python objects (needs pickle).
    """
    require_file(path)
    with open(path, "rb") as f:
        head = f.read(6)
    if head != b"\x93NUMPY" and not head.startswith(b"PK"):  # .npz archives: named below
        raise FormatError("not an .npy file", source=path, found=f"it starts with {head!r}",
                          expected="an array written by numpy.save")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as exc:
        refused = "allow_pickle" in str(exc)
        raise FormatError("refused an .npy that needs pickle" if refused else
                          "not a readable .npy file", source=path, found=str(exc),
                          expected="a plain numeric array" if refused else None) from exc
    except (OSError, EOFError) as exc:
        raise FormatError("not a readable .npy file", source=path, found=str(exc)) from exc
    if not isinstance(arr, np.ndarray):
        arr.close()
        raise FormatError("expected one array, not an archive", source=path,
                          found=type(arr).__name__, expected="an .npy file")
    return arr


def load_masks(masks: MaskFiles, num_nodes: int) -> tuple[list[np.ndarray], list[str]]:
    """Masks from one (3, N) ``.npy`` or three (N,) ``.npy`` files; with their sources."""
    if not isinstance(masks, (str, os.PathLike)) and len(masks) == 1:
        masks = masks[0]
    if isinstance(masks, (str, os.PathLike)):
        stacked = load_npy(masks)
        if stacked.ndim != 2 or stacked.shape != (3, num_nodes):
            raise FormatError("a mask file holds one row per split", source=masks,
                              found=stacked.shape, expected=(3, num_nodes))
        sources = [f"{masks}[{i}]" for i in range(3)]
        return [_as_mask(stacked[i], sources[i]) for i in range(3)], sources
    paths = list(masks)
    if len(paths) != 3:
        raise ValueError(f"masks needs one (3, N) file or 3 paths (train, val, test), "
                         f"got {len(paths)} paths")
    out = []
    for p in paths:
        m = load_npy(p)
        if m.shape != (num_nodes,):
            raise FormatError("mask needs one entry per vertex", source=p, found=m.shape,
                              expected=(num_nodes,))
        out.append(_as_mask(m, str(p)))
    return out, [str(p) for p in paths]


def _as_mask(m: np.ndarray, source: str) -> np.ndarray:
    if m.dtype == np.bool_:
        return m
    if m.dtype.kind in "iu" and np.isin(m, (0, 1)).all():
        return m.astype(bool)
    raise FormatError("mask must be boolean", source=source, found=m.dtype,
                      expected="bool (or 0/1 integers)")
