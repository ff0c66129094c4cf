"""Downloads through ``file://`` URLs only (never the network) and safe unzipping."""
from __future__ import annotations

import shutil
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import fullgraph.graph
from fullgraph.errors import DatasetNotFoundError, FormatError
from fullgraph.graph.formats import download as dl
from fullgraph.graph.formats.npz import load_npz
from fullgraph.graph.formats.ogb import load_ogb
from fullgraph.graph.formats.planetoid import load_planetoid

BUILTIN_CORA = Path(fullgraph.graph.__file__).resolve().parent / "builtin" / "cora"


def test_download_writes_atomically(tmp_path: Path) -> None:
    src = tmp_path / "upstream" / "file.bin"
    src.parent.mkdir()
    src.write_bytes(b"payload" * 1000)
    dest = dl.download(src.as_uri(), tmp_path / "out" / "file.bin")
    assert dest.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.bin"]  # no temp file left


def test_offline_says_where_to_place_the_file(tmp_path: Path) -> None:
    dest = tmp_path / "raw" / "ind.cora.x"
    url = (tmp_path / "no" / "such" / "host" / "ind.cora.x").as_uri()
    with pytest.raises(DatasetNotFoundError) as err:
        dl.download(url, dest)
    assert err.value.source == url
    assert str(dest) in str(err.value)
    assert list(dest.parent.iterdir()) == []  # the partial temp file is removed


def test_canonical_urls() -> None:
    assert dl.PLANETOID_URL.startswith("https://github.com/kimiyoung/planetoid/")
    assert dl.GNN_BENCHMARK_URL.startswith("https://github.com/shchur/gnn-benchmark/")
    assert dl.GNN_BENCHMARK_FILES["amazon_photo"] == "amazon_electronics_photo.npz"
    assert dl.GNN_BENCHMARK_FILES["coauthor_physics"] == "ms_academic_phy.npz"
    assert dl.OGB_URL.startswith("http://snap.stanford.edu/ogb/")
    assert dl.OGB_FILES["ogbn-arxiv"] == "arxiv.zip"


def test_fetch_planetoid_from_a_mirror(tmp_path: Path) -> None:
    raw = dl.fetch_planetoid(tmp_path / "raw", "Cora", base_url=BUILTIN_CORA.as_uri())
    assert load_planetoid(raw, "cora").graph.num_nodes == 2708


def test_fetch_npz_names_the_file_after_the_dataset(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    adj = sp.csr_matrix(np.array([[0, 1], [1, 0]], dtype=np.float32))
    np.savez(mirror / "amazon_electronics_photo.npz", adj_data=adj.data,
             adj_indices=adj.indices, adj_indptr=adj.indptr, adj_shape=np.array(adj.shape),
             attr_matrix=np.eye(2, dtype=np.float32), labels=np.array([0, 1]))
    path = dl.fetch_npz(tmp_path / "raw", "amazon_photo", base_url=mirror.as_uri())
    assert path.name == "amazon_photo.npz"
    assert load_npz(path, train_per_class=1, val_per_class=0).graph.num_edges == 2


def test_fetch_dataset_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="format"):
        dl.fetch_dataset("x", "tarball", tmp_path)


def _ogb_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("arxiv/raw/edge.csv.gz", _gzip(b"0,1\n1,2\n"))
        zf.writestr("arxiv/raw/node-feat.csv.gz", _gzip(b"0.5,1\n1,2\n2,3\n"))
        zf.writestr("arxiv/raw/node-label.csv.gz", _gzip(b"0\n1\n0\n"))
        zf.writestr("arxiv/split/time/train.csv.gz", _gzip(b"0\n"))
        zf.writestr("arxiv/split/time/valid.csv.gz", _gzip(b"1\n"))
        zf.writestr("arxiv/split/time/test.csv.gz", _gzip(b"2\n"))
    return path


def _gzip(data: bytes) -> bytes:
    import gzip
    return gzip.compress(data)


def test_fetch_ogb_unpacks_into_the_root(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    _ogb_zip(mirror / "arxiv.zip")
    root = dl.fetch_ogb(tmp_path / "ogbn-arxiv", "ogbn-arxiv", base_url=mirror.as_uri())
    assert sorted(p.name for p in root.iterdir()) == ["raw", "split"]
    ds = load_ogb(root, "ogbn-arxiv")
    assert (ds.graph.num_nodes, ds.graph.num_edges) == (3, 4)


@pytest.mark.parametrize("member", ["../escape.txt", "/abs/escape.txt", "a/../../escape.txt"])
def test_extract_zip_refuses_escaping_paths(tmp_path: Path, member: str) -> None:
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("fine.txt", b"ok")
        zf.writestr(zipfile.ZipInfo(member), b"gotcha")
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(FormatError, match="outside") as err:
        dl.extract_zip(archive, target)
    assert err.value.field == member
    assert not (tmp_path / "escape.txt").exists()
    assert list(target.iterdir()) == []  # checked before anything is written


def test_extract_zip_refuses_symlinks(tmp_path: Path) -> None:
    archive = tmp_path / "link.zip"
    info = zipfile.ZipInfo("link")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(FormatError, match="symbolic link"):
        dl.extract_zip(archive, tmp_path / "target")


def test_extract_zip_corrupt_archive(tmp_path: Path) -> None:
    archive = tmp_path / "bad.zip"
    archive.write_bytes(b"PK not really")
    with pytest.raises(FormatError, match="zip"):
        dl.extract_zip(archive, tmp_path)


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_fetch_keeps_files_already_present(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    shutil.copytree(BUILTIN_CORA, raw)
    before = _contents(raw)
    # An unreachable mirror is fine when nothing is missing: no download is tried.
    assert dl.fetch_planetoid(raw, "cora", base_url=(tmp_path / "nowhere").as_uri()) == raw
    assert _contents(raw) == before  # nothing replaced, added or removed


def test_fetch_downloads_only_the_missing_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    shutil.copytree(BUILTIN_CORA, raw)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for p in raw.iterdir():  # the mirror's copies differ, so a re-download shows
        (mirror / p.name).write_bytes(b"mirror " + p.name.encode())
    (raw / "ind.cora.tx").unlink()
    before = _contents(raw)
    dl.fetch_planetoid(raw, "cora", base_url=mirror.as_uri())
    after = _contents(raw)
    assert after.pop("ind.cora.tx") == b"mirror ind.cora.tx"
    assert after == before
