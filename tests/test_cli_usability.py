"""The command line explains itself: --help, --version, choices, config files in the
flags' names, ``fullgraph config --print``, --quiet / --log-level and exit codes.

A failed worker's exit code (1) is tested with real workers in tests/test_launch.py.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

import fullgraph
from fullgraph.cli import EXIT_CODES, build_parser, config_from_args, main
from fullgraph.config import Config, sections
from fullgraph.configfile import flag_names, normalize
from fullgraph.errors import ConfigError


def train_parser(parser=None):
    parser = parser or build_parser()
    return parser._subparsers._group_actions[0].choices["train"]


def config_actions() -> list:
    return [a for a in train_parser()._actions if a.dest.count(".") == 1 and a.help
            and "--quiet" not in a.option_strings]


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def test_every_option_has_help_choices_and_its_default_once(capsys):
    actions = config_actions()
    assert len(actions) == len(flag_names())
    for action in actions:
        assert action.help.count("(default: ") == 1, action.option_strings
        assert "None" not in action.help and "\n" not in action.help, action.help
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "(default: None)" not in text
    assert "--model {gcn,sage,gat,gin,tagcn,module:Class,file.py:Class}" in text
    assert "--dep-mode {depcomm,depcache,hybrid}" in text
    assert "config section [data_parallel]" in text and "exit codes:" in text


def test_choices_are_read_from_the_registries(monkeypatch):
    import fullgraph.models as models
    from fullgraph.parallel import STRATEGIES
    from fullgraph.parallel.data import MODES
    from fullgraph.partition import PARTITIONERS
    from fullgraph.schedule.bins import SCHEDULES

    monkeypatch.setitem(models.MODELS, "toy", models.GCN)
    monkeypatch.setitem(PARTITIONERS, "mine", PARTITIONERS["chunk"])
    choices = {a.option_strings[0]: a.choices for a in config_actions()}
    model = next(a for a in config_actions() if a.option_strings[0] == "--model")
    assert choices["--model"] is None  # a user's class is accepted too: listed, not enforced
    assert model.metavar == "{%s,module:Class,file.py:Class}" % ",".join(models.MODELS)
    assert list(choices["--partitioner"]) == list(PARTITIONERS)
    assert list(choices["--strategy"]) == [*STRATEGIES, "auto"]  # auto: the planner's choice
    assert list(choices["--dep-mode"]) == list(MODES)
    assert list(choices["--p2p-schedule"]) == list(SCHEDULES)


@pytest.mark.parametrize("argv,needle", [
    (["train", "--partitioner", "metiss"], "'chunk', 'random', 'metis', 'g3'"),
    (["train", "--dep-mode", "cache"], "'depcomm', 'depcache', 'hybrid'"),
    (["train", "--epochs", "ten"], "--epochs: invalid int value: 'ten'"),
    (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["trian"], "invalid choice: 'trian'"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_unknown_choice_in_a_config_file_lists_the_valid_ones(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[partition]\nmethod = "metiss"\n')
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "partition.method: got 'metiss'; expected one of chunk, random, metis, g3" in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fullgraph {fullgraph.__version__}"
    with pytest.raises(SystemExit) as exit_:  # among other options, argparse's action
        main(["--version", "--help"])
    assert exit_.value.code == 0


def test_version_does_not_load_torch():
    import subprocess
    import sys

    code = ("import sys; from fullgraph.cli import main; main(['--version']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == ["fullgraph", fullgraph.__version__, "False"]


def test_ctrl_c_before_the_command_starts_is_one_line(monkeypatch, capsys):
    """While torch loads or the flags are parsed (a traceback from inside the imports
    before)."""
    from fullgraph import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "fullgraph: interrupted\n"


def test_python_m_fullgraph_runs_the_command_line():
    """For an environment whose scripts are not on the PATH, and ``torchrun -m``."""
    import subprocess
    import sys

    version = subprocess.run([sys.executable, "-m", "fullgraph", "--version"],
                             capture_output=True, text=True, check=True, timeout=60)
    assert version.stdout.strip() == f"fullgraph {fullgraph.__version__}"
    bad = subprocess.run([sys.executable, "-m", "fullgraph", "train", "--epochs", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--epochs" in bad.stderr and "Traceback" not in bad.stderr


def test_every_flag_names_its_option_in_a_config_file():
    for (section, field), flag in flag_names().items():
        for spelled in (flag, flag.replace("-", "_")):
            assert normalize({spelled: 1}, "f") == {section: {field: 1}}, spelled
            assert normalize({section: {spelled: 1}}, "f") == {section: {field: 1}}, spelled


def _config(argv: list[str]) -> Config:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_config_file_in_flag_names_and_old_names(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: gat\ndep-mode: hybrid\ntimeout: 30\npartitioner: chunk\n"
                    "partition_seed: 3\np2p-schedule: sequential\nepochs: 2\n")
    old = tmp_path / "old.yaml"
    old.write_text("model: {name: gat}\ndata_parallel: {mode: hybrid}\nlaunch: {timeout_s: 30}\n"
                   "partition: {method: chunk, seed: 3}\np2p: {schedule: sequential}\n"
                   "train: {epochs: 2}\n")
    flags = ["--model", "gat", "--dep-mode", "hybrid", "--timeout", "30", "--partitioner",
             "chunk", "--partition-seed", "3", "--p2p-schedule", "sequential", "--epochs", "2"]
    expected = _config(flags)
    assert expected != Config()
    assert _config(["--config", str(flat)]) == expected
    assert _config(["--config", str(old)]) == expected
    twice = tmp_path / "twice.yaml"
    twice.write_text("model: {name: gcn}\ndataset: cora\nmodel_: 1\ndata: {dataset: x}\n")
    with pytest.raises(ConfigError, match="data.dataset is given twice"):
        _config(["--config", str(twice)])


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
@pytest.mark.parametrize("flags", [[], ["--model", "gat", "--root", "/data", "--dep-mode",
                                        "hybrid", "--byte-cost", "1e-9", "--progress", "off",
                                        "--pipeline", "--threads", "2"]])
def test_config_print_is_complete_and_loads_back(tmp_path, capsys, fmt, flags):
    assert main(["config", "--print", "--format", fmt, *flags]) == 0
    text = capsys.readouterr().out
    for (section, field), flag in flag_names().items():
        assert f"# --{flag}: " in text and re.search(rf"^(# )?\s*{field}\b", text, re.M)
    path = tmp_path / f"printed.{fmt}"
    path.write_text(text)
    assert _config(["--config", str(path)]) == _config(flags)
    for section in sections():
        assert (f"[{section}]\n" if fmt == "toml" else f"\n{section}:\n") in text


def test_quiet_prints_nothing_but_writes_metrics(root, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--epochs", "2", "--quiet", "--metrics-out", str(metrics)]) == 0
    assert capsys.readouterr().out == ""
    events = [json.loads(line)["event"] for line in metrics.read_text().splitlines()]
    assert events == ["run", "epoch", "epoch", "summary"]


def test_log_level_error_hides_warnings_and_debug_shows_tracebacks(root, capsys, recwarn):
    assert main(["train", "--epochs", "1", "--heads", "4", "--log-level", "error"]) == 0
    assert not [w for w in recwarn if "no effect" in str(w.message)]
    assert "final test accuracy" not in capsys.readouterr().out
    with pytest.warns(UserWarning, match="--heads has no effect"):
        assert main(["train", "--epochs", "1", "--heads", "4", "--log-level", "warning"]) == 0
    assert main(["train", "--dataset", "nope", "--log-level", "warning"]) == 2
    capsys.readouterr()
    assert main(["train", "--dataset", "nope", "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "DatasetNotFoundError" in err and "unknown dataset" in err


def test_exit_codes_are_documented():
    readme = (fullgraph_root() / "README.md").read_text()
    for code in re.findall(r"^  (\d+) ", EXIT_CODES, re.M):
        assert re.search(rf"^\| `?{code}`? \|", readme, re.M), f"README lacks exit code {code}"


def fullgraph_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


def test_options_declare_their_help_in_their_own_dataclass():
    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{section}.{f.name} has no help metadata"


def test_offline_dataset_error_lists_every_missing_file_at_once(root, tmp_path, capsys,
                                                                monkeypatch):
    from fullgraph.graph.formats import download

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for suffix in ("x", "y"):  # two of the eight files can be had; the other six cannot
        (mirror / f"ind.citeseer.{suffix}").write_bytes(b"stub")
    monkeypatch.setattr(download, "PLANETOID_URL", mirror.as_uri())
    assert main(["train", "--dataset", "citeseer", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot download 6 of 8 raw files" in err
    listed = err.split(f"place them in {root / 'citeseer' / 'raw'}: ")[1]
    missing = {f"ind.citeseer.{s}" for s in download.PLANETOID_SUFFIXES} - {
        "ind.citeseer.x", "ind.citeseer.y"}
    assert set(listed.rstrip(")\n").split(", ")) == missing


def test_neutronstar_files_as_convert_help_describes_them(root, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", "neutronstar", "--help"])
    text = capsys.readouterr().out
    assert "NeutronStar / NeutronTask four-file format" in text
    assert "unsigned 32-bit integer (8 bytes per edge)" in text and '"eval" is read as val' in text
    import numpy as np

    from fullgraph.graph import datasets

    np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], dtype="<u4").tofile(tmp_path / "g.edge")
    (tmp_path / "g.feature").write_text("2 0.5 1\n0 1 0\n3 0 0.25\n1 1 1\n")  # any order
    (tmp_path / "g.label").write_text("0 0\n1 1\n3 1\n")  # vertex 2 unlabelled
    (tmp_path / "g.mask").write_text("0 train\n1 eval\n3 test\n")
    files = [f"--{kind}={tmp_path / ('g.' + ext)}" for kind, ext in (
        ("edges", "edge"), ("features", "feature"), ("labels", "label"), ("masks", "mask"))]
    for name, flags, edges in (("ns", [], 5), ("nssym", ["--symmetrize"], 10)):
        assert main(["convert", "neutronstar", "--name", name, *files, *flags]) == 0
        ds = datasets.load(name, root)
        assert (ds.graph.num_nodes, ds.graph.num_edges) == (4, edges)
        assert ds.data.features[2].tolist() == [0.5, 1.0] and ds.data.labels.tolist() == [
            0, 1, -1, 1]
        assert ds.data.val_mask.tolist() == [False, True, False, False]
    assert main(["convert", "neutronstar", "--name", "x", *files, "--binary", "int64"]) == 2
    assert "always uint32 pairs" in capsys.readouterr().err


def test_final_test_accuracy_says_what_it_is(root, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--epochs", "3", "--progress", "off", "--metrics-out",
                 str(metrics)]) == 0
    summary = json.loads(metrics.read_text().splitlines()[-1])
    line = [x for x in capsys.readouterr().out.splitlines() if "final test accuracy" in x]
    assert line == [line[0]] and line[0].startswith(
        f"final test accuracy {summary['test_acc']:.2%} (test accuracy at epoch "
        f"{summary['best_epoch']}, the best validation accuracy); 3 epochs in ")


def test_readme_lists_every_key_that_differs_from_its_flag():
    readme = (fullgraph_root() / "README.md").read_text()
    row = r"^\| `--([a-z0-9-]+)` \| `([a-z0-9_]+)\.([a-z0-9_]+)` \|$"
    rows = set(re.findall(row, readme, re.M))
    differ = {(flag, section, field) for (section, field), flag in flag_names().items()
              if flag != field.replace("_", "-")}
    assert rows == differ


def test_a_stopped_run_says_where_its_last_checkpoint_is(monkeypatch, tmp_path, capsys):
    """Ctrl-C in epoch 3 of a run that checkpoints: the run said only "interrupted",
    not that epoch 2's checkpoint was there to go on from."""
    from fullgraph import report

    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    epoch = report.Reporter.epoch

    def stopped_at_3(self, rec):
        if rec.epoch == 3:
            raise KeyboardInterrupt
        epoch(self, rec)

    monkeypatch.setattr(report.Reporter, "epoch", stopped_at_3)
    ck = tmp_path / "ck"
    assert main(["train", "--epochs", "5", "--progress", "off", "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "1"]) == 130
    err = capsys.readouterr().err
    assert f"its last checkpoint is {ck / 'checkpoint.pt'}; the same command with " \
           "--resume auto goes on from it" in err and err.endswith("fullgraph: interrupted\n")
    # without --checkpoint-dir there is nothing to say
    assert main(["train", "--epochs", "5", "--progress", "off"]) == 130
    assert capsys.readouterr().err == "fullgraph: interrupted\n"
