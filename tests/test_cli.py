"""The CLI: flags, config files, user errors without tracebacks, and end-to-end runs."""
from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from clirun import one_line_error

from fullgraph import launch
from fullgraph.cli import build_parser, main

# One flag per Config field; adding a knob means adding it here on purpose.
TRAIN_FLAGS = sorted("""
--config --dataset --root --feature-dtype --normalize-features --split-seed --sparse-features
--model --hidden
--layers --dropout --input-dropout --activation --residual --decoupled --num-props --heads
--batch-norm --out-heads --attn-dropout --epochs --lr --weight-decay --seed --device --eval-every
--patience
--metrics-out --progress --log-level --quiet --strategy --spmm-backend --threads --workers
--backend --timeout --run-dir --keep-run-dir --oversubscribe --partitioner --partition-file
--partition-seed --dep-mode --byte-cost --edge-cost --vertex-cost --device-memory --num-chunks
--column-split --pipeline --nn-device --prefetch --row-block --spill-dir --spill-memory
--p2p-schedule --bin-memory --bin-size --checkpoint-dir --checkpoint-every --resume --save-model
--task-split --task-gamma --subgraphs --recompute --chunks --task-deps --group-parallel
--task-device-memory --task-pieces --hops --model-options
--adapt --cache-budget --inject --staleness --slack --late-gradients --shares
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
    assert "model    sage" in out and "1 epoch in" in out
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nepochs = 1\nprogress = 'off'\n[model]\nname = 'gin'\n")
    assert main(["train", "--config", str(toml)]) == 0
    assert "model    gin" in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [
    ("model:\n  hiden: 8\n", "unknown key 'hiden'"),
    ("modle:\n  hidden: 8\n", "unknown section or option 'modle'"),
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
    features = root / "cora" / "processed" / "features_values.npy"  # (stored as CSR)
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
    with pytest.warns(UserWarning, match="--pipeline has no effect with --strategy single"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--pipeline"]) == 0


@pytest.mark.parametrize("flags,message", [
    (["--strategy", "data", "--dep-mode", "depcache", "--byte-cost", "1e-9"],
     "--byte-cost has no effect with --dep-mode depcache (only with hybrid)"),
    (["--strategy", "task", "--task-split", "1:1", "--task-gamma", "0.3"],
     "--task-gamma has no effect with --task-split 1:1"),
])
def test_options_another_option_of_the_strategy_disables_warn(flags, message):
    """An option of the strategy's own section that its other options make ineffective
    is named, as options of another strategy are."""
    from fullgraph.config import config_from_dict
    from fullgraph.parallel import build_strategy

    tree: dict = {}
    args = iter(flags)
    for flag, value in zip(args, args):
        section, key = {"--strategy": ("runtime", "strategy"),
                        "--dep-mode": ("data_parallel", "mode"),
                        "--byte-cost": ("data_parallel", "byte_cost"),
                        "--task-split": ("task_parallel", "split"),
                        "--task-gamma": ("task_parallel", "gamma")}[flag]
        tree.setdefault(section, {})[key] = float(value) if "cost" in flag or "gamma" in flag \
            else value
    with pytest.warns(UserWarning, match=re.escape(message)):
        build_strategy(config_from_dict(tree, source="test"))


def test_plan_takes_no_strategy_outputs_or_resume(capsys):
    """plan prices every strategy and writes nothing: those flags of train are not its."""
    for flag in ("--strategy", "--save-model", "--metrics-out", "--checkpoint-dir",
                 "--resume", "--run-dir"):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", flag, "x"])
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {flag} x" in capsys.readouterr().err


def test_model_options_without_effect_warn(root):
    with pytest.warns(UserWarning, match="--heads has no effect with --model gcn"):
        assert main(["train", "--epochs", "1", "--progress", "off", "--heads", "4"]) == 0


# ------------------------------------------------- partition, partition files, nn-device

def test_partition_writes_a_book_and_reports(root, tmp_path, capsys):
    from fullgraph.partition import PartitionBook

    book = tmp_path / "book.npz"
    assert main(["partition", "--parts", "3", "--partitioner", "random", "--seed", "4",
                 "--out", str(book), "--report"]) == 0
    out = capsys.readouterr().out
    assert "random partition of cora into 3 parts" in out and f"wrote {book}" in out
    loaded = PartitionBook.load(str(book), num_nodes=2708)
    sizes = [loaded.part_to_gids(p).numel() for p in range(3)]
    assert loaded.num_parts == 3 and sum(sizes) == 2708
    # the report's per-part vertex counts are those of the written book
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
            and len(line.split()) == 4]
    assert [int(r[1].replace(",", "")) for r in rows] == sizes
    assert "edge cut" in out and "replication factor" in out
    # only the report, nothing written; and nothing at all is refused
    assert main(["partition", "--parts", "2", "--report"]) == 0
    assert "edge cut" in capsys.readouterr().out
    assert main(["partition", "--parts", "2"]) == 2
    assert "nothing to do: give --out FILE, --shards DIR or --report" in capsys.readouterr().err


def test_train_reads_the_partition_file(root, tmp_path, capsys):
    """A book with 2 parts for 1 worker is refused by name: the file is really read."""
    book = tmp_path / "two.npz"
    assert main(["partition", "--parts", "2", "--partitioner", "chunk", "--out", str(book)]) == 0
    capsys.readouterr()
    assert main(["train", "--strategy", "data", "--epochs", "1", "--progress", "off",
                 "--partition-file", str(book)]) == 2
    err = capsys.readouterr().err
    assert f"partition file {book} has 2 parts but there are 1 workers" in err
    assert main(["train", "--strategy", "data", "--epochs", "1", "--progress", "off",
                 "--partition-file", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz" in capsys.readouterr().err


def test_nn_device_flag_places_the_dense_stages():
    """--nn-device reaches the tensor strategy: its model device is the given one, not
    the training device (train() puts the parameters there, see the CUDA test below)."""
    import torch

    from fullgraph.cli import config_from_args
    from fullgraph.parallel import build_strategy

    def strategy(*flags: str):
        args = build_parser().parse_args(["train", "--strategy", "tensor", *flags])
        return build_strategy(config_from_args(args))

    gpu = torch.device("cuda", 0)
    assert strategy("--nn-device", "cpu").model_device(gpu) == torch.device("cpu")
    assert strategy().model_device(gpu) == gpu



def test_an_nn_device_torch_cannot_give_is_one_error_before_launch(capsys, monkeypatch):
    """Launched workers ended in torch's AssertionError ('Torch not compiled with CUDA
    enabled') where --device cuda is one line."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for workers in ("1", "2"):
        assert main(["train", "--strategy", "tensor", "--workers", workers, "--epochs", "1",
                     "--nn-device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error: --nn-device: got 'cuda' but " in err, err


def test_nn_device_cpu_with_cuda_training():
    """On a GPU: parameters and vertex rows on the CPU, propagation on the GPU, and the
    same losses as the run with everything on the GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: on a CPU-only host both devices are the CPU")
    from fullgraph.config import Config, ModelConfig, RuntimeConfig, TrainConfig
    from fullgraph.graph.synthetic import sbm
    from fullgraph.parallel import build_strategy
    from fullgraph.parallel.tensor import TensorParallel
    from fullgraph.train import train

    class Where:
        def between_epochs(self, model, plan, epoch, profile):
            self.params = {p.device.type for p in model.parameters()}
            self.plan = (plan.device.type, plan.features.device.type)

    toy = sbm(300, 3, avg_degree=6.0, num_features=8, seed=0)
    losses = {}
    for nn_device in ("cpu", None):
        cfg = Config(model=ModelConfig(name="gcn", hidden=8), runtime=RuntimeConfig(
            strategy="tensor"), train=TrainConfig(epochs=3, device="cuda"),
            options={"tensor_parallel": TensorParallel.Options(nn_device=nn_device)})
        where = Where()
        res = train(toy, cfg, strategy=build_strategy(cfg), adapters=[where])
        expect = nn_device or "cuda"
        assert where.params == {expect} and where.plan == ("cuda", expect)
        losses[nn_device] = [r.loss for r in res.epochs]
    np.testing.assert_allclose(losses["cpu"], losses[None], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def launch_root(tmp_path_factory):
    """A dataset root for the subprocess runs below, and the single-process reference."""
    from clirun import TRAIN, events, run_cli

    root = tmp_path_factory.mktemp("data")
    metrics = root.parent / "single.jsonl"
    out = run_cli(TRAIN + ["--strategy", "single", "--metrics-out", str(metrics)], root,
                  timeout=120)
    assert out.returncode == 0, out.stderr
    return root, [r["loss"] for r in events(metrics, "epoch")]


def _launched_losses(args: list[str], root, metrics, cmd=None) -> str:
    """Run ``TRAIN + args`` (through ``cmd`` when given), writing ``metrics``; stdout."""
    from clirun import TRAIN, run_cli

    out = run_cli(TRAIN + args + ["--metrics-out", str(metrics)], root, timeout=180, cmd=cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.dist
def test_partition_file_through_the_launcher(launch_root, tmp_path):
    """`fullgraph partition --out` then `train --partition-file` on 2 workers, hybrid
    dependencies with given costs: the header names the file and the split, and the
    losses are the single-process ones."""
    from clirun import events, run_cli

    root, single = launch_root
    book = tmp_path / "book.npz"
    made = run_cli(["partition", "--parts", "2", "--partitioner", "random", "--out", str(book)],
                   root)
    assert made.returncode == 0, made.stderr
    metrics = tmp_path / "m.jsonl"
    stdout = _launched_losses(["--strategy", "data", "--workers", "2", "--partition-file",
                               str(book), "--dep-mode", "hybrid", "--byte-cost", "1e-9",
                               "--edge-cost", "1e-9", "--vertex-cost", "1e-9",
                               "--run-dir", str(tmp_path / "run")], root, metrics)
    assert f"deps     hybrid, partition file {book}; remote dependencies" in stdout
    np.testing.assert_allclose([r["loss"] for r in events(metrics, "epoch")], single,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_shards_through_the_launcher(launch_root, tmp_path):
    """`fullgraph partition --shards` then `train --dataset DIR` on 2 workers with
    DepCache and with p2p: each worker opens only its part, the header says what it
    holds, and the losses are the single-process ones on the whole dataset."""
    from clirun import events, run_cli

    root, single = launch_root
    shards = tmp_path / "shards"
    made = run_cli(["partition", "--parts", "2", "--partitioner", "random", "--shards",
                    str(shards), "--shard-hops", "2"], root)
    assert made.returncode == 0, made.stderr
    assert "wrote 2 shards with 2 hops" in made.stdout
    metrics = tmp_path / "m.jsonl"
    stdout = _launched_losses(["--dataset", str(shards), "--strategy", "data", "--workers",
                               "2", "--dep-mode", "depcache", "--run-dir",
                               str(tmp_path / "run")], root, metrics)
    assert "dataset  cora: 2708 vertices, 10556 edges" in stdout
    assert "per-part shards (2 parts, 2 hops): this worker's part holds" in stdout
    np.testing.assert_allclose([r["loss"] for r in events(metrics, "epoch")], single,
                               rtol=1e-5, atol=1e-6)
    # p2p on the same shards: each worker bins its own part
    metrics = tmp_path / "p2p.jsonl"
    stdout = _launched_losses(["--dataset", str(shards), "--strategy", "p2p", "--workers",
                               "2", "--bin-size", "500", "--run-dir", str(tmp_path / "p2p")],
                              root, metrics)
    assert "per-part shards (2 parts, 2 hops)" in stdout
    np.testing.assert_allclose([r["loss"] for r in events(metrics, "epoch")], single,
                               rtol=1e-5, atol=1e-6)
    # another worker count or strategy is refused before any worker starts
    for args, message in ((["--workers", "3"], "use --workers 2"),
                          (["--strategy", "single"], "'single' cannot train on "
                           "per-part shards")):
        out = run_cli(["train", "--dataset", str(shards), "--strategy", "data", *args,
                       "--epochs", "1"], root)
        assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.dist
def test_tensor_through_the_launcher_and_torchrun(launch_root, tmp_path):
    import sys

    from clirun import events, free_port

    root, single = launch_root
    runs = {"launcher": (["--workers", "2", "--run-dir", str(tmp_path / "run")], None),
            "torchrun": ([], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-port", str(free_port()), "-m", "fullgraph.cli"])}
    for name, (extra, cmd) in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        stdout = _launched_losses(["--strategy", "tensor", *extra], root, metrics, cmd)
        assert "strategy tensor, 2 worker(s)" in stdout, (name, stdout)
        np.testing.assert_allclose([r["loss"] for r in events(metrics, "epoch")], single,
                                   rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- checked before launching

@pytest.fixture
def no_launch(monkeypatch):
    """Fake the launcher (records its calls) on a machine of 8 cores and 64 GiB."""
    calls = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: calls.append((a, k)) or 0)
    monkeypatch.setattr(launch, "available_cores", lambda: 8, raising=False)
    monkeypatch.setattr(launch, "available_memory", lambda: 64 * 2**30, raising=False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_partition_file_is_checked_before_launch(root, tmp_path, capsys, no_launch):
    from fullgraph.partition import PartitionBook

    other = tmp_path / "other.npz"
    PartitionBook.from_assignment(np.arange(100) % 2, 2).save(other)
    assert main(["train", "--strategy", "data", "--workers", "2", "--partition-file",
                 str(other)]) == 2
    one_line_error(capsys, "other.npz", "another graph", "found 100", "expected 2708")
    three = tmp_path / "three.npz"
    PartitionBook.from_assignment(np.arange(2708) % 3, 3).save(three)
    assert main(["train", "--strategy", "p2p", "--workers", "2", "--partition-file",
                 str(three)]) == 2
    one_line_error(capsys, "three.npz has 3 parts but there are 2 workers")
    assert no_launch == []


def test_a_net_slowdown_is_refused_before_the_local_launcher_starts_workers(
        root, tmp_path, capsys, no_launch):
    """It shapes a worker's own interface, which the workers of one host do not have;
    before, each worker refused it after the header, leaving a metrics file without
    a summary."""
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--strategy", "data", "--workers", "2", "--inject",
                 "net:rate=10mbit,ranks=1,at=3", "--metrics-out", str(metrics)]) == 2
    one_line_error(capsys, "--inject net: shapes a worker's own network interface")
    assert no_launch == [] and not metrics.exists()
    from fullgraph.config import config_from_dict
    from fullgraph.graph import datasets
    from fullgraph.train import check_any_strategy

    cfg = config_from_dict({"adapt": {"inject": "net:rate=10mbit,ranks=1,at=3"}})
    check_any_strategy(cfg, datasets.load("cora", root), 2, launching=False)  # plan's


def test_missing_optional_package_is_found_before_launch(root, capsys, no_launch, monkeypatch):
    monkeypatch.setitem(sys.modules, "pymetis", None)  # import pymetis now fails
    assert main(["train", "--strategy", "data", "--workers", "2"]) == 2
    one_line_error(capsys, "'metis' needs pymetis", "--partitioner chunk")
    from fullgraph.ops import kernels

    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    assert main(["train", "--strategy", "data", "--workers", "2", "--partitioner", "chunk",
                 "--spmm-backend", "numba"]) == 2
    one_line_error(capsys, "'numba' needs numba", "pip install 'fullgraph[fast]'")
    assert no_launch == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_cuda_without_cuda_is_one_line(root, capsys, no_launch, monkeypatch, workers):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--device", "cuda", "--epochs", "1", "--workers", workers]) == 2
    one_line_error(capsys, "error: --device: got 'cuda'", "--device cpu")
    assert no_launch == []


@pytest.mark.parametrize("rank", ["0", "1"])
def test_workers_conflicting_with_torchrun_is_refused_once(root, capsys, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--workers", "3", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert "--workers 3 conflicts with the launcher's WORLD_SIZE=2" in err
        assert len(err.strip().splitlines()) == 1, err
    else:  # rank 0 says it; the others only refuse
        assert err == ""


def test_too_many_workers_are_refused_unless_oversubscribed(root, capsys, no_launch,
                                                          monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    assert main(["train", "--workers", "1000"]) == 2
    one_line_error(capsys, "1000 workers on 2 cores is more than 4 per core", "--oversubscribe")
    monkeypatch.setattr(launch, "available_memory", lambda: 2**30)
    assert main(["train", "--workers", "4"]) == 2
    one_line_error(capsys, "4 workers need at least 1.6 GiB", "1.0 GiB is available")
    assert no_launch == []
    with pytest.warns(UserWarning, match="1000 workers on 2 cores"):
        assert main(["train", "--workers", "1000", "--oversubscribe",
                     "--strategy", "data"]) == 0
    assert len(no_launch) == 1 and no_launch[0][0][1] == 1000


def test_more_workers_than_cores_warn(root, no_launch, monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 2)
    with pytest.warns(UserWarning, match="3 workers on 2 cores"):
        assert main(["train", "--workers", "3", "--strategy", "data"]) == 0
    assert len(no_launch) == 1


def test_generate_rmat_streams_the_same_dataset(root, capsys):
    """A tiny --memory forces many destination ranges; the result is rmat()'s dataset."""
    from fullgraph.graph import datasets, synthetic
    from fullgraph.graph.store import load_dataset

    assert main(["generate", "rmat", "--vertices", "500", "--edges", "4000", "--features", "6",
                 "--classes", "4", "--memory", "4K", "--feature-dtype", "float16",
                 "--name", "tiny"]) == 0
    assert "wrote tiny: 500 vertices" in capsys.readouterr().out
    got = load_dataset(datasets.processed_dir(root, "tiny"))
    want = synthetic.rmat(500, 4000, num_features=6, num_classes=4, feature_dtype="float16")
    assert torch.equal(got.graph.indptr, want.graph.indptr)
    assert torch.equal(got.graph.indices, want.graph.indices)
    assert torch.equal(got.data.features, want.data.features)
    assert torch.equal(got.data.train_mask, want.data.train_mask)
    assert main(["train", "--dataset", "tiny", "--epochs", "1", "--progress", "off"]) == 0


def test_a_refused_run_leaves_an_earlier_metrics_file_as_it_was(root, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"event": "run"}\n')
    rc = main(["train", "--epochs", "2", "--progress", "off", "--metrics-out", str(metrics),
               "--resume", str(tmp_path / "no-checkpoint")])
    assert rc == 2 and "error: --resume: no checkpoint" in capsys.readouterr().err
    assert metrics.read_text() == '{"event": "run"}\n'
