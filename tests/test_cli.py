"""The CLI: flags, config files, user errors without tracebacks, and end-to-end runs."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fullgraph.cli import build_parser, main

# One flag per Config field; adding a knob means adding it here on purpose.
TRAIN_FLAGS = sorted("""
--config --dataset --root --feature-dtype --normalize-features --split-seed --model --hidden
--layers --dropout --input-dropout --activation --residual --decoupled --num-props --heads --batch-norm
--out-heads --attn-dropout --epochs --lr --weight-decay --seed --device --eval-every
--metrics-out --progress --strategy --spmm-backend --threads --workers --backend --timeout
--run-dir --partitioner --partition-file --partition-seed --dep-mode --byte-cost --edge-cost
--device-memory --num-chunks --column-split --pipeline --nn-device --p2p-schedule --bin-memory
--bin-size
""".split())


def train_flags() -> list[str]:
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    return sorted(s for a in sub._actions for s in a.option_strings
                  if s.startswith("--") and s != "--help" and not s.startswith("--no-"))


def test_train_flag_list_is_pinned():
    assert train_flags() == TRAIN_FLAGS


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def test_train_on_builtin_cora_writes_metrics(root, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    rc = main(["train", "--epochs", "3", "--progress", "off", "--metrics-out", str(metrics)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dataset  cora: 2708 vertices" in out and "final test accuracy" in out
    events = [json.loads(line)["event"] for line in metrics.read_text().splitlines()]
    assert events == ["run", "epoch", "epoch", "epoch", "summary"]
    assert (root / "cora" / "processed" / "meta.json").is_file()


def test_config_file_and_flag_override(root, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  name: sage\n  hidden: 8\ntrain:\n  epochs: 2\n  progress: 'off'\n")
    assert main(["train", "--config", str(cfg), "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "model    sage" in out and "1 epochs" in out
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nepochs = 1\nprogress = 'off'\n[model]\nname = 'gin'\n")
    assert main(["train", "--config", str(toml)]) == 0
    assert "model    gin" in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [
    ("model:\n  hiden: 8\n", "unknown key 'hiden'"),
    ("modle:\n  hidden: 8\n", "unknown section 'modle'"),
    ("train:\n  epochs: 'ten'\n", "train.epochs: got 'ten'"),
    ("train:\n  lr: -1\n", "train.lr: got -1"),
])
def test_bad_config_is_one_line_error(root, tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_dataset_lists_known_ones(root, capsys):
    assert main(["train", "--dataset", "coraa"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset" in err and "cora" in err and "coauthor_cs" in err


def test_generate_then_train(root, capsys):
    assert main(["generate", "sbm", "--vertices", "300", "--classes", "3", "--features", "8",
                 "--name", "toy"]) == 0
    assert main(["train", "--dataset", "toy", "--epochs", "2", "--progress", "off"]) == 0
    assert "dataset  toy: 300 vertices" in capsys.readouterr().out
    assert main(["datasets"]) == 0
    listing = capsys.readouterr().out
    assert "toy" in listing and "cora" in listing


def test_convert_edgelist_then_train(root, tmp_path, capsys):
    rng = np.random.default_rng(0)
    edges = tmp_path / "edges.txt"
    pairs = rng.integers(0, 50, (200, 2))
    edges.write_text("# src dst\n" + "\n".join(f"{s} {d}" for s, d in pairs) + "\n")
    np.save(tmp_path / "x.npy", rng.standard_normal((50, 6)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 3, 50))
    assert main(["convert", "edgelist", "--name", "mine", "--edges", str(edges),
                 "--features", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                 "--symmetrize"]) == 0
    assert main(["train", "--dataset", "mine", "--epochs", "2", "--progress", "off"]) == 0


def test_bad_edge_file_is_one_line_error(root, tmp_path, capsys):
    edges = tmp_path / "edges.txt"
    edges.write_text("0 1\n1 x\n")
    np.save(tmp_path / "x.npy", np.zeros((2, 2), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(2, np.int64))
    rc = main(["convert", "edgelist", "--name", "bad", "--edges", str(edges),
               "--features", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and "edges.txt:2" in err and "Traceback" not in err


def test_corrupt_cache_is_rebuilt_with_warning(root, capsys):
    assert main(["train", "--epochs", "1", "--progress", "off"]) == 0
    features = root / "cora" / "processed" / "features.npy"
    data = bytearray(features.read_bytes())
    data[-1] ^= 0xFF
    features.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="rebuilding"):
        assert main(["train", "--epochs", "1", "--progress", "off"]) == 0


def test_missing_raw_files_offline_say_where(root, tmp_path, capsys, monkeypatch):
    from fullgraph.graph.formats import download

    monkeypatch.setattr(download, "PLANETOID_URL", (tmp_path / "nowhere").as_uri())
    assert main(["train", "--dataset", "citeseer", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "citeseer" in err and str(root / "citeseer" / "raw") in err


def test_datasets_describe(root, shared_datasets, capsys):
    raw = root / "amazon_photo" / "raw"
    raw.mkdir(parents=True)
    shutil.copy(shared_datasets / "amazon_photo" / "amazon_photo.npz", raw)
    assert main(["datasets", "amazon_photo"]) == 0
    assert "7650" in capsys.readouterr().out


def test_options_of_another_strategy_warn(root, capsys):
    with pytest.warns(UserWarning, match="tensor_parallel options pipeline have no effect"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--pipeline"]) == 0


def test_model_options_without_effect_warn(root):
    with pytest.warns(UserWarning, match="heads have no effect on model 'gcn'"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--heads", "4"]) == 0
