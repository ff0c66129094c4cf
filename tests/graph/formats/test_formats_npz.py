"""gnn-benchmark ``.npz`` loader: real Amazon Photo / Coauthor CS and bad input."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.formats.npz import load_npz

# A directed 4-cycle plus one self-loop (3 -> 3) and a duplicate-in-reverse (1 -> 0).
ADJ = sp.csr_matrix(np.array([[0, 1, 0, 0],
                              [1, 0, 1, 0],
                              [0, 0, 0, 1],
                              [1, 0, 0, 1]], dtype=np.float32))


def _write_flat(path: Path, *, adj: sp.csr_matrix = ADJ, attr: np.ndarray | None = None,
                labels: np.ndarray | None = None, **extra: np.ndarray) -> Path:
    """The original shchur/gnn-benchmark layout: flat arrays, no pickles."""
    n = adj.shape[0]
    attr_csr = sp.csr_matrix(np.eye(n, 3, dtype=np.float32) if attr is None else attr)
    arrays = {"adj_data": adj.data, "adj_indices": adj.indices, "adj_indptr": adj.indptr,
              "adj_shape": np.array(adj.shape), "attr_data": attr_csr.data,
              "attr_indices": attr_csr.indices, "attr_indptr": attr_csr.indptr,
              "attr_shape": np.array(attr_csr.shape),
              "labels": np.array([0, 1, 0, 1]) if labels is None else labels}
    arrays.update(extra)
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def photo(shared_datasets: Path):
    return load_npz(shared_datasets / "amazon_photo" / "amazon_photo.npz", "amazon_photo")


def test_amazon_photo_counts(photo) -> None:
    assert photo.summary() == {"name": "amazon_photo", "vertices": 7650, "edges": 238162,
                               "features": 745, "classes": 8, "train": 160, "val": 240,
                               "test": 7250}
    assert not photo.graph.has_self_loops()
    src, dst = photo.graph.edges()
    edges = set(zip(src.tolist(), dst.tolist()))
    assert edges == {(d, s) for s, d in edges}
    assert float(photo.data.features.sum()) == 1979909.0  # binary bag of words: nnz


def test_per_class_split_20_30(photo) -> None:
    d = photo.data
    assert torch.bincount(d.labels[d.train_mask], minlength=8).tolist() == [20] * 8
    assert torch.bincount(d.labels[d.val_mask], minlength=8).tolist() == [30] * 8
    assert torch.equal(d.test_mask, ~(d.train_mask | d.val_mask))


def test_split_is_deterministic_per_seed(photo, shared_datasets: Path) -> None:
    path = shared_datasets / "amazon_photo" / "amazon_photo.npz"
    again = load_npz(path, "amazon_photo")
    other = load_npz(path, "amazon_photo", seed=1)
    assert torch.equal(again.data.train_mask, photo.data.train_mask)
    assert torch.equal(again.data.val_mask, photo.data.val_mask)
    assert not torch.equal(other.data.train_mask, photo.data.train_mask)
    assert torch.equal(other.data.features, photo.data.features)


def test_coauthor_cs_counts(shared_datasets: Path) -> None:
    ds = load_npz(shared_datasets / "coauthor_cs" / "coauthor_cs.npz")
    assert ds.summary() == {"name": "coauthor_cs", "vertices": 18333, "edges": 163788,
                            "features": 6805, "classes": 15, "train": 300, "val": 450,
                            "test": 17583}
    assert not ds.graph.has_self_loops()
    assert float(ds.data.features.max()) == 105.0  # keyword counts, not binary


def test_flat_layout_symmetrised_without_self_loops(tmp_path: Path) -> None:
    ds = load_npz(_write_flat(tmp_path / "tiny.npz"), train_per_class=1, val_per_class=1)
    assert ds.name == "tiny"
    src, dst = ds.graph.edges()
    assert set(zip(src.tolist(), dst.tolist())) == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3),
                                                    (3, 2), (0, 3), (3, 0)}
    assert torch.equal(ds.data.features, torch.eye(4, 3))
    assert ds.data.labels.tolist() == [0, 1, 0, 1]


def test_flat_layout_never_unpickles(tmp_path: Path) -> None:
    # Object members the loader does not need (names) are never read.
    path = _write_flat(tmp_path / "names.npz", node_names=np.array([Fraction(1, 2)] * 4))
    assert load_npz(path, train_per_class=1, val_per_class=1).graph.num_nodes == 4


# ------------------------------------------------------------------- bad input
def test_refused_pickle_class(tmp_path: Path) -> None:
    path = tmp_path / "evil.npz"
    evil = np.empty((), dtype=object)
    evil[()] = Fraction(1, 3)
    np.savez(path, adj_matrix=evil, node_attr=evil, node_label=np.zeros(4, dtype=np.int32))
    with pytest.raises(FormatError, match="allow-list") as err:
        load_npz(path)
    assert str(path) in err.value.source
    assert err.value.found == "fractions.Fraction"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_npz(tmp_path / "absent.npz")
    assert "absent.npz" in str(err.value)


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / "junk.npz"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(FormatError, match="npz"):
        load_npz(path)


def test_missing_members(tmp_path: Path) -> None:
    path = tmp_path / "partial.npz"
    np.savez(path, adj_data=np.ones(1))
    with pytest.raises(FormatError, match="required members") as err:
        load_npz(path)
    assert "adj_indices" in str(err.value)


def test_column_index_out_of_range(tmp_path: Path) -> None:
    adj = ADJ.copy()
    adj.indices[2] = 9
    with pytest.raises(ValidationError, match="out of range") as err:
        load_npz(_write_flat(tmp_path / "bad.npz", adj=adj))
    assert err.value.found == 9


def test_negative_column_index(tmp_path: Path) -> None:
    adj = ADJ.copy()
    adj.indices = adj.indices.astype(np.int64)
    adj.indices[0] = -2
    with pytest.raises(ValidationError, match="negative"):
        load_npz(_write_flat(tmp_path / "bad.npz", adj=adj))


def test_feature_rows_mismatch(tmp_path: Path) -> None:
    path = _write_flat(tmp_path / "bad.npz", attr=np.ones((3, 2), dtype=np.float32))
    with pytest.raises(ValidationError, match="feature rows") as err:
        load_npz(path)
    assert (err.value.source, err.value.found, err.value.expected) == (str(path), 3, 4)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_feature(tmp_path: Path, bad: float) -> None:
    attr = np.ones((4, 2), dtype=np.float32)
    attr[2, 1] = bad
    with pytest.raises(ValidationError, match="not finite") as err:
        load_npz(_write_flat(tmp_path / "bad.npz", attr=attr))
    assert err.value.field == "node attributes[2, 1]"


def test_negative_label(tmp_path: Path) -> None:
    path = _write_flat(tmp_path / "bad.npz", labels=np.array([0, -3, 1, 1]))
    with pytest.raises(ValidationError, match="label") as err:
        load_npz(path)
    assert (err.value.field, err.value.found) == ("labels[1]", -3)


def test_empty_graph(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="empty"):
        load_npz(_write_flat(tmp_path / "bad.npz", adj=sp.csr_matrix((4, 4),
                                                                      dtype=np.float32)))


def test_empty_train_split(tmp_path: Path) -> None:
    ds = load_npz(_write_flat(tmp_path / "tiny.npz"), train_per_class=0)
    with pytest.raises(ValidationError, match="train mask is empty"):  # data to predict on
        ds.data.require_training(ds.name)


def test_truncated_file(tmp_path: Path) -> None:
    full = _write_flat(tmp_path / "full.npz").read_bytes()
    path = tmp_path / "cut.npz"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(FormatError) as err:
        load_npz(path)
    assert str(path) in err.value.source


def test_corrupt_member(tmp_path: Path) -> None:
    path = _write_flat(tmp_path / "flat.npz")
    data = bytearray(path.read_bytes())
    start = data.index(b"NUMPY")  # header of the first member, stored uncompressed
    data[start + 60:start + 80] = b"\xff" * 20
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as err:
        load_npz(path)
    assert str(path) in err.value.source
