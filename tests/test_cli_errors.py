"""Mistakes at the command line get one line, early: config files under flags, output
paths checked before the training, file-system errors, diverged runs, names of the
built-in datasets, and warnings in the flags' names."""
from __future__ import annotations

import json

import numpy as np
import pytest
from clirun import one_line_error

from fullgraph.cli import main

README_YAML = """\
model: gat
hidden: 8
dep-mode: hybrid      # or dep_mode
partitioner: chunk
epochs: 100
"""


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def printed_config(capsys, *argv: str) -> dict:
    import yaml

    assert main(["config", "--print", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_flags_override_a_config_file_in_any_spelling(tmp_path, capsys):
    """The README's flat file (flags' names at the top level) and a section file in the
    flags' spelling: a flag wins over either, as the README says."""
    flat = tmp_path / "flat.yaml"
    flat.write_text(README_YAML)
    tree = printed_config(capsys, "--config", str(flat), "--epochs", "2", "--hidden", "4",
                          "--model", "gcn", "--dep-mode", "depcomm")
    assert (tree["train"]["epochs"], tree["model"]["hidden"], tree["model"]["name"]) == \
        (2, 4, "gcn")
    assert tree["data_parallel"]["mode"] == "depcomm"
    assert tree["partition"]["method"] == "chunk"  # from the file, not overridden
    section = tmp_path / "section.yaml"
    section.write_text("partition:\n  partitioner: chunk\n")
    tree = printed_config(capsys, "--config", str(section), "--partitioner", "random")
    assert tree["partition"]["method"] == "random"


def test_a_config_file_that_is_no_mapping_is_one_error(tmp_path, capsys):
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    assert main(["train", "--config", str(listed)]) == 2
    one_line_error(capsys, "list.yaml: expected a mapping", "got a list")


@pytest.mark.parametrize("flag, kind, expect", [
    ("--save-model", "dir", "is a directory; give a file name"),
    ("--save-model", "under-file", "is a file, not a directory"),
    ("--metrics-out", "dir", "is a directory; give a file name"),
    ("--checkpoint-dir", "file", "is a file, not a directory"),
])
def test_output_paths_are_checked_before_training(root, tmp_path, capsys, flag, kind, expect):
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("x")
    path = {"dir": tmp_path / "a-dir", "file": tmp_path / "a-file",
            "under-file": tmp_path / "a-file" / "model.pt"}[kind]
    assert main(["train", "--epochs", "1", "--progress", "off", flag, str(path)]) == 2
    captured = capsys.readouterr()
    assert "final test accuracy" not in captured.out  # refused before any epoch
    err = captured.err
    assert "Traceback" not in err and f"{flag} {path}: " in err and expect in err, err


def test_a_file_system_error_is_one_line(root, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", "--epochs", "1", "--root", str(afile)]) == 2
    one_line_error(capsys, "not a directory")


def test_debug_shows_the_traceback_and_keeps_the_exit_code(root, capsys):
    assert main(["train", "--epochs", "0", "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("train.epochs: got 0; expected >= 1")


def test_a_diverged_run_stops_and_says_so(root, capsys):
    assert main(["train", "--lr", "inf"]) == 2
    one_line_error(capsys, "train.lr: got inf; expected > 0 and finite")
    with pytest.warns(UserWarning, match=r"epoch 2: the loss is nan: the training diverged.*"
                                         r"stops here; the model kept is epoch 1's"):
        assert main(["train", "--lr", "1e30", "--epochs", "20", "--progress", "off"]) == 0
    out = capsys.readouterr().out
    assert "    2      nan " in out and "2 epochs in" in out


def test_predict_writes_the_file_it_names(root, tmp_path, capsys):
    model = tmp_path / "m.pt"
    assert main(["train", "--epochs", "2", "--progress", "off", "--save-model", str(model)]) == 0
    capsys.readouterr()
    out = tmp_path / "preds.txt"
    assert main(["predict", "--model", str(model), "--out", str(out), "--embeddings"]) == 0
    assert f"wrote {out}:" in capsys.readouterr().out
    assert np.load(out).shape == (2708,) and not (tmp_path / "preds.txt.npy").exists()
    assert np.load(tmp_path / "preds-embeddings.npy").shape == (2708, 16)
    assert main(["predict", "--model", str(model), "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "is a directory; give a file name")


def test_partition_and_report_outputs_are_checked(root, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["partition", "--parts", "2", "--out", str(tmp_path)]) == 2
    one_line_error(capsys, f"--out {tmp_path}: is a directory")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"event": "run"}) + "\n")
    assert main(["report", str(metrics), "--out", str(afile)]) == 2
    one_line_error(capsys, "is a file, not a directory")


@pytest.mark.parametrize("argv", [
    ["generate", "sbm", "--vertices", "50", "--classes", "2", "--name", "cora"],
    ["convert", "edgelist", "--name", "citeseer", "--edges", "e.txt"],
])
def test_the_names_of_built_in_datasets_are_not_taken(root, capsys, argv):
    assert main(argv) == 2
    one_line_error(capsys, "is a built-in dataset's", "give your data another name")
    assert not (root / argv[argv.index("--name") + 1]).exists()


def test_warnings_are_one_line_in_the_flags_names(tmp_path):
    """In a real process (pytest records warnings instead of printing them)."""
    from clirun import run_cli

    run = run_cli(["train", "--epochs", "1", "--progress", "off", "--heads", "4",
                   "--pipeline"], tmp_path / "data")
    assert run.returncode == 0, run.stderr
    assert "fullgraph train: warning: --heads has no effect with --model gcn" in run.stderr
    assert "fullgraph train: warning: --pipeline has no effect with --strategy single" in \
        run.stderr
    assert ".py:" not in run.stderr, run.stderr  # no source file and line
