"""``fullgraph.fit``, the Python API: the README example as written, launched workers
returning the single-process model, PyG ``Data`` (real and duck-typed) and bad input."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import warnings
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
    (lambda: fullgraph.fit(42, epochs=1),
     "a PyG Data with x, y and edge_index \\(or adj_t\\); got int"),
    (lambda: fullgraph.fit("cora", model="gnc"), "fit: model: got 'gnc'"),
    (lambda: fullgraph.fit("cora", dataset="x"), "first argument"),
    (lambda: fullgraph.fit("cora", verbose="yes"), "verbose must be True or False, got 'yes'"),
    (lambda: fullgraph.fit("cora", model=fullgraph.models.build_model("gcn", 4, 8, 3)),
     "^fit: model must be a name .* got an instance of GCN \\(pass the class, not an "),
])
def test_bad_input_is_one_clear_error(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


def test_a_failed_launch_raises_naming_the_cause(monkeypatch) -> None:
    """A worker failure (the launcher's non-zero exit) is an error that carries the
    launcher's first line (rank, phase, error), not an empty result."""
    from fullgraph import launch

    seen = {}

    def failing(argv, workers, **kwargs):
        seen.update(argv=argv, workers=workers, module=kwargs["module"])
        return 1, ("fullgraph: worker rank 1 failed during setup: ValueError: boom\n"
                   "fullgraph: ranks [0] stopped after it; logs in /tmp/x")

    monkeypatch.setattr(launch, "run_local", failing)
    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    with pytest.raises(fullgraph.FullgraphError,
                       match=r"^fit: worker rank 1 failed during setup: ValueError: boom "
                             r"\(the whole report"):
        fullgraph.fit(ds, strategy="data", workers=2, epochs=1, partitioner="chunk")
    assert seen["workers"] == 2 and seen["module"] == "fullgraph.api"
    assert seen["argv"][:2] == ["train", "--config"]


def test_a_fit_stopped_by_sigterm_removes_its_copy_of_the_data(monkeypatch) -> None:
    """SIGTERM stops the workers (exit 143): the data's temporary copy is removed before
    the signal is sent on to this process, whose default would end it at once."""
    import os
    import signal

    from fullgraph import launch

    copies, sent = [], []

    def stopped(argv, workers, **kwargs):
        assert kwargs["resignal"] is False  # fit sends it on itself
        copies.append(os.path.dirname(argv[2]))
        return 143, "fullgraph: stopped by SIGTERM; the workers were stopped"

    monkeypatch.setattr(launch, "run_local", stopped)
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    with pytest.raises(fullgraph.FullgraphError, match="stopped by SIGTERM"):
        fullgraph.fit(_random_data(), strategy="data", workers=2, epochs=1)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert not os.path.exists(copies[0])


def test_fit_in_process_warns_at_the_callers_line() -> None:
    """With workers=1 a warning the training raises (here deep in train.py) is shown at
    the caller's call of fit, as the launched workers' warnings are; check's too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fullgraph.fit(_random_data(), epochs=4, lr=1e30)
    diverged = [w for w in caught if "the training diverged" in str(w.message)]
    assert len(diverged) == 1 and diverged[0].filename == __file__, \
        [(str(w.message), w.filename) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fullgraph.fit(_random_data(), epochs=1, residual=True, hidden=7)
    residual = [w for w in caught if "--residual has no effect" in str(w.message)]
    assert len(residual) == 1 and residual[0].filename == __file__


@pytest.mark.dist
def test_launched_workers_warn_the_caller_and_record_the_data_as_given(tmp_path) -> None:
    """A worker's warning is a Python warning of the caller, every fit anew (a second fit
    that warns alike is not left silent), and the metrics file's run record names the
    data as the caller gave it, not the workers' temporary copy."""
    metrics = tmp_path / "run.jsonl"
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fullgraph.fit(_random_data(), strategy="data", workers=2, epochs=4,
                                   lr=1e30, split_seed=5, metrics_out=str(metrics))
        diverged = [w for w in caught if "the training diverged" in str(w.message)]
        assert len(diverged) == 1 and diverged[0].category is UserWarning, \
            [str(w.message) for w in caught]
        assert diverged[0].filename == __file__  # the caller's line
        assert len(result.history) < 4
    run = json.loads(metrics.read_text().splitlines()[0])
    assert run["config"]["data"] == result.config.to_dict()["data"]
    assert (run["config"]["data"]["dataset"], run["config"]["data"]["split_seed"]) == ("pyg", 5)


def test_workers_without_a_distributed_strategy_are_refused_before_launch(
        monkeypatch) -> None:
    from fullgraph import launch

    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ConfigError, match="'single' runs on one worker, not 2.*data, tensor"):
        fullgraph.fit("cora", workers=2, epochs=1)
    tiny = sbm(2, 2, avg_degree=1.0, num_features=3, seed=1)
    with pytest.raises(ConfigError, match="3 workers for a graph of 2 vertices"):
        fullgraph.fit(tiny, strategy="data", workers=3, epochs=1)


def _random_data(n: int = 100, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(x=torch.randn(n, 8, generator=g),
                           y=torch.randint(0, 3, (n,), generator=g),
                           edge_index=torch.randint(0, n, (2, 4 * n), generator=g))


def test_without_validation_vertices_the_last_epoch_is_kept() -> None:
    d = _random_data()
    n = d.x.shape[0]
    d.train_mask, d.test_mask = torch.arange(n) < 60, torch.arange(n) >= 60
    result = fullgraph.fit(d, epochs=12, hidden=8, lr=0.05)
    assert result.best_epoch == 12 and math.isnan(result.val_accuracy)
    assert result.test_accuracy == result.history[-1]["test_acc"]
    with torch.no_grad():
        pred = result.model(d.edge_index, d.x).argmax(1)
    hits = (pred == d.y)[d.test_mask]
    assert float(hits.float().mean()) == pytest.approx(result.test_accuracy)


def test_split_seed_draws_the_split_of_data_without_masks() -> None:
    with pytest.warns(UserWarning, match="repeated edges"):
        runs = [fullgraph.fit(_random_data(), epochs=3, hidden=8, split_seed=seed)
                for seed in (0, 0, 7)]
    assert runs[0].losses == runs[1].losses != runs[2].losses
    assert runs[2].model.meta["data"]["split_seed"] == 7
    with warnings.catch_warnings(record=True) as caught:  # drawn here, not said to be unused
        warnings.simplefilter("always")
        launched = fullgraph.fit(_random_data(), epochs=3, hidden=8, split_seed=7, workers=2,
                                 strategy="data")
    assert not [w for w in caught if "split" in str(w.message)], [str(w.message) for w in caught]
    torch.testing.assert_close(launched.losses, runs[2].losses)


def test_fit_gives_back_the_callers_random_state() -> None:
    draws = []
    for seed in (1, 999):
        torch.manual_seed(seed)
        expected = torch.rand(3, generator=torch.Generator().manual_seed(seed))
        fullgraph.fit(sbm(40, 2, avg_degree=4.0, num_features=5, seed=3), epochs=1)
        draws.append(torch.rand(3))
        assert torch.equal(draws[-1], expected)
    assert not torch.equal(*draws)


def test_fit_in_process_ignores_the_callers_dtype_grad_mode_and_threads() -> None:
    """A notebook's float64 default or no_grad block must not change the run (launched
    workers never see them), and fit's threads stay its own."""
    data = sbm(40, 2, avg_degree=4.0, num_features=5, seed=3)

    def losses(**options: object) -> list[float]:
        return [row["loss"] for row in fullgraph.fit(data, epochs=2, **options).history]

    expected = losses()
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert losses() == expected
        torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            assert losses() == expected
            assert not torch.is_grad_enabled()
        with torch.inference_mode():
            assert losses() == expected
        assert losses(threads=1) == pytest.approx(expected, rel=1e-5)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_default_dtype(dtype)


def test_repeated_edges_and_edge_weights_are_named_in_warnings() -> None:
    d = _random_data()
    d.edge_index = torch.cat([d.edge_index, d.edge_index[:, :5]], dim=1)
    d.edge_weight = torch.ones(d.edge_index.shape[1])
    with pytest.warns(UserWarning) as caught:
        fullgraph.from_pyg(d)
    text = " | ".join(str(w.message) for w in caught)
    assert "repeated edges in edge_index were dropped" in text
    assert "edge_weight not used" in text


def test_num_classes_states_classes_the_labels_leave_unused() -> None:
    d = _random_data(40)
    d.y[d.y == 2] = 30  # 31 classes, 3 of them used by 40 vertices: implausible
    with pytest.raises(fullgraph.DataError, match="num_classes"):
        fullgraph.fit(d, epochs=1)
    assert fullgraph.fit(d, epochs=1, num_classes=31).model.program.out_dim == 31
    with pytest.raises(ConfigError, match="num_classes applies to a PyG Data"):
        fullgraph.fit("cora", epochs=1, num_classes=7)


def test_the_saved_model_refuses_inputs_of_the_wrong_shape_or_dtype(tmp_path) -> None:
    d = _random_data()
    model = fullgraph.fit(d, epochs=2, hidden=8).model
    with pytest.raises(ValueError, match=r"edge_index must be a \(2, E\) integer.*\(400, 2\)"):
        model(d.edge_index.t(), d.x)
    with pytest.raises(ValueError, match=r"edge_index must be.*\(3, 400\)"):
        model(torch.cat([d.edge_index, d.edge_index[:1]]), d.x)
    with pytest.raises(ValueError, match=r"features must be an \(N, F\) matrix"):
        model(d.edge_index, d.x[0])
    with pytest.raises(ValueError, match="float32 or float64; its parameters are float16"):
        model.half()(d.edge_index, d.x.half())
    model.double().save(tmp_path / "m.pt")
    assert next(fullgraph.load_model(tmp_path / "m.pt").parameters()).dtype == torch.float64


def test_the_saved_model_takes_numpy_and_scipy_features() -> None:
    import scipy.sparse as sp

    d = _random_data()
    model = fullgraph.fit(d, epochs=1, hidden=4).model
    want = model(d.edge_index, d.x)
    torch.testing.assert_close(model(d.edge_index.numpy(), d.x.numpy()), want)
    torch.testing.assert_close(model(d.edge_index, sp.csr_matrix(d.x.numpy())), want)


def test_tab_completion_offers_the_api() -> None:
    assert {"fit", "check", "FitResult", "SavedModel", "from_pyg", "to_pyg",
            "load_model"} <= set(dir(fullgraph))


def test_the_saved_model_in_training_mode_draws_new_dropout_masks() -> None:
    d = _random_data()
    model = fullgraph.fit(d, epochs=2, hidden=8).model
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(d.edge_index, d.x), model(d.edge_index, d.x))
        model.train()
        assert not torch.equal(model(d.edge_index, d.x), model(d.edge_index, d.x))


def test_the_result_prints_briefly() -> None:
    result = fullgraph.fit(sbm(40, 2, avg_degree=4.0, num_features=5, seed=3), epochs=2)
    assert repr(result).startswith("FitResult(test_accuracy=") and "'gcn'" in repr(result)
    assert len(repr(result)) < 200


def test_the_worker_entry_point_alone_says_what_it_is(monkeypatch, capsys) -> None:
    from fullgraph.api import RESULT_ENV, _worker_main

    monkeypatch.delenv(RESULT_ENV, raising=False)
    assert _worker_main(["train", "--epochs", "1"]) == 2
    assert "use `fullgraph train`" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin", "tagcn"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_embeddings_are_the_last_hidden_layer(name, decoupled) -> None:
    """(N, hidden) for every model and form; a decoupled TAGCN's filter opens with a
    dropout-free LayerInput of its own, which is not a layer (it gave (N, classes))."""
    from fullgraph.models import build_model
    from fullgraph.saved import SavedModel

    ds = sbm(40, 3, num_features=6, seed=2)
    for layers in (1, 2):
        program = build_model(name, 6, 8, 3, num_layers=layers, decoupled=decoupled)
        model = SavedModel(program, {}).eval()
        if layers == 1:
            with pytest.raises(ValueError, match="a one-layer model has no hidden layer"):
                model.embed(ds.graph, ds.data.features)
        else:
            width = 8 * 8 if name == "gat" and not decoupled else 8  # 8 heads, concatenated
            assert model.embed(ds.graph, ds.data.features).shape == (40, width)


@pytest.mark.parametrize("change,match", [
    ("nan", "features\\[5, 2\\]: feature is not finite"),
    ("overlap", "masks overlap"),
    ("classes", "at least one class"),
])
def test_an_inconsistent_dataset_is_refused_in_this_process_as_on_workers(change, match):
    from fullgraph.errors import ValidationError
    from fullgraph.graph.data import Dataset

    base = sbm(60, 3, avg_degree=4.0, num_features=5, seed=2)
    d = base.data
    if change == "nan":
        x = d.features.clone()
        x[5, 2] = float("nan")
        d = dataclasses.replace(d, features=x)
    elif change == "overlap":
        d = dataclasses.replace(d, test_mask=d.train_mask.clone())
    else:
        d = dataclasses.replace(d, num_classes=0)
    with pytest.raises(ValidationError, match=match):
        fullgraph.fit(Dataset("bad", base.graph, d, {}), epochs=2)


def test_workers_warnings_keep_their_category_and_point_at_the_caller(tmp_path) -> None:
    """Each (category, message) once, its category found where this process has its
    module (a scipy warning stays a scipy warning), attributed to the caller's line."""
    import scipy.sparse as sp

    from fullgraph.api import _warn_as_workers_did

    prefix = tmp_path / "warnings"
    lines = [{"module": "scipy.sparse._base", "category": "SparseEfficiencyWarning",
              "message": "expensive"},
             {"module": "builtins", "category": "RuntimeWarning", "message": "overflow"},
             {"module": "not.imported", "category": "Odd", "message": "odd"}]
    for rank in (0, 1):  # every rank says the same: raised once
        (tmp_path / f"warnings-rank{rank}.jsonl").write_text(
            "\n".join(json.dumps(line) for line in lines) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_as_workers_did(prefix)
    assert [(w.category, str(w.message)) for w in caught] == [
        (sp.SparseEfficiencyWarning, "expensive"), (RuntimeWarning, "overflow"),
        (UserWarning, "odd")]
    assert {w.filename for w in caught} == {__file__}


def test_warnings_as_errors_do_not_hide_how_a_launched_run_ended(monkeypatch) -> None:
    """With warnings as errors, a worker's warning must not stand in for the run's end:
    SIGTERM is still sent on, Ctrl-C is still an interrupt."""
    import os
    import signal

    from fullgraph import api, launch

    def ended(code):
        def run_local(argv, workers, **kwargs):
            prefix = os.environ[api.WARNINGS_ENV]
            with open(f"{prefix}-rank0.jsonl", "w") as f:
                f.write(json.dumps({"module": "builtins", "category": "UserWarning",
                                    "message": "the loss is nan"}) + "\n")
            return code, "fullgraph: stopped"
        return run_local

    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    for code, raised in ((143, fullgraph.FullgraphError), (130, KeyboardInterrupt)):
        monkeypatch.setattr(launch, "run_local", ended(code))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="the loss is nan")  # (the worker's)
            with pytest.raises(raised):
                fullgraph.fit(_random_data(), strategy="data", workers=2, epochs=1)
    assert sent == [signal.SIGTERM]


def test_a_check_stopped_by_sigterm_removes_its_temporary_files(monkeypatch, tmp_path) -> None:
    import os
    import signal
    import tempfile

    from fullgraph import launch

    sent = []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: (143, "fullgraph: stopped"))
    with pytest.raises(fullgraph.FullgraphError, match="check: stopped by SIGTERM"):
        fullgraph.check(_random_data(), strategies="tensor", epochs=1)
    assert sent == [signal.SIGTERM] and list(tmp_path.iterdir()) == []


def test_a_resumed_fit_marks_the_epochs_its_checkpoint_brought(tmp_path) -> None:
    d = _random_data()
    fullgraph.fit(d, epochs=2, hidden=8, checkpoint_dir=str(tmp_path / "ck"))
    again = fullgraph.fit(d, epochs=4, hidden=8, checkpoint_dir=str(tmp_path / "ck"),
                          resume="auto")
    assert [row.get("restored", False) for row in again.history] == [True, True, False, False]
    assert again.losses == fullgraph.fit(d, epochs=4, hidden=8).losses
    with pytest.raises(ConfigError, match="is a training checkpoint, not a saved model"):
        fullgraph.load_model(tmp_path / "ck" / "checkpoint.pt")


def test_numpy_and_torch_scalars_are_taken_as_the_numbers_they_hold() -> None:
    """A sweep's grid hands out np.int64 and np.float32: "model.hidden: got
    np.int64(16) (int64); expected int", and a raw TypeError from json in model_options."""
    import numpy as np

    data = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    plain = fullgraph.fit(data, epochs=2, hidden=8, lr=0.05, dropout=0.25, model="gin",
                          model_options={"eps": 0.5})
    scalars = fullgraph.fit(data, epochs=np.int64(2), hidden=np.int64(8),
                            lr=np.float32(0.05), dropout=torch.tensor(0.25),
                            workers=np.int64(1), model="gin",
                            model_options={"eps": np.float32(0.5)})
    assert scalars.losses == pytest.approx(plain.losses, rel=1e-6)
    with pytest.raises(ConfigError, match=r"model_options: the value of 'eps' \(of type "
                       r"object\) is no option value"):
        fullgraph.fit(data, epochs=1, model="gin", model_options={"eps": object()})


def test_a_val_or_test_mask_without_a_train_mask_is_refused() -> None:
    """They were replaced, silently, by a drawn 60/20/20 split."""
    from fullgraph.errors import FormatError

    d = _random_data()
    d.val_mask, d.test_mask = torch.arange(100) < 20, torch.arange(100) >= 80
    with pytest.raises(FormatError, match="val_mask and test_mask given without train_mask"):
        fullgraph.fit(d, epochs=1)


def test_nan_labels_mark_unlabelled_vertices_as_ogbs_do() -> None:
    d = _random_data()
    d.y = d.y.float()
    d.y[::5] = float("nan")
    as_minus_one = _random_data()
    as_minus_one.y[::5] = -1
    with pytest.warns(UserWarning, match="repeated edges"):
        runs = [fullgraph.fit(x, epochs=2, hidden=8) for x in (d, as_minus_one)]
    assert runs[0].losses == runs[1].losses


def test_options_fit_takes_and_does_not_use_are_named(tmp_path) -> None:
    data = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    with pytest.warns(UserWarning, match="run_dir and keep_run_dir have no effect with "
                      "workers=1"):
        fullgraph.fit(data, epochs=1, run_dir=str(tmp_path / "rd"))
    with pytest.warns(UserWarning, match="split_seed=3 has no effect: the data given has its "
                      "own split"):
        fullgraph.fit(data, epochs=1, split_seed=3)


def test_launched_workers_print_where_the_caller_prints() -> None:
    """Rank 0 wrote to the caller's file descriptor 1: ``redirect_stdout``, a test's
    capture and a notebook's cell (which replace ``sys.stdout``) saw nothing of the
    table that ``workers=1`` prints there."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), strategy="data",
                      workers=2, epochs=2, hidden=5, verbose=True)
    printed = out.getvalue()
    assert "strategy data, 2 worker(s)" in printed and "final test accuracy" in printed


def test_the_adj_t_of_pygs_to_sparse_tensor_is_read_as_its_edges() -> None:
    """``T.ToSparseTensor()`` (as OGB's examples use) replaces edge_index by the
    transposed adjacency adj_t: "lacks an attribute edge_index"."""
    import scipy.sparse as sp

    ds = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    data = to_pyg(ds)
    n, (src, dst) = data.x.shape[0], data.edge_index
    masks = dict(train_mask=data.train_mask, val_mask=data.val_mask, test_mask=data.test_mask)
    given = fullgraph.fit(SimpleNamespace(x=data.x, y=data.y, edge_index=data.edge_index,
                                          **masks), epochs=3, hidden=8)
    ones = torch.ones(src.shape[0])
    forms = {"torch CSR": torch.sparse_coo_tensor(torch.stack([dst, src]), ones, (n, n))
             .to_sparse_csr(),
             "scipy": sp.csr_matrix((ones.numpy(), (dst.numpy(), src.numpy())), shape=(n, n))}
    try:
        import torch_geometric.transforms as T
    except ImportError:
        pass
    else:
        forms["ToSparseTensor"] = T.ToSparseTensor(layout=torch.sparse_csr)(data.clone()).adj_t
    for form, adj_t in forms.items():
        run = fullgraph.fit(SimpleNamespace(x=data.x, y=data.y, adj_t=adj_t, **masks),
                            epochs=3, hidden=8)
        assert run.losses == given.losses, form
    zeros = sp.csr_matrix(forms["scipy"])
    zeros.data[:5] = 0.0  # explicit zeros: no edges (the run is that of the rest)
    kept = zeros.copy()
    kept.eliminate_zeros()
    runs = [fullgraph.fit(SimpleNamespace(x=data.x, y=data.y, adj_t=a, **masks), epochs=2,
                          hidden=8) for a in (zeros, kept)]
    assert runs[0].losses == runs[1].losses
    weighted = forms["scipy"] * 2.0
    with pytest.warns(UserWarning, match="adj_t's values \\(edge weights\\) are not read"):
        fullgraph.fit(SimpleNamespace(x=data.x, y=data.y, adj_t=weighted, **masks), epochs=1)


def test_outputs_and_inputs_given_with_a_tilde_are_in_the_home_directory(tmp_path,
                                                                         monkeypatch) -> None:
    """A path from a config file (``save-model: ~/models/m.pt``) was checked as
    $HOME/... and written to a directory named ``~`` under the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    data = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    fullgraph.fit(data, epochs=1, metrics_out="~/m.jsonl", save_model="~/m.pt")
    assert (home / "m.jsonl").is_file() and (home / "m.pt").is_file()
    assert not (work / "~").exists()
    assert fullgraph.load_model("~/m.pt").meta["model"]["name"] == "gcn"


def test_a_model_on_data_of_more_classes_says_which_it_never_predicts(tmp_path) -> None:
    few = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    model = fullgraph.fit(few, epochs=1).model
    model.save(tmp_path / "m.pt")
    from fullgraph.graph import store

    store.save_dataset(sbm(67, 5, avg_degree=5.0, num_features=9, seed=11), tmp_path / "more")
    with pytest.warns(UserWarning, match="has 5 classes and the model predicts 3: classes "
                      "3-4 are never predicted"):
        load_dataset_for(fullgraph.load_model(tmp_path / "m.pt"), str(tmp_path / "more"))


def test_a_model_on_data_of_other_features_is_refused_naming_the_dataset(tmp_path) -> None:
    from fullgraph.graph import store

    model = fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), epochs=1).model
    store.save_dataset(sbm(67, 3, avg_degree=5.0, num_features=4, seed=11), tmp_path / "narrow")
    with pytest.raises(ConfigError, match="it takes 9 feature columns and dataset '.*narrow' has "
                       "4: give a dataset with the features it was trained on"):
        load_dataset_for(model, str(tmp_path / "narrow"))
