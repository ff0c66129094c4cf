"""Edge-list loader (text and binary edges, ``.npy`` arrays): round trips and bad input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.formats.edgelist import load_edgelist

N, F, C = 12, 3, 3
RNG = np.random.default_rng(0)
SRC = RNG.integers(0, N, size=40)
DST = RNG.integers(0, N, size=40)
X = RNG.standard_normal((N, F)).astype(np.float32)
Y = np.arange(N) % C


def _files(tmp_path: Path, *, x: np.ndarray = X, y: np.ndarray = Y) -> tuple[Path, Path]:
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return tmp_path / "x.npy", tmp_path / "y.npy"


def _text_edges(tmp_path: Path, body: str | None = None) -> Path:
    if body is None:
        body = "# src dst\n\n" + "".join(f"{s}\t{d}\n" for s, d in zip(SRC, DST))
    path = tmp_path / "edges.txt"
    path.write_text(body)
    return path


def _edge_set(ds) -> set[tuple[int, int]]:
    src, dst = ds.graph.edges()
    return set(zip(src.tolist(), dst.tolist()))


def test_text_round_trip(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    ds = load_edgelist(_text_edges(tmp_path), x, y, name="tiny")
    assert ds.name == "tiny"
    assert _edge_set(ds) == set(zip(SRC.tolist(), DST.tolist()))
    assert torch.equal(ds.data.features, torch.from_numpy(X))
    assert ds.data.labels.tolist() == Y.tolist()
    assert ds.data.num_classes == C


@pytest.mark.parametrize("dtype", ["uint32", "int64"])
def test_binary_round_trip(tmp_path: Path, dtype: str) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.stack([SRC, DST], axis=1).astype(dtype).tofile(path)
    ds = load_edgelist(path, x, y, binary_dtype=dtype)
    assert _edge_set(ds) == set(zip(SRC.tolist(), DST.tolist()))


def test_symmetrize_and_isolated_vertices(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    ds = load_edgelist(_text_edges(tmp_path, "0 1\n"), x, y, symmetrize=True)
    assert _edge_set(ds) == {(0, 1), (1, 0)}
    assert ds.graph.num_nodes == N


def test_fraction_split_is_seeded(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    edges = _text_edges(tmp_path)
    a = load_edgelist(edges, x, y, seed=3)
    b = load_edgelist(edges, x, y, seed=3)
    assert torch.equal(a.data.train_mask, b.data.train_mask)
    counts = [int(m.sum()) for m in (a.data.train_mask, a.data.val_mask, a.data.test_mask)]
    assert counts == [7, 2, 3]  # round(0.6 * 12), round(0.2 * 12), rest


def test_stacked_and_separate_mask_files(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    masks = np.zeros((3, N), dtype=bool)
    masks[0, :4], masks[1, 4:8], masks[2, 8:] = True, True, True
    np.save(tmp_path / "masks.npy", masks)
    for i, split in enumerate(("train", "val", "test")):
        np.save(tmp_path / f"{split}.npy", masks[i])
    edges = _text_edges(tmp_path)
    one = load_edgelist(edges, x, y, masks=tmp_path / "masks.npy")
    three = load_edgelist(edges, x, y, masks=[tmp_path / f"{s}.npy" for s in
                                              ("train", "val", "test")])
    for ds in (one, three):
        assert ds.data.train_mask.tolist() == masks[0].tolist()
        assert ds.data.test_mask.tolist() == masks[2].tolist()


# ------------------------------------------------------------------- bad input
def test_non_numeric_token_names_line(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    path = _text_edges(tmp_path, "# header\n0 1\n\n2 three\n")
    with pytest.raises(FormatError, match="not a number") as err:
        load_edgelist(path, x, y)
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 4, "'three'")


def test_wrong_number_of_values(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(FormatError, match="number of values") as err:
        load_edgelist(_text_edges(tmp_path, "0 1\n1 2 3\n"), x, y)
    assert (err.value.line, err.value.found) == (2, 3)


def test_vertex_id_out_of_range(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(ValidationError, match="out of range") as err:
        load_edgelist(_text_edges(tmp_path, "0 1\n# c\n1 12\n"), x, y)
    assert (err.value.line, err.value.field, err.value.found) == (3, "dst", 12)
    assert err.value.expected == f"0 <= id < {N}"


def test_negative_id(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(ValidationError, match="negative") as err:
        load_edgelist(_text_edges(tmp_path, "0 1\n-1 2\n"), x, y)
    assert (err.value.line, err.value.field, err.value.found) == (2, "src", -1)


def test_binary_id_out_of_range_names_record(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.array([[0, 1], [2, 99]], dtype=np.uint32).tofile(path)
    with pytest.raises(ValidationError, match="out of range") as err:
        load_edgelist(path, x, y, binary_dtype="uint32")
    assert (err.value.field, err.value.found) == ("edge 1 (dst)", 99)


@pytest.mark.parametrize("dtype,size", [("uint32", 12), ("int64", 24)])
def test_truncated_binary_file(tmp_path: Path, dtype: str, size: int) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    path.write_bytes(bytes(size))
    with pytest.raises(FormatError, match="truncated") as err:
        load_edgelist(path, x, y, binary_dtype=dtype)
    assert err.value.found == f"{size} bytes"
    assert "multiple of" in err.value.expected


def test_int64_file_read_as_uint32_is_refused(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.stack([SRC, DST], axis=1).astype("<i8").tofile(path)
    with pytest.raises(FormatError, match="does not look like uint32") as err:
        load_edgelist(path, x, y, binary_dtype="uint32")
    assert err.value.source == str(path)
    assert "--binary int64" in str(err.value)
    assert "every destination id" in err.value.found
    # the rare real file of edges that all point to vertex 0 has a way through: text
    assert "write the edges as text" in str(err.value)


def test_uint32_file_read_as_int64_is_refused(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.stack([SRC, DST], axis=1).astype("<u4").tofile(path)  # 40 edges: 320 bytes
    with pytest.raises(FormatError, match="does not look like int64") as err:
        load_edgelist(path, x, y, binary_dtype="int64")
    assert err.value.source == str(path)
    assert "--binary uint32" in str(err.value)
    assert f"for {N} vertices" in err.value.found


def test_size_that_fits_only_uint32_names_it(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.array([[0, 1], [2, 3], [4, 5]], dtype="<u4").tofile(path)  # 24 bytes
    with pytest.raises(FormatError, match="truncated") as err:
        load_edgelist(path, x, y, binary_dtype="int64")
    assert "--binary uint32" in str(err.value)


def test_uint32_edges_into_vertex_0_of_odd_count_are_kept(tmp_path: Path) -> None:
    # 3 records (24 bytes) cannot be int64 pairs, so a star into vertex 0 is taken as is.
    x, y = _files(tmp_path)
    path = tmp_path / "edges.bin"
    np.array([[1, 0], [2, 0], [3, 0]], dtype="<u4").tofile(path)
    ds = load_edgelist(path, x, y, binary_dtype="uint32")
    assert _edge_set(ds) == {(1, 0), (2, 0), (3, 0)}


@pytest.mark.parametrize("body", ["", "# only a comment\n\n"])
def test_empty_text_edge_file(tmp_path: Path, body: str) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(ValidationError, match="no edges"):
        load_edgelist(_text_edges(tmp_path, body), x, y)


def test_empty_binary_edge_file(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    (tmp_path / "edges.bin").write_bytes(b"")
    with pytest.raises(ValidationError, match="no edges"):
        load_edgelist(tmp_path / "edges.bin", x, y, binary_dtype="int64")


def test_feature_rows_mismatch(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(ValidationError, match="feature rows") as err:
        load_edgelist(_text_edges(tmp_path), x, y, num_nodes=N + 1)
    assert (err.value.source, err.value.found, err.value.expected) == (str(x), N, N + 1)


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_non_finite_features(tmp_path: Path, bad: float) -> None:
    x_bad = X.copy()
    x_bad[5, 2] = bad
    x, y = _files(tmp_path, x=x_bad)
    with pytest.raises(ValidationError, match="not finite") as err:
        load_edgelist(_text_edges(tmp_path), x, y)
    assert (err.value.source, err.value.field) == (str(x), "features[5, 2]")


def test_label_out_of_range(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    with pytest.raises(ValidationError, match="label out of range") as err:
        load_edgelist(_text_edges(tmp_path), x, y, num_classes=2)
    assert (err.value.source, err.value.field, err.value.found) == (str(y), "labels[2]", 2)


@pytest.mark.parametrize("top", [10_000_000_000, 40])
def test_implausible_class_count_is_refused(tmp_path: Path, top: int) -> None:
    # 3 distinct labels in use; one vertex says there are top + 1 classes.
    x, y = _files(tmp_path, y=np.array([0, 1, 2] * 3 + [0, 1, top]))
    with pytest.raises(ValidationError, match="implausible class count") as err:
        load_edgelist(_text_edges(tmp_path), x, y)
    assert err.value.source == str(y)
    assert err.value.found == f"largest label {top}, so {top + 1} classes, but only 4 " \
        "distinct labels"
    assert "--num-classes" in err.value.hint


def test_stated_class_count_allows_sparse_labels(tmp_path: Path) -> None:
    x, y = _files(tmp_path, y=np.array([0, 1, 2] * 3 + [0, 1, 40]))
    ds = load_edgelist(_text_edges(tmp_path), x, y, num_classes=41)
    assert ds.data.num_classes == 41
    # Up to 10x the distinct labels is inferred without complaint (4 used, 40 classes).
    x, y = _files(tmp_path, y=np.array([0, 1, 2] * 3 + [0, 1, 39]))
    assert load_edgelist(_text_edges(tmp_path), x, y).data.num_classes == 40


def test_label_below_minus_one(tmp_path: Path) -> None:
    x, y = _files(tmp_path, y=np.array([0, -2] + [1] * (N - 2)))
    with pytest.raises(ValidationError, match="label out of range") as err:
        load_edgelist(_text_edges(tmp_path), x, y)
    assert err.value.field == "labels[1]"


def test_empty_train_mask(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    masks = np.zeros((3, N), dtype=bool)
    masks[1, :3] = True
    np.save(tmp_path / "masks.npy", masks)
    ds = load_edgelist(_text_edges(tmp_path), x, y, masks=tmp_path / "masks.npy")
    with pytest.raises(ValidationError, match="train mask is empty"):  # data to predict on
        ds.data.require_training(ds.name)


def test_overlapping_masks(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    masks = np.zeros((3, N), dtype=bool)
    masks[0, :4] = True
    masks[2, 3:6] = True
    np.save(tmp_path / "masks.npy", masks)
    with pytest.raises(ValidationError, match="overlap") as err:
        load_edgelist(_text_edges(tmp_path), x, y, masks=tmp_path / "masks.npy")
    assert err.value.field == "train_mask & test_mask"
    assert "vertex 3" in err.value.found


def test_mask_file_wrong_shape(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    np.save(tmp_path / "masks.npy", np.zeros((2, N), dtype=bool))
    with pytest.raises(FormatError, match="one row per split"):
        load_edgelist(_text_edges(tmp_path), x, y, masks=tmp_path / "masks.npy")


def test_npy_needing_pickle_is_refused(tmp_path: Path) -> None:
    x, _ = _files(tmp_path)
    np.save(tmp_path / "y.npy", np.array([object()] * N), allow_pickle=True)
    with pytest.raises(FormatError, match="pickle") as err:
        load_edgelist(_text_edges(tmp_path), x, tmp_path / "y.npy")
    assert err.value.source == str(tmp_path / "y.npy")


def test_missing_feature_file(tmp_path: Path) -> None:
    _, y = _files(tmp_path)
    with pytest.raises(DatasetNotFoundError, match="not found"):
        load_edgelist(_text_edges(tmp_path), tmp_path / "absent.npy", y)


def test_float_labels_must_be_whole(tmp_path: Path) -> None:
    x, y = _files(tmp_path, y=np.full(N, 0.5))
    with pytest.raises(FormatError, match="class id"):
        load_edgelist(_text_edges(tmp_path), x, y)


def test_npz_instead_of_npy(tmp_path: Path) -> None:
    _, y = _files(tmp_path)
    np.savez(tmp_path / "x.npz", x=X)
    with pytest.raises(FormatError, match="archive"):
        load_edgelist(_text_edges(tmp_path), tmp_path / "x.npz", y)


def test_truncated_npy(tmp_path: Path) -> None:
    x, y = _files(tmp_path)
    x.write_bytes(x.read_bytes()[:-7])
    with pytest.raises(FormatError, match="readable") as err:
        load_edgelist(_text_edges(tmp_path), x, y)
    assert err.value.source == str(x)


def test_repeated_edges_are_dropped_with_a_warning(tmp_path: Path, recwarn) -> None:
    x, y = _files(tmp_path)
    path = tmp_path / "edges.txt"
    path.write_text("0 1\n0 1\n2 3\n0 1\n")
    with pytest.warns(UserWarning, match=r"edges.txt: 2 repeated edges were dropped \(each "
                                         r"edge is stored once; 2 remain\)"):
        assert load_edgelist(path, x, y).graph.num_edges == 2
    recwarn.clear()
    path.write_text("0 1\n1 0\n2 3\n")  # both directions given, then symmetrised: no repeat
    assert load_edgelist(path, x, y, symmetrize=True).graph.num_edges == 4
    assert not [w for w in recwarn if "repeated" in str(w.message)]


def test_inputs_named_for_what_they_are(tmp_path: Path) -> None:
    """A text file given as .npy, a finite float64 feature beyond float32, and a uint64
    label beyond int64 (it became -1, unlabelled, without a word)."""
    x, y = _files(tmp_path)
    edges = tmp_path / "edges.txt"
    edges.write_text("0 1\n2 3\n")
    with pytest.raises(FormatError, match="not an .npy file") as err:
        load_edgelist(edges, edges, y)
    assert "starts with b'0 1" in str(err.value)
    wide = np.load(x).astype(np.float64)
    wide[3, 1] = 1e300
    np.save(tmp_path / "wide.npy", wide)
    with pytest.raises(FormatError, match=r"features\[3, 1\]: feature does not fit float32"):
        load_edgelist(edges, tmp_path / "wide.npy", y)
    wide[3, 1] = float(np.finfo(np.float32).max)  # the largest float32 fits
    np.save(tmp_path / "wide.npy", wide)
    load_edgelist(edges, tmp_path / "wide.npy", y)
    labels = np.load(y).astype(np.uint64)
    labels[2] = 2**64 - 1
    np.save(tmp_path / "u64.npy", labels)
    with pytest.raises(FormatError, match=r"labels\[2\]: label is not a class id; found "
                                          r"18446744073709551615"):
        load_edgelist(edges, x, tmp_path / "u64.npy")


def test_a_huge_float_label_is_named_not_wrapped(tmp_path: Path) -> None:
    """1e20 was cast first and then named as label -9223372036854775808."""
    y = Y.astype(np.float64)
    y[2] = 1e20
    x, labels = _files(tmp_path, y=y)
    with pytest.raises(FormatError, match=r"labels\[2\]: label is not a class id; found 1e\+20"):
        load_edgelist(_text_edges(tmp_path), x, labels)
