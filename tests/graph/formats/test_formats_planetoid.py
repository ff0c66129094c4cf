"""Planetoid ``ind.*`` loader: real Cora/CiteSeer/PubMed counts and bad-input errors."""
from __future__ import annotations

import pickle
import shutil
from collections import OrderedDict, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

import fullgraph.graph
from fullgraph.errors import DatasetNotFoundError, FormatError, ValidationError
from fullgraph.graph.formats.planetoid import load_planetoid, load_planetoid_graph
from fullgraph.graph.formats.safe_pickle import load_pickle

BUILTIN_CORA = Path(fullgraph.graph.__file__).resolve().parent / "builtin" / "cora"


@pytest.fixture
def cora_dir(tmp_path: Path) -> Path:
    """A private copy of the built-in Cora files that a test may corrupt."""
    raw = tmp_path / "raw"
    shutil.copytree(BUILTIN_CORA, raw)
    return raw


def _repickle(path: Path, obj: object) -> None:
    path.chmod(0o644)
    path.write_bytes(pickle.dumps(obj, protocol=4))


def _assert_symmetric_simple(graph) -> None:
    src, dst = graph.edges()
    assert not bool((src == dst).any())
    forward = set(zip(src.tolist(), dst.tolist()))
    assert forward == {(d, s) for s, d in forward}


# --------------------------------------------------------------- real datasets
def test_cora_counts_split_and_features() -> None:
    ds = load_planetoid(BUILTIN_CORA, "Cora")
    assert ds.name == "cora"
    assert ds.summary() == {"name": "cora", "vertices": 2708, "edges": 10556, "features": 1433,
                            "classes": 7, "train": 140, "val": 500, "test": 1000}
    d = ds.data
    assert torch.bincount(d.labels[d.train_mask], minlength=7).tolist() == [20] * 7
    assert torch.equal(d.train_mask.nonzero().flatten(), torch.arange(140))
    assert torch.equal(d.val_mask.nonzero().flatten(), torch.arange(140, 640))
    assert torch.equal(d.test_mask.nonzero().flatten(), torch.arange(1708, 2708))
    assert d.features.dtype == torch.float32
    assert float(d.features.sum()) == 49216.0  # binary bag of words: total nnz
    assert d.features[0].nonzero().flatten()[:5].tolist() == [19, 81, 146, 315, 774]
    assert d.features.sum(1)[:5].tolist() == [9.0, 23.0, 19.0, 21.0, 18.0]
    assert d.labels[:10].tolist() == [3, 4, 4, 0, 3, 2, 0, 3, 3, 2]
    _assert_symmetric_simple(ds.graph)


def test_citeseer_counts_and_isolated_test_gaps(shared_datasets: Path) -> None:
    ds = load_planetoid(shared_datasets / "planetoid" / "raw", "CiteSeer")
    assert ds.summary() == {"name": "citeseer", "vertices": 3327, "edges": 9104,
                            "features": 3703, "classes": 6, "train": 120, "val": 500,
                            "test": 1000}
    d = ds.data
    assert torch.bincount(d.labels[d.train_mask], minlength=6).tolist() == [20] * 6
    assert float(d.features.sum()) == 105165.0
    gaps = [2407, 2489, 2553, 2682, 2781, 2953, 3042, 3063, 3212, 3214, 3250, 3292, 3305,
            3306, 3309]
    assert (d.labels < 0).nonzero().flatten().tolist() == gaps
    assert float(d.features[gaps].abs().sum()) == 0.0
    in_any = d.train_mask | d.val_mask | d.test_mask
    assert not bool(in_any[gaps].any())
    assert ds.info["unlabelled"] == 15
    _assert_symmetric_simple(ds.graph)


def test_matches_pyg_read_planetoid_data() -> None:
    pyg_planetoid = pytest.importorskip("torch_geometric.io.planetoid")
    ref = pyg_planetoid.read_planetoid_data(str(BUILTIN_CORA), "cora")
    ds = load_planetoid(BUILTIN_CORA, "cora")
    src, dst = ds.graph.edges()
    assert set(zip(src.tolist(), dst.tolist())) == set(zip(*ref.edge_index.tolist()))
    assert torch.equal(ds.data.features, ref.x)
    assert torch.equal(ds.data.labels, ref.y)
    for name in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(ds.data, name), getattr(ref, name))


def test_pubmed_graph_and_split_without_allx(shared_datasets: Path) -> None:
    raw = shared_datasets / "planetoid" / "raw"
    if (raw / "ind.pubmed.allx").exists():
        pytest.skip("this copy of PubMed has allx")
    structure = load_planetoid_graph(raw, "PubMed")
    assert structure.graph.num_nodes == 19717
    assert structure.graph.num_edges == 88648
    assert structure.num_classes == 3
    counts = [int(m.sum()) for m in (structure.train_mask, structure.val_mask,
                                     structure.test_mask)]
    assert counts == [60, 500, 1000]
    assert torch.bincount(structure.labels[structure.train_mask]).tolist() == [20, 20, 20]
    with pytest.raises(DatasetNotFoundError) as err:
        load_planetoid(raw, "PubMed")
    assert "ind.pubmed.allx" in str(err.value)
    assert str(raw) in str(err.value)


# ------------------------------------------------------------------- bad input
def test_missing_files_are_all_named(cora_dir: Path) -> None:
    (cora_dir / "ind.cora.allx").unlink()
    (cora_dir / "ind.cora.tx").unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        load_planetoid(cora_dir, "cora")
    msg = str(err.value)
    assert "ind.cora.allx" in msg and "ind.cora.tx" in msg and str(cora_dir) in msg
    assert "kimiyoung/planetoid" in msg


def test_refused_pickle_class(cora_dir: Path) -> None:
    _repickle(cora_dir / "ind.cora.graph", OrderedDict({0: [1]}))
    with pytest.raises(FormatError) as err:
        load_planetoid(cora_dir, "cora")
    assert err.value.source == str(cora_dir / "ind.cora.graph")
    assert err.value.found == "collections.OrderedDict"


def test_truncated_pickle(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.ty"
    data = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="not a readable pickle") as err:
        load_planetoid(cora_dir, "cora")
    assert err.value.source == str(path)


def _edit_test_index(cora_dir: Path, line: int, text: str) -> Path:
    path = cora_dir / "ind.cora.test.index"
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.chmod(0o644)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_non_numeric_test_index_names_line(cora_dir: Path) -> None:
    path = _edit_test_index(cora_dir, 7, "12x")
    with pytest.raises(FormatError) as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 7, "'12x'")


def test_test_id_out_of_range(cora_dir: Path) -> None:
    path = _edit_test_index(cora_dir, 3, "99999")
    with pytest.raises(ValidationError, match="out of range") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 3, 99999)
    assert "2708" in str(err.value.expected)


def test_negative_test_id(cora_dir: Path) -> None:
    path = _edit_test_index(cora_dir, 5, "-4")
    with pytest.raises(ValidationError, match="negative") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 5, -4)


def test_repeated_test_id(cora_dir: Path) -> None:
    first = (cora_dir / "ind.cora.test.index").read_text().splitlines()[0]
    _edit_test_index(cora_dir, 10, first)
    with pytest.raises(ValidationError, match="twice") as err:
        load_planetoid(cora_dir, "cora")
    assert err.value.line == 10


def test_nan_feature_names_file(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.tx"
    tx = load_pickle(path)
    tx.data[0] = np.nan
    _repickle(path, tx)
    with pytest.raises(ValidationError, match="not finite") as err:
        load_planetoid(cora_dir, "cora")
    assert err.value.source == str(path)
    assert err.value.field.startswith("tx[0, ")


def test_feature_rows_mismatch(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.allx"
    _repickle(path, load_pickle(path)[:-1])
    with pytest.raises(FormatError, match="rows") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.found, err.value.expected) == (str(path), 1707, 1708)


def test_label_rows_must_be_one_hot(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.ally"
    ally = load_pickle(path)
    ally[4, :] = 1
    _repickle(path, ally)
    with pytest.raises(FormatError, match="one-hot") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.field) == (str(path), "row 4")


def test_empty_graph(cora_dir: Path) -> None:
    _repickle(cora_dir / "ind.cora.graph", defaultdict(list))
    with pytest.raises(ValidationError, match="no edges"):
        load_planetoid(cora_dir, "cora")


def test_neighbour_id_out_of_range(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.graph"
    adjacency = load_pickle(path)
    adjacency[5].append(5000)
    _repickle(path, adjacency)
    with pytest.raises(ValidationError, match="out of range") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.found) == (str(path), 5000)
    assert err.value.field == "neighbours of vertex 5"


def test_empty_train_split(cora_dir: Path) -> None:
    path = cora_dir / "ind.cora.y"
    _repickle(path, load_pickle(path)[:0])
    with pytest.raises(ValidationError, match="train mask is empty"):
        load_planetoid(cora_dir, "cora")


def test_test_id_overlapping_train_and_val(cora_dir: Path) -> None:
    path = _edit_test_index(cora_dir, 2, "100")
    with pytest.raises(ValidationError, match="allx block") as err:
        load_planetoid(cora_dir, "cora")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 2, 100)
