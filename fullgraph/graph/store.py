"""The processed on-disk format of a Dataset: one ``.npy`` per array plus ``meta.json``.

Loaders of real formats parse once and save here; later runs load from here,
memory-mapped, so a large feature matrix is paged in on demand instead of read into
RAM. A dataset directory holds::

    meta.json        format_version, name, counts, info, and per array: file, dtype,
                     shape, checksum (of the whole .npy file, header included)
    indptr.npy       (N + 1,) int64
    indices.npy      (E,) int32 or int64
    edge_weight.npy  (E,) optional
    features.npy     (N, F) float32 or float16; bfloat16 is stored as its uint16 bits
                     and ``meta.json`` records the real dtype
    or, for sparse features (a CSR ``VertexData.features``; ``meta.json`` then records
    ``feature_shape`` [N, F]):
    features_indptr.npy (N + 1,) int64, features_indices.npy (Z,) int64 column ids,
    features_values.npy (Z,) the non-zeros, dtype as above
    labels.npy       (N,) int64
    train_mask.npy, val_mask.npy, test_mask.npy   (N,) bool

One part of a sharded dataset (``partition.shards``) is a dataset directory too:
``meta.json`` then has a ``shard`` entry (part, parts, hops, num_edges, feature_min,
fingerprint), the feature arrays hold M rows named by ``feature_row_ids.npy`` (M,)
int64, and ``shard_part_of.npy``, ``shard_in_degree.npy`` (N,) int64 and
``shard_edge_rows.npy`` hold the rest of ``graph.data.Shard``.

Invariants: nothing is half-written. ``save_dataset`` writes into a temporary sibling
directory, fsyncs it, then swaps it into place by renames, so a reader sees the old
dataset, the new one, or (for the instant between two renames) none, never a mix.
``load_dataset`` refuses a stale format version, a missing or truncated file and a
checksum mismatch with a ``CacheError`` naming the file. The checksum is SHA-256,
streamed in 16 MiB reads: on the 2-core dev machine it hashed a 1 GiB file from the
page cache at about 1.0 GB/s, against 0.6 GB/s for BLAKE2b (OpenSSL uses SHA-NI).

This module must not import torch.distributed or anything above the graph layer.

Shapes: N = number of vertices, E = number of edges, F = feature dimension.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.errors import CacheError, ConfigError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset, Shard, VertexData
from fullgraph.graph.sparse import csr, is_sparse
from fullgraph.paths import sibling_dir

FORMAT_VERSION = 1
META_FILE = "meta.json"
SHARDS_FILE = "shards.json"
"""The manifest of a directory of per-part shards (``partition.shards``)."""
SHARDS_FORMAT = "fullgraph-shards-1"
CHECKSUM_ALGORITHM = "sha256"
CHUNK_BYTES = 16 << 20
REBUILD_HINT = ("delete the directory: a built-in or downloaded dataset is then rebuilt from "
                "its source files; run `fullgraph convert` or `generate` again for your own, "
                "and `fullgraph partition --shards` for a shard set")

# numpy has no bfloat16: such tensors travel as their raw 16-bit patterns.
_BIT_VIEWS = {torch.bfloat16: (torch.int16, np.uint16)}
_TORCH_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}


# ------------------------------------------------------------------------ save
def save_dataset(dataset: Dataset, path: Path | str) -> None:
    """Write ``dataset`` to the directory ``path``, replacing what is there atomically.

    Args:
        dataset: a valid dataset (checked with ``Dataset.validate`` first).
        path: target directory; its parent is created if needed. An existing
            directory is replaced only if it is empty or holds a ``meta.json``.

    Raises:
        ValidationError: the dataset is inconsistent, or its ``info`` is not JSON.
        CacheError: ``path`` exists and is not a dataset directory.
    """
    dataset.validate()
    with DatasetWriter(path) as writer:
        for name, tensor in _arrays_of(dataset).items():
            writer.put(name, tensor)
        x = dataset.data.features
        writer.commit(name=dataset.name, num_nodes=dataset.graph.num_nodes,
                      num_edges=dataset.graph.num_edges, num_classes=dataset.data.num_classes,
                      info=dataset.info,
                      feature_shape=list(x.shape) if is_sparse(x) else None,
                      shard=dataset.shard)


class DatasetWriter:
    """Writes a dataset directory array by array, for data too large to hold at once.

    Arrays go into a temporary sibling of ``path``: small ones whole (``put``), large
    ones block by block, in order (``append`` ... ``close``), through plain file writes
    (no memory map, so the blocks written are page cache, not the writer's memory).
    ``commit`` writes ``meta.json``, fsyncs and swaps the directory into place, so the
    atomicity of ``save_dataset`` holds here too; leaving the ``with`` block without
    ``commit`` (an error, a kill) removes the temporary directory, and the old
    dataset, if any, stays as it was.

    Example::

        with DatasetWriter(path) as w:
            x = w.append("features", torch.float32, (f,))
            for block in blocks: x.append(block)  # (rows, f) numpy arrays
            w.close("features")
            w.put("labels", y)
            ...
            w.commit(name="...", num_nodes=n, num_edges=e, num_classes=c, info={})
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        _check_replaceable(self.path)
        # the folders made here for it (``<root>/<name>`` of a first write), which an
        # abort removes again where they stayed empty
        self.made = [p for p in (self.path.parent, *self.path.parent.parents)
                     if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = sibling_dir(self.path, "tmp")
        self.entries: dict[str, dict[str, Any]] = {}
        self._open: dict[str, ArrayAppender] = {}
        self._done = False

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    def put(self, name: str, tensor: Tensor) -> None:
        """Write a whole tensor as ``name.npy``."""
        self.entries[name] = _write_array(self.tmp / f"{name}.npy", tensor)

    def append(self, name: str, dtype: torch.dtype,
               row_shape: tuple[int, ...] = ()) -> "ArrayAppender":
        """Start ``name.npy``, to be filled in order by ``ArrayAppender.append``."""
        appender = ArrayAppender(self.tmp / f"{name}.npy", dtype, row_shape)
        self._open[name] = appender
        return appender

    def close(self, name: str) -> None:
        """Finish an array begun with ``append``: its header gets the rows written."""
        self.entries[name] = self._open.pop(name).close()

    def commit(self, *, name: str, num_nodes: int, num_edges: int, num_classes: int,
               info: dict[str, Any], feature_shape: list[int] | None = None,
               shard: Shard | None = None) -> None:
        """Write ``meta.json`` and swap the directory into place."""
        if self._open:
            raise ValueError(f"arrays still open: {', '.join(sorted(self._open))}")
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "name": name, "num_nodes": num_nodes,
            "num_edges": num_edges, "num_classes": num_classes, "info": info,
            "checksum_algorithm": CHECKSUM_ALGORITHM, "arrays": self.entries}
        if feature_shape is not None:
            meta["feature_shape"] = feature_shape
        if shard is not None:
            meta["shard"] = {"part": shard.part, "parts": shard.parts, "hops": shard.hops,
                             "num_edges": shard.num_edges, "feature_min": shard.feature_min,
                             "fingerprint": shard.fingerprint}
        _write_meta(self.tmp / META_FILE, meta)
        fsync_dir(self.tmp)
        swap_into_place(self.tmp, self.path)
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far."""
        for appender in self._open.values():
            appender.file.close()
        self._open.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        for folder in self.made:  # innermost first
            try:
                folder.rmdir()
            except OSError:  # not empty (another writer's), or gone
                break
        self._done = True


class ArrayAppender:
    """One ``.npy`` file written row block by row block; see ``DatasetWriter.append``."""

    def __init__(self, path: Path, dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape = path, dtype, tuple(row_shape)
        self.stored = _stored_dtype(dtype)
        self.rows = 0
        self.file = open(path, "wb")
        self.file.write(_npy_header(self.stored, (0, *self.row_shape)))

    def append(self, block: np.ndarray | Tensor) -> None:
        """Write rows ``(k, *row_shape)``; a tensor is stored as ``stored_array`` gives it."""
        array = stored_array(block) if isinstance(block, Tensor) else np.asarray(block)
        if array.dtype != self.stored or tuple(array.shape[1:]) != self.row_shape:
            raise ValueError(f"{self.path.name}: cannot append {array.dtype} "
                             f"{array.shape} to rows of {self.stored} {self.row_shape}")
        with _writing(self.path):
            self.file.write(np.ascontiguousarray(array).data)
        self.rows += array.shape[0]

    def close(self) -> dict[str, Any]:
        """Put the row count in the header, fsync, return the ``meta.json`` entry."""
        shape = (self.rows, *self.row_shape)
        header = _npy_header(self.stored, shape)
        with _writing(self.path):
            self.file.flush()
            self.file.seek(0)
            self.file.write(header)
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()
        return {"file": self.path.name, "dtype": _dtype_name(self.dtype), "shape": list(shape),
                "checksum": file_checksum(self.path)}


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """numpy's own ``.npy`` header; its length does not depend on the first axis's size
    (numpy pads it to room for 21 digits), so it can be rewritten in place."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": shape})
    return out.getvalue()


def _arrays_of(dataset: Dataset) -> dict[str, Tensor]:
    g, d = dataset.graph, dataset.data
    arrays = {"indptr": g.indptr, "indices": g.indices}
    if g.edge_weight is not None:
        arrays["edge_weight"] = g.edge_weight
    x = d.features
    if is_sparse(x):
        arrays.update(features_indptr=x.crow_indices(), features_indices=x.col_indices(),
                      features_values=x.values())
    else:
        arrays["features"] = x
    arrays.update(labels=d.labels, train_mask=d.train_mask, val_mask=d.val_mask,
                  test_mask=d.test_mask)
    if d.row_ids is not None:
        arrays["feature_row_ids"] = d.row_ids
    if dataset.shard is not None:
        arrays.update(shard_part_of=dataset.shard.part_of,
                      shard_in_degree=dataset.shard.in_degree,
                      shard_edge_rows=dataset.shard.edge_rows)
    return arrays


def _write_array(file: Path, tensor: Tensor) -> dict[str, Any]:
    """Write one tensor as ``.npy``, fsync it, and return its ``meta.json`` entry."""
    dtype_name = _dtype_name(tensor.dtype)
    array = stored_array(tensor)
    with _writing(file), open(file, "wb") as f:
        np.lib.format.write_array(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"file": file.name, "dtype": dtype_name, "shape": list(tensor.shape),
            "checksum": file_checksum(file)}


@contextlib.contextmanager
def _writing(file: Path) -> Iterator[None]:
    """Re-raise a failed write as an ``OSError`` naming ``file`` and the cause (numpy's
    short write says only "N requested and M written", without either)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None and exc.errno is not None:
            raise
        code = exc.errno
        if code is None:  # a short write: most often a full disk
            try:
                full = shutil.disk_usage(file.parent).free < 1 << 20
            except OSError:
                full = False
            code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, os.strerror(code), str(file)) from exc


def stored_array(tensor: Tensor) -> np.ndarray:
    """The numpy array a tensor is stored as (bfloat16 as its uint16 bits), on the CPU."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype in _BIT_VIEWS:
        int_view, np_view = _BIT_VIEWS[tensor.dtype]
        return tensor.view(int_view).numpy().view(np_view)
    return tensor.numpy()


def _write_meta(file: Path, meta: dict[str, Any]) -> None:
    try:
        text = json.dumps(meta, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError("dataset info must be JSON-serialisable", source=meta["name"],
                              field="info", found=str(exc)) from None
    with open(file, "w", encoding="ascii") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def _check_replaceable(path: Path) -> None:
    if not path.exists():
        return
    if not path.is_dir() or (any(path.iterdir()) and not (path / META_FILE).is_file()):
        raise CacheError("refusing to replace something that is not a dataset directory",
                         source=path, expected=f"an empty directory or one with {META_FILE}",
                         hint="choose another path or remove it yourself")


def swap_into_place(tmp: Path, path: Path) -> None:
    """Rename ``path`` away, rename ``tmp`` to ``path``, then delete the old copy."""
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        old.rmdir()  # only the unique name is wanted; rename needs it free
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ load
def load_dataset(path: Path | str, *, mmap: bool = True, verify: bool = True) -> Dataset:
    """Read a dataset written by ``save_dataset``.

    Args:
        path: the dataset directory.
        mmap: memory-map the arrays (copy-on-write), so nothing is read into RAM
            until used; otherwise read them in full (default: True).
        verify: stream every file through the checksum before using it (default: True).

    Returns:
        The dataset; with ``mmap`` its tensors share memory with the mapped files.

    Raises:
        CacheError: naming the file when meta.json is missing, unreadable or of
            another format version, or an array file is missing, truncated, of the
            wrong dtype or shape, or fails its checksum.
    """
    path = Path(path)
    meta = read_meta(path)
    entries = _array_entries(path, meta)
    tensors = {name: _load_array(path, name, entry, mmap=mmap, verify=verify)
               for name, entry in entries.items()}
    graph = _graph_from(path, meta, tensors)
    data = VertexData(_features_from(path, meta, tensors), tensors["labels"],
                      tensors["train_mask"],
                      tensors["val_mask"], tensors["test_mask"], int(meta["num_classes"]),
                      row_ids=tensors.get("feature_row_ids"))
    rows = graph.num_nodes if data.row_ids is None else data.row_ids.numel()
    if data.features.shape[0] != rows:
        raise CacheError("feature rows do not match the number of vertices"
                         if data.row_ids is None else
                         "feature rows do not match the shard's row ids",
                         source=path / ("features.npy" if "features" in tensors
                                        else "features_indptr.npy"),
                         found=data.features.shape[0], expected=rows, hint=REBUILD_HINT)
    if data.labels.shape[0] != graph.num_nodes:
        raise CacheError("labels do not match the number of vertices",
                         source=path / "labels.npy", found=data.labels.shape[0],
                         expected=graph.num_nodes, hint=REBUILD_HINT)
    _check_label_range(path, str(meta["name"]), data)
    return Dataset(str(meta["name"]), graph, data, dict(meta["info"]),
                   shard=_shard_from(path, meta, tensors),
                   checksums={name: str(e["checksum"]) for name, e in entries.items()})


def _shard_from(path: Path, meta: dict[str, Any], tensors: dict[str, Tensor]) -> Shard | None:
    entry = meta.get("shard")
    if entry is None:
        return None
    needed = ("shard_part_of", "shard_in_degree", "shard_edge_rows", "feature_row_ids")
    missing = [k for k in needed if k not in tensors]
    keys = ("part", "parts", "hops", "num_edges", "feature_min")
    if missing or not isinstance(entry, dict) or any(k not in entry for k in keys):
        raise CacheError("shard metadata is incomplete", source=path / META_FILE,
                         field="shard", found=f"arrays missing: {missing}" if missing else entry,
                         hint="write the shards again with fullgraph partition --shards")
    return Shard(int(entry["part"]), int(entry["parts"]), int(entry["hops"]),
                 tensors["shard_part_of"], tensors["shard_in_degree"],
                 tensors["shard_edge_rows"], int(entry["num_edges"]),
                 float(entry["feature_min"]), dict(entry.get("fingerprint") or {}))


def read_shard_manifest(path: Path | str) -> dict[str, Any]:
    """The ``shards.json`` of a directory of per-part shards (CacheError if unreadable)."""
    file = Path(path) / SHARDS_FILE
    try:
        manifest = json.loads(file.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError("shard manifest is not readable", source=file, found=str(exc),
                         hint="write the shards again with fullgraph partition --shards"
                         ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDS_FORMAT:
        raise CacheError("not a shard manifest of this version", source=file,
                         field="format", expected=SHARDS_FORMAT,
                         found=manifest.get("format") if isinstance(manifest, dict)
                         else type(manifest).__name__,
                         hint="write the shards again with fullgraph partition --shards")
    return manifest


def load_shard(path: Path | str, part: int, *, verify: bool = True,
               split_seed: int | None = None) -> Dataset:
    """Part ``part`` of the shard set at ``path`` (memory-mapped); ``split_seed``, when
    given, must be the one the shards were written with."""
    path = Path(path)
    manifest = read_shard_manifest(path)
    parts = manifest.get("parts")
    if not isinstance(parts, int) or parts < 1:
        raise CacheError("shard manifest lacks its part count", source=path / SHARDS_FILE,
                         field="parts", found=parts,
                         hint="write the shards again with fullgraph partition --shards")
    written = manifest.get("split_seed", 0)  # None: the dataset's split was fixed
    if written is None:
        if split_seed:
            warnings.warn(f"--split-seed has no effect on the shards at {path}: the split "
                          "of their dataset was fixed when it was made", stacklevel=3)
    elif split_seed is not None and split_seed != int(written):
        raise ConfigError(f"data.split_seed: {split_seed}, but the shards at {path} hold the "
                          f"split of seed {written}; write them with partition --split-seed "
                          f"{split_seed}")
    if not 0 <= part < parts:
        raise ConfigError(f"dataset {path}: a set of {parts} shards has no part {part}; "
                          f"train it with --workers {parts}")
    if not (path / f"part-{part}").is_dir():  # a host given other parts than its ranks'
        held = sorted(p.name for p in path.glob("part-*") if p.is_dir())
        raise ConfigError(f"dataset {path}: this host holds {', '.join(held) or 'no part'}, "
                          f"not part-{part}, which worker rank {part} reads: copy each "
                          "host the parts of its own ranks (under torchrun a host's ranks "
                          "follow --node-rank only with its static rendezvous, "
                          "--master-addr/--master-port; --rdzv-backend c10d ranks hosts in "
                          "the order they join)")
    dataset = load_dataset(path / f"part-{part}", verify=verify)
    sh = dataset.shard
    if sh is None or sh.part != part or sh.parts != parts:
        raise CacheError("shard directory does not match the manifest",
                         source=path / f"part-{part}", found=None if sh is None else
                         f"part {sh.part} of {sh.parts}", expected=f"part {part} of {parts}",
                         hint="write the shards again with fullgraph partition --shards")
    return dataset


def _check_label_range(path: Path, name: str, data: VertexData) -> None:
    """Refuse labels outside ``[-1, num_classes)`` (one O(N) pass over the labels)."""
    labels, num_classes = data.labels, data.num_classes
    if labels.numel() == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if num_classes >= 1 and low >= -1 and high < num_classes:
        return
    found = f"labels from {low} to {high}" if low < -1 else f"max label {high}"
    raise CacheError(f"dataset {name!r}: labels do not fit its class count", source=path,
                     field="num_classes", found=f"{found}, num_classes {num_classes}",
                     expected=f"labels in -1 (unlabelled) .. {num_classes - 1}",
                     hint="num_classes in meta.json is wrong or the labels were changed; "
                     "convert the dataset again (fullgraph convert ... --num-classes C)")


def is_cached(path: Path | str) -> bool:
    """Whether ``path`` holds a dataset of the current format (checksums not checked)."""
    try:
        read_meta(Path(path))
    except CacheError:
        return False
    return True


def read_meta(path: Path) -> dict[str, Any]:
    """Parse ``path/meta.json`` and check its format version.

    Raises:
        CacheError: the file is missing, not JSON, lacks a field, or has another version.
    """
    file = path / META_FILE
    try:
        meta = json.loads(file.read_text(encoding="ascii"))
    except FileNotFoundError:
        raise CacheError("dataset metadata is missing", source=file,
                         hint="the dataset was never saved here, or saving was interrupted"
                         ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError("dataset metadata is not readable JSON", source=file,
                         found=str(exc), hint=REBUILD_HINT) from None
    if not isinstance(meta, dict):
        raise CacheError("dataset metadata must be a JSON object", source=file,
                         found=type(meta).__name__, hint=REBUILD_HINT)
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheError("stale dataset format version", source=file, field="format_version",
                         found=version, expected=FORMAT_VERSION, hint=REBUILD_HINT)
    for key in ("name", "num_nodes", "num_edges", "num_classes", "info", "arrays"):
        if key not in meta:
            raise CacheError("dataset metadata lacks a field", source=file, field=key,
                             hint=REBUILD_HINT)
    if meta.get("checksum_algorithm", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:
        raise CacheError("unknown checksum algorithm", source=file, field="checksum_algorithm",
                         found=meta["checksum_algorithm"], expected=CHECKSUM_ALGORITHM,
                         hint=REBUILD_HINT)
    return meta


def _array_entries(path: Path, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = meta["arrays"]
    sparse = ("features_indptr", "features_indices", "features_values")
    required = ("indptr", "indices", "labels", "train_mask", "val_mask", "test_mask") + \
        (sparse if "feature_shape" in meta else ("features",))
    for name in required:
        if not isinstance(entries, dict) or name not in entries:
            raise CacheError("dataset metadata lists no such array", source=path / META_FILE,
                             field=f"arrays.{name}", hint=REBUILD_HINT)
    for name, entry in entries.items():
        missing = {"file", "dtype", "shape", "checksum"} - set(entry)
        if missing or entry["dtype"] not in _TORCH_DTYPES:
            raise CacheError("bad array entry in dataset metadata", source=path / META_FILE,
                             field=f"arrays.{name}", found=entry,
                             expected="file, a known dtype, shape and checksum",
                             hint=REBUILD_HINT)
    return entries


def _load_array(path: Path, name: str, entry: dict[str, Any], *, mmap: bool,
                verify: bool) -> Tensor:
    file = path / entry["file"]
    if not file.is_file():
        raise CacheError("dataset array file is missing", source=file, field=name,
                         hint=REBUILD_HINT)
    if verify:
        found = file_checksum(file)
        if found != entry["checksum"]:
            raise CacheError("checksum mismatch (file corrupt or modified)", source=file,
                             field=name, found=f"{CHECKSUM_ALGORITHM} {found[:16]}...",
                             expected=f"{entry['checksum'][:16]}...", hint=REBUILD_HINT)
    try:
        array = np.load(file, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise CacheError("dataset array file is unreadable or truncated", source=file,
                         field=name, found=str(exc), hint=REBUILD_HINT) from None
    dtype = _TORCH_DTYPES[entry["dtype"]]
    stored = _stored_dtype(dtype)
    if array.dtype != stored or list(array.shape) != list(entry["shape"]):
        raise CacheError("array dtype or shape differs from the metadata", source=file,
                         field=name, found=f"{array.dtype} {list(array.shape)}",
                         expected=f"{stored} {entry['shape']}", hint=REBUILD_HINT)
    if dtype in _BIT_VIEWS:
        return torch.from_numpy(array.view(np.int16)).view(dtype)
    return torch.from_numpy(array)


def _features_from(path: Path, meta: dict[str, Any], tensors: dict[str, Tensor]) -> Tensor:
    """The dense feature array, or the CSR one from its three arrays (O(1) checks)."""
    if "feature_shape" not in meta:
        return tensors["features"]
    shape = meta["feature_shape"]
    ptr, cols, vals = (tensors[f"features_{k}"] for k in ("indptr", "indices", "values"))
    ok = (isinstance(shape, list) and len(shape) == 2 and ptr.dtype == torch.int64
          and ptr.shape == (int(shape[0]) + 1,) and cols.shape == vals.shape
          and int(ptr[0]) == 0 and int(ptr[-1]) == vals.shape[0])
    if not ok:
        raise CacheError("sparse feature arrays do not match feature_shape", source=path,
                         field="features_indptr, features_indices, features_values",
                         found=f"feature_shape {shape}, indptr {tuple(ptr.shape)}, "
                         f"indices {tuple(cols.shape)}, values {tuple(vals.shape)}",
                         hint=REBUILD_HINT)
    return csr(ptr, cols, vals, (int(shape[0]), int(shape[1])))


def _graph_from(path: Path, meta: dict[str, Any], tensors: dict[str, Tensor]) -> Graph:
    """Build the Graph after O(1) consistency checks (the checksums cover the rest)."""
    n, e = int(meta["num_nodes"]), int(meta["num_edges"])
    indptr, indices = tensors["indptr"], tensors["indices"]
    ok = (indptr.dtype == torch.int64 and indptr.shape == (n + 1,) and indices.shape == (e,)
          and int(indptr[0]) == 0 and int(indptr[-1]) == e)
    if not ok:
        raise CacheError("CSR arrays do not match num_nodes/num_edges", source=path,
                         field="indptr, indices",
                         found=f"indptr {tuple(indptr.shape)}, indices {tuple(indices.shape)}",
                         expected=f"indptr ({n + 1},) from 0 to {e}, indices ({e},)",
                         hint=REBUILD_HINT)
    return Graph(indptr, indices, n, tensors.get("edge_weight"), validate=False)


# -------------------------------------------------------------------- helpers
def file_checksum(file: Path) -> str:
    """Hex SHA-256 of a file, streamed in ``CHUNK_BYTES`` reads (constant memory)."""
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while True:
            count = f.readinto(view)
            if not count:
                break
            digest.update(view[:count])
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise ValidationError("array dtype cannot be stored", field="dtype", found=name,
                              expected=" | ".join(_TORCH_DTYPES))
    return name


def _stored_dtype(dtype: torch.dtype) -> np.dtype:
    """The dtype of the ``.npy`` file that holds a tensor of ``dtype``."""
    if dtype in _BIT_VIEWS:
        return np.dtype(_BIT_VIEWS[dtype][1])
    return np.dtype("bool" if dtype == torch.bool else str(dtype).removeprefix("torch."))
