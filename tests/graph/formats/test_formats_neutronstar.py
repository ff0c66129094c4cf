"""NeutronStar four-file loader: round trip (multi-block parsing) and bad input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.formats import _text
from fullgraph.graph.formats.neutronstar import load_neutronstar

N, F, C = 40, 4, 3
RNG = np.random.default_rng(1)
EDGES = RNG.integers(0, N, size=(120, 2)).astype(np.uint32)
X = np.round(RNG.standard_normal((N, F)), 4).astype(np.float32)
Y = RNG.integers(0, C, size=N)
SPLIT = np.array(["train", "val", "eval", "test", "none"])[np.arange(N) % 5]


def _write(tmp_path: Path, *, features: str | None = None, labels: str | None = None,
           masks: str | None = None, edges: bytes | None = None) -> tuple[Path, ...]:
    """Write the four files; lines come in a shuffled vertex order."""
    order = RNG.permutation(N)
    if features is None:
        features = "".join(f"{v} " + " ".join(f"{a:g}" for a in X[v]) + "\n" for v in order)
    if labels is None:
        labels = "".join(f"{v} {Y[v]}\n" for v in order)
    if masks is None:
        masks = "".join(f"{v} {SPLIT[v]}\n" for v in order if SPLIT[v] != "none")
    paths = tuple(tmp_path / name for name in ("g.edge", "g.feat", "g.label", "g.mask"))
    paths[0].write_bytes(EDGES.tobytes() if edges is None else edges)
    for path, text in zip(paths[1:], (features, labels, masks)):
        path.write_text(text)
    return paths


def test_round_trip(tmp_path: Path) -> None:
    ds = load_neutronstar(*_write(tmp_path), name="ns")
    assert ds.name == "ns"
    assert torch.equal(ds.data.features, torch.from_numpy(X))
    assert ds.data.labels.tolist() == Y.tolist()
    assert ds.data.train_mask.tolist() == (SPLIT == "train").tolist()
    assert ds.data.val_mask.tolist() == np.isin(SPLIT, ["val", "eval"]).tolist()
    assert ds.data.test_mask.tolist() == (SPLIT == "test").tolist()
    src, dst = ds.graph.edges()
    assert set(zip(src.tolist(), dst.tolist())) == set(map(tuple, EDGES.tolist()))


def test_round_trip_in_many_small_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", 64)
    ds = load_neutronstar(*_write(tmp_path), symmetrize=True)
    assert torch.equal(ds.data.features, torch.from_numpy(X))
    assert ds.data.labels.tolist() == Y.tolist()
    src, dst = ds.graph.edges()
    assert set(zip(src.tolist(), dst.tolist())) == set(map(tuple, EDGES.tolist())) | {
        (d, s) for s, d in EDGES.tolist()}


def test_line_numbers_survive_block_boundaries(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", 32)
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N)).replace("\n37 1 2", "\n37 1 x")
    with pytest.raises(FormatError) as err:
        load_neutronstar(*_write(tmp_path, features=features))
    assert (err.value.line, err.value.found) == (38, "'x'")


# ------------------------------------------------------------------- bad input
def test_non_numeric_feature(tmp_path: Path) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N)).replace("\n5 1 2 3", "\n5 1 2 a3")
    paths = _write(tmp_path, features=features)
    with pytest.raises(FormatError, match="not a number") as err:
        load_neutronstar(*paths)
    assert (err.value.source, err.value.line, err.value.found) == (str(paths[1]), 6, "'a3'")


def test_feature_line_with_missing_value(tmp_path: Path) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N)).replace("\n9 1 2 3 4", "\n9 1 2 3")
    with pytest.raises(FormatError, match="number of values") as err:
        load_neutronstar(*_write(tmp_path, features=features))
    assert (err.value.line, err.value.found) == (10, 4)


def test_feature_rows_fewer_than_vertices(tmp_path: Path) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N - 1))
    paths = _write(tmp_path, features=features)
    with pytest.raises(ValidationError, match="feature rows") as err:
        load_neutronstar(*paths, num_nodes=N)
    assert (err.value.source, err.value.found, err.value.expected) == (str(paths[1]), N - 1, N)


def test_repeated_feature_id(tmp_path: Path) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in [*range(N - 1), 7])
    with pytest.raises(ValidationError, match="twice") as err:
        load_neutronstar(*_write(tmp_path, features=features))
    assert (err.value.line, err.value.found) == (N, 7)


def test_feature_id_not_an_integer(tmp_path: Path) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N)).replace("\n3 1", "\n3.5 1")
    with pytest.raises(FormatError, match="not an integer") as err:
        load_neutronstar(*_write(tmp_path, features=features))
    assert err.value.line == 4


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_feature(tmp_path: Path, bad: str) -> None:
    features = "".join(f"{v} 1 2 3 4\n" for v in range(N)).replace("\n11 1 2", f"\n11 1 {bad}")
    paths = _write(tmp_path, features=features)
    with pytest.raises(ValidationError, match="not finite") as err:
        load_neutronstar(*paths)
    assert (err.value.source, err.value.line, err.value.field) == (str(paths[1]), 12,
                                                                  "features[11, 1]")


def test_label_id_out_of_range(tmp_path: Path) -> None:
    labels = "".join(f"{v} 0\n" for v in range(N - 1)) + f"{N} 1\n"
    paths = _write(tmp_path, labels=labels)
    with pytest.raises(ValidationError, match="out of range") as err:
        load_neutronstar(*paths)
    assert (err.value.source, err.value.line, err.value.found) == (str(paths[2]), N, N)


def test_label_out_of_range(tmp_path: Path) -> None:
    labels = "".join(f"{v} {v % 5}\n" for v in range(N))
    with pytest.raises(ValidationError, match="label out of range") as err:
        load_neutronstar(*_write(tmp_path, labels=labels), num_classes=4)
    assert (err.value.line, err.value.field, err.value.found) == (5, "label", 4)


def test_negative_mask_id(tmp_path: Path) -> None:
    masks = "0 train\n-3 test\n"
    paths = _write(tmp_path, masks=masks)
    with pytest.raises(ValidationError, match="negative") as err:
        load_neutronstar(*paths)
    assert (err.value.source, err.value.line, err.value.found) == (str(paths[3]), 2, -3)


def test_unknown_split_word(tmp_path: Path) -> None:
    masks = "0 train\n1 validation\n"
    with pytest.raises(FormatError) as err:
        load_neutronstar(*_write(tmp_path, masks=masks))
    assert (err.value.line, err.value.found) == (2, "'validation'")
    assert "train, val, eval or test" in err.value.expected


@pytest.mark.parametrize("code", ["0", "-1", "-3"])
def test_numeric_split_code_is_refused(tmp_path: Path, code: str) -> None:
    """-1/-2/-3 were the words' own codes, and were read as train/val/test."""
    with pytest.raises(FormatError, match="unknown split") as err:
        load_neutronstar(*_write(tmp_path, masks=f"0 train\n1 {code}\n"))
    assert err.value.line == 2 and err.value.found == int(code)


def test_empty_train_mask(tmp_path: Path) -> None:
    ds = load_neutronstar(*_write(tmp_path, masks="0 val\n1 test\n"))
    with pytest.raises(ValidationError, match="train mask is empty"):  # data to predict on
        ds.data.require_training(ds.name)


def test_vertex_in_two_masks(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="twice") as err:
        load_neutronstar(*_write(tmp_path, masks="0 train\n1 val\n0 test\n"))
    assert (err.value.line, err.value.found) == (3, 0)


def test_masked_vertex_without_label(tmp_path: Path) -> None:
    labels = "".join(f"{v} 0\n" for v in range(1, N))
    with pytest.raises(ValidationError, match="no label"):
        load_neutronstar(*_write(tmp_path, labels=labels, masks="0 train\n"))


def test_truncated_edge_file(tmp_path: Path) -> None:
    paths = _write(tmp_path, edges=EDGES.tobytes()[:-2])
    with pytest.raises(FormatError, match="truncated") as err:
        load_neutronstar(*paths)
    assert err.value.source == str(paths[0])


def test_edges_that_all_point_to_vertex_0_are_read(tmp_path: Path, recwarn) -> None:
    """The format fixes uint32, so a file that reads as int64 too is not questioned."""
    edges = np.array([[3, 0], [5, 0]], dtype=np.uint32).tobytes()
    ds = load_neutronstar(*_write(tmp_path, edges=edges))
    src, dst = ds.graph.edges()
    assert sorted(zip(src.tolist(), dst.tolist())) == [(3, 0), (5, 0)]
    assert not [w for w in recwarn if "destination" in str(w.message)]


def test_a_feature_id_beyond_int64_is_named_as_read(tmp_path: Path) -> None:
    """1e20 was cast to int64 first and reported as a negative id."""
    rows = "".join(f"{v} " + " ".join(f"{a:g}" for a in X[v]) + "\n" for v in range(N - 1))
    with pytest.raises(ValidationError, match="vertex id out of range; found 1e\\+20"):
        load_neutronstar(*_write(tmp_path, features=rows + "1e20 1 2 3 4\n"))


def test_a_vertex_missing_from_the_features_is_suspected_there(tmp_path: Path) -> None:
    """N comes from the feature file: an id the other files name beyond it points there."""
    rows = "".join(f"{v} " + " ".join(f"{a:g}" for a in X[v]) + "\n" for v in range(N - 1))
    with pytest.raises(ValidationError, match=f"out of range.*N = {N - 1}, the vertices of the "
                                              "feature file .*g.feat: is a vertex missing"):
        load_neutronstar(*_write(tmp_path, features=rows))


def test_a_label_out_of_range_gets_no_hint_about_vertices(tmp_path: Path) -> None:
    labels = "".join(f"{v} {7 if v == 2 else Y[v]}\n" for v in range(N))
    with pytest.raises(ValidationError, match="label out of range") as err:
        load_neutronstar(*_write(tmp_path, labels=labels), num_classes=C)
    assert err.value.hint is None


def test_edge_id_out_of_range(tmp_path: Path) -> None:
    edges = np.array([[0, 1], [N + 5, 2]], dtype=np.uint32).tobytes()
    with pytest.raises(ValidationError, match="out of range") as err:
        load_neutronstar(*_write(tmp_path, edges=edges))
    assert (err.value.field, err.value.found) == ("edge 1 (src)", N + 5)


def test_empty_edge_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no edges"):
        load_neutronstar(*_write(tmp_path, edges=b""))
