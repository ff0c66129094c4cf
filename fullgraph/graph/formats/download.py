"""Download raw dataset files from their canonical upstream locations.

Every download is written to a temporary name in the destination directory and
moved into place with ``os.replace``, so an interrupted download never leaves a
half-written file under the final name. When the network (or the given URL) cannot
be reached, :class:`~fullgraph.errors.DatasetNotFoundError` says which files to
place where by hand. Base URLs are arguments so tests can point at ``file://`` URLs;
nothing here is called implicitly by the loaders.

Zip archives (OGB) are extracted member by member, refusing absolute paths, ``..``
components and symbolic links, so no file lands outside the target directory.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

from fullgraph.errors import DatasetNotFoundError, FormatError
from fullgraph.paths import sibling_file

PathLike = str | os.PathLike[str]

#: kimiyoung/planetoid raw ``ind.<name>.<suffix>`` files.
PLANETOID_URL = "https://github.com/kimiyoung/planetoid/raw/master/data"
PLANETOID_SUFFIXES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
PLANETOID_DATASETS = {"cora": "cora", "citeseer": "citeseer", "pubmed": "pubmed"}

#: shchur/gnn-benchmark raw npz files (the ones PyG's Amazon and Coauthor download).
GNN_BENCHMARK_URL = "https://github.com/shchur/gnn-benchmark/raw/master/data/npz"
GNN_BENCHMARK_FILES = {
    "amazon_photo": "amazon_electronics_photo.npz",
    "amazon_computers": "amazon_electronics_computers.npz",
    "coauthor_cs": "ms_academic_cs.npz",
    "coauthor_physics": "ms_academic_phy.npz",
}

#: OGB node-property-prediction zips; each unpacks to ``<stem>/raw``, ``<stem>/split``.
OGB_URL = "http://snap.stanford.edu/ogb/data/nodeproppred"
OGB_FILES = {
    "ogbn-arxiv": "arxiv.zip",
    "ogbn-products": "products.zip",
    "ogbn-proteins": "proteins.zip",
    "ogbn-mag": "mag.zip",
    "ogbn-papers100M": "papers100M-bin.zip",
}


def download(url: str, dest_path: PathLike, *, timeout: float = 60) -> Path:
    """Fetch ``url`` into ``dest_path`` atomically (temp file + ``os.replace``).

    Args:
        url: ``http(s)://`` or ``file://`` URL.
        dest_path: final path; its directory is created if needed.
        timeout: seconds to wait for the server (default: 60).

    Returns:
        ``dest_path`` as a Path.

    Raises:
        DatasetNotFoundError: the URL cannot be reached or read (offline, 404, ...);
            the message says to place the file at ``dest_path`` by hand.
    """
    dest = Path(dest_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = sibling_file(dest, "part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out, length=1 << 20)
        os.replace(tmp_name, dest)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _remove_quietly(tmp_name)
        raise DatasetNotFoundError("cannot download a dataset file", source=url,
                                   found=f"{type(exc).__name__}: {exc}",
                                   hint=f"offline? download it elsewhere and place it at {dest}"
                                   ) from exc
    except BaseException:
        _remove_quietly(tmp_name)
        raise
    return dest


def fetch_dataset(upstream: str, fmt: str, raw_dir: PathLike, files: Sequence[str] = (), *,
                  base_url: str | None = None, timeout: float = 60) -> Path:
    """Download the raw files of one dataset into ``raw_dir``.

    Args:
        upstream: upstream name: ``cora`` (planetoid), ``amazon_electronics_photo``
            (npz, the gnn-benchmark file stem) or ``ogbn-arxiv`` (ogb).
        fmt: ``"planetoid"``, ``"npz"`` or ``"ogb"``.
        raw_dir: destination. For ``ogb`` the archive is unpacked into its parent, the
            dataset root, so ``raw_dir`` ends up holding ``edge.csv.gz`` etc.
        files: for ``planetoid``, the ``ind.*`` files to fetch (default: all eight);
            for ``npz``, the local file name (default: ``<upstream>.npz``).
        base_url: overrides the canonical upstream directory (default: None).
        timeout: seconds to wait for the server (default: 60).

    Returns:
        ``raw_dir``.

    Raises:
        DatasetNotFoundError: unknown format or name, or a download failed.
    """
    raw = Path(raw_dir)
    if fmt == "planetoid":
        names = list(files) or [f"ind.{upstream}.{suffix}" for suffix in PLANETOID_SUFFIXES]
        _download_all(base_url or PLANETOID_URL, names, raw, timeout)
    elif fmt == "npz":
        local = files[0] if files else f"{upstream}.npz"
        download(f"{base_url or GNN_BENCHMARK_URL}/{upstream}.npz", raw / local, timeout=timeout)
    elif fmt == "ogb":
        fetch_ogb(raw.parent, upstream, base_url=base_url or OGB_URL, timeout=timeout)
    else:
        raise DatasetNotFoundError("no download for this format", field="format", found=fmt,
                                   expected="planetoid | npz | ogb")
    return raw


def _download_all(base_url: str, names: list[str], raw: Path, timeout: float) -> None:
    """Download ``base_url/NAME`` into ``raw`` for every name; one error lists every file
    that is still missing (after the first unreachable host, the rest are not tried)."""
    failed: list[str] = []
    first: DatasetNotFoundError | None = None
    for i, name in enumerate(names):
        try:
            download(f"{base_url}/{name}", raw / name, timeout=timeout)
        except DatasetNotFoundError as exc:
            failed.append(name)
            first = first or exc
            if not _file_missing(exc.__cause__):  # the host is unreachable: try no more
                failed += names[i + 1:]
                break
    if first is not None:
        raise DatasetNotFoundError(
            f"cannot download {len(failed)} of {len(names)} raw files", source=base_url,
            found=first.found, hint=f"offline? download them elsewhere and place them in "
            f"{raw}: {', '.join(failed)}")


def _file_missing(exc: BaseException | None) -> bool:
    """Whether a download failed for want of that one file (HTTP 404, a missing local
    file), not because the host cannot be reached."""
    return isinstance(exc, urllib.error.HTTPError) or isinstance(
        getattr(exc, "reason", None), FileNotFoundError)


def fetch_planetoid(raw_dir: PathLike, name: str, *, base_url: str = PLANETOID_URL,
                    timeout: float = 60) -> Path:
    """Download the eight ``ind.<name>.*`` files into ``raw_dir`` (present files are kept).

    Raises:
        DatasetNotFoundError: the name is unknown or a file cannot be downloaded.
    """
    key = _known(name.lower(), PLANETOID_DATASETS, "Planetoid")
    raw = Path(raw_dir)
    missing = [f"ind.{key}.{suffix}" for suffix in PLANETOID_SUFFIXES
               if not (raw / f"ind.{key}.{suffix}").is_file()]
    if missing:
        fetch_dataset(key, "planetoid", raw, missing, base_url=base_url, timeout=timeout)
    return raw


def fetch_npz(dest_dir: PathLike, name: str, *, base_url: str = GNN_BENCHMARK_URL,
              timeout: float = 60) -> Path:
    """Download a gnn-benchmark npz (``amazon_photo``, ``coauthor_cs``, ...) as ``<name>.npz``.

    Returns:
        The path of the npz file (kept if already present).
    """
    upstream = _known(name.lower(), GNN_BENCHMARK_FILES, "gnn-benchmark")[:-len(".npz")]
    dest = Path(dest_dir) / f"{name.lower()}.npz"
    if not dest.is_file():
        fetch_dataset(upstream, "npz", dest.parent, [dest.name], base_url=base_url,
                      timeout=timeout)
    return dest


def fetch_ogb(root_dir: PathLike, name: str, *, base_url: str = OGB_URL,
              timeout: float = 600) -> Path:
    """Download an OGB node dataset (``ogbn-arxiv``, ...) and unpack it into ``root_dir``.

    The zip holds one top folder (``arxiv/``); its contents (``raw/``, ``split/``, ...)
    are moved to ``root_dir``, the directory :func:`~fullgraph.graph.formats.ogb.load_ogb`
    reads.

    Returns:
        ``root_dir``.

    Raises:
        DatasetNotFoundError: unknown name or failed download.
        FormatError: a corrupt zip, or a member that would land outside ``root_dir``.
    """
    filename = _known(name, OGB_FILES, "OGB")
    root = Path(root_dir)
    archive = download(f"{base_url}/{filename}", root / filename, timeout=timeout)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".unzip-"))
    try:
        extract_zip(archive, staging)
        tops = list(staging.iterdir())
        inner = tops[0] if len(tops) == 1 and tops[0].is_dir() else staging
        for item in inner.iterdir():
            target = root / item.name
            if target.is_dir():  # a stale or partial copy: the archive's is complete
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        archive.unlink(missing_ok=True)
    return root


def extract_zip(archive: PathLike, target_dir: PathLike) -> list[Path]:
    """Extract ``archive`` under ``target_dir``, refusing members that would escape it.

    Returns:
        The extracted file paths.

    Raises:
        FormatError: the archive is corrupt, or a member is absolute, contains ``..``
            or is a symbolic link; nothing is extracted then.
    """
    target = Path(target_dir).resolve()
    try:
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
            for info in members:
                _check_member(info, target, archive)
            out = []
            for info in members:
                zf.extract(info, target)
                out.append(target / info.filename)
            return out
    except zipfile.BadZipFile as exc:
        raise FormatError("not a valid zip archive", source=archive, found=str(exc)) from exc


def _check_member(info: zipfile.ZipInfo, target: Path, archive: PathLike) -> None:
    name = info.filename
    parts = Path(name.replace("\\", "/")).parts
    escapes = (name.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0])
               or not (target / name).resolve().is_relative_to(target))
    if escapes:
        raise FormatError("zip member would be written outside the target directory",
                          source=archive, field=name, expected=f"a path inside {target}")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise FormatError("zip member is a symbolic link", source=archive, field=name,
                          expected="regular files and directories only")


def _known(name: str, table: dict[str, str], family: str) -> str:
    if name not in table:
        raise DatasetNotFoundError(f"unknown {family} dataset", field="name", found=name,
                                   expected=" | ".join(table))
    return table[name]


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
