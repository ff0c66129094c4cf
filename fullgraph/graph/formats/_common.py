"""Checks and assembly shared by the format loaders.

Every check raises a :class:`~fullgraph.errors.DataError` subclass that names the
file, the line (text formats) or field (binary and array formats), what was found and
what was expected. A *locator* turns the position of a bad value in a parsed array
into that line or field, lazily: text files are re-scanned only when an error is
actually raised. :func:`assemble` builds the :class:`Dataset` and validates it.

Shapes: N = number of vertices, F = feature dimension.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import MASK_NAMES, Dataset, VertexData
from fullgraph.graph.formats._text import line_of_row
from fullgraph.graph.sparse import csr

PathLike = str | os.PathLike[str]
#: Maps the 0-based position of a bad value to ``line=`` / ``field=`` error arguments.
Locator = Callable[[int], dict[str, Any]]


def text_locator(path: PathLike, *, delimiter: bytes | None = None, comments: bool = False,
                 column: str | None = None) -> Locator:
    """Locator for row ``k`` of a text table: its line number and optional column name."""
    def locate(k: int) -> dict[str, Any]:
        return {"line": line_of_row(path, k, delimiter=delimiter, comments=comments),
                "field": column}
    return locate


def field_locator(template: str) -> Locator:
    """Locator naming a field, e.g. ``field_locator("edge {k} (src)")``."""
    return lambda k: {"field": template.format(k=k)}


def require_files(directory: Path, names: Sequence[str], *, dataset: str,
                  url_base: str | None = None) -> None:
    """Raise DatasetNotFoundError listing every file of ``names`` missing from ``directory``.

    Args:
        directory: where the files should be.
        names: file names inside ``directory``.
        dataset: dataset name for the message.
        url_base: upstream URL prefix of the files, quoted in the hint (default: None).
    """
    missing = [name for name in names if not (directory / name).is_file()]
    if not missing:
        return
    hint = f"place {'it' if len(missing) == 1 else 'them'} in {directory}"
    if url_base:
        hint += "; upstream: " + ", ".join(f"{url_base}/{name}" for name in missing)
    raise DatasetNotFoundError(f"dataset {dataset!r} is missing {len(missing)} of its "
                               f"{len(names)} files: {', '.join(missing)}", source=directory,
                               hint=hint)


def check_ids(ids: np.ndarray, num_nodes: int, *, source: PathLike, locate: Locator,
              what: str = "vertex id") -> None:
    """Raise ValidationError at the first negative id or id ``>= num_nodes``."""
    if ids.size == 0:
        return
    expected = f"0 <= id < {num_nodes}"
    negative = ids < 0
    if negative.any():
        k = int(np.argmax(negative))
        raise ValidationError(f"negative {what}", source=source, found=_scalar(ids[k]),
                              expected=expected, **locate(k))
    too_big = ids >= num_nodes
    if too_big.any():
        k = int(np.argmax(too_big))
        raise ValidationError(f"{what} out of range", source=source, found=_scalar(ids[k]),
                              expected=expected, **locate(k))


def check_unique(ids: np.ndarray, *, source: PathLike, locate: Locator,
                 what: str = "vertex id") -> None:
    """Raise ValidationError at the second occurrence of a repeated id."""
    if ids.size < 2:
        return
    order = np.argsort(ids, kind="stable")
    repeated = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if repeated.size:
        second = order[1:][repeated]
        k = int(second.min())
        raise ValidationError(f"{what} listed twice", source=source, found=_scalar(ids[k]),
                              expected="each id at most once", **locate(k))


def check_finite(x: np.ndarray, *, source: PathLike, locate: Locator,
                 block_rows: int = 1 << 16) -> None:
    """Raise ValidationError at the first NaN/inf feature, scanning row blocks."""
    for start in range(0, x.shape[0], block_rows):
        bad = ~np.isfinite(x[start:start + block_rows])
        if bad.any():
            r, c = (int(v) for v in np.argwhere(bad)[0])
            where = locate(start + r)
            where["field"] = f"{where.get('field') or 'features'}[{start + r}, {c}]"
            raise ValidationError("feature is not finite", source=source,
                                  found=float(x[start + r, c]), expected="a finite number",
                                  **where)


#: An inferred class count above this, or above ``SPARSE_CLASS_RATIO`` times the number
#: of distinct labels, is refused unless ``num_classes`` is given explicitly: a model's
#: output layer and every per-class buffer is that wide.
MAX_INFERRED_CLASSES = 1_000_000
SPARSE_CLASS_RATIO = 10


def check_labels(labels: np.ndarray, num_classes: int | None, *, source: PathLike,
                 locate: Locator) -> int:
    """Check labels are in ``[-1, num_classes)``; return ``num_classes`` (inferred if None).

    -1 marks an unlabelled vertex. An inferred ``num_classes`` is ``max(label) + 1``
    and must be plausible (see :func:`check_class_count`).

    Raises:
        ValidationError: a label out of range, ``num_classes < 1``, or an implausible
            inferred class count.
    """
    if num_classes is None:
        num_classes = max(int(labels.max(initial=0)) + 1, 1)
        check_class_count(labels, num_classes, source=source)
    elif int(num_classes) < 1:
        raise ValidationError("there must be at least one class", source=source,
                              field="num_classes", found=num_classes, expected="an integer >= 1")
    elif num_classes > SPARSE_CLASS_RATIO:
        distinct = int(np.unique(labels[labels >= 0]).size)
        if distinct and (num_classes > MAX_INFERRED_CLASSES
                         or num_classes > SPARSE_CLASS_RATIO * distinct):
            warnings.warn(f"{source}: num_classes {num_classes:,} is given for {distinct:,} "
                          "distinct labels: a model's output layer will be that wide (a "
                          "typo?)", stacklevel=4)
    bad = (labels < -1) | (labels >= num_classes)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValidationError("label out of range", source=source, found=_scalar(labels[k]),
                              expected=f"-1 (unlabelled) or 0 <= label < {num_classes}",
                              **locate(k))
    return num_classes


def check_class_count(labels: np.ndarray, num_classes: int, *, source: PathLike) -> None:
    """Refuse a class count far beyond the distinct labels it would hold.

    ``max(label) + 1`` classes are plausible when at most ``MAX_INFERRED_CLASSES``
    and at most ``SPARSE_CLASS_RATIO`` times the number of distinct labels used.

    Raises:
        ValidationError: naming the largest label, the class count and the number
            of distinct labels, with the ``num_classes`` / ``--num-classes`` way out.
    """
    if num_classes <= SPARSE_CLASS_RATIO:
        return
    distinct = int(np.unique(labels[labels >= 0]).size)
    if num_classes <= MAX_INFERRED_CLASSES and num_classes <= SPARSE_CLASS_RATIO * distinct:
        return
    raise ValidationError(
        "implausible class count", source=source, field="labels",
        found=f"largest label {num_classes - 1}, so {num_classes} classes, but only "
        f"{distinct} distinct labels",
        expected=f"at most {MAX_INFERRED_CLASSES:,} classes and at most "
        f"{SPARSE_CLASS_RATIO}x the distinct labels",
        hint="renumber the labels 0..C-1, or state the count with --num-classes C "
        "(num_classes=C) if it is right")


def as_features(x: np.ndarray, *, source: PathLike, field: str = "features") -> np.ndarray:
    """(N, F) features as float32 (float16 is kept); refuse other shapes and dtypes."""
    if x.ndim != 2:
        raise FormatError("features must be a 2-D array", source=source, field=field,
                          found=x.shape, expected="(N, F)")
    if x.shape[1] == 0:
        raise FormatError("features have no columns", source=source, field=field,
                          found=x.shape, expected="(N, F) with F >= 1",
                          hint="for a graph without vertex features, give a column of ones")
    if x.dtype == np.float16 or x.dtype == np.float32:
        return x
    if x.dtype.kind == "f":  # wider floats: a finite value that float32 rounds to inf
        top = float(np.finfo(np.float32).max)
        for start in range(0, x.shape[0], 1 << 16):  # in row blocks: x may be mapped
            block = x[start:start + (1 << 16)]
            with np.errstate(invalid="ignore", over="ignore"):
                big = np.isfinite(block) & np.isinf(block.astype(np.float32))
            if not big.any():
                continue
            row, col = (int(i) for i in np.argwhere(big)[0])
            row += start
            raise FormatError("feature does not fit float32", source=source,
                              field=f"{field}[{row}, {col}]", found=float(x[row, col]),
                              expected=f"a value float32 holds, |value| up to about {top:.3g} "
                                       "(features are held as float32)")
    if x.dtype.kind in "fiub":
        return x.astype(np.float32)
    raise FormatError("features must be numbers", source=source, field=field, found=x.dtype,
                      expected="a float, integer or bool array")


def as_labels(y: np.ndarray, *, source: PathLike, field: str = "labels") -> np.ndarray:
    """(N,) labels as int64; (N, 1) is squeezed; floats must hold whole numbers, or NaN
    for an unlabelled vertex (-1), as OGB's float labels mark one."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise FormatError("labels must be a 1-D array of class ids", source=source,
                          field=field, found=y.shape, expected="(N,)")
    if y.dtype.kind == "u" and y.size and int(y.max()) > np.iinfo(np.int64).max:
        k = int(np.argmax(y > np.iinfo(np.int64).max))
        raise FormatError("label is not a class id", source=source, field=f"{field}[{k}]",
                          found=int(y[k]), expected="an integer below 2**63")
    if y.dtype.kind in "iu":
        return y.astype(np.int64)
    if y.dtype.kind == "f":
        missing = np.isnan(y)
        whole = missing | (np.isfinite(y) & (y == np.round(y)) & (np.abs(y) < 2.0**62))
        if not whole.all():  # (before the cast, which would wrap a huge one)
            k = int(np.argmax(~whole))
            raise FormatError("label is not a class id", source=source,
                              field=f"{field}[{k}]", found=float(y[k]),
                              expected="an integer below 2**62 (or NaN or -1 for an "
                              "unlabelled vertex)")
        return np.where(missing, -1, y).astype(np.int64)
    raise FormatError("labels must be integer class ids", source=source, field=field,
                      found=y.dtype, expected="an integer array")


def check_masks(masks: Sequence[np.ndarray], labels: np.ndarray,
                sources: Sequence[str]) -> None:
    """Raise ValidationError naming the mask file: overlap, unlabelled vertex (an empty
    train mask is taken, for data to predict on; training refuses it)."""
    for i in range(3):
        unlabelled = masks[i] & (labels < 0)
        if unlabelled.any():
            v = int(np.argmax(unlabelled))
            raise ValidationError("a masked vertex has no label", source=sources[i],
                                  field=f"{MASK_NAMES[i]}[{v}]", found="label -1",
                                  expected="a class id")
        for j in range(i + 1, 3):
            both = masks[i] & masks[j]
            if both.any():
                v = int(np.argmax(both))
                raise ValidationError("masks overlap", source=sources[j],
                                      field=f"{MASK_NAMES[i]} & {MASK_NAMES[j]}",
                                      found=f"vertex {v} in both ({int(both.sum())} in all)",
                                      expected="disjoint train/val/test masks")


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def is_sparse_input(x: Any) -> bool:
    """A torch sparse tensor (COO, CSR, CSC), a ``torch_sparse.SparseTensor`` or a
    scipy sparse matrix or array."""
    if isinstance(x, torch.Tensor):
        return x.layout in SPARSE_LAYOUTS
    return hasattr(x, "to_torch_sparse_csr_tensor") or sp.issparse(x)


def sparse_features(x: Any, name: PathLike, field: str = "x") -> torch.Tensor:
    """Sparse ``x`` (``is_sparse_input``) as fullgraph's CSR features (float32, float16
    kept), its non-zeros only: it is never made dense here (``--sparse-features``
    decides the layout later). ``name`` and ``field`` locate it in errors."""
    if sp.issparse(x):
        m = x.tocsr(copy=True)  # summing duplicates below must not change the caller's
        if m.ndim != 2:
            raise FormatError("features must be a 2-D array", source=name, field=field,
                              found=m.shape, expected="(N, F)")
        m.sum_duplicates()
        data = np.asarray(m.data)
        if data.dtype.kind not in "biuf":
            raise FormatError("features must be real numbers", source=name, field=field,
                              found=data.dtype, expected="a float, integer or bool matrix")
        if data.dtype.itemsize > 8:  # long double: torch has no such type
            data = data.astype(np.float64)
        t = torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                    torch.from_numpy(m.indices.astype(np.int64)),
                                    torch.from_numpy(data), size=m.shape,
                                    check_invariants=True)
    else:
        t = x if isinstance(x, torch.Tensor) else x.to_torch_sparse_csr_tensor()
    if t.dim() != 2 or (t.layout == torch.sparse_coo and t.sparse_dim() != 2):
        raise FormatError("features must be a 2-D array (sparse in both dimensions)",
                          source=name, field=field, found=f"{tuple(t.shape)} {t.layout}",
                          expected="(N, F)")
    if t.shape[1] == 0:
        raise FormatError("features have no columns", source=name, field=field,
                          found=tuple(t.shape), expected="(N, F) with F >= 1",
                          hint="for a graph without vertex features, give a column of ones")
    t = t.detach().cpu()
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
    t = t.to_sparse_csr()
    values = t.values()
    if values.dtype not in (torch.float16, torch.float32):
        if values.dtype.is_complex:
            raise FormatError("features must be real numbers", source=name, field=field,
                              found=values.dtype, expected="a float, integer or bool tensor")
        values = values.to(torch.float32)
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        row = int(torch.searchsorted(t.crow_indices(), k, right=True)) - 1
        col = int(t.col_indices()[k])
        raise ValidationError("feature is not finite", source=name, field=f"{field}[{row}, {col}]",
                              found=float(values[k]), expected="a finite number")
    return csr(t.crow_indices(), t.col_indices(), values, (int(t.shape[0]), int(t.shape[1])))


def assemble(name: str, graph: Graph, features: np.ndarray | torch.Tensor,
             labels: np.ndarray, masks: Sequence[np.ndarray | torch.Tensor], num_classes: int,
             info: dict[str, Any]) -> Dataset:
    """Build a Dataset from numpy arrays (``features`` may also be a tensor, CSR for
    sparse features), validate it and return it."""
    train, val, test = (torch.as_tensor(np.asarray(m, dtype=bool)) if isinstance(m, np.ndarray)
                        else m.to(torch.bool) for m in masks)
    x = features if isinstance(features, torch.Tensor) else \
        torch.from_numpy(np.ascontiguousarray(features))
    data = VertexData(x,
                      torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
                      train, val, test, int(num_classes))
    dataset = Dataset(name, graph, data, info)
    dataset.validate()
    return dataset


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def warn_repeated_edges(given: int, graph: Graph, source: PathLike, *,
                        symmetrize: bool) -> None:
    """Warn that ``given - graph.num_edges`` repeated edges of ``source`` were dropped
    (a graph holds each edge once). Under ``symmetrize`` an edge given in both
    directions is no repeat worth naming, and the count is not told apart: no warning."""
    dropped = given - graph.num_edges
    if dropped > 0 and not symmetrize:
        warnings.warn(f"{source}: {dropped} repeated edges were dropped (each edge is stored "
                      f"once; {graph.num_edges} remain)", stacklevel=3)
