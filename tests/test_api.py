"""``fullgraph.fit``, the Python API: the README example as written, launched workers
returning the single-process model, PyG ``Data`` (real and duck-typed) and bad input."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import fullgraph
from fullgraph.errors import ConfigError
from fullgraph.graph.formats.pyg import to_pyg
from fullgraph.graph.synthetic import sbm
from fullgraph.saved import accuracy, load_dataset_for


def test_import_fullgraph_stays_light() -> None:
    code = ("import sys, fullgraph; assert callable(fullgraph.__getattr__); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.dist
def test_readme_example_trains_on_two_workers(readme_api_run) -> None:
    ns, where = readme_api_run
    result = ns["result"]
    assert isinstance(result, fullgraph.FitResult)
    assert result.config.launch.workers == 2 and result.config.runtime.strategy == "data"
    assert [row["epoch"] for row in result.history] == list(range(1, 31))
    assert result.losses[-1] < result.losses[0]
    assert result.test_accuracy > 0.6  # Cora, 30 epochs
    best = result.history[result.best_epoch - 1]
    assert best["test_acc"] == result.test_accuracy and best["val_acc"] == result.val_accuracy
    assert isinstance(ns["model"], torch.nn.Module) and not ns["model"].training
    run = json.loads((where / "cora-run.jsonl").read_text().splitlines()[0])
    expected = result.config.to_dict()
    expected["train"]["progress"] = "off"  # fit is not verbose
    assert run["event"] == "run" and run["config"] == expected  # the options reached them
    assert run["config"]["data"]["normalize_features"] is True
    saved = fullgraph.load_model(where / "cora-gcn.pt")  # what the example saved
    assert saved.meta["trained"]["workers"] == 2 and saved.meta["data"]["dataset"] == "cora"
    assert saved.meta["trained"]["test_acc"] == result.test_accuracy
    ds = load_dataset_for(saved, root=str(where / "data"))  # found, and the data it knew
    assert accuracy(saved, ds)["test"][0] / 1000 == pytest.approx(result.test_accuracy)


@pytest.mark.dist
def test_a_model_of_other_data_under_a_stored_name_is_refused(readme_api_run) -> None:
    """Cora in memory with its train and test masks swapped keeps the name "cora":
    finding the stored Cora for it names the difference, not a silent wrong score; data
    of a name nothing stores says to give --dataset."""
    from fullgraph.errors import DatasetNotFoundError
    from fullgraph.graph.datasets import load

    root = readme_api_run[1] / "data"
    ds = load("cora", root)
    d = ds.data
    ds.data = dataclasses.replace(d, train_mask=d.test_mask, test_mask=d.train_mask)
    swapped = fullgraph.fit(ds, epochs=2, hidden=8)
    with pytest.raises(ConfigError, match="not the data it was trained on.*masks"):
        load_dataset_for(swapped.model, root=str(root))
    assert load_dataset_for(swapped.model, "cora", root=str(root)).name == "cora"  # asked for
    other = fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), epochs=1)
    with pytest.raises(DatasetNotFoundError, match="held in memory.*--dataset"):
        load_dataset_for(other.model, root=str(root))


@pytest.mark.dist
def test_launched_workers_return_the_single_process_model(readme_api_run) -> None:
    """The model rank 0 hands back is the one the single-process executor trains: the
    same losses, outputs within 1e-3 and parameters within 1e-2. In float32, Adam turns
    float-order noise in a gradient of about 0 (a hidden unit whose ReLU is off almost
    everywhere) into steps of up to the learning rate, so such a unit's input weights
    may part by a few thousandths (the same run in float64 agrees to 1e-14). 30
    epochs move the weights by 0.1-0.3, so an untrained or other model still fails."""
    from fullgraph.graph.datasets import load
    from fullgraph.parallel.single import SingleProcess

    processed = readme_api_run[1] / "data" / "cora" / "processed"
    launched = readme_api_run[0]["result"]
    here = fullgraph.fit(processed, epochs=30, normalize_features=True)
    for a, b in zip(launched.history, here.history):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    dataset = load(str(processed), processed)
    dataset.data = dataset.data.row_normalized()

    def logits(model: torch.nn.Module) -> torch.Tensor:
        strategy = SingleProcess()
        plan = strategy.setup(dataset, model, torch.device("cpu"))
        with torch.no_grad():
            return strategy.forward(model, plan, training=False, seed=0).logits

    with torch.no_grad():  # the result's model called as a module gives the same
        assert torch.equal(launched.model(dataset.graph, dataset.data.features),
                           logits(launched.model.program))

    torch.testing.assert_close(logits(launched.model.program), logits(here.model.program),
                               atol=1e-3, rtol=1e-3)
    for (name, p), (_, q) in zip(launched.model.named_parameters(),
                                 here.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-2, rtol=0, msg=name)


@pytest.mark.dist
def test_in_memory_dataset_on_launched_tensor_workers(tmp_path) -> None:
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    opts = dict(model="sage", epochs=3, hidden=5, lr=0.05)
    here = fullgraph.fit(ds, **opts)
    launched = fullgraph.fit(ds, strategy="tensor", workers=2,
                             save_model=str(tmp_path / "model.pt"), **opts)
    assert launched.config.data.dataset == ds.name  # not the workers' temporary copy
    saved = fullgraph.load_model(tmp_path / "model.pt")
    assert saved.meta["data"] == launched.model.meta["data"]
    assert saved.meta["data"]["dataset"] == ds.name
    assert launched.history[-1]["loss"] == pytest.approx(here.history[-1]["loss"], rel=1e-4)
    for p, q in zip(launched.model.parameters(), here.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_the_model_predicts_and_saves_as_a_saved_model(tmp_path) -> None:
    """``FitResult.model`` maps (edge_index, features) to logits whose accuracy is the
    run's, and saves a file that ``load_model`` reads back to the same logits."""
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    result = fullgraph.fit(ds, epochs=6, hidden=8, lr=0.05)
    edge_index = torch.stack(ds.graph.edges())
    with torch.no_grad():
        logits = result.model(edge_index, ds.data.features)
    assert logits.shape == (67, 3) and not result.model.training
    correct, total = accuracy(result.model, ds)["test"]
    assert correct / total == pytest.approx(result.test_accuracy)
    result.model.save(tmp_path / "model.pt")
    loaded = fullgraph.load_model(tmp_path / "model.pt")
    with torch.no_grad():
        assert torch.equal(loaded(edge_index, ds.data.features), logits)
    assert loaded.meta["trained"]["best_epoch"] == result.best_epoch
    assert loaded.meta["trained"]["workers"] == 1


def test_pyg_data_real_and_duck_typed_train_alike() -> None:
    pytest.importorskip("torch_geometric")
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    data = to_pyg(ds)
    duck = SimpleNamespace(x=data.x, y=data.y, edge_index=data.edge_index,
                           train_mask=data.train_mask, val_mask=data.val_mask,
                           test_mask=data.test_mask)
    real = fullgraph.fit(data, epochs=4, hidden=8)
    plain = fullgraph.fit(duck, epochs=4, hidden=8)
    assert real.losses == plain.losses and len(real.losses) == 4
    assert real.test_accuracy == plain.test_accuracy and not math.isnan(real.test_accuracy)
    no_masks = fullgraph.fit(SimpleNamespace(x=data.x, y=data.y, edge_index=data.edge_index),
                             epochs=2)
    assert len(no_masks.history) == 2  # a 60/20/20 split was drawn


def test_in_memory_bag_of_words_features_are_held_as_csr(capsys) -> None:
    """``fit`` on a dataset in memory holds sparse features as CSR (``sparse_features``
    auto), as ``fullgraph train`` does with a stored one, and trains as the dense run."""
    ds = sbm(67, 3, avg_degree=5.0, num_features=200, seed=11)
    keep = torch.rand(ds.data.features.shape, generator=torch.Generator().manual_seed(0)) < 0.02
    ds.data = dataclasses.replace(ds.data, features=ds.data.features * keep)
    runs = {}
    for layout in ("auto", "off"):
        runs[layout] = fullgraph.fit(ds, epochs=3, hidden=8, sparse_features=layout,
                                     verbose=True)
        header = capsys.readouterr().out
        assert ("held as CSR" in header) == (layout == "auto"), header
    assert runs["auto"].losses == pytest.approx(runs["off"].losses, rel=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda: fullgraph.fit("cora", epochs=1, hiddne=8), "unknown option 'hiddne'.*hidden"),
    (lambda: fullgraph.fit(42, epochs=1), "a PyG Data with x, y and edge_index; got int"),
    (lambda: fullgraph.fit("cora", model="gnc"), "model.name: got 'gnc'"),
    (lambda: fullgraph.fit("cora", dataset="x"), "first argument"),
])
def test_bad_input_is_one_clear_error(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


def test_a_failed_launch_raises(monkeypatch) -> None:
    """A worker failure (the launcher's non-zero exit) is an error, not an empty result."""
    from fullgraph import launch

    seen = {}

    def failing(argv, workers, **kwargs):
        seen.update(argv=argv, workers=workers, module=kwargs["module"])
        return 1

    monkeypatch.setattr(launch, "launch_local", failing)
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    with pytest.raises(fullgraph.FullgraphError, match="a worker failed"):
        fullgraph.fit(ds, strategy="data", workers=2, epochs=1, partitioner="chunk")
    assert seen["workers"] == 2 and seen["module"] == "fullgraph.api"
    assert seen["argv"][:2] == ["train", "--config"]


def test_the_worker_entry_point_alone_says_what_it_is(monkeypatch, capsys) -> None:
    from fullgraph.api import RESULT_ENV, _worker_main

    monkeypatch.delenv(RESULT_ENV, raising=False)
    assert _worker_main(["train", "--epochs", "1"]) == 2
    assert "use `fullgraph train`" in capsys.readouterr().err
