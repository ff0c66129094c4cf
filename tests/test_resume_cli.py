"""From the command line: a worker killed while writing a checkpoint, the same command
rerun with ``--resume``, and the saved model used by ``evaluate``, ``predict`` and
``fullgraph.load_model``.

The kill is injected with a ``sitecustomize`` module on the workers' PYTHONPATH (the
product code carries no test hooks): rank 0 SIGKILLs itself inside the rename of its
``KILL_AT``-th checkpoint, after the temporary file is written.
"""
from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import events, final_accuracy, run_cli

import fullgraph
from fullgraph.checkpoint import FILE_NAME, read
from fullgraph.cli import main
from fullgraph.config import DataConfig
from fullgraph.graph import datasets
from fullgraph.graph.synthetic import sbm

EPOCHS, KILL_AT = 6, 4
README = Path(__file__).resolve().parents[1] / "README.md"

KILL = textwrap.dedent('''\
    """Test-only: rank 0 kills itself inside the rename of its Nth checkpoint."""
    import os

    _at = os.environ.get("FG_TEST_KILL_AT_WRITE")
    if _at and os.environ.get("RANK") == "0":
        import signal

        _real, _count = os.replace, [0]

        def _replace(src, dst, *args, **kwargs):
            if str(dst).endswith("checkpoint.pt"):
                _count[0] += 1
                if _count[0] == int(_at):
                    os.kill(os.getpid(), signal.SIGKILL)
            return _real(src, dst, *args, **kwargs)

        os.replace = _replace
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The killed run and its rerun with ``--resume``, on a small SBM graph."""
    tmp = tmp_path_factory.mktemp("resume")
    root, site = tmp / "data", tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KILL)
    datasets.save_processed(sbm(300, 4, avg_degree=8.0, num_features=12, seed=0), root, "tiny")
    command = ["train", "--dataset", "tiny", "--epochs", str(EPOCHS), "--dropout", "0.5",
               "--progress", "off", "--timeout", "60", "--strategy", "data", "--workers", "2",
               "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "1",
               "--save-model", str(tmp / "model.pt")]
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    killed = run_cli(command + ["--metrics-out", str(tmp / "killed.jsonl")], root,
                     PYTHONPATH=path, FG_TEST_KILL_AT_WRITE=str(KILL_AT))
    leftovers = sorted(p.name for p in (tmp / "ckpt").iterdir())
    assert not (tmp / "model.pt").exists()
    saved_epoch = read(tmp / "ckpt")["epoch"]
    resumed = run_cli(command + ["--metrics-out", str(tmp / "resumed.jsonl"),
                                 "--resume", str(tmp / "ckpt")], root)
    return tmp, killed, leftovers, saved_epoch, resumed


@pytest.mark.dist
def test_killed_run_resumes_from_the_last_checkpoint(runs):
    tmp, killed, leftovers, saved_epoch, resumed = runs
    assert killed.returncode == 1, killed.stderr
    assert re.search(r"worker rank 0 failed .*signal 9", killed.stderr), killed.stderr
    # killed inside its 4th write: the 3rd checkpoint is whole, the 4th never replaced it
    assert saved_epoch == KILL_AT - 1
    assert FILE_NAME in leftovers and len(leftovers) == 2 and leftovers[0].endswith(".tmp")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (f"resume   from {tmp / 'ckpt'} after epoch {saved_epoch} (saved by strategy data "
            "on 2 worker(s))") in resumed.stdout
    before = {r["epoch"]: r["loss"] for r in events(tmp / "killed.jsonl", "epoch")}
    epochs = events(tmp / "resumed.jsonl", "epoch")
    after = {r["epoch"]: r["loss"] for r in epochs if not r.get("restored")}
    assert sorted(after) == list(range(saved_epoch + 1, EPOCHS + 1))
    assert KILL_AT in before and after[KILL_AT] == before[KILL_AT]  # bit-equal
    # the checkpoint's epochs come first, marked, with the killed run's numbers
    restored = {r["epoch"]: r["loss"] for r in epochs if r.get("restored")}
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))
    assert restored == {e: before[e] for e in range(1, saved_epoch + 1)}
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == [FILE_NAME]  # no stale file
    assert read(tmp / "ckpt")["epoch"] == EPOCHS


@pytest.mark.dist
def test_saved_model_evaluates_and_predicts(runs, capsys, monkeypatch):
    tmp, _, _, _, resumed = runs
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp / "data"))
    model_path = str(tmp / "model.pt")
    assert main(["evaluate", "--model", model_path]) == 0
    out = capsys.readouterr().out
    assert "strategy data on 2 worker(s)) on tiny" in out
    # the saved model is the best-validation one: its test accuracy is the run's result
    found = re.search(r"^test  accuracy +([0-9.]+%) \(\d+/\d+\)$", out, re.MULTILINE)
    assert found and found.group(1) == final_accuracy(resumed.stdout), out
    summary = events(tmp / "resumed.jsonl", "summary")[0]
    assert f"val   accuracy {summary['best_val']:>7.2%}" in out

    preds = tmp / "out" / "preds.npy"
    assert main(["predict", "--model", model_path, "--out", str(preds), "--embeddings"]) == 0
    model = fullgraph.load_model(model_path)  # a plain torch module
    assert isinstance(model, torch.nn.Module) and not model.training
    ds = datasets.load_for(DataConfig(dataset="tiny", root=str(tmp / "data")))
    edge_index = torch.stack(ds.graph.edges())
    with torch.no_grad():
        logits = model(edge_index, ds.data.features)
        assert torch.equal(logits, model(ds.graph, ds.data.features))
        hidden = model.embed(ds.graph, ds.data.features)
    np.testing.assert_array_equal(np.load(preds), logits.argmax(dim=1).numpy())
    emb = np.load(tmp / "out" / "preds-embeddings.npy")
    assert emb.shape == (300, 16) and np.array_equal(emb, hidden.numpy())
    assert json.loads(json.dumps(model.meta["trained"]))["best_epoch"] == summary["best_epoch"]

    # the README's example, as written, on this model
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    example = [b for b in blocks if 'fullgraph.load_model("cora-gcn.pt")' in b]
    assert len(example) == 1
    scope: dict = {}
    exec(example[0].replace('"cora-gcn.pt"', repr(model_path)), scope)
    assert torch.equal(scope["logits"], logits) and torch.equal(scope["hidden"], hidden)


def test_outputs_refuse_bad_files(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    torch.save({"format": "something else"}, bad)
    assert main(["evaluate", "--model", str(bad)]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a saved fullgraph model")
    out = tmp_path / "x.npy"
    assert main(["predict", "--model", str(tmp_path / "none.pt"), "--out", str(out)]) == 2
    assert "none.pt not found" in capsys.readouterr().err and not out.exists()


def test_a_model_trained_under_a_root_is_evaluated_there_from_anywhere(
        tmp_path, capsys, monkeypatch):
    root = tmp_path / "data"
    datasets.save_processed(sbm(60, 2, avg_degree=4.0, num_features=6, seed=0), root, "tiny")
    model = tmp_path / "model.pt"
    assert main(["train", "--dataset", "tiny", "--root", str(root), "--epochs", "2",
                 "--progress", "off", "--save-model", str(model)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "empty"))
    capsys.readouterr()
    assert main(["evaluate", "--model", str(model)]) == 0
    assert "on tiny" in capsys.readouterr().out
    # --dataset (named, as the refusal of changed data advises) is looked for there too
    assert main(["evaluate", "--model", str(model), "--dataset", "tiny"]) == 0
    assert "on tiny" in capsys.readouterr().out
    root.rename(tmp_path / "moved")  # gone from there: the error says where it looked
    assert main(["evaluate", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"trained on 'tiny' under --root {root}" in err and "(--root, or root= in Python)" in err
    assert main(["evaluate", "--model", str(model), "--root", str(tmp_path / "moved")]) == 0
    root.mkdir()  # the recorded root is there again, without the dataset: the usual root
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "moved"))
    assert main(["evaluate", "--model", str(model)]) == 0
