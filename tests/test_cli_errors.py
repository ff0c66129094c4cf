"""Mistakes at the command line get one line, early: config files under flags, output
paths checked before the training, file-system errors, diverged runs, names of the
built-in datasets, and warnings in the flags' names."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from clirun import one_line_error

from fullgraph.cli import main

README_YAML = """\
model: gat
hidden: 8
epochs: 100
strategy: data
workers: 2
dep-mode: hybrid      # or dep_mode
partitioner: chunk
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


def test_a_yaml_file_reads_values_as_the_flags_do(tmp_path, capsys):
    """YAML 1.1 would read off as False, 1:3 as 63 (base 60) and 1e-3 as text."""
    f = tmp_path / "run.yaml"
    f.write_text("progress: off\nadapt: off\ntask-split: 1:3\nlr: 1e-3\n"
                 "device-memory: 1000000\nnormalize-features: true\n")
    tree = printed_config(capsys, "--config", str(f))
    assert tree["train"]["progress"] == "off" and tree["adapt"]["mode"] == "off"
    assert tree["task_parallel"]["split"] == "1:3" and tree["train"]["lr"] == 0.001
    assert tree["tensor_parallel"]["device_memory"] == "1000000"
    assert tree["data"]["normalize_features"] is True


@pytest.mark.parametrize("name,content,needle", [
    ("date.yaml", "model: gin\nmodel-options:\n  eps: 2020-01-01\n",
     "date.yaml: model.options: the value of 'eps' (of type date) is no option value"),
    ("latin1.yaml", b"dataset: caf\xe9\n", "latin1.yaml: not UTF-8 text"),
    ("zero.yaml", "0\n", "zero.yaml: expected a mapping"),
])
def test_a_config_file_of_odd_values_is_one_error(tmp_path, capsys, name, content, needle):
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["train", "--config", str(f)]) == 2
    one_line_error(capsys, needle)


def test_a_config_file_may_start_with_a_byte_order_mark(tmp_path, capsys):
    for name, text in (("bom.toml", "hidden = 8\n"), ("bom.json", '{"hidden": 8}'),
                       ("bom.yaml", "hidden: 8\n")):
        f = tmp_path / name
        f.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert printed_config(capsys, "--config", str(f))["model"]["hidden"] == 8
    assert main(["train", "--config", str(tmp_path)]) == 2
    one_line_error(capsys, "is a directory, not a config file")


def test_a_config_file_in_other_spellings(tmp_path, capsys):
    """Empty sections, dashed keys inside a section, a negated flag's name, and an
    option's error named where it came from (the file, or the command line)."""
    f = tmp_path / "s.yaml"
    f.write_text("p2p:\nmodel:\ntask_parallel:\n  device-memory: 2GB\n"
                 "launch:\n  timeout-s: 60\n")
    tree = printed_config(capsys, "--config", str(f))
    assert tree["task_parallel"]["device_memory"] == "2GB"
    assert tree["launch"]["timeout_s"] == 60 and tree["model"]["name"] == "gcn"
    f.write_text("no-pipeline: true\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    one_line_error(capsys, "(to switch --pipeline off, write pipeline: false)")
    f.write_text("inject: bogus\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    one_line_error(capsys, f"{f}: --inject 'bogus': unknown kind")
    f.write_text("epochs: 2\n")
    assert main(["config", "--print", "--config", str(f), "--device-memory", "1GB",
                 "--num-chunks", "3"]) == 2
    one_line_error(capsys, "error: the command line: tensor_parallel: give device_memory")
    f.write_text("device-memory: 1GB\n")
    assert main(["config", "--print", "--config", str(f), "--num-chunks", "3"]) == 2
    one_line_error(capsys, f"error: the command line and {f}: tensor_parallel: give")
    # a strategy's check of one option names it as the others are named: its flag where
    # the flag gave it, the file and key where the file did
    assert main(["config", "--print", "--bin-size", "-1"]) == 2
    one_line_error(capsys, "error: --bin-size: must be >= 1, got -1")
    f.write_text("p2p:\n  bin_size: -1\n")
    assert main(["config", "--print", "--config", str(f)]) == 2
    one_line_error(capsys, f"error: {f}: p2p.bin_size: must be >= 1, got -1")
    assert main(["config", "--print", "--shares", "2,-1"]) == 2
    one_line_error(capsys, "error: --shares: '2,-1': expected comma-separated")


def test_a_toml_file_printed_with_any_character_loads_back(tmp_path, capsys):
    assert main(["config", "--print", "--format", "toml", "--root",
                 str(tmp_path / "d\U0001F600\u00e9")]) == 0
    printed = tmp_path / "run.toml"
    printed.write_text(capsys.readouterr().out, encoding="utf-8")
    tree = printed_config(capsys, "--config", str(printed))
    assert tree["data"]["root"] == str(tmp_path / "d\U0001F600\u00e9")


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
    ("--run-dir", "file", "is a file, not a directory"),  # (was: "a-file: file exists")
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


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_where_no_file_can_be_made_is_refused_before_training(root, capsys):
    """/proc refuses new files even to root, for whom ``os.access`` says yes."""
    path = "/proc/fullgraph-metrics.jsonl"
    assert main(["train", "--epochs", "1", "--progress", "off", "--metrics-out", path]) == 2
    captured = capsys.readouterr()
    assert "final test accuracy" not in captured.out
    assert f"--metrics-out {path}: /proc is not writable" in captured.err, captured.err


def test_a_file_system_error_is_one_line(root, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", "--epochs", "1", "--root", str(afile)]) == 2
    one_line_error(capsys, "not a directory")


def test_debug_shows_the_traceback_and_keeps_the_exit_code(root, capsys):
    assert main(["train", "--epochs", "0", "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("--epochs: got 0; expected >= 1")


def test_a_diverged_run_stops_and_says_so(root, tmp_path, capsys):
    assert main(["train", "--lr", "inf"]) == 2
    one_line_error(capsys, "error: --lr: got inf; expected > 0 and at most 3.4e37")
    for lr in ("1e39", "5e37"):  # (torch's Adam: a traceback, its first step 10x lr)
        assert main(["train", "--lr", lr]) == 2
        one_line_error(capsys, f"error: --lr: got {float(lr)}; expected > 0 and at most "
                               "3.4e37 (Adam's first step is 10x the rate")
    with pytest.warns(UserWarning, match=r"epoch 2: the loss is nan: the training diverged.*"
                                         r"stops here; the model kept is epoch 1's"):
        assert main(["train", "--lr", "1e30", "--epochs", "20", "--progress", "off",
                     "--metrics-out", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "    2      nan " in out and "2 epochs in" in out
    # the summary and its record say why it stopped (they read as a short run's)
    assert "stopped after epoch 2: its loss is nan (the training diverged" in out
    from fullgraph.plots import final_lines
    from fullgraph.runlog import read_run_log

    log = read_run_log(tmp_path / "m.jsonl")
    assert log.summary["diverged_at"] == 2 and log.summary["stopped_early"] is False
    assert "stopped at epoch 2: its loss is not finite (the training diverged)" in \
        final_lines(log)[1]


def test_predict_writes_the_file_it_names(root, tmp_path, capsys):
    model = tmp_path / "m.pt"
    assert main(["train", "--epochs", "2", "--progress", "off", "--save-model", str(model)]) == 0
    capsys.readouterr()
    out = tmp_path / "preds.out"
    assert main(["predict", "--model", str(model), "--out", str(out), "--embeddings"]) == 0
    assert f"wrote {out}:" in capsys.readouterr().out
    assert np.load(out).shape == (2708,) and not (tmp_path / "preds.out.npy").exists()
    assert np.load(tmp_path / "preds-embeddings.out").shape == (2708, 16)
    assert main(["predict", "--model", str(model), "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "is a directory; give a file name")
    assert main(["predict", "--model", str(model), "--out", f"{tmp_path}/new/"]) == 2
    one_line_error(capsys, "names a directory; give a file name")
    assert main(["predict", "--model", str(model), "--out", str(out), "--embeddings",
                 str(out)]) == 2
    one_line_error(capsys, "the file --out writes")
    assert np.load(out).shape == (2708,)  # the predictions are still there
    # a model without a hidden layer has no embeddings: refused before anything is written
    one = tmp_path / "one.pt"
    assert main(["train", "--epochs", "1", "--progress", "off", "--layers", "1",
                 "--save-model", str(one)]) == 0
    capsys.readouterr()
    assert main(["predict", "--model", str(one), "--out", str(tmp_path / "p1.npy"),
                 "--embeddings"]) == 2
    assert not (tmp_path / "p1.npy").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


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


def test_more_inputs_that_are_one_line(root, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    np.save(tmp_path / "x.npy", np.zeros(3))
    cases = [
        (["train", "--strategy", "data", "--workers", "2", "--epochs", "1",
          "--partition-file", str(tmp_path / "x.npy")], "an .npy array, not an .npz archive"),
        (["train", "--strategy", "tensor", "--nn-device", "gpu"], "expected cpu, cuda or cuda:N"),
        (["datasets", "--root", str(afile)], "is a file, not a directory"),
        (["generate", "rmat", "--vertices", "0"],
         "--vertices: out of range; found 0; expected an integer"),
        (["generate", "sbm", "--vertices", "3"], "--vertices: out of range; found 3"),
        (["generate", "sbm", "--vertices", "50", "--avg-degree", "60"],
         "--avg-degree: out of range; found 60.0; expected at most 49"),
        (["generate", "rmat", "--vertices", "50", "--memory", "0"],
         "--memory: out of range; found 0"),
        (["generate", "rmat", "--vertices", "99999999999999", "--edges", "10"],
         "--vertices: 99999999999999 vertices need about"),
        (["generate", "rmat", "--vertices", "50", "--edges", "200000", "--memory", "64"],
         "--memory: 64 (64 bytes) holds the sort keys of 8 edges, so 200000 edges would be "
         "drawn over 25000 times"),
        (["train", "--strategy", "data", "--workers", "2", "--partitioner", "random",
          "--partition-seed", "-1"], "--partition-seed: got -1; expected an integer in [0, 2**63)"),
        (["train", "--seed", "99999999999999999999"], "error: --seed: got 99999999999999999999"),
        (["train", "--split-seed", "-2"], "error: --split-seed: got -2"),
        (["train", "--timeout", "inf"], "error: --timeout: got inf; expected seconds in [1, "),
        (["train", "--timeout", "0.4"], "error: --timeout: got 0.4"),
        (["generate", "rmat", "--vertices", "9", "--rmat", "-1", "1", "0.5", "0.5"],
         "found a = -1.0"),
        (["train", "--model", "gat", "--heads", "0"], "error: --heads: got 0; expected >= 1"),
        (["evaluate", "--model", str(tmp_path)], "is a directory, not a model file"),
        (["evaluate", "--model", str(afile)], "not a whole file of torch.save"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        one_line_error(capsys, needle)
    for argv in (["generate", "rmat", "--vertices", "9", "--seed", "-3"],
                 ["partition", "--parts", "2", "--seed", "-5"],
                 ["partition", "--parts", "2", "--split-seed", "x"]):
        with pytest.raises(SystemExit) as stop:  # argparse's own usage error
            main(argv)
        assert stop.value.code == 2
        assert "expected an integer in [0, 2**63)" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--backend", "nccl", "--strategy", "data"], "'nccl' needs CUDA devices"),
    (["--strategy", "tensor", "--shares", "1,2,3"], "gives 3 shares for 2 workers"),
    (["--model", "gin", "--batch-norm", "--strategy", "p2p"], "batch normalisation"),
    (["--strategy", "tensor", "--spill-dir", "spill", "--model", "gat"], "edge weights"),
    (["--strategy", "tensor", "--device-memory", "1KB"],
     "cannot hold vertex 1358 with its 169 in-edges (8160 bytes at 8 columns); raise "
     "--device-memory"),
    (["--strategy", "task", "--task-device-memory", "1KB"],
     "(13600 bytes at 16 columns); raise --task-device-memory"),
])
def test_what_a_strategy_refuses_is_found_before_launch(root, capsys, monkeypatch, args,
                                                        needle):
    from fullgraph import launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    assert main(["train", "--workers", "2", "--epochs", "1", *args]) == 2
    one_line_error(capsys, needle)


def test_options_without_effect_warn(root):
    with pytest.warns(UserWarning, match="--staleness, --slack have no effect without --adapt "
                                         "adjust\\+partial"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--staleness", "5",
                     "--slack", "0.9"]) == 0
    with pytest.warns(UserWarning, match="--run-dir and --keep-run-dir have no effect with "
                                         "one worker"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--run-dir", "rd"]) == 0
    with pytest.warns(UserWarning, match="--residual has no effect here: .* no layer of this "
                                         "model does \\(1433 features, --hidden 16, 7 classes"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--residual"]) == 0
    from fullgraph.partition import PartitionOptions

    with pytest.warns(UserWarning, match="--partitioner chunk / --partition-seed 0 have no "
                                         "effect with --partition-file b.npz"):
        PartitionOptions(method="chunk", file="b.npz")
    from fullgraph.config import ModelConfig

    with pytest.warns(UserWarning, match="--heads, --out-heads have no effect with --decoupled: "
                                         "the decoupled gat computes one attention head"):
        ModelConfig(name="gat", decoupled=True, heads=2, out_heads=3)


def test_a_checkpoint_file_may_be_given_for_its_directory(root, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    base = ["train", "--epochs", "4", "--progress", "off", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2"]
    assert main(base[:2] + ["2"] + base[3:]) == 0
    capsys.readouterr()
    assert main(base + ["--resume", str(ckpt / "checkpoint.pt")]) == 0
    assert "2 epochs (3-4, after the checkpoint) in" in capsys.readouterr().out


def test_a_split_without_vertices_is_reported_as_not_applicable(root, capsys):
    assert main(["generate", "rmat", "--vertices", "3", "--edges", "20", "--name", "tiny"]) == 0
    assert main(["train", "--dataset", "tiny", "--epochs", "2", "--progress", "off"]) == 0
    out = capsys.readouterr().out
    assert "nan%" not in out and "n/a" in out


def test_a_partition_book_is_readable_by_others(root, tmp_path):
    import os
    import stat

    book = tmp_path / "book.npz"
    assert main(["partition", "--parts", "2", "--partitioner", "chunk", "--out", str(book)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(book.stat().st_mode) == 0o666 & ~umask


def test_flags_are_not_abbreviated(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--epoch", "1"])
    assert exit_.value.code == 2
    one_line_error(capsys, "unrecognized arguments: --epoch 1 (see fullgraph train --help)")


def test_convert_options_of_another_format_warn(root, tmp_path):
    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    np.save(tmp_path / "x.npy", np.ones((3, 2), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.array([0, 1, 0]))
    with pytest.warns(UserWarning, match="convert edgelist: --input has no effect"):
        assert main(["convert", "edgelist", "--name", "g", "--edges", str(tmp_path / "e.txt"),
                     "--features", str(tmp_path / "x.npy"), "--labels",
                     str(tmp_path / "y.npy"), "--input", "somewhere"]) == 0


def test_resuming_a_finished_run_says_no_epoch_ran(root, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--epochs", "2", "--progress", "off", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv + ["--resume", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "no epochs after the checkpoint of epoch 2" in out and "nan" not in out, out


def test_tensor_shares_and_spill_are_checked_for_the_whole_run(tmp_path):
    """The shares are one per worker; the spill check alone does not count them."""
    from fullgraph.config import config_from_dict
    from fullgraph.models import build_model
    from fullgraph.parallel.base import get_strategy

    cfg = config_from_dict({"tensor_parallel": {"shares": "1,3",
                                                "spill_dir": str(tmp_path / "spill")}})
    strategy = get_strategy("tensor").from_sections(cfg.options)
    strategy.check_launch(build_model("gcn", 8, 4, 3), 100, 2)
    with pytest.raises(ValueError, match="gives 2 shares for 3 workers"):
        strategy.check_launch(build_model("gcn", 8, 4, 3), 100, 3)
    with pytest.raises(ValueError, match="edge weights"):
        strategy.check_launch(build_model("gat", 8, 4, 3), 100, 2)


def test_more_threads_than_cores_warn(root, monkeypatch):
    from fullgraph import launch

    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    with pytest.warns(UserWarning, match="--threads 4 x 1 worker\\(s\\) on 2 cores"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--threads", "4"]) == 0


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys):
    """YAML and JSON parsers keep the last of two equal keys: the first would be lost."""
    for name, text in (("dup.yaml", "model: gcn\nepochs: 3\nmodel: gat\n"),
                       ("dup.json", '{"train": {"lr": 0.1, "lr": 0.2}}')):
        path = tmp_path / name
        path.write_text(text)
        assert main(["config", "--print", "--config", str(path)]) == 2
        one_line_error(capsys, "is given twice")


def test_a_bad_value_from_a_config_file_names_the_file(tmp_path, capsys):
    cfg = tmp_path / "neg.toml"
    cfg.write_text("[train]\nepochs = -3\n")
    assert main(["train", "--config", str(cfg)]) == 2
    one_line_error(capsys, f"{cfg}: train.epochs: got -3")
    assert main(["train", "--config", str(cfg), "--epochs", "-4"]) == 2  # the flag's value
    assert str(cfg) not in one_line_error(capsys, "error: --epochs: got -4")


def test_a_split_seed_without_effect_is_said_once_at_training(root, tmp_path, capsys):
    """Cora's split is public: train warns of --split-seed; evaluate, which reloads the
    data with the model's seed and has no such option, does not say it again."""
    model = tmp_path / "m.pt"
    with pytest.warns(UserWarning, match="--split-seed has no effect on dataset 'cora'"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--split-seed", "3",
                     "--save-model", str(model)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["evaluate", "--model", str(model)]) == 0


def test_generate_names_the_options_of_the_other_generator(root):
    with pytest.warns(UserWarning, match=r"generate sbm: --edges, --symmetrize have no "
                      r"effect on sbm \(only on rmat\)"):
        assert main(["generate", "sbm", "--vertices", "60", "--classes", "2", "--name", "s",
                     "--edges", "500", "--no-symmetrize"]) == 0
    with pytest.warns(UserWarning, match=r"--homophily has no effect on rmat \(only on sbm"):
        assert main(["generate", "rmat", "--vertices", "60", "--edges", "300", "--name", "r",
                     "--homophily", "0.5"]) == 0
    with pytest.warns(UserWarning, match="below --avg-degree 50"):  # possible, not as asked
        assert main(["generate", "sbm", "--vertices", "60", "--classes", "2", "--name", "d",
                     "--avg-degree", "50"]) == 0


def test_shards_of_a_fixed_split_take_any_split_seed_with_a_warning(root, tmp_path):
    """Cora's split is public: shards written with --split-seed record none, and train
    with any seed, warning as the unsharded dataset does."""
    shards = tmp_path / "shards"
    with pytest.warns(UserWarning, match="--split-seed has no effect on dataset 'cora'"):
        assert main(["partition", "--parts", "2", "--split-seed", "5", "--partitioner", "chunk",
                     "--shards", str(shards)]) == 0
    assert json.loads((shards / "shards.json").read_text())["split_seed"] is None
    from fullgraph.graph.store import load_shard

    assert load_shard(shards, 0, split_seed=0).shard is not None
    with pytest.warns(UserWarning, match="--split-seed has no effect on the shards"):
        load_shard(shards, 1, split_seed=5)


def test_plan_ignores_a_files_options_it_does_not_take(tmp_path):
    import warnings as w

    from fullgraph import exactness
    from fullgraph.cli import build_parser, config_from_args

    f = tmp_path / "run.yaml"
    f.write_text("checkpoint-every: 5\nstrategy: tensor\nepochs: 3\n")
    args = build_parser().parse_args(["plan", "--config", str(f)])
    with w.catch_warnings():
        w.simplefilter("error")  # (--checkpoint-every without --checkpoint-dir warned)
        cfg = config_from_args(args, ignored=exactness.NOT_TAKEN)
    assert (cfg.train.checkpoint_every, cfg.runtime.strategy, cfg.train.epochs) == \
        (10, "single", 3)


def test_a_yaml_file_keeps_yaml_1_1_switch_words_and_reads_decimals(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("pipeline: yes\nnormalize-features: on\nprogress: off\nepochs: 010\n"
                 "lr: .5e-1\nhidden: 1_6\n")
    tree = printed_config(capsys, "--config", str(f))
    assert tree["tensor_parallel"]["pipeline"] is True
    assert tree["data"]["normalize_features"] is True and tree["train"]["progress"] == "off"
    assert (tree["train"]["epochs"], tree["train"]["lr"], tree["model"]["hidden"]) == \
        (10, 0.05, 16)


@pytest.mark.parametrize("argv, needle", [
    (["--timeout", "0"], "error: --timeout: got 0.0; expected seconds"),
    (["--model", "mlp"], "error: --model: got 'mlp'; expected gcn"),
    (["--resume", "nowhere"], "error: --resume: no checkpoint in nowhere"),
])
def test_a_flags_bad_value_is_named_by_the_flag(root, capsys, argv, needle):
    """The user typed the flag: the error names it, not the option's config key."""
    assert main(["train", "--epochs", "1", *argv]) == 2
    one_line_error(capsys, needle)


def test_the_readme_config_file_runs_as_it_shows(tmp_path, capsys):
    """README's example sets options of data parallelism: it must choose it too."""
    flat = tmp_path / "run.yaml"
    flat.write_text(README_YAML)
    import yaml

    assert README_YAML in Path(__file__).parents[1].joinpath("README.md").read_text()
    assert main(["config", "--print", "--config", str(flat)]) == 0
    out, err = capsys.readouterr()
    tree = yaml.safe_load(out)
    assert (tree["runtime"]["strategy"], tree["launch"]["workers"]) == ("data", 2)
    assert "no effect" not in err, err


def test_a_model_that_cannot_be_written_leaves_no_summary(root, tmp_path, capsys,
                                                           monkeypatch):
    """A full disk under --save-model: one line naming the file and the OS's reason, exit
    2, and the metrics file does not end in the summary of a finished run."""
    import torch

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if not str(getattr(f, "name", "")).endswith(".tmp"):
            return real_save(obj, f, *args, **kwargs)
        try:
            raise OSError(27, "File too large")
        except OSError as exc:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from exc

    monkeypatch.setattr(torch, "save", full_disk)
    model, metrics = tmp_path / "model.pt", tmp_path / "run.jsonl"
    assert main(["train", "--epochs", "2", "--save-model", str(model), "--metrics-out",
                 str(metrics), "--progress", "off"]) == 2
    one_line_error(capsys, f"error: {model}: file too large")
    events = [json.loads(line)["event"] for line in metrics.read_text().splitlines()]
    assert events[-1] == "epoch" and "summary" not in events, events
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run.jsonl"]


def test_a_shards_directory_is_checked_before_the_partition_is_made(root, tmp_path, capsys):
    """Before loading and partitioning, and before --out is written; an unwritable one is
    named as given (it was named by an internal temporary directory)."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    book = tmp_path / "book.npz"
    assert main(["partition", "--dataset", "cora", "--parts", "2", "--out", str(book),
                 "--shards", str(taken)]) == 2
    assert "exists and is not a shard set" in capsys.readouterr().err and not book.exists()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # (root writes anywhere)
            return
        assert main(["partition", "--dataset", "cora", "--parts", "2", "--shards",
                     str(locked / "sh")]) == 2
        assert f"--shards {locked / 'sh'}: " in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_a_shard_set_in_the_dataset_root_is_found_by_its_name(root, capsys):
    """It was refused as holding part-* folders but no shards.json, which it holds."""
    from fullgraph.graph import datasets

    assert main(["partition", "--dataset", "cora", "--parts", "2", "--shards",
                 str(root / "corash")]) == 0
    part = datasets.load("corash", root, part=1)
    assert part.shard is not None and part.shard.parts == 2


def test_checks_reference_run_does_not_warn_of_the_checked_strategys_options(tmp_path):
    """``check --strategies tensor --spill-dir D`` said "--spill-dir ... no effect with
    --strategy single": its one-process reference run was given the tensor options."""
    import warnings as w

    from fullgraph import exactness
    from fullgraph.cli import build_parser, config_from_args
    from fullgraph.parallel import build_strategy

    args = build_parser().parse_args(["check", "--strategies", "tensor", "--spill-dir",
                                      str(tmp_path), "--spill-memory", "64KB", "--task-split",
                                      "1:1", "--hidden", "8"])
    cfg = config_from_args(args, ignored=exactness.NOT_TAKEN)
    reference = exactness._reference(cfg)
    with w.catch_warnings():
        w.simplefilter("error")
        build_strategy(reference)
    assert reference.model.hidden == 8 and reference.options["tensor_parallel"].spill_dir is None


@pytest.mark.parametrize("argv, needle", [
    (["train", "--save-model", "{d}/r.out", "--metrics-out", "{d}/r.out"],
     "--metrics-out {d}/r.out: the file --save-model writes"),
    (["train", "--checkpoint-dir", "{d}/ck", "--save-model", "{d}/ck/checkpoint.pt"],
     "--checkpoint-dir {d}/ck/checkpoint.pt: the file --save-model writes"),
    (["train", "--save-model", "~/book.npz", "--partition-file", "{d}/book.npz"],
     "the file --partition-file reads"),  # (~ is {d} here)
    (["predict", "--model", "{d}/m.pt", "--out", "{d}/m.pt"],
     "--out {d}/m.pt: the file --model reads"),
    (["predict", "--model", "{d}/m.pt", "--out", "{d}/p.npy", "--embeddings", "{d}/p.npy"],
     "--embeddings {d}/p.npy: the file --out writes"),
])
def test_an_output_over_an_input_or_another_output_is_refused(root, tmp_path, capsys, argv,
                                                              needle, monkeypatch):
    """They were written over each other without a word: predict replaced its own model
    with the predictions, --save-model the run's checkpoint or its metrics."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.pt").write_bytes(b"a model")
    (tmp_path / "book.npz").write_bytes(b"a partition")
    argv = [a.format(d=tmp_path) for a in argv]
    assert main(argv + (["--epochs", "1"] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err
    assert needle.format(d=tmp_path) in err and err.count("\n") == 1, err
    assert (tmp_path / "m.pt").read_bytes() == b"a model"


def test_predictions_into_a_pipe_go_through_it(root, tmp_path, capsys):
    """The pipe was replaced by a regular file (a temporary renamed over it), and its
    reader waited forever."""
    import threading

    import numpy as np

    assert main(["train", "--epochs", "1", "--save-model", str(tmp_path / "m.pt"),
                 "--progress", "off", "-q"]) == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["predict", "--model", str(tmp_path / "m.pt"), "--out", str(fifo)]) == 0
    reader.join(30)
    assert got and np.load(__import__("io").BytesIO(got[0])).shape == (2708,)
    assert not fifo.is_file()


def test_a_partition_book_of_another_graph_of_the_same_size_is_refused(root, tmp_path,
                                                                        capsys):
    """Only the vertex count was checked: a book made for another graph of as many
    vertices partitioned this one as it never meant to, without a word."""
    from fullgraph.graph import store
    from fullgraph.graph.synthetic import sbm

    for name, seed in (("one", 1), ("other", 2)):
        store.save_dataset(sbm(90, 3, avg_degree=4.0, num_features=6, seed=seed),
                           tmp_path / name)
    book = tmp_path / "book.npz"
    assert main(["partition", "--dataset", str(tmp_path / "one"), "--parts", "2", "--out",
                 str(book)]) == 0
    capsys.readouterr()
    train = ["train", "--strategy", "data", "--workers", "2", "--epochs", "1",
             "--partition-file", str(book), "--dataset"]
    assert main(train + [str(tmp_path / "other")]) == 2
    one_line_error(capsys, "was made for another graph of 90 vertices (its edges differ)")


def test_predict_writes_the_format_its_file_names_and_the_class_scores(root, tmp_path,
                                                                      capsys):
    """.csv and .pt files were .npy bytes, and the class scores could not be had."""
    import torch

    model = tmp_path / "m.pt"
    assert main(["train", "--epochs", "2", "--progress", "off", "--save-model", str(model),
                 "-q"]) == 0
    assert main(["predict", "--model", str(model), "--out", str(tmp_path / "p.npy"),
                 "--scores", str(tmp_path / "s.npy")]) == 0
    pred, scores = np.load(tmp_path / "p.npy"), np.load(tmp_path / "s.npy")
    assert scores.shape == (2708, 7) and (scores.argmax(1) == pred).all()
    assert main(["predict", "--model", str(model), "--out", str(tmp_path / "p.csv"),
                 "--scores", str(tmp_path / "s.csv"), "--embeddings"]) == 0
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0] == "vertex,class" and lines[1:] == [f"{i},{c}" for i, c in enumerate(pred)]
    table = np.loadtxt(tmp_path / "s.csv", delimiter=",", skiprows=1)
    assert (tmp_path / "s.csv").read_text().startswith("vertex,class_0,class_1,")
    np.testing.assert_allclose(table[:, 1:], scores, rtol=1e-6, atol=1e-7)
    assert np.loadtxt(tmp_path / "p-embeddings.csv", delimiter=",", skiprows=1).shape == \
        (2708, 17)
    assert main(["predict", "--model", str(model), "--out", str(tmp_path / "p.txt"),
                 "--scores", str(tmp_path / "s.pt")]) == 0
    assert (np.loadtxt(tmp_path / "p.txt", dtype=np.int64) == pred).all()
    assert torch.equal(torch.load(tmp_path / "s.pt"), torch.from_numpy(scores))


def test_shards_written_over_a_shard_set_say_they_replace_it(root, tmp_path, capsys):
    shards = tmp_path / "shards"
    for parts in ("3", "2"):
        assert main(["partition", "--parts", parts, "--partitioner", "chunk", "--shards",
                     str(shards)]) == 0
        said = capsys.readouterr().out
        assert ("(replacing the shard set that was there)" in said) == (parts == "2"), said
    assert main(["datasets", str(shards)]) == 0  # described as the shards they are
    assert capsys.readouterr().out.startswith("    shards: 2 per-part shards with 0 hops")


@pytest.mark.parametrize("gpus, args, needle", [
    (2, ["--device", "cuda:1", "--workers", "2"], "--device: 'cuda:1' names one GPU for each "
     "of this host's 2 workers; use --device cuda (each worker takes its local rank's GPU)"),
    (2, ["--device", "cuda:5"], "--device: got 'cuda:5' but this host has 2 GPUs visible "
     "(cuda:0 to cuda:1)"),
    (1, ["--device", "cuda", "--backend", "nccl", "--workers", "2"],
     "--backend: 'nccl' needs a GPU for each worker, and this host has 1 for --workers 2"),
])
def test_gpus_a_run_cannot_have_are_refused_before_launch(root, capsys, monkeypatch, gpus,
                                                          args, needle):
    """On a host of (fake) GPUs: these were accepted and failed in every worker."""
    import torch

    from fullgraph import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    assert main(["train", "--epochs", "1", "--strategy", "data", *args]) == 2
    one_line_error(capsys, needle)


@pytest.mark.parametrize("args, needle", [
    (["--checkpoint-dir", ""], "--checkpoint-dir: got an empty value ''; leave the option out"),
    (["--resume", ""], "--resume: got an empty value ''"),
    (["--metrics-out", " "], "--metrics-out: got an empty value ' '"),
    (["--strategy", "tensor", "--spill-dir", ""], "--spill-dir: got an empty value ''"),
])
def test_an_empty_path_is_refused_not_read_as_here_or_unset(root, capsys, args, needle):
    """``--checkpoint-dir "$CKPT"`` with $CKPT unset wrote checkpoint.pt into the working
    directory, ``--resume ''`` resumed from whatever was there, and an empty
    ``--metrics-out`` or ``--save-model`` was taken as not given."""
    assert main(["train", "--epochs", "1", *args]) == 2
    one_line_error(capsys, needle)
    assert not Path("checkpoint.pt").exists()


def test_a_config_files_debug_level_gives_the_traceback(root, tmp_path, capsys):
    """`log-level: debug` in a file printed as the flag does, but gave no traceback."""
    (tmp_path / "d.yaml").write_text("log-level: debug\ndataset: nothing-here\n")
    assert main(["train", "--config", str(tmp_path / "d.yaml")]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--strategy", "data", "--dep-mode", "hybrid", "--byte-cost", "-1"],
     "error: --byte-cost: must be a finite number >= 0, got -1.0"),
    (["--strategy", "task", "--task-gamma", "3"], "error: --task-gamma: must be in [0, 1]"),
    (["--strategy", "tensor", "--device-memory", "lots"],
     "error: --device-memory: cannot read 'lots' as a size"),
    (["--strategy", "data", "--partition-seed", "-1"], "error: --partition-seed: got -1"),
])
def test_a_strategy_options_error_names_its_flag(root, capsys, args, needle):
    """They named the section and the field (``command line: data_parallel: data
    parallel byte_cost must be ...``)."""
    assert main(["train", "--epochs", "1", *args]) == 2
    one_line_error(capsys, needle)


def test_fit_names_a_refused_option_by_its_keyword():
    import fullgraph
    from fullgraph.errors import ConfigError

    for kwargs, said in ((dict(strategy="data", dep_mode="depcach"), "fit: dep_mode: got "),
                         (dict(dropout=1.5), "fit: dropout: got 1.5"),
                         (dict(strategy="data", dep_mode="hybrid", byte_cost=-1),
                          "fit: byte_cost: must be a finite number")):
        with pytest.raises(ConfigError) as err:
            fullgraph.fit("cora", epochs=1, **kwargs)
        assert str(err.value).startswith(said), err.value


def test_printed_configs_load_back_unchanged_in_every_format(root, tmp_path, capsys):
    """A text that YAML 1.2 reads as a number (``1e3``, ``007``) was printed unquoted
    and loaded back as another text (``'1000.0'``); JSON could not be printed."""
    given = ["--dataset", "1e3", "--metrics-out", "2e5", "--checkpoint-dir", "007",
             "--epochs", "7"]
    for fmt in ("yaml", "toml", "json"):
        assert main(["config", "--print", "--format", fmt, *given]) == 0
        first = capsys.readouterr().out
        (tmp_path / f"c.{fmt}").write_text(first)
        assert main(["config", "--print", "--format", fmt, "--config",
                     str(tmp_path / f"c.{fmt}")]) == 0
        assert capsys.readouterr().out == first, fmt
    assert json.loads(first)["data"]["dataset"] == "1e3"


def test_config_file_spellings_a_user_would_try(root, tmp_path, capsys):
    """``quiet: true`` was refused as no train flag, a second --config silently
    replaced the first, and --partition-seed with the chunk partitioner was ignored."""
    (tmp_path / "q.yaml").write_text("quiet: true\n")
    assert printed_config(capsys, "--config", str(tmp_path / "q.yaml"))["train"][
        "log_level"] == "warning"
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "q.yaml"), "--config",
              str(tmp_path / "q.yaml")])
    assert "--config given twice" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="--partition-seed 3 has no effect with --partitioner "
                                         "chunk"):
        printed_config(capsys, "--partitioner", "chunk", "--partition-seed", "3")


def test_a_bad_integer_in_the_environment_is_named(root, capsys, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_THREADS", "abc")
    assert main(["train", "--epochs", "1", "--progress", "off"]) == 2
    one_line_error(capsys, "environment variable FULLGRAPH_THREADS='abc' is not an integer")


def test_an_empty_options_mapping_and_quiet_false_are_no_options(root, tmp_path, capsys):
    """An empty value is refused, but an empty mapping of model options (a sweep's
    ``model_options={}``, ``options: {}`` in a file) is none, and ``quiet: false`` is
    the level as it is."""
    import fullgraph

    assert fullgraph.fit("cora", epochs=1, model_options={}).config.model.options is None
    (tmp_path / "e.yaml").write_text("model:\n  options: {}\nquiet: false\n")
    printed = printed_config(capsys, "--config", str(tmp_path / "e.yaml"))
    assert printed["model"]["options"] is None and printed["train"]["log_level"] == "info"


@pytest.fixture(scope="module")
def saved_gcn(tmp_path_factory) -> Path:
    """A GCN trained 2 epochs on Cora and saved (its data root is the module's own)."""
    where = tmp_path_factory.mktemp("saved")
    os.environ["FULLGRAPH_DATA"] = str(where / "data")
    try:
        assert main(["train", "--epochs", "2", "--progress", "off", "-q", "--save-model",
                     str(where / "m.pt")]) == 0
    finally:
        del os.environ["FULLGRAPH_DATA"]
    return where


def test_outputs_through_a_symbolic_link_write_its_target(saved_gcn, tmp_path, monkeypatch,
                                                          capsys):
    """A link given as --out was replaced by a regular file and its target never written
    (as root, `--out /dev/stdout` replaced the system's link)."""
    monkeypatch.setenv("FULLGRAPH_DATA", str(saved_gcn / "data"))
    target = tmp_path / "target.npy"
    target.write_bytes(b"old")
    (tmp_path / "link.npy").symlink_to(target)
    assert main(["predict", "--model", str(saved_gcn / "m.pt"), "--out",
                 str(tmp_path / "link.npy")]) == 0
    assert (tmp_path / "link.npy").is_symlink()
    assert np.load(target).shape == (2708,)


def test_predict_into_standard_output_says_what_it_wrote_on_stderr(saved_gcn, tmp_path):
    """`--out /dev/stdout > file` got the "wrote" line after the array's bytes (a link
    of the test's own stands in for /dev/stdout, which the old code replaced)."""
    out, stdout = tmp_path / "preds.npy", tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    with open(out, "wb") as f:
        done = subprocess.run(
            [sys.executable, "-m", "fullgraph", "predict", "--model", str(saved_gcn / "m.pt"),
             "--out", str(stdout)], stdout=f, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "FULLGRAPH_DATA": str(saved_gcn / "data")}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"wrote {stdout}: 2708 class predictions" in done.stderr
    assert np.load(out).shape == (2708,) and stdout.is_symlink()


def test_a_half_precision_model_loads_in_float32(saved_gcn, tmp_path, monkeypatch, capsys):
    import torch

    from fullgraph import load_model

    monkeypatch.setenv("FULLGRAPH_DATA", str(saved_gcn / "data"))
    model = load_model(saved_gcn / "m.pt")
    model.half().save(tmp_path / "half.pt")
    with pytest.warns(UserWarning, match="float16 parameters; they are loaded as float32"):
        again = load_model(tmp_path / "half.pt")
    assert next(again.parameters()).dtype == torch.float32
    with pytest.warns(UserWarning, match="float16"):
        assert main(["evaluate", "--model", str(tmp_path / "half.pt")]) == 0
    assert "test  accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("damage,said", [
    (lambda s: s["model"].update(dtype="int8"), "model.dtype 'int8' is not one of"),
    (lambda s: s.update(model="gcn"), "its model record is not a mapping"),
    (lambda s: s["model"].pop("hidden"), "wrong type for hidden"),
    (lambda s: s.update(trained=[]), "its trained record is not a mapping"),
    (lambda s: s["model"]["options"].update(some_future_option="x"),
     "its options some_future_option are not ones this fullgraph's gcn takes"),
])
def test_a_damaged_model_record_is_one_error(saved_gcn, tmp_path, monkeypatch, capsys,
                                             damage, said):
    import torch

    saved = torch.load(saved_gcn / "m.pt", weights_only=False)
    damage(saved)
    torch.save(saved, tmp_path / "bad.pt")
    monkeypatch.setenv("FULLGRAPH_DATA", str(saved_gcn / "data"))
    assert main(["evaluate", "--model", str(tmp_path / "bad.pt")]) == 2
    one_line_error(capsys, said)


def test_evaluate_neither_makes_a_root_nor_resumes_from_a_saved_model(saved_gcn, tmp_path,
                                                                      capsys):
    assert main(["evaluate", "--model", str(saved_gcn / "m.pt"), "--root",
                 str(tmp_path / "typo")]) == 2
    one_line_error(capsys, "no such directory")
    assert not (tmp_path / "typo").exists()
    assert main(["train", "--epochs", "3", "--resume", str(saved_gcn / "m.pt"),
                 "--progress", "off"]) == 2
    one_line_error(capsys, "is a saved model (--save-model), not a checkpoint")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_files_under_dev_shm_are_replaced_whole_and_links_under_dev_written_into(tmp_path):
    """Every existing file under /dev was written in place, so a checkpoint kept in
    /dev/shm was cut short by a failed write; only links there (/dev/stdout) are."""
    from fullgraph.checkpoint import write_with

    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (shm / "ckpt").write_bytes(b"old" * 1000)
        before = (shm / "ckpt").stat().st_ino
        write_with(shm / "ckpt", lambda f: f.write(b"new"))  # a new file renamed over it
        assert (shm / "ckpt").read_bytes() == b"new" and (shm / "ckpt").stat().st_ino != before
        target = tmp_path / "out.bin"
        target.write_bytes(b"old")
        (shm / "link").symlink_to(target)
        write_with(shm / "link", lambda f: f.write(b"new"))
        assert (shm / "link").is_symlink() and target.read_bytes() == b"new"
    finally:
        shutil.rmtree(shm)


@pytest.mark.dist
def test_a_model_trained_on_shards_is_evaluated_on_the_dataset_they_were_written_from(
        tmp_path, capsys):
    """evaluate refused the shards it was trained on and named the whole dataset without
    its root, so the command it suggested failed too: the shards now record both."""
    root = tmp_path / "root"
    assert main(["generate", "sbm", "--root", str(root), "--vertices", "120",
                 "--name", "sbm"]) == 0
    assert main(["partition", "--root", str(root), "--dataset", "sbm", "--parts", "2",
                 "--shards", str(tmp_path / "shards")]) == 0
    assert main(["train", "--dataset", str(tmp_path / "shards"), "--strategy", "data",
                 "--workers", "2", "--epochs", "2", "--progress", "off", "-q",
                 "--save-model", str(tmp_path / "m.pt")]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tmp_path / "m.pt")]) == 0
    assert ") on sbm" in capsys.readouterr().out
    root.rename(tmp_path / "moved")
    assert main(["evaluate", "--model", str(tmp_path / "m.pt")]) == 2
    one_line_error(capsys, f"the dataset they were written from under --root {root}")
