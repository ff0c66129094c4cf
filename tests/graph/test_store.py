"""Tests of the processed dataset format: round trips, memory mapping, corruption, atomicity."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fullgraph.errors import CacheError, ValidationError
from fullgraph.graph import store
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import FEATURE_DTYPES, Dataset, VertexData
from fullgraph.graph.split import fraction_split
from fullgraph.graph.store import FORMAT_VERSION, is_cached, load_dataset, save_dataset


def make_dataset(num_nodes: int = 60, num_features: int = 7, *, seed: int = 0,
                 feature_dtype: str = "float32", weighted: bool = False,
                 name: str = "toy") -> Dataset:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (4 * num_nodes,), generator=g)
    dst = torch.randint(0, num_nodes, (4 * num_nodes,), generator=g)
    graph = Graph.from_edges(src, dst, num_nodes, symmetrize=True)
    if weighted:
        graph.edge_weight = torch.rand(graph.num_edges, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (num_nodes,), generator=g)
    labels[:2] = -1  # unlabelled vertices stay out of the masks
    masks = fraction_split(labels, train=0.5, val=0.25, seed=seed)
    x = torch.randn(num_nodes, num_features, generator=g).to(FEATURE_DTYPES[feature_dtype])
    return Dataset(name, graph, VertexData(x, labels, *masks, num_classes=3),
                   {"source": "test", "seed": seed, "nested": {"a": [1, 2]}})


def assert_same(a: Dataset, b: Dataset) -> None:
    assert (a.name, a.info, a.data.num_classes) == (b.name, b.info, b.data.num_classes)
    assert torch.equal(a.graph.indptr, b.graph.indptr)
    assert torch.equal(a.graph.indices, b.graph.indices)
    assert a.graph.indices.dtype == b.graph.indices.dtype
    if a.graph.edge_weight is None:
        assert b.graph.edge_weight is None
    else:
        assert torch.equal(a.graph.edge_weight, b.graph.edge_weight)
    for field in ("features", "labels", "train_mask", "val_mask", "test_mask"):
        x, y = getattr(a.data, field), getattr(b.data, field)
        assert x.dtype == y.dtype and torch.equal(x, y), field


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("feature_dtype", ["float32", "float16", "bfloat16"])
def test_round_trip(tmp_path: Path, feature_dtype: str, mmap: bool) -> None:
    ds = make_dataset(feature_dtype=feature_dtype, weighted=feature_dtype == "float16")
    save_dataset(ds, tmp_path / "ds")
    loaded = load_dataset(tmp_path / "ds", mmap=mmap)
    assert_same(ds, loaded)
    loaded.validate()
    assert is_cached(tmp_path / "ds")
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["arrays"]["features"]["dtype"] == feature_dtype
    if feature_dtype == "bfloat16":  # numpy has no bf16: the file holds the bits
        assert np.load(tmp_path / "ds" / "features.npy").dtype == np.uint16


def test_int64_indices_and_empty_edges(tmp_path: Path) -> None:
    ds = make_dataset()
    ds.graph.indices = ds.graph.indices.to(torch.int64)  # as a graph with >2**31 vertices has
    save_dataset(ds, tmp_path / "wide")
    meta = json.loads((tmp_path / "wide" / "meta.json").read_text())
    assert meta["arrays"]["indices"]["dtype"] == "int64"
    loaded = load_dataset(tmp_path / "wide")
    assert torch.equal(loaded.graph.indices.to(torch.int64), ds.graph.indices)

    empty = make_dataset()
    n = empty.graph.num_nodes
    empty.graph = Graph(torch.zeros(n + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
    save_dataset(empty, tmp_path / "empty")
    assert load_dataset(tmp_path / "empty").graph.num_edges == 0


def _mapped_ranges(file: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(file.resolve())):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_mmap_load_maps_the_files(tmp_path: Path) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    file = tmp_path / "ds" / "features.npy"
    mapped = load_dataset(tmp_path / "ds", mmap=True)
    ptr = mapped.data.features.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in _mapped_ranges(file))
    mapped.data.features[0, 0] += 1.0  # copy-on-write: the file is not changed
    assert load_dataset(tmp_path / "ds").data.features[0, 0] != mapped.data.features[0, 0]
    del mapped
    read = load_dataset(tmp_path / "ds", mmap=False)
    assert not any(lo <= read.data.features.data_ptr() < hi for lo, hi in _mapped_ranges(file))


def _resident_bytes(file: Path) -> int:
    """Bytes of ``file``'s mappings resident in this process (/proc/self/smaps Rss)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            inside = line.endswith(str(file.resolve()))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_mmap_load_does_not_read_features_into_ram(tmp_path: Path) -> None:
    """The mapped features stay on disk until touched (measured on the mapping itself,
    not on the process RSS, which the allocator's reuse of freed memory blurs)."""
    ds = make_dataset(num_nodes=1 << 14, num_features=1024)  # 64 MiB of features
    save_dataset(ds, tmp_path / "big")
    file = tmp_path / "big" / "features.npy"
    size = file.stat().st_size
    del ds
    mapped = load_dataset(tmp_path / "big", mmap=True, verify=True)
    assert _resident_bytes(file) < size // 2
    float(mapped.data.features.sum())  # touching every page makes it resident
    assert _resident_bytes(file) > size // 2


def _flip_last_byte(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0xFF
    file.write_bytes(bytes(raw))


def test_corrupt_byte_raises(tmp_path: Path) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    _flip_last_byte(tmp_path / "ds" / "features.npy")
    with pytest.raises(CacheError, match=r"features\.npy.*checksum"):
        load_dataset(tmp_path / "ds")
    load_dataset(tmp_path / "ds", verify=False)  # the caller asked not to check
    assert is_cached(tmp_path / "ds")  # is_cached does not read the arrays


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mmap", [True, False])
def test_truncated_file_raises(tmp_path: Path, verify: bool, mmap: bool) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    file = tmp_path / "ds" / "indices.npy"
    os.truncate(file, file.stat().st_size - 5)
    with pytest.raises(CacheError, match=r"indices\.npy"):
        load_dataset(tmp_path / "ds", mmap=mmap, verify=verify)


def _edit_meta(path: Path, **changes: object) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def test_stale_format_version_raises(tmp_path: Path) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    _edit_meta(tmp_path / "ds", format_version=FORMAT_VERSION - 1)
    assert not is_cached(tmp_path / "ds")
    with pytest.raises(CacheError, match=r"meta\.json.*format_version.*stale"):
        load_dataset(tmp_path / "ds")


def test_missing_or_bad_meta_raises(tmp_path: Path) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    meta = tmp_path / "ds" / "meta.json"
    meta.write_text("{not json")
    assert not is_cached(tmp_path / "ds")
    with pytest.raises(CacheError, match="not readable JSON"):
        load_dataset(tmp_path / "ds")
    meta.unlink()
    assert not is_cached(tmp_path / "ds")
    with pytest.raises(CacheError, match=r"meta\.json.*missing"):
        load_dataset(tmp_path / "ds")
    with pytest.raises(CacheError, match="missing"):
        load_dataset(tmp_path / "never-saved")


def test_missing_array_and_shape_mismatch_raise(tmp_path: Path) -> None:
    save_dataset(make_dataset(), tmp_path / "ds")
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    arrays = meta["arrays"]
    arrays["labels"]["shape"] = [arrays["labels"]["shape"][0] + 1]
    _edit_meta(tmp_path / "ds", arrays=arrays)
    with pytest.raises(CacheError, match=r"labels\.npy.*shape"):
        load_dataset(tmp_path / "ds", verify=False)
    save_dataset(make_dataset(), tmp_path / "ds")
    (tmp_path / "ds" / "test_mask.npy").unlink()
    with pytest.raises(CacheError, match=r"test_mask\.npy.*missing"):
        load_dataset(tmp_path / "ds")


@pytest.mark.parametrize("num_classes", [2, 0])
def test_labels_beyond_the_stated_class_count_raise(tmp_path: Path, num_classes: int) -> None:
    save_dataset(make_dataset(name="toy"), tmp_path / "ds")  # labels 0..2 (and -1)
    _edit_meta(tmp_path / "ds", num_classes=num_classes)
    with pytest.raises(CacheError, match="'toy': labels do not fit its class count") as err:
        load_dataset(tmp_path / "ds", verify=False)
    assert err.value.found == f"max label 2, num_classes {num_classes}"
    assert err.value.source == str(tmp_path / "ds")


def _only_entry(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_overwrite_replaces_and_leaves_nothing_behind(tmp_path: Path) -> None:
    save_dataset(make_dataset(seed=0), tmp_path / "ds")
    new = make_dataset(seed=1, feature_dtype="bfloat16", name="second")
    save_dataset(new, tmp_path / "ds")
    assert_same(new, load_dataset(tmp_path / "ds"))
    assert _only_entry(tmp_path) == ["ds"]


def test_a_write_killed_outright_is_cleared_by_the_next(tmp_path: Path) -> None:
    """SIGKILL leaves a writer's temporary directory; the next write beside it removes
    those of this host's processes that are gone, and keeps a running one's."""
    import subprocess

    from fullgraph.paths import process_space

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = process_space()
    dead = tmp_path / f".ds.tmp-{here}-{gone.pid}-0badc0de"
    running = tmp_path / f".ds.tmp-{here}-{os.getpid()}-0badc0de"
    other_host = tmp_path / f".ds.tmp-0123456789ab-{gone.pid}-0badc0de"  # another host's
    for d in (dead, running, other_host):
        (d / "features.npy").parent.mkdir()
        (d / "features.npy").write_bytes(b"partial")
    save_dataset(make_dataset(seed=0), tmp_path / "ds")
    assert not dead.exists() and running.exists() and other_host.exists()
    assert_same(make_dataset(seed=0), load_dataset(tmp_path / "ds"))


def test_a_written_dataset_has_the_umasks_modes(tmp_path: Path) -> None:
    """Others sharing a dataset root can read it: the directory was mkdtemp's 0700."""
    old = os.umask(0o022)
    try:
        save_dataset(make_dataset(seed=0), tmp_path / "ds")
    finally:
        os.umask(old)
    assert (tmp_path / "ds").stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in (tmp_path / "ds").iterdir())


def test_crash_mid_write_keeps_old_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    old = make_dataset(seed=0)
    save_dataset(old, tmp_path / "ds")
    real_write = store._write_array

    def failing_write(file: Path, tensor: torch.Tensor) -> dict:
        if file.name == "features.npy":
            with open(file, "wb") as f:  # half a file, then the "disk" fails
                f.write(b"\x93NUMPY partial")
            raise OSError(28, "No space left on device")
        return real_write(file, tensor)

    monkeypatch.setattr(store, "_write_array", failing_write)
    with pytest.raises(OSError, match="No space"):
        save_dataset(make_dataset(seed=1), tmp_path / "ds")
    assert _only_entry(tmp_path) == ["ds"]
    assert_same(old, load_dataset(tmp_path / "ds"))
    with pytest.raises(OSError):  # a first save that fails leaves nothing either
        save_dataset(make_dataset(seed=1), tmp_path / "fresh")
    assert _only_entry(tmp_path) == ["ds"]


def test_crash_during_swap_restores_old_dataset(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    old = make_dataset(seed=0)
    save_dataset(old, tmp_path / "ds")
    real_rename = os.rename
    calls = []

    def rename(src: object, dst: object) -> None:
        calls.append((src, dst))
        if len(calls) == 2:  # old copy moved away; moving the new one in fails
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        save_dataset(make_dataset(seed=1), tmp_path / "ds")
    monkeypatch.undo()
    assert _only_entry(tmp_path) == ["ds"]
    assert_same(old, load_dataset(tmp_path / "ds"))


def test_refuses_bad_input(tmp_path: Path) -> None:
    other = tmp_path / "not-a-dataset"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(CacheError, match="not a dataset directory"):
        save_dataset(make_dataset(), other)
    assert (other / "precious.txt").read_text() == "keep me"

    bad_info = make_dataset()
    bad_info.info["when"] = object()
    with pytest.raises(ValidationError, match="JSON"):
        save_dataset(bad_info, tmp_path / "ds")
    invalid = make_dataset()
    invalid.data.features[3, 1] = float("nan")
    with pytest.raises(ValidationError, match="finite"):
        save_dataset(invalid, tmp_path / "ds")
    assert _only_entry(tmp_path) == ["not-a-dataset"]


def test_checksum_is_streamed_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    monkeypatch.setattr(store, "CHUNK_BYTES", 10)  # many chunks: same digest as one read
    file = tmp_path / "blob"
    file.write_bytes(bytes(range(256)) * 3)
    import hashlib
    assert store.file_checksum(file) == hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_short_labels_file_is_named(tmp_path: Path) -> None:
    """Labels of the wrong length are reported against labels.npy, not the features."""
    path = tmp_path / "ds"
    save_dataset(make_dataset(), path)
    np.save(path / "labels.npy", np.zeros(59, dtype=np.int64))
    meta = json.loads((path / "meta.json").read_text())
    meta["arrays"]["labels"]["shape"] = [59]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match="labels do not match") as err:
        load_dataset(path, verify=False)
    assert "labels.npy" in str(err.value)


def test_sampled_density_reaches_the_last_row_exactly():
    """Evenly spaced sample rows of a 20M-row matrix stay in range (a float32 spacing
    rounded the last one to row 20,000,000)."""
    from fullgraph.graph.sparse import sampled_density

    x = torch.zeros(20_000_000, 1, dtype=torch.uint8).expand(20_000_000, 3)
    assert sampled_density(x) == 0.0
    y = torch.zeros(5000, 2)
    y[-1] = 1.0
    assert sampled_density(y, rows=2) == 0.5


def test_a_short_write_names_the_file_and_a_full_disk(tmp_path, monkeypatch):
    """numpy's short write says only "N requested and M written": the error names the
    file, and the cause where the disk is full; nothing is left half-written."""
    import errno
    import shutil
    from collections import namedtuple

    from fullgraph.graph import store
    from fullgraph.graph.synthetic import sbm

    def short(*args, **kwargs):
        raise OSError("1280000 requested and 382944 written")

    monkeypatch.setattr(store.np.lib.format, "write_array", short)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    with pytest.raises(OSError) as err:
        store.save_dataset(sbm(30, 2, seed=0), tmp_path / "d")
    assert err.value.errno == errno.ENOSPC and err.value.filename.endswith(".npy")
    assert not (tmp_path / "d").exists()


def test_a_failed_first_write_leaves_no_empty_folders(tmp_path, monkeypatch):
    """<root>/<name>/ made for a first write is removed with the rest (it was left)."""
    from fullgraph.graph import store
    from fullgraph.graph.synthetic import sbm

    def short(*args, **kwargs):
        raise OSError("1 requested and 0 written")

    monkeypatch.setattr(store.np.lib.format, "write_array", short)
    with pytest.raises(OSError):
        store.save_dataset(sbm(30, 2, seed=0), tmp_path / "root" / "name" / "processed")
    assert list(tmp_path.iterdir()) == []
