"""Tests of PartitionBook: the gid <-> (part, lid) maps and the on-disk format."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from fullgraph.errors import CacheError, ValidationError
from fullgraph.partition.book import FORMAT_NAME, FORMAT_VERSION, PartitionBook, _checksum


def _book(num_nodes: int = 50, num_parts: int = 4, seed: int = 0) -> PartitionBook:
    rng = np.random.default_rng(seed)
    return PartitionBook.from_assignment(rng.integers(0, num_parts, num_nodes), num_parts)


def _write_fields(path, **overrides) -> None:
    part_of = np.array([0, 1, 1, 0, 2], dtype=np.int64)
    fields = dict(format=np.array(FORMAT_NAME), format_version=np.int64(FORMAT_VERSION),
                  num_parts=np.int64(3), num_nodes=np.int64(5), part_of=part_of,
                  checksum=np.array(_checksum(part_of, 3)))
    fields.update(overrides)
    with open(path, "wb") as f:
        np.savez(f, **{k: v for k, v in fields.items() if v is not None})


# ------------------------------------------------------------------------ maps
def test_maps_are_consistent() -> None:
    book = _book(num_nodes=101, num_parts=5)
    gids = torch.arange(101)
    part, lid = book.gid_to_part(gids), book.gid_to_lid(gids)
    for tensor in (book.part_of, book.perm, book.offsets, part, lid, book.part_sizes()):
        assert tensor.dtype == torch.int64
    assert torch.equal(part, book.part_of)
    assert torch.equal(book.perm[book.offsets[part] + lid], gids)
    assert torch.equal(torch.sort(book.perm).values, gids)
    assert int(book.offsets[0]) == 0 and int(book.offsets[-1]) == 101
    for p in range(5):
        owned = book.part_to_gids(p)
        assert torch.equal(owned, torch.nonzero(book.part_of == p).flatten())  # ascending
        assert torch.equal(book.gid_to_lid(owned), torch.arange(owned.numel()))
    assert book.part_sizes().tolist() == np.bincount(book.part_of.numpy(), minlength=5).tolist()


def test_gid_queries_accept_ints_lists_arrays_and_tensors() -> None:
    book = PartitionBook.from_assignment([1, 0, 1, 0], 2)
    assert book.perm.tolist() == [1, 3, 0, 2] and book.offsets.tolist() == [0, 2, 4]
    assert int(book.gid_to_part(2)) == 1 and int(book.gid_to_lid(2)) == 1
    assert book.gid_to_part([0, 3]).tolist() == [1, 0]
    assert book.gid_to_lid(np.array([3, 0], dtype=np.int32)).tolist() == [1, 0]
    assert book.gid_to_part(torch.tensor([1])).tolist() == [0]
    with pytest.raises(ValueError, match="gid out of range.*found 4"):
        book.gid_to_part([0, 4])
    with pytest.raises(ValueError, match="found -1"):
        book.gid_to_lid(-1)
    with pytest.raises(TypeError, match="integers"):
        book.gid_to_part([0.5])
    with pytest.raises(ValueError, match="part must be in"):
        book.part_to_gids(2)


def test_empty_parts_are_allowed_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        book = PartitionBook.from_assignment(np.array([2, 0, 2]), 4)
    assert book.part_sizes().tolist() == [1, 0, 2, 0]
    assert book.part_to_gids(1).numel() == 0 and book.part_to_gids(2).tolist() == [0, 2]


def test_from_assignment_refuses_bad_input() -> None:
    with pytest.raises(ValidationError, match=r"part_of\[2\].*found 3.*0 <= part < 3"):
        PartitionBook.from_assignment([0, 1, 3], 3)
    with pytest.raises(ValidationError, match=r"part_of\[1\].*found -1"):
        PartitionBook.from_assignment([0, -1], 3)
    with pytest.raises(ValidationError, match="integers"):
        PartitionBook.from_assignment(np.array([0.0, 1.0]), 2)
    with pytest.raises(ValidationError, match="1-D"):
        PartitionBook.from_assignment(np.zeros((2, 2), dtype=np.int64), 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_parts"):
            PartitionBook.from_assignment([0], bad)


def test_from_assignment_copies_its_input() -> None:
    part_of = np.array([0, 1, 1], dtype=np.int64)
    book = PartitionBook.from_assignment(part_of, 2)
    part_of[0] = 1
    assert book.part_of.tolist() == [0, 1, 1]


def test_equality() -> None:
    book = PartitionBook.from_assignment([0, 1, 1], 2)
    assert book == PartitionBook.from_assignment(torch.tensor([0, 1, 1]), 2)
    assert book != PartitionBook.from_assignment([0, 1, 1], 3)  # one more (empty) part
    assert book != PartitionBook.from_assignment([1, 1, 0], 2)
    assert book != "book"
    assert "num_parts=2" in repr(book)


# ------------------------------------------------------------------------ disk
def test_save_load_round_trip(tmp_path) -> None:
    book = _book(num_nodes=1000, num_parts=7)
    path = tmp_path / "sub" / "book.npz"
    book.save(path)
    book.save(path)  # replacing an existing book is fine
    assert os.listdir(path.parent) == ["book.npz"]  # no temporary left behind
    loaded = PartitionBook.load(path, num_nodes=1000)
    assert loaded == book
    assert torch.equal(loaded.perm, book.perm) and torch.equal(loaded.offsets, book.offsets)
    assert PartitionBook.load(str(path)) == book


def test_load_refuses_a_book_of_another_graph(tmp_path) -> None:
    path = tmp_path / "book.npz"
    _book(num_nodes=10).save(path)
    with pytest.raises(ValidationError, match="book.npz: num_nodes.*found 10; expected 11"):
        PartitionBook.load(path, num_nodes=11)


def test_load_refuses_missing_truncated_and_corrupt_files(tmp_path) -> None:
    with pytest.raises(CacheError, match="missing"):
        PartitionBook.load(tmp_path / "absent.npz")
    path = tmp_path / "book.npz"
    _book(num_nodes=5000).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match="book.npz.*unreadable or truncated"):
        PartitionBook.load(path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside part_of: only the checksum can tell
    path.write_bytes(bytes(flipped))
    with pytest.raises(CacheError, match="book.npz"):
        PartitionBook.load(path)
    path.write_bytes(b"not a zip file at all")
    with pytest.raises(CacheError, match="unreadable"):
        PartitionBook.load(path)


def test_load_refuses_modified_stale_and_foreign_files(tmp_path) -> None:
    path = tmp_path / "book.npz"
    _write_fields(path)
    assert PartitionBook.load(path).part_of.tolist() == [0, 1, 1, 0, 2]
    _write_fields(path, part_of=np.array([0, 1, 1, 0, 1], dtype=np.int64))
    with pytest.raises(CacheError, match="book.npz: checksum: checksum mismatch"):
        PartitionBook.load(path)
    _write_fields(path, format_version=np.int64(FORMAT_VERSION + 1))
    with pytest.raises(CacheError, match="format_version: stale"):
        PartitionBook.load(path)
    _write_fields(path, format=np.array("something else"))
    with pytest.raises(CacheError, match="format: not a partition book"):
        PartitionBook.load(path)
    _write_fields(path, checksum=None)
    with pytest.raises(CacheError, match="checksum: not a partition book"):
        PartitionBook.load(path)
    _write_fields(path, num_nodes=np.int64(6))
    with pytest.raises(CacheError, match="part_of: part assignment does not match"):
        PartitionBook.load(path)
    bad = np.array([0, 1, 1, 0, 3], dtype=np.int64)
    _write_fields(path, part_of=bad, checksum=np.array(_checksum(bad, 3)))
    with pytest.raises(CacheError, match="part_of: part id out of range"):
        PartitionBook.load(path)
