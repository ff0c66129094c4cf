"""Dataset names, the dataset root and the raw -> processed pipeline.

Layout, as PyG users expect: ``<root>/<name>/raw/`` holds the files as published
and ``<root>/<name>/processed/`` the memory-mappable processed form (see
``fullgraph.graph.store``). ``load(name, root)`` opens the processed form when it is
valid, rebuilds it (with a warning) when it is corrupt or stale, processes the raw
files when they are there, copies Cora from the package's built-in copy, downloads
from the canonical upstream location when the machine is online, and otherwise
says exactly which files to place where.

``name`` may also be the path of a processed dataset directory, or the name of one
written into the root by ``fullgraph generate`` / ``fullgraph convert``. A name is a
single directory name inside the root (``check_name``): no path separators, no
leading dot (so neither ``.`` nor ``..``), not empty.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fullgraph.errors import CacheError, ConfigError, DatasetNotFoundError
from fullgraph.fields import changed_fields
from fullgraph.graph import store
from fullgraph.graph.data import Dataset
from fullgraph.graph.sparse import choose_layout

BUILTIN = Path(__file__).resolve().parent / "builtin"
PLANETOID_SUFFIXES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset fullgraph knows by name.

    Attributes:
        name: the name users type.
        format: ``planetoid``, ``npz`` or ``ogb``.
        files: raw file names expected under ``raw/``.
        description: one line for ``fullgraph datasets``.
        upstream: the upstream name the download table knows it by.
    """

    name: str
    format: str
    files: tuple[str, ...]
    description: str
    upstream: str


def _planetoid(name: str, text: str) -> DatasetSpec:
    return DatasetSpec(name, "planetoid", tuple(f"ind.{name}.{s}" for s in PLANETOID_SUFFIXES),
                       text, name)


def _npz(name: str, upstream: str, text: str) -> DatasetSpec:
    return DatasetSpec(name, "npz", (f"{name}.npz",), text, upstream)


def _ogb(name: str, text: str) -> DatasetSpec:
    return DatasetSpec(name, "ogb", ("edge.csv.gz", "node-feat.csv.gz", "node-label.csv.gz"),
                       text, name)


KNOWN: dict[str, DatasetSpec] = {s.name: s for s in (
    _planetoid("cora", "Cora citation graph, 2708 vertices, 7 classes, public split"),
    _planetoid("citeseer", "CiteSeer citation graph, 3327 vertices, 6 classes, public split"),
    _planetoid("pubmed", "PubMed citation graph, 19717 vertices, 3 classes, public split"),
    _npz("amazon_photo", "amazon_electronics_photo", "Amazon Photo co-purchase, 7650 vertices"),
    _npz("amazon_computers", "amazon_electronics_computers",
         "Amazon Computers co-purchase, 13752 vertices"),
    _npz("coauthor_cs", "ms_academic_cs", "Coauthor CS, 18333 vertices, 15 classes"),
    _npz("coauthor_physics", "ms_academic_phy", "Coauthor Physics, 34493 vertices, 5 classes"),
    _ogb("ogbn-arxiv", "OGB arXiv citation graph, 169343 vertices, 40 classes"),
    _ogb("ogbn-products", "OGB Amazon products, 2.4M vertices, 47 classes"),
)}


def load(name: str, root: Path, *, feature_dtype: str = "stored", split_seed: int = 0,
         download: bool = True, verify: bool = True, part: int = 0) -> Dataset:
    """Open dataset ``name`` under ``root`` (or at path ``name``), processing it if needed.

    ``name`` may be a directory of per-part shards (``fullgraph partition --shards``):
    then only part ``part`` is opened (a worker's rank; the launcher checks part 0).

    Raises:
        DatasetNotFoundError: unknown name (the message lists the known ones), a path
            that does not exist, or raw files missing and not downloadable (the
            message says what to put where), or a path to a folder that holds no
            dataset.
        ConfigError: ``name`` is empty.
    """
    direct = Path(name).expanduser()
    if name != check_name_or_none(name) and (direct / "processed" / store.META_FILE).is_file():
        direct = direct / "processed"  # a path to the folder convert or generate made
    if name and (direct / store.SHARDS_FILE).is_file():  # a shard set: one part of it
        return _finish(store.load_shard(direct, part, verify=verify, split_seed=split_seed),
                       feature_dtype)
    if name and (direct / store.META_FILE).is_file():
        return _finish(_fixed_split(store.load_dataset(direct, verify=verify), split_seed),
                       feature_dtype)
    if name.strip() and check_name_or_none(name) is None:  # a path, but to no dataset
        if not direct.exists():
            raise DatasetNotFoundError(
                f"dataset {name!r}: no such directory; a dataset is a name under the root "
                "(`fullgraph datasets` lists them) or the directory `fullgraph convert` "
                "or `generate` wrote")
        try:
            check_name(name, path_ok=True)
        except ConfigError as exc:
            raise DatasetNotFoundError(str(exc)) from None
    check_name(name, path_ok=True)
    if name not in KNOWN and (root / name / store.SHARDS_FILE).is_file():  # by its name
        return _finish(store.load_shard(root / name, part, verify=verify,
                                        split_seed=split_seed), feature_dtype)
    processed = processed_dir(root, name, split_seed)
    spec = KNOWN.get(name)
    if (processed / store.META_FILE).exists():
        try:
            dataset = store.load_dataset(processed, verify=verify)
            if spec is not None and _stored_dense(dataset):  # processed by an older version
                raise CacheError("its features are stored dense, and a built-in dataset's "
                                 "bag of words is stored as CSR (every host alike)",
                                 source=processed)
            if spec is None or spec.format != "npz":
                _fixed_split(dataset, split_seed)
            return _finish(dataset, feature_dtype)
        except CacheError as exc:
            if name not in KNOWN:
                raise
            warnings.warn(f"{exc}; rebuilding the processed dataset from raw files",
                          stacklevel=2)
    if name not in KNOWN:
        _incomplete(direct if direct.is_dir() else processed.parent)
        raise DatasetNotFoundError(
            "unknown dataset", field="dataset", found=repr(name),
            expected="one of " + ", ".join(sorted(set(KNOWN) | set(_processed_names(root)))),
            hint="or a processed dataset directory; `fullgraph convert` imports your own files")
    spec = KNOWN[name]
    raw = ensure_raw(spec, root / name / "raw", download=download)
    dataset = _read_raw(spec, raw, split_seed)
    from fullgraph.graph.sparse import choose_layout

    # stored in the layout `--sparse-features auto` loads (bag-of-words: CSR), as convert
    # does: a dense store is paged in whole to be made CSR (Coauthor CS: 477 MB on disk)
    features = choose_layout(dataset.data.features, "auto")
    if features is not dataset.data.features:
        dataset.data = dataclasses.replace(dataset.data, features=features)
    store.save_dataset(dataset, processed)
    dataset = store.load_dataset(processed, verify=False)
    if spec.format != "npz":
        _fixed_split(dataset, split_seed)
    return _finish(dataset, feature_dtype)


def _stored_dense(dataset: Dataset) -> bool:
    """Whether ``dataset``'s features are stored dense where ``--sparse-features auto``
    holds them as CSR (a built-in dataset processed before it was stored so)."""
    from fullgraph.graph.sparse import is_sparse, sparse_enough

    x = dataset.data.features
    return not is_sparse(x) and sparse_enough(x)


def _fixed_split(dataset: Dataset, split_seed: int) -> Dataset:
    """Warn that ``split_seed`` has no effect on ``dataset``, whose split was fixed when
    it was made (a public split, mask files, or a random split drawn by ``convert`` /
    ``generate`` with their own ``--seed``); only the downloaded datasets without a
    public split are split at load time, by ``split_seed``."""
    if split_seed:
        how = dataset.info.get("split")
        warnings.warn(f"--split-seed has no effect on dataset {dataset.name!r}: its split was "
                      f"fixed when it was made{f' ({how})' if how else ''}; `fullgraph "
                      "convert --seed` or `generate --seed` make it with another",
                      stacklevel=3)
    return dataset


def load_for(cfg: Any, part: int = 0) -> Dataset:
    """Load the dataset a ``DataConfig`` names and apply its data options (``part``: of
    a shard set, which one)."""
    dataset = load(cfg.dataset, cfg.resolved_root(), feature_dtype=cfg.feature_dtype,
                   split_seed=cfg.split_seed, part=part)
    if cfg.normalize_features:
        import torch

        sh = dataset.shard
        low = None if sh is None else float(  # the whole dataset's minimum, as stored now
            torch.tensor(sh.feature_min).to(dataset.data.features.dtype))
        dataset.data = dataset.data.row_normalized(low)
        if sh is not None:
            sh.normalized = True
    mode = cfg.sparse_features
    if dataset.shard is not None and mode == "auto":
        mode = "keep"  # a part keeps the layout auto chose for the whole dataset
    features = dataset.data.features if mode == "keep" else \
        choose_layout(dataset.data.features, mode)
    if features is not dataset.data.features:
        dataset.data = dataclasses.replace(dataset.data, features=features)
    return dataset


def split_at_load(name: str) -> bool:
    """Whether ``name`` is split at load time, by ``split_seed`` (the downloaded datasets
    without a public split); every other dataset's split was fixed when it was made."""
    spec = KNOWN.get(name)
    return spec is not None and spec.format == "npz"


def processed_dir(root: Path, name: str, split_seed: int = 0) -> Path:
    """Where the processed form of ``name`` lives (split-seed specific for random splits)."""
    if split_at_load(name) and split_seed:
        return root / name / f"processed-split{split_seed}"
    return root / name / "processed"


def _incomplete(where: Path) -> None:
    """Name what is wrong with a directory that holds part of a dataset (the store's
    arrays without their metadata, shard parts without the set's manifest), not just
    "unknown"; any other directory is left to that message.

    Raises:
        CacheError: ``where`` or its ``processed`` folder holds arrays but no metadata.
        ConfigError: ``where`` holds part-* folders but no shard manifest.
    """
    if any(p.is_dir() and (p / store.META_FILE).is_file() for p in where.glob("part-*")):
        raise ConfigError(f"dataset {where} holds part-* folders but no {store.SHARDS_FILE}, "
                          "which `fullgraph partition --shards` writes last: copy it from "
                          "the shard set, or write the shards again")
    for folder in (where, where / "processed"):  # the store's own arrays, not any .npy
        if (folder / "indptr.npy").is_file() and (folder / "indices.npy").is_file():
            store.load_dataset(folder, verify=False)  # raises, naming the missing metadata


def check_name_or_none(name: str) -> str | None:
    """``name`` if it is a dataset name (``check_name``), else None."""
    try:
        return check_name(name)
    except ConfigError:
        return None


def check_name(name: str, *, path_ok: bool = False) -> str:
    """Return ``name`` if it is a dataset name: one directory name inside the root.

    Args:
        name: the name to check.
        path_ok: the caller also accepts a processed dataset directory (the message
            says so) (default: False).

    Raises:
        ConfigError: empty, a path separator (``/`` or ``\\``), a leading dot (``.``,
            ``..``, hidden names) or a NUL character.
    """
    seps = {s for s in ("/", "\\", os.sep, os.altsep) if s}
    if name.strip() and not name.startswith(".") and not any(c in name for c in seps | {"\0"}):
        return name
    msg = (f"dataset name {name!r} is not a name: a dataset name must be non-empty, "
           "must not start with a dot and must hold no '/' or '\\'")
    if path_ok:
        msg += (f"; nor is it a processed dataset directory (one holding {store.META_FILE}) "
                f"or a shard set (one holding {store.SHARDS_FILE})")
        if Path(name).is_dir() and any(Path(name).glob("part-*")):
            msg += (f": {name} holds part-* folders but no {store.SHARDS_FILE}, which "
                    "`fullgraph partition --shards` writes last; copy it from the shard "
                    "set, or write the shards again")
    raise ConfigError(msg)


def check_new_name(name: str) -> str:
    """``name`` if a dataset of the user's own may be written under it: a name
    (``check_name``) that no built-in dataset has, so that ``--dataset cora`` always
    means Cora.

    Raises:
        ConfigError: not a name, or a built-in dataset's name.
    """
    check_name(name)
    if name in KNOWN:
        raise ConfigError(f"dataset name {name!r} is a built-in dataset's (fullgraph datasets "
                          "lists them); give your data another name")
    return name


def save_processed(dataset: Dataset, root: Path, name: str) -> Path:
    """Write ``dataset`` as the processed dataset ``name`` under ``root``.

    Raises:
        ConfigError: ``name`` is not a dataset name (see ``check_name``).
    """
    check_name(name)
    dataset.name = name
    path = processed_dir(root, name)
    store.save_dataset(dataset, path)
    return path


def ensure_raw(spec: DatasetSpec, raw: Path, *, download: bool = True) -> Path:
    """Make sure the raw files of ``spec`` are in ``raw``; return the directory. A
    built-in dataset's file of another size than the package's copy (one cut short)
    is copied again."""
    builtin = BUILTIN / spec.name

    def present(f: str) -> bool:
        if not (builtin / f).is_file():
            return (raw / f).exists()
        return (raw / f).is_file() and (raw / f).stat().st_size == (builtin / f).stat().st_size

    missing = [f for f in spec.files if not present(f)]
    if not missing:
        return raw
    if builtin.is_dir():
        raw.mkdir(parents=True, exist_ok=True)
        for f in missing:
            if (builtin / f).is_file():  # whole or not at all: a copy cut short by a
                partial = raw / f".{f}.partial"  # kill must not pass for the file
                shutil.copyfile(builtin / f, partial)
                os.replace(partial, raw / f)
        missing = [f for f in spec.files if not (raw / f).exists()]
        if not missing:
            return raw
    if download:
        from fullgraph.graph.formats import download as dl

        dl.fetch_dataset(spec.upstream, spec.format, raw, missing)
        return raw
    raise DatasetNotFoundError(
        "raw files are missing", source=raw, found=", ".join(missing),
        hint=f"place them in {raw} (see `fullgraph datasets` for the upstream location)")


def _read_raw(spec: DatasetSpec, raw: Path, split_seed: int) -> Dataset:
    module = importlib.import_module(f"fullgraph.graph.formats.{spec.format}")
    if spec.format == "planetoid":
        return module.load_planetoid(raw, spec.name)
    if spec.format == "npz":
        return module.load_npz(raw / spec.files[0], spec.name, seed=split_seed)
    return module.load_ogb(raw.parent, spec.name)


CONVERT_FORMATS = ("edgelist", "neutronstar", "ogb")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """What ``convert`` reads: the user's files and how to interpret them.

    Attributes:
        name: the dataset name to save it under (``check_name``).
        edges: edgelist / neutronstar: the edge file (default: None).
        features: edgelist: ``.npy``; neutronstar: text (default: None).
        labels: edgelist: ``.npy``; neutronstar: text (default: None).
        masks: edgelist: ``.npy`` (3, N) bool; neutronstar: text (default: None; an
            edgelist without masks gets a random split).
        input: ogb: directory in the OGB raw layout (default: None).
        binary: edgelist: binary (src, dst) records of this dtype (``uint32`` or
            ``int64``) instead of text (default: None, text).
        symmetrize: add the reverse of every edge (default: None: no for edgelist and
            neutronstar; yes for ogb, whose graphs are usually made undirected).
        seed: edgelist: split seed when no masks are given (default: 0).
        split_scheme: ogb: the sub-directory of ``split/`` to read (default: None, the
            only one there).
        num_classes: number of classes (default: None, max label + 1).
    """

    name: str
    edges: str | None = None
    features: str | None = None
    labels: str | None = None
    masks: str | None = None
    input: str | None = None
    binary: str | None = None
    symmetrize: bool | None = None
    seed: int = 0
    split_scheme: str | None = None
    num_classes: int | None = None


def convert(fmt: str, opts: ConvertOptions) -> Dataset:
    """Read the user's own files (CLI ``convert``) in format ``fmt`` into a Dataset.

    Raises:
        ConfigError: ``fmt`` is not one of ``CONVERT_FORMATS``, or ``opts.name`` is not
            a dataset name.
        DatasetNotFoundError: a file the format needs is not given.
    """
    from fullgraph.graph.formats import edgelist, neutronstar, ogb

    if fmt not in CONVERT_FORMATS:
        raise ConfigError(f"convert format {fmt!r}; expected one of {', '.join(CONVERT_FORMATS)}")
    check_new_name(opts.name)
    paths: dict[str, Any] = {  # ~ expanded; absolute, as the stored source
        key: os.path.abspath(os.path.expanduser(value))
        for key in ("edges", "features", "labels", "masks", "input")
        if isinstance(value := getattr(opts, key), (str, os.PathLike))}
    opts = dataclasses.replace(opts, **paths)

    def need(*names: str) -> list[str]:
        absent = [n for n in names if not getattr(opts, n)]
        if absent:
            raise DatasetNotFoundError(f"`convert {fmt}` needs " +
                                       ", ".join(f"--{n}" for n in absent))
        return [getattr(opts, n) for n in names]

    read = {"edgelist": ("edges", "features", "labels", "masks", "binary", "symmetrize",
                         "seed"),
            "neutronstar": ("edges", "features", "labels", "masks", "binary", "symmetrize"),
            "ogb": ("input", "symmetrize", "split_scheme")}[fmt]
    unused = changed_fields(opts, skip=(*read, "name", "num_classes"))
    if unused:
        warnings.warn(f"convert {fmt}: {', '.join('--' + n.replace('_', '-') for n in unused)} "
                      f"{'has' if len(unused) == 1 else 'have'} no effect on this format",
                      stacklevel=2)
    if fmt == "edgelist" and opts.masks and opts.seed != 0:
        warnings.warn("convert edgelist: --seed has no effect with --masks (the masks give "
                      "the split; the seed draws one without them)", stacklevel=2)
    if fmt == "edgelist":
        edges, features = need("edges", "features")
        return edgelist.load_edgelist(edges, features, opts.labels,
                                      binary_dtype=opts.binary,
                                      symmetrize=bool(opts.symmetrize),
                                      masks=opts.masks, seed=opts.seed, name=opts.name,
                                      num_classes=opts.num_classes)
    if fmt == "neutronstar":
        edges, features, labels, masks = need("edges", "features", "labels", "masks")
        if opts.binary not in (None, "uint32"):
            raise ConfigError(f"convert neutronstar: --binary {opts.binary}: the edge file "
                              "of this format is always uint32 pairs")
        return neutronstar.load_neutronstar(edges, features, labels, masks,
                                            symmetrize=bool(opts.symmetrize),
                                            name=opts.name,
                                            num_classes=opts.num_classes)
    (source,) = need("input")
    return ogb.load_ogb(Path(source), opts.name, num_classes=opts.num_classes,
                        symmetrize=opts.symmetrize is not False,
                        split_scheme=opts.split_scheme)


def list_datasets(root: Path) -> list[dict[str, str]]:
    """Known and processed datasets with whether each is ready under ``root``."""
    rows = []
    for name, spec in KNOWN.items():
        if store.is_cached(processed_dir(root, name)):
            status = "processed"
        elif (BUILTIN / name).is_dir():
            status = "built-in"
        elif all((root / name / "raw" / f).exists() for f in spec.files):
            status = "raw"
        else:
            status = "download"
        rows.append({"name": name, "status": status, "description": spec.description})
    for name in _processed_names(root):
        if name not in KNOWN:
            rows.append({"name": name, "status": "processed", "description": "user dataset"})
    return rows


def _processed_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if store.is_cached(p / "processed"))


def _finish(dataset: Dataset, feature_dtype: str) -> Dataset:
    """``dataset`` with its features converted to ``feature_dtype`` ("stored": as they
    are, memory-mapped; a run converts the rows it reads, a block at a time)."""
    if feature_dtype != "stored" and dataset.data.features.dtype != _dtype(feature_dtype):
        dataset.data = dataset.data.with_feature_dtype(feature_dtype)
    return dataset


def _dtype(name: str) -> Any:
    from fullgraph.graph.data import FEATURE_DTYPES

    return FEATURE_DTYPES[name]
