"""The benchmark scripts' command lines: names checked before any work, one line for a
user's error, what is left out said so, and the bytes in the project's units.

Nothing here times anything: the heavy parts (the dataset, the runs) are replaced by
stubs that fail the test if a script reaches them when it should have stopped."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fullgraph.errors import ConfigError
from fullgraph.graph import datasets
from fullgraph.graph.synthetic import sbm


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch):
    """The scripts that re-execute themselves for huge pages run in this process."""
    monkeypatch.setenv("FULLGRAPH_HUGEPAGES_SET", "1")


def _no_work(*args, **kwargs):
    raise AssertionError("the script started work before checking its command line")


def _error(capsys) -> str:
    """The one line a script ended with on stderr (after argparse's usage, if any)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------------ the shared helper
def test_entry_point_ends_a_users_error_with_one_line_and_exit_2(monkeypatch, capsys):
    from fullgraph.bench import entry_point

    @entry_point
    def config(argv: list[str] | None = None) -> int:
        raise ConfigError("model.hidden: got 0; expected >= 1")

    @entry_point
    def size(argv: list[str] | None = None) -> int:
        raise ValueError("--vertices: got -1")

    @entry_point
    def bug(argv: list[str] | None = None) -> int:
        raise KeyError("a bug keeps its traceback")

    monkeypatch.setattr(sys, "argv", ["/x/models.py"])
    for main, message in ((config, "model.hidden: got 0; expected >= 1"),
                          (size, "--vertices: got -1")):
        with pytest.raises(SystemExit) as exit_:
            main([])
        assert exit_.value.code == 2
        assert _error(capsys) == f"models.py: error: {message}"
    with pytest.raises(KeyError):
        bug([])


def test_a_size_the_library_refuses_is_one_line(tmp_path, capsys):
    from fullgraph.bench import defaults

    with pytest.raises(SystemExit) as exit_:
        defaults.main(["--graphs", "200:2000", "--features", "0", "--cache", str(tmp_path),
                       "--tables", "defaults"])
    assert exit_.value.code == 2
    line = _error(capsys)
    assert ": error: num_features: out of range" in line, line


# ------------------------------------------------------------------ names checked first
@pytest.mark.parametrize("argv, expected", [
    (["--models", "tagcn"], "--models: unknown 'tagcn'; expected some of gcn, sage, gat, gin"),
    (["--models", "gcn,GAT"], "--models: unknown 'GAT'"),
    (["--tables", "model"], "--tables: unknown 'model'; expected some of models, attention"),
])
def test_models_checks_its_names_before_any_work(argv, expected, monkeypatch, capsys):
    from fullgraph.bench import models

    monkeypatch.setattr(models, "cached_rmat", _no_work)
    with pytest.raises(SystemExit) as exit_:
        models.main(argv)
    assert exit_.value.code == 2
    assert expected in _error(capsys)


def test_cloud_and_cloud_accuracy_refuse_an_unknown_table(monkeypatch, capsys):
    from fullgraph.bench import cloud, cloud_accuracy

    monkeypatch.setattr(cloud, "dataset_dir", _no_work)
    with pytest.raises(SystemExit) as exit_:
        cloud.main(["--tables", "tim"])
    assert exit_.value.code == 2
    assert "--tables: unknown 'tim'; expected some of time, breakdown" in _error(capsys)
    with pytest.raises(SystemExit) as exit_:
        cloud_accuracy.main(["--tables", "stalenes"])
    assert exit_.value.code == 2
    assert "--tables: unknown 'stalenes'; expected some of accuracy, staleness" in \
        _error(capsys)


# ------------------------------------------------------------------ PyG not installed
@pytest.fixture
def no_pyg(monkeypatch):
    """torch_geometric unimportable, as where it is not installed."""
    for name in [m for m in sys.modules if m.startswith("torch_geometric.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch_geometric", None)


def test_the_pyg_comparisons_say_pyg_is_missing_before_any_work(no_pyg, monkeypatch, capsys):
    from fullgraph.bench import models, pyg_accuracy

    monkeypatch.setattr(models, "cached_rmat", _no_work)
    monkeypatch.setattr(pyg_accuracy, "load", _no_work)
    for run in (lambda: models.main(["--models", "gcn"]),
                lambda: pyg_accuracy.main(["--datasets", "cora", "--models", "sage"])):
        with pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 2
        line = _error(capsys)
        assert "torch_geometric" in line and line.endswith("pip install 'fullgraph[pyg]'")


def test_kernels_and_sparse_features_say_why_pyg_is_left_out(no_pyg, capsys):
    from fullgraph.bench import kernels, sparse_features

    why = "PyG left out: torch_geometric is not installed; pip install 'fullgraph[pyg]'"
    assert kernels.epoch_pyg(None, argparse.Namespace()) == {"pyg_left_out": why}
    kernels.print_summary([_kernels_record(pyg_left_out=why)])
    assert f"epoch PyG GCNConv  -  ({why})" in capsys.readouterr().out
    assert sparse_features.main(["--datasets", "bow", "--vertices", "200", "--features",
                                 "128", "--words", "6", "--epochs", "1", "--hidden", "8"]) == 0
    out = capsys.readouterr().out
    assert why in out and "| bow | 200 x 128" in out


# ------------------------------------------------------------------ sparse_features
def _tiny_npz(path: Path) -> None:
    """A gnn-benchmark .npz (flat layout) of 200 vertices in 2 classes and 100 columns
    of word counts, 3 per row: bag-of-words features, which the loader holds as CSR."""
    rng = np.random.default_rng(0)
    n, cols = 200, 100
    src = rng.integers(0, n, 1000)
    dst = rng.integers(0, n, 1000)
    order = np.lexsort((dst, src))
    src, dst = src[order], dst[order]
    adj_indptr = np.searchsorted(src, np.arange(n + 1))
    attr_indices = np.stack([rng.choice(cols, 3, replace=False) for _ in range(n)]).ravel()
    path.parent.mkdir(parents=True)
    np.savez(path, adj_data=np.ones(len(dst), np.float32), adj_indices=dst,
             adj_indptr=adj_indptr, adj_shape=np.array([n, n]),
             attr_data=np.ones(3 * n, np.float32), attr_indices=attr_indices,
             attr_indptr=np.arange(0, 3 * n + 1, 3), attr_shape=np.array([n, cols]),
             labels=np.repeat([0, 1], n // 2))


def test_sparse_features_uses_csr_features_as_loaded_and_leaves_no_folder(tmp_path, monkeypatch,
                                                                         capsys):
    from fullgraph.bench import sparse_features

    _tiny_npz(tmp_path / "shared" / "coauthor_cs" / "coauthor_cs.npz")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(sparse_features, "have_pyg", lambda: True, raising=False)
    monkeypatch.setattr(sparse_features, "epoch_pyg", lambda ds, sparse, args: None)
    assert sparse_features.main(["--root", str(tmp_path / "shared"), "--datasets",
                                 "coauthor_cs", "--epochs", "1", "--hidden", "8"]) == 0
    assert "| coauthor_cs | 200 x 100, 3.00% |" in capsys.readouterr().out
    assert not list(scratch.iterdir())  # the processed copy is gone
    assert sorted(p.name for p in (tmp_path / "shared").rglob("*")) == \
        ["coauthor_cs", "coauthor_cs.npz"]  # the shared folder as it was


def test_plan_removes_its_dataset_root(tmp_path, monkeypatch):
    from fullgraph.bench import plan

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(plan, "graphs", lambda scale: {})  # Cora alone, and a small one
    monkeypatch.setattr(plan.datasets, "load_for",
                        lambda cfg: sbm(50, 2, avg_degree=4.0, num_features=4, seed=0))
    args = argparse.Namespace(scale=0.01, graphs=[], workers=[2], rounds=1, epochs=1,
                              model="gcn")
    assert plan.run(args) == []
    assert not list(scratch.iterdir())


# ------------------------------------------------------------------ defaults, task
def test_defaults_names_a_failed_configuration_and_the_rounds_that_ran(monkeypatch):
    from fullgraph.bench import defaults

    calls = {"depcache": 0}

    def run(args, data, workers, flags):
        if "5000" in flags:
            return {"error": "fullgraph train: error: simulated failure"}
        if "depcache" in flags:
            calls["depcache"] += 1
            if calls["depcache"] == 1:
                return {"error": "fullgraph train: error: once"}
        return {"epoch_s": 0.5}

    monkeypatch.setattr(defaults, "run", run)
    lines = defaults.defaults_table(argparse.Namespace(workers=[2], repeats=2), Path(), "G")
    rows = {line.split(" | ")[2]: line for line in lines}
    assert rows["p2p, --bin-size 5000"] == \
        "| G | 2 | p2p, --bin-size 5000 | failed: fullgraph train: error: simulated failure | - |"
    assert rows["p2p, default bins"] == "| G | 2 | p2p, default bins | 0.500 | - |"
    assert rows["data, DepCache"] == ("| G | 2 | data, DepCache | 0.500 (1 of 2 rounds; failed: "
                                      "fullgraph train: error: once) | 1.00 |")
    assert "nan" not in "".join(lines)


def _fake_train(bytes_sent: int, error: str | None = None):
    """``subprocess.run`` for ``fullgraph train``: a metrics file of 2 ranks and 2
    epochs, each rank sending ``bytes_sent`` per epoch, or a failure."""
    def run(cmd, **kwargs):
        if error is not None:
            return subprocess.CompletedProcess(cmd, 1, "", f"some output\n{error}\n")
        records = [{"event": "run"}]
        for epoch in (1, 2):
            records.append({"event": "epoch", "epoch": epoch, "epoch_s": 0.25, "loss": 1.0,
                            "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5})
            records += [{"event": "rank_epoch", "rank": r, "epoch": epoch, "epoch_s": 0.25,
                         "compute_s": 0.2, "comm_s": 0.03, "wait_s": 0.02, "wall_s": 0.25,
                         "bytes_sent": {"halo": bytes_sent}, "saved_bytes": 3 * 2**20,
                         "peak_mem": 100 * 2**20} for r in (0, 1)]
        out = Path(cmd[cmd.index("--metrics-out") + 1])
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_task_reports_mib_and_a_failure_as_its_last_line(monkeypatch):
    from fullgraph.bench import task

    args = argparse.Namespace(epochs=2)
    monkeypatch.setattr(task.subprocess, "run", _fake_train(2**20))
    r = task.run(args, Path("data"), 2, [])
    assert (r["mib_epoch"], r["saved_mib"], r["rss_mib"]) == (2.0, 3.0, 100.0)
    monkeypatch.setattr(task.subprocess, "run", _fake_train(0, "fullgraph train: error: no"))
    assert task.run(args, Path("data"), 2, []) == {"error": "fullgraph train: error: no"}


def test_tensor_and_p2p_tables_count_mib():
    from fullgraph.bench.tensor import _mb

    assert _mb(10 * 2**20) == "10.0"


# ------------------------------------------------------------------ outofcore
def test_outofcore_takes_what_train_takes(tmp_path, monkeypatch, capsys):
    from fullgraph.bench import outofcore

    root = tmp_path / "data"
    processed = datasets.save_processed(sbm(120, 3, avg_degree=4.0, num_features=4, seed=0),
                                        root, "tiny")  # as `fullgraph generate` lays it out
    runs = []

    def watch(cmd, cgroup, log):
        runs.append(cmd[cmd.index("--dataset") + 1])
        return 0, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "epoch_anon": 0}

    monkeypatch.setattr(outofcore, "watch", watch)
    assert outofcore.main(["--dataset", str(root / "tiny"), "--spill-dir", str(tmp_path / "s"),
                           "--logs", str(tmp_path / "logs")]) == 0
    assert runs == [str(processed)] * 2  # the children train on the folder measured
    assert f"dataset {processed}:" in capsys.readouterr().out
    for given, where in ((str(root / "tiny"), None), (str(processed), None),
                         ("tiny", str(root))):
        assert outofcore.resolve_dataset(given, where) == processed
    with pytest.raises(SystemExit) as exit_:
        outofcore.main(["--dataset", "nosuch", "--root", str(root), "--spill-dir",
                        str(tmp_path / "s"), "--logs", str(tmp_path / "logs")])
    assert exit_.value.code == 2
    assert "unknown dataset; found 'nosuch'" in _error(capsys)


# ------------------------------------------------------------------ kernels
def _kernels_record(**extra):
    rec = {"allocator": "system malloc", "threads": 1, "vertices": 10, "edges_with_loops": 20,
           "read_GBps": 10.0, "copy_GBps": 20.0, "triad_GBps": 30.0, "bandwidth_GBps": 30.0,
           "gemm_GFLOPs": 50.0, "spmm_torch_GBps": 5.0, "ours_epoch_s": 1.0,
           "roofline_s": 0.5, "roofline_gemm_s": 0.25, "roofline_spmm_s": 0.25}
    return {**rec, **extra}


def test_kernels_finds_every_allocator_before_the_first_run(tmp_path, monkeypatch, capsys):
    import fullgraph.allocator
    from fullgraph.bench import kernels

    monkeypatch.setattr(fullgraph.allocator, "LIB_DIRS", (str(tmp_path),))
    monkeypatch.setattr(kernels, "run_with_allocator", _no_work)
    with pytest.raises(SystemExit) as exit_:
        kernels.main(["--allocators", "system,tcmalloc", "--hugepages", "off"])
    assert exit_.value.code == 2
    assert "--allocators: tcmalloc is not installed" in _error(capsys)


def test_kernels_shows_a_failed_childs_error(monkeypatch, capsys):
    from fullgraph.bench import kernels

    def run(cmd, **kwargs):
        assert "--allocators" not in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nOSError: /proc/nope\n")

    monkeypatch.setattr(kernels.subprocess, "run", run)
    assert kernels.main(["--allocators", "system", "--cache", "/proc/nope"]) == 1
    captured = capsys.readouterr()
    assert "allocator system: the measurement failed (exit 1)" in captured.err
    assert "OSError: /proc/nope" in captured.err
    assert "== system: failed: OSError: /proc/nope" in captured.out


def test_kernels_prints_the_summary_against_the_read_bandwidth(monkeypatch, capsys):
    from fullgraph.bench import kernels

    monkeypatch.setattr(kernels, "measure", lambda args: _kernels_record())
    assert kernels.main(["--hugepages", "off"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[0])["allocator"] == "system malloc"
    assert any(line.startswith("== system malloc") for line in out)
    assert "5.0 GB/s effective (50% of the read bandwidth)" in "\n".join(out)


# ------------------------------------------------------------------ devices, labels
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_asked_for_without_cuda_is_one_line(monkeypatch, capsys):
    from fullgraph.bench import models, p2p

    monkeypatch.setattr(models, "cached_rmat", _no_work)
    for run in (lambda: models.main(["--device", "cuda", "--models", "gcn"]),
                lambda: p2p.parse_args(["--device", "cuda"])):
        with pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 2
        assert "--device cuda: " in _error(capsys)


def test_the_attention_column_names_the_path_that_ran(monkeypatch):
    from fullgraph.bench import models
    from fullgraph.ops import kernels

    ds = sbm(60, 2, avg_degree=4.0, num_features=4, seed=0)
    args = argparse.Namespace(heads=2, epochs=1, rounds=1)
    if kernels.HAVE_NUMBA:
        assert "| fused (numba) s |" in "\n".join(models.attention_table(ds, args))
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    lines = models.attention_table(ds, args)
    assert "| fused (torch ops) s | torch ops s | fused / torch ops |" in lines
    assert any("numba is not installed" in line for line in lines)


def test_cloud_accuracy_plot_names_its_workers_and_links_where_it_wrote(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from fullgraph.bench import cloud_accuracy

    figures = []
    new_figure = cloud_accuracy.new_figure
    monkeypatch.setattr(cloud_accuracy, "new_figure",
                        lambda *size: figures.append(new_figure(*size)) or figures[-1])
    epochs = [{"epoch_s": 1.0, "val_acc": 0.5}, {"epoch_s": 1.0, "val_acc": 0.7}]
    monkeypatch.setattr(cloud_accuracy, "run", lambda *args: {"epochs": epochs})
    out = tmp_path / "img" / "fig14.png"
    lines = cloud_accuracy.convergence_table(
        argparse.Namespace(workers=2, plot=str(out), epochs=2), [])
    assert lines[-1] == f"![epoch-to-accuracy]({out.as_posix()})" and out.is_file()
    assert figures[0].axes[0].get_title() == "Cora, 2 workers, compute injection"


# ------------------------------------------------------------------ accuracy
def test_accuracy_takes_the_label_it_prints_and_checks_names_first(monkeypatch, capsys):
    from fullgraph.bench import accuracy

    trained = []

    def train(ds, cfg):
        trained.append(cfg.model)
        return argparse.Namespace(test_at_best=0.5)

    monkeypatch.setattr(accuracy, "load", lambda root, name: None)
    monkeypatch.setattr(accuracy, "train", train)
    assert accuracy.main(["--datasets", "cora", "--models", "gin-bn", "--seeds", "1"]) == 0
    assert "| cora | gin-bn | 50.0 +- 0.0 | 1 |" in capsys.readouterr().out
    assert trained[0].name == "gin" and trained[0].batch_norm
    monkeypatch.setattr(accuracy, "load", _no_work)
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(["--datasets", "cora", "--models", "gcn,gin-b"])
    assert exit_.value.code == 2
    assert "--models: unknown 'gin-b'; expected some of gcn, sage, gat, gin, gin-bn" in \
        _error(capsys)


def test_accuracy_reads_a_fullgraph_root_and_names_both_layouts(tmp_path, capsys):
    from fullgraph.bench import accuracy

    datasets.save_processed(sbm(80, 2, avg_degree=4.0, num_features=4, seed=0),
                            tmp_path / "fullgraph", "cora")
    assert accuracy.load(tmp_path / "fullgraph", "cora").data.num_nodes == 80
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(["--root", str(tmp_path / "empty"), "--datasets", "cora"])
    assert exit_.value.code == 2
    line = _error(capsys)
    assert "planetoid/raw/ind.cora.*" in line and "cora/processed" in line
    assert not (tmp_path / "empty").exists()  # nothing written where nothing was
