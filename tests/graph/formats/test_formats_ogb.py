"""OGB raw CSV layout: round trip on a generated fixture and bad input."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.formats.ogb import load_ogb

N, F, C = 30, 4, 3
RNG = np.random.default_rng(2)
EDGES = RNG.integers(0, N, size=(80, 2))
X = np.round(RNG.standard_normal((N, F)), 3).astype(np.float32)
Y = RNG.integers(0, C, size=N)
PERM = RNG.permutation(N)
SPLITS = {"train": PERM[:15], "valid": PERM[15:20], "test": PERM[20:]}


def _gz(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        fh.write(text)
    return path


def _csv(rows: np.ndarray, fmt: str = "{}") -> str:
    rows = rows.reshape(len(rows), -1)
    return "".join(",".join(fmt.format(v) for v in row) + "\n" for row in rows)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A tiny dataset in the layout of an unpacked OGB zip."""
    root = tmp_path / "tiny"
    _gz(root / "raw" / "edge.csv.gz", _csv(EDGES))
    _gz(root / "raw" / "node-feat.csv.gz", _csv(X, "{:g}"))
    _gz(root / "raw" / "node-label.csv.gz", _csv(Y))
    _gz(root / "raw" / "num-node-list.csv.gz", f"{N}\n")
    for split, ids in SPLITS.items():
        _gz(root / "split" / "random" / f"{split}.csv.gz", _csv(ids))
    return root


def _edge_set(ds) -> set[tuple[int, int]]:
    src, dst = ds.graph.edges()
    return set(zip(src.tolist(), dst.tolist()))


def test_round_trip_symmetrised(root: Path) -> None:
    ds = load_ogb(root, "ogbn-tiny")
    assert ds.name == "ogbn-tiny"
    assert torch.equal(ds.data.features, torch.from_numpy(X))
    assert ds.data.labels.tolist() == Y.tolist()
    assert ds.data.num_classes == C
    for mask, split in zip((ds.data.train_mask, ds.data.val_mask, ds.data.test_mask), SPLITS):
        assert sorted(mask.nonzero().flatten().tolist()) == sorted(SPLITS[split].tolist())
    directed = set(map(tuple, EDGES.tolist()))
    assert _edge_set(ds) == directed | {(d, s) for s, d in directed}
    assert ds.info["split"].startswith("random")


def test_directed_and_without_num_node_list(root: Path) -> None:
    (root / "raw" / "num-node-list.csv.gz").unlink()
    ds = load_ogb(root, "ogbn-tiny", symmetrize=False)
    assert ds.graph.num_nodes == N
    assert _edge_set(ds) == set(map(tuple, EDGES.tolist()))


def test_uncompressed_csv_and_nan_labels(root: Path) -> None:
    (root / "raw" / "node-label.csv.gz").unlink()
    labels = Y.astype(object)
    unlabelled = PERM[-1]  # a test vertex; drop it from the test split
    labels[unlabelled] = "nan"
    (root / "raw" / "node-label.csv").write_text(_csv(np.array(labels)))
    _gz(root / "split" / "random" / "test.csv.gz", _csv(SPLITS["test"][:-1]))
    ds = load_ogb(root, "ogbn-tiny")
    assert int(ds.data.labels[unlabelled]) == -1


def test_an_infinite_label_is_named_as_such(root: Path) -> None:
    """inf is not a whole class id (it was cast to -2**63 with a numpy warning)."""
    import warnings

    from fullgraph.errors import FormatError

    (root / "raw" / "node-label.csv.gz").unlink()
    labels = Y.astype(object)
    labels[2] = "inf"
    (root / "raw" / "node-label.csv").write_text(_csv(np.array(labels)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FormatError, match="node-label.csv:3: label is not a class id; "
                                              "found inf"):
            load_ogb(root, "ogbn-tiny")


def test_split_scheme_choice(root: Path) -> None:
    shutil.copytree(root / "split" / "random", root / "split" / "time")
    with pytest.raises(DatasetNotFoundError, match="split scheme") as err:
        load_ogb(root, "ogbn-tiny")
    assert "random" in str(err.value) and "time" in str(err.value)
    assert load_ogb(root, "ogbn-tiny", split_scheme="time").graph.num_nodes == N
    with pytest.raises(DatasetNotFoundError, match="not found"):
        load_ogb(root, "ogbn-tiny", split_scheme="sales_ranking")


# ------------------------------------------------------------------- bad input
def test_missing_raw_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_ogb(tmp_path, "ogbn-arxiv")
    msg = str(err.value)
    assert "raw/edge.csv.gz" in msg and "raw/node-feat.csv.gz" in msg and str(tmp_path) in msg
    assert "arxiv.zip" in msg


def test_non_numeric_edge_token(root: Path) -> None:
    path = _gz(root / "raw" / "edge.csv.gz", "0,1\n2,3\n4,five\n")
    with pytest.raises(FormatError, match="not a number") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 3, "'five'")


def test_edge_line_with_three_values(root: Path) -> None:
    _gz(root / "raw" / "edge.csv.gz", "0,1\n2,3,4\n")
    with pytest.raises(FormatError, match="number of values") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.line, err.value.found) == (2, 3)


def test_edge_id_out_of_range(root: Path) -> None:
    path = _gz(root / "raw" / "edge.csv.gz", f"0,1\n1,2\n{N},3\n")
    with pytest.raises(ValidationError, match="out of range") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.source, err.value.line, err.value.field, err.value.found) == (
        str(path), 3, "src", N)


def test_negative_split_id(root: Path) -> None:
    path = _gz(root / "split" / "random" / "valid.csv.gz", "16\n-1\n")
    with pytest.raises(ValidationError, match="negative") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.source, err.value.line) == (str(path), 2)


def test_feature_rows_mismatch(root: Path) -> None:
    path = _gz(root / "raw" / "num-node-list.csv.gz", f"{N + 2}\n")
    with pytest.raises(ValidationError, match="rows") as err:
        load_ogb(root, "ogbn-tiny")
    assert err.value.source == str(root / "raw" / "node-feat.csv.gz")
    assert (err.value.found, err.value.expected) == (N, N + 2)
    assert path.exists()


def test_nan_feature_names_line(root: Path) -> None:
    x = X.astype(object)
    x[7, 2] = "nan"
    path = _gz(root / "raw" / "node-feat.csv.gz", _csv(np.array(x)))
    with pytest.raises(ValidationError, match="not finite") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.source, err.value.line, err.value.field) == (str(path), 8,
                                                                  "features[7, 2]")


def test_label_not_a_class_id(root: Path) -> None:
    _gz(root / "raw" / "node-label.csv.gz", _csv(np.r_[Y[:-1], 1.5]))
    with pytest.raises(FormatError, match="class id") as err:
        load_ogb(root, "ogbn-tiny")
    assert err.value.line == N


def test_negative_label(root: Path) -> None:
    _gz(root / "raw" / "node-label.csv.gz", _csv(np.r_[-4, Y[1:]]))
    with pytest.raises(ValidationError, match="label out of range") as err:
        load_ogb(root, "ogbn-tiny")
    assert (err.value.line, err.value.found) == (1, -4)


def test_multi_label_refused(root: Path) -> None:
    _gz(root / "raw" / "node-label.csv.gz", _csv(np.ones((N, 3), dtype=int)))
    with pytest.raises(FormatError, match="multi-label"):
        load_ogb(root, "ogbn-tiny")


def test_overlapping_splits(root: Path) -> None:
    path = _gz(root / "split" / "random" / "test.csv.gz", _csv(np.r_[SPLITS["test"],
                                                                     SPLITS["train"][0]]))
    with pytest.raises(ValidationError, match="overlap") as err:
        load_ogb(root, "ogbn-tiny")
    assert err.value.source == str(path)


def test_empty_train_split(root: Path) -> None:
    _gz(root / "split" / "random" / "train.csv.gz", "")
    ds = load_ogb(root, "ogbn-tiny")
    with pytest.raises(ValidationError, match="train mask is empty"):  # data to predict on
        ds.data.require_training(ds.name)


def test_empty_edge_file(root: Path) -> None:
    _gz(root / "raw" / "edge.csv.gz", "")
    with pytest.raises(ValidationError, match="no edges"):
        load_ogb(root, "ogbn-tiny")


def test_missing_split_file(root: Path) -> None:
    (root / "split" / "random" / "valid.csv.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match="valid"):
        load_ogb(root, "ogbn-tiny")


def test_truncated_gzip(root: Path) -> None:
    path = root / "raw" / "edge.csv.gz"
    data = gzip.compress(_csv(np.tile(EDGES, (50, 1))).encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated") as err:
        load_ogb(root, "ogbn-tiny")
    assert err.value.source == str(path)
