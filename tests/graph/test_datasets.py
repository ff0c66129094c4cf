"""Dataset names stay inside the root; opening a dataset checks labels against its classes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fullgraph.errors import CacheError, ConfigError, DatasetNotFoundError
from fullgraph.graph import datasets, store
from fullgraph.graph.synthetic import sbm

BAD_NAMES = ["", "  ", "../../escape", "..", ".", ".hidden", "a/b", "/abs", "a\\b", "x\0y"]


@pytest.mark.parametrize("name", ["cora", "my-graph_2", "rmat.v1", "a..b"])
def test_good_names_pass(name: str) -> None:
    assert datasets.check_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="is not a name"):
        datasets.check_name(name)


@pytest.mark.parametrize("name", ["../../escape", "..", "sub/dir", ".hidden"])
def test_save_processed_stays_inside_the_root(tmp_path: Path, name: str) -> None:
    root = tmp_path / "a" / "b" / "root"
    with pytest.raises(ConfigError, match="is not a name"):
        datasets.save_processed(sbm(40, 2, num_features=3, seed=0), root, name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == []  # nothing written anywhere


def test_load_refuses_a_name_that_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    store.save_dataset(sbm(40, 2, num_features=3, seed=0), outside / "processed")
    with pytest.raises(DatasetNotFoundError, match="'../outside': no such directory"):
        datasets.load("../outside", root)  # (relative to here, not to the root)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError, match="nor is it a processed dataset directory"):
        datasets.load(str(tmp_path / "empty"), root)
    # A path to the processed directory itself is still accepted, as documented.
    assert datasets.load(str(outside / "processed"), root).graph.num_nodes == 40
    # shard folders without their manifest: the message names what is missing
    (tmp_path / "shards" / "part-0").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError, match=r"holds part-\* folders but no shards.json"):
        datasets.load(str(tmp_path / "shards"), root)


def test_open_checks_labels_against_classes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ds = sbm(60, 4, num_features=3, seed=0)
    path = datasets.save_processed(ds, root, "mine")
    meta = json.loads((path / store.META_FILE).read_text())
    meta["num_classes"] = 2
    (path / store.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CacheError, match="'mine': labels do not fit its class count") as err:
        datasets.load("mine", root)
    assert err.value.found == "max label 3, num_classes 2"


def _edgelist_files(tmp_path: Path) -> dict[str, str]:
    import numpy as np

    n = 12
    src = np.arange(n - 1)
    np.savetxt(tmp_path / "edges.txt", np.stack([src, src + 1], axis=1), fmt="%d")
    np.save(tmp_path / "x.npy", np.ones((n, 3), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(n) % 2)
    return {"edges": str(tmp_path / "edges.txt"), "features": str(tmp_path / "x.npy"),
            "labels": str(tmp_path / "y.npy")}


def test_convert_takes_typed_options(tmp_path: Path) -> None:
    files = _edgelist_files(tmp_path)
    plain = datasets.convert("edgelist", datasets.ConvertOptions(name="g", **files))
    both = datasets.convert("edgelist", datasets.ConvertOptions(name="g", symmetrize=True,
                                                                **files))
    assert plain.name == "g" and plain.graph.num_nodes == 12
    assert plain.graph.num_edges == 11 and both.graph.num_edges == 22


def test_convert_names_the_missing_files_as_flags(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="needs --edges, --masks"):
        datasets.convert("neutronstar", datasets.ConvertOptions(
            name="g", features="x", labels="y"))


def test_convert_refuses_an_unknown_format() -> None:
    with pytest.raises(ConfigError, match="convert format 'csv'; expected one of edgelist"):
        datasets.convert("csv", datasets.ConvertOptions(name="g"))


def test_features_are_kept_as_stored_unless_a_dtype_is_asked_for(tmp_path: Path) -> None:
    """bf16 features stay bf16 by default (a run converts the rows
    it reads); ``feature_dtype`` converts them once at load, exactly."""
    import torch

    ds = sbm(60, 3, avg_degree=4.0, num_features=5, feature_dtype="bfloat16")
    store.save_dataset(ds, tmp_path / "bf")
    kept = datasets.load(str(tmp_path / "bf"), tmp_path).data.features
    assert kept.dtype == torch.bfloat16
    wide = datasets.load(str(tmp_path / "bf"), tmp_path, feature_dtype="float32").data.features
    assert wide.dtype == torch.float32 and torch.equal(wide, kept.float())


def test_a_split_seed_that_cannot_draw_the_split_warns(tmp_path: Path, recwarn) -> None:
    """A generated or converted dataset keeps the split it was made with: --split-seed
    was ignored there without a word."""
    ds = sbm(60, 3, avg_degree=4.0, num_features=5)
    datasets.save_processed(ds, tmp_path, "mine")
    datasets.load("mine", tmp_path)  # the default seed: nothing to say
    assert not [w for w in recwarn if "split" in str(w.message)]
    with pytest.warns(UserWarning, match="--split-seed has no effect on dataset 'mine': its "
                                         "split was fixed when it was made"):
        again = datasets.load("mine", tmp_path, split_seed=3)
    assert again.data.train_mask.tolist() == ds.data.train_mask.tolist()


def test_a_built_in_bag_of_words_dataset_is_stored_as_csr(tmp_path: Path) -> None:
    """As convert stores one: Cora's processed features take its non-zeros (0.7 MB,
    not 15 MB), and load as CSR, or dense with --sparse-features off, the same values."""
    import torch

    from fullgraph.graph.sparse import densify, is_sparse

    ds = datasets.load("cora", tmp_path)
    meta = json.loads((datasets.processed_dir(tmp_path, "cora") / "meta.json").read_text())
    assert meta["feature_shape"] == [2708, 1433] and is_sparse(ds.data.features)
    size = sum(f.stat().st_size for f in datasets.processed_dir(tmp_path, "cora").iterdir())
    assert size < 3 * 2**20
    again = datasets.load("cora", tmp_path)  # from the store
    assert torch.equal(densify(again.data.features), densify(ds.data.features))


def test_features_beyond_float16s_range_are_refused_for_float16() -> None:
    """They became inf, and the loss NaN from epoch 1, blamed on the learning rate."""
    import torch

    from fullgraph.errors import ValidationError
    from fullgraph.graph.data import VertexData

    mask = torch.ones(3, dtype=torch.bool)
    data = VertexData(torch.tensor([[1.0, 2e5], [0.0, 1.0], [1.0, 1.0]]),
                      torch.tensor([0, 1, 0]), mask, mask, mask, 2)
    with pytest.raises(ValidationError, match="does not fit float16; found 200000.*bfloat16"):
        data.with_feature_dtype("float16")
    assert data.with_feature_dtype("bfloat16").features.dtype == torch.bfloat16
    sparse = VertexData(data.features.to_sparse_csr(), data.labels, mask, mask, mask, 2)
    with pytest.raises(ValidationError, match="does not fit float16"):
        sparse.with_feature_dtype("float16")


def test_a_built_in_dataset_processed_dense_is_processed_again(tmp_path: Path) -> None:
    """A cache an older version wrote dense is rebuilt as CSR (with a warning), so every
    host of a run holds the same arrays (torchrun compares them)."""
    import torch

    from fullgraph.graph.sparse import densify, is_sparse

    ds = datasets.load("cora", tmp_path)
    want = densify(ds.data.features)
    ds.data.features = want
    store.save_dataset(ds, datasets.processed_dir(tmp_path, "cora"))
    with pytest.warns(UserWarning, match="stored dense.*rebuilding the processed dataset"):
        again = datasets.load("cora", tmp_path)
    assert is_sparse(again.data.features)
    assert torch.equal(densify(again.data.features), want)


def test_a_built_in_raw_file_cut_short_is_copied_again(tmp_path: Path) -> None:
    """A first run killed while copying Cora's raw files left a truncated file that
    every later run failed to read ("pickle data was truncated") until it was deleted
    by hand; the package holds the whole file."""
    spec = datasets.KNOWN["cora"]
    raw = datasets.ensure_raw(spec, tmp_path / "cora" / "raw", download=False)
    whole = (raw / spec.files[0]).read_bytes()
    (raw / spec.files[0]).write_bytes(whole[:100])
    datasets.ensure_raw(spec, raw, download=False)
    assert (raw / spec.files[0]).read_bytes() == whole
    assert not list(raw.glob(".*.partial"))
