"""A user's own model class through every entry point: ``--model file.py:Class`` and
``module:Class`` on the command line, ``fit(model=Class)`` in this process and on
launched workers, ``--model-options``, saved models read back from elsewhere, and one
clear error for each thing that can be wrong with a reference."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import fullgraph
from fullgraph.cli import main
from fullgraph.config import ModelConfig
from fullgraph.errors import ConfigError
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.models.custom import format_options, parse_options, resolve

MODELS_DIR = Path(__file__).parent / "models"
FILE_REF = f"{MODELS_DIR / 'user_gnn.py'}:GatedGCN"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(autouse=True)
def own_import_state(monkeypatch):
    """Each test finds its model modules afresh: resolving a model puts directories on
    sys.path and modules in sys.modules, which would let a later test pass for the
    wrong reason."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "user_gnn" or name.startswith("fullgraph_model_"):
            del sys.modules[name]


def small():
    return sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)


def test_a_file_reference_trains_saves_and_loads_from_another_directory(
        root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(MODELS_DIR)
    model_file = tmp_path / "gated.pt"
    assert main(["train", "--model", "user_gnn.py:GatedGCN", "--model-options", "norm=mean",
                 "--epochs", "3", "--progress", "off", "--save-model", str(model_file)]) == 0
    out = capsys.readouterr().out
    assert f"model    gated-gcn ({FILE_REF}, options norm=mean):" in out
    monkeypatch.chdir(tmp_path)  # the saved model names the file by its absolute path
    saved = fullgraph.load_model(model_file)
    assert saved.meta["model"]["name"] == FILE_REF
    assert saved.meta["model"]["options"]["norm"] == "mean"
    assert type(saved.program).__name__ == "GatedGCN"
    assert main(["evaluate", "--model", str(model_file)]) == 0
    assert "test  accuracy" in capsys.readouterr().out


def test_a_module_reference_is_found_in_the_working_directory(root, monkeypatch, capsys):
    monkeypatch.chdir(MODELS_DIR)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(MODELS_DIR))])
    monkeypatch.delitem(sys.modules, "user_gnn", raising=False)  # found here, not cached
    assert main(["train", "--model", "user_gnn:GatedGCN", "--epochs", "2", "--progress",
                 "off"]) == 0
    assert "model    gated-gcn (user_gnn:GatedGCN)" in capsys.readouterr().out


def test_fit_takes_the_class_and_its_options(monkeypatch):
    monkeypatch.syspath_prepend(str(MODELS_DIR))
    from user_gnn import GatedGCN

    opts = dict(epochs=3, hidden=5, lr=0.05)
    result = fullgraph.fit(small(), model=GatedGCN, model_options={"norm": "sum"}, **opts)
    assert result.config.model.name == "user_gnn:GatedGCN"
    assert result.config.model.options == 'norm="sum"'
    assert isinstance(result.model.program, GatedGCN)
    assert result.model.meta["model"]["options"]["norm"] == "sum"
    by_name = fullgraph.fit(small(), model="user_gnn:GatedGCN", model_options='norm="sum"',
                            **opts)
    assert by_name.losses == result.losses
    other = fullgraph.fit(small(), model=GatedGCN, model_options={"norm": "gcn"}, **opts)
    assert other.losses != result.losses  # the option reached conv()


@pytest.mark.dist
def test_launched_workers_import_the_class_as_the_caller_did(monkeypatch):
    """The class's module is on this process's sys.path only: the workers get it."""
    monkeypatch.syspath_prepend(str(MODELS_DIR))
    from user_gnn import GatedGCN

    opts = dict(model=GatedGCN, epochs=3, hidden=5, lr=0.05)
    here = fullgraph.fit(small(), **opts)
    launched = fullgraph.fit(small(), strategy="data", workers=2, **opts)
    assert launched.losses == pytest.approx(here.losses, rel=1e-5)
    for p, q in zip(launched.model.parameters(), here.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_a_class_only_this_process_has_trains_here_and_is_refused_for_workers():
    from fullgraph.models import GCN

    class Local(GCN):
        pass

    result = fullgraph.fit(small(), model=Local, epochs=1, hidden=5)
    assert "<locals>" in result.config.model.name
    for strategy in ("data", "auto"):  # auto: before the planner's probe workers, too
        with pytest.raises(ConfigError, match="which the workers cannot import; move it "
                           "to a module or a .py file, or train it with workers=1"):
            fullgraph.fit(small(), model=Local, strategy=strategy, workers=2, epochs=1)


def test_a_file_that_trains_when_imported_is_refused_with_the_fix(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("import fullgraph\nfrom fullgraph.models import GCN\n\n"
                      "class Mine(GCN):\n    pass\n\n"
                      "fullgraph.fit('cora', model=Mine, epochs=1)\n")
    with pytest.raises(ConfigError, match='call fit under `if __name__ == "__main__":`'):
        resolve(f"{script}:Mine")


@pytest.mark.parametrize("name,needle", [
    ("mlp", "expected gcn | sage | gat | gin | tagcn, or module:Class"),
    ("no_such_module_here:Net", "no module named 'no_such_module_here'"),
    (f"{FILE_REF.rpartition(':')[0]}:Missing", "has no attribute 'Missing'"),
    (f"{FILE_REF.rpartition(':')[0]}:NotAModel", "NotAModel is not a subclass of "
     "fullgraph.models.GNN"),
    ("fullgraph.models.stages:Propagate", "Propagate is not a subclass"),
    ("/no/such/dir/model.py:Net", "/no/such/dir/model.py is not a file"),
])
def test_bad_references_are_one_clear_error(name, needle):
    with pytest.raises(ConfigError, match=needle.replace("|", r"\|")):
        ModelConfig(name=name)


def test_a_file_that_fails_to_import_names_the_file_and_the_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def oops(:\n")
    with pytest.raises(ConfigError, match=f"importing {bad} failed: SyntaxError"):
        ModelConfig(name=f"{bad}:Net")
    missing_dep = tmp_path / "needs.py"
    missing_dep.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match="No module named 'no_such_dependency_xyz'"):
        ModelConfig(name=f"{missing_dep}:Net")


def test_a_model_file_edited_between_fits_trains_its_new_class(tmp_path):
    """A notebook edits the file and fits again: the process trains the edited class, as
    launched workers would (they import it afresh); a file broken by the edit is one
    error, and the earlier class stays usable."""
    model_file = tmp_path / "editme.py"
    ref = f"{model_file}:Net"

    def fit(base: str) -> list[float]:
        model_file.write_text(f"from fullgraph.models import {base}\n\n"
                              f"class Net({base}):\n    pass\n")
        return [r["loss"] for r in fullgraph.fit(small(), model=ref, epochs=2).history]

    gcn, sage = fit("GCN"), fit("GraphSAGE")
    assert gcn != sage
    assert sage == [r["loss"] for r in fullgraph.fit(small(), model="sage", epochs=2).history]
    earlier = resolve(ref)
    assert earlier.__mro__[1].__name__ == "GraphSAGE"
    # an edit of the same size within the same second: the bytes read are the ones run,
    # not the bytecode cached for the file's size and modification time
    same = tmp_path / "same.py"
    for letter in "AB":
        same.write_text(f"from fullgraph.models import GCN\nWHICH = {letter * 3!r}\n\n\n"
                        "class Net(GCN):\n    pass\n")
        os.utime(same, ns=(10**18, 10**18))
        assert sys.modules[resolve(f"{same}:Net").__module__].WHICH == letter * 3
    model_file.write_text("def oops(:\n")
    with pytest.raises(ConfigError, match="SyntaxError"):
        resolve(ref)
    assert sys.modules[earlier.__module__].Net is earlier  # pickling still finds it


@pytest.mark.parametrize("model,options,needle", [
    ("gin", "foo=1", "model gin takes no option 'foo' (it takes: aggregate_first, eps;"),
    ("gat", "heads=2", "give 'heads' as its own flag, --heads"),
    ("gcn", "num_layers=3", "'num_layers' is an option of every model"),
    ("gcn", "aggregate_first", "'aggregate_first' is not key=value"),
    ("gcn", "aggregate_first=true,aggregate_first=false", "'aggregate_first' is given twice"),
    (FILE_REF, "alpha=1", "takes no option 'alpha' (it takes: norm;"),
])
def test_model_options_the_class_does_not_take_are_refused(model, options, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(name=model, options=options)


def test_model_options_reach_the_model():
    cfg = ModelConfig(name="gin", options="eps=0.25")
    assert cfg.build_options()["eps"] == 0.25
    model = build_model("gin", 9, 5, 3, **cfg.build_options())
    assert model.stages[2].eps == 0.25


def test_options_are_read_as_json_where_they_are_json():
    text = 'a=1,b=0.5,c=true,d=null,e=word,f="x,y",g=[1, 2]'
    assert parse_options(text) == {"a": 1, "b": 0.5, "c": True, "d": None, "e": "word",
                                   "f": "x,y", "g": [1, 2]}
    values = {"n": 3, "s": "a=b,c", "flag": False}
    assert parse_options(format_options(values)) == values
    assert parse_options("") == {}


@pytest.mark.dist
def test_the_readme_example_runs_as_written(root, tmp_path, monkeypatch, capsys):
    """README "Your own model": its file, its two commands (the first on 2 launched
    workers), and the exactness it promises against the single process."""
    import re
    import shlex

    text = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = text.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(# my_models.py\n.*?)```", section, re.S)
    commands = re.search(r"```bash\n(.*?)```", section, re.S)
    assert code and commands, "README.md: the example under '## Your own model' moved"
    (tmp_path / "my_models.py").write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    losses = []
    for line in commands.group(1).splitlines():
        argv = shlex.split(line.split("#", 1)[0])
        assert argv[:2] == ["fullgraph", "train"], line
        assert main([*argv[1:], "--epochs", "3", "--progress", "off", "--metrics-out",
                     str(tmp_path / "m.jsonl")]) == 0, line
        rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if r["event"] == "epoch"])
    out = capsys.readouterr().out
    assert "model    gated-gcn (" in out and "norm=mean" in out
    assert main(["train", "--model", "my_models.py:GatedGCN", "--epochs", "3", "--progress",
                 "off", "--metrics-out", str(tmp_path / "m.jsonl")]) == 0
    rows = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    single = [r["loss"] for r in rows if r["event"] == "epoch"]
    assert losses[0] == pytest.approx(single, rel=1e-5)  # tensor on 2 workers: exact
    assert losses[1] != single  # norm=mean: another model


@pytest.mark.dist
def test_a_script_that_trains_unguarded_fails_fast_naming_the_fix(root, tmp_path):
    """The script's own class, launched: each worker imports the script, which calls
    fit again; the worker refuses, and the launcher names that error (not "died
    without a report")."""
    import subprocess

    script = tmp_path / "train_mine.py"
    script.write_text("import fullgraph\nfrom fullgraph.models import GCN\n\n"
                      "class Mine(GCN):\n    pass\n\n"
                      "fullgraph.fit('cora', model=Mine, strategy='data', workers=2, "
                      "epochs=1, timeout=60)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    first = done.stderr.strip().splitlines()[0]
    assert first.startswith("fullgraph: worker rank ") and "during start-up: ConfigError" in first
    assert 'call fit under `if __name__ == "__main__":`' in first


def test_workers_get_the_directory_of_the_models_package(monkeypatch):
    from fullgraph.models.custom import for_workers

    monkeypatch.syspath_prepend(str(MODELS_DIR))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    paths = for_workers("user_gnn:GatedGCN")["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(MODELS_DIR.resolve()) and paths[-1] == "/somewhere/else"
    assert for_workers("gcn") == {}
    assert for_workers(FILE_REF)["PYTHONPATH"].split(os.pathsep)[-1] == "/somewhere/else"
    fullgraph_root = Path(fullgraph.__file__).parent.parent.resolve()
    assert for_workers("fullgraph.models.gin:GIN")["PYTHONPATH"].startswith(
        str(fullgraph_root))


def test_a_class_of_an_exec_namespace_is_kept_to_this_process():
    from fullgraph.models.custom import reference_of

    namespace: dict = {"__name__": "not_a_module_anywhere"}
    exec("from fullgraph.models import GCN\nclass Made(GCN):\n    pass\n", namespace)
    ref = reference_of(namespace["Made"])
    assert ref == "not_a_module_anywhere:Made"
    assert fullgraph.fit(small(), model=namespace["Made"], epochs=1, hidden=5).losses
    with pytest.raises(ConfigError, match="which the workers cannot import"):
        fullgraph.fit(small(), model=namespace["Made"], strategy="data", workers=2, epochs=1)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    from fullgraph.graph import store

    where = tmp_path_factory.mktemp("check") / "small"
    store.save_dataset(sbm(300, 4, avg_degree=6.0, num_features=16, seed=3), where)
    return where


@pytest.mark.dist
def test_check_finds_a_model_exact_and_one_that_is_not(small_store, capsys):
    assert main(["check", "--model", FILE_REF, "--dataset", str(small_store), "--strategies",
                 "tensor", "--hidden", "8"]) == 0
    out = capsys.readouterr().out
    assert "one process against 2 workers per strategy" in out
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert rows["tensor"].endswith("exact")
    mixing = FILE_REF.replace(":GatedGCN", ":RowMixingGCN")
    assert main(["check", "--model", mixing, "--dataset", str(small_store), "--strategies",
                 "data/depcomm,task", "--hidden", "8", "--dropout", "0"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS from epoch 1 (already in the forward pass)" in out
    # task on 2 workers would be 1:1, its T worker holding every row: it runs 2:1 on 3
    assert "(task on 3, split 2:1, so that its T rows are split)" in out
    assert "not exact: data/depcomm, task" in out


@pytest.mark.dist
def test_check_lists_refusals_and_takes_a_config_files_epochs_and_workers(
        small_store, tmp_path, capsys):
    """p2p refuses batch normalisation before any worker starts: listed, not a failure;
    with nothing compared the check fails. The file's epochs and workers are used; its
    strategy, outputs and patience are ignored, as plan ignores them (they were refused
    as flags never typed)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  epochs: 2\n  metrics-out: m.jsonl\n  patience: 3\nlaunch:\n"
                   "  workers: 3\nstrategy: data\n")
    assert main(["check", "--config", str(cfg), "--model", "gin", "--batch-norm",
                 "--dataset", str(small_store), "--strategies", "p2p"]) == 1
    out = capsys.readouterr().out
    assert "2 epochs from seed 0: one process against 3 workers" in out
    assert "refused: strategy p2p cannot run model 'gin' with statistics over all rows" in out
    assert "nothing compared: every strategy refused this model or setup" in out


def test_an_interrupted_check_stops(monkeypatch, small_store):
    """Ctrl-C ends the launcher with 130: the check stops, it does not go on to the next
    strategy nor report the run as a difference."""
    from fullgraph import exactness, launch
    from fullgraph.config import config_from_dict

    monkeypatch.setattr(launch, "run_local", lambda *a, **k: (130, "fullgraph: interrupted"))
    cfg = config_from_dict({"data": {"dataset": str(small_store)}, "launch": {"workers": 2}})
    with pytest.raises(KeyboardInterrupt):
        exactness.run_checks(cfg, ["tensor"], exactness.prepare(cfg))


@pytest.mark.parametrize("argv,needle", [
    (["--strategy", "data"], "unrecognized arguments: --strategy data"),
    (["--metrics-out", "m.jsonl"], "unrecognized arguments: --metrics-out"),
    (["--workers", "1"], "--workers 1; the strategies need 2 or more"),
    (["--strategies", "data,pipeline"], "--strategies: unknown 'pipeline'; expected some of "
     "data, data/depcomm"),
    (["--strategies", ","], "give at least one strategy"),
    (["--adapt", "adjust+partial"], "check compares exact runs, and --adapt adjust+partial "
     "is approximate by design"),
    (["--device", "cuda:7"], "cuda"),
])
def test_check_refuses_what_it_cannot_compare(argv, needle, capsys):
    """Before any run (the header is not printed), in one line."""
    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    if argv[0] in ("--strategy", "--metrics-out"):  # check has no such flags
        with pytest.raises(SystemExit) as exit_:
            main(["check", *argv])
        assert exit_.value.code == 2
    else:
        assert main(["check", *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and "check: model" not in captured.out


def test_check_takes_the_adaptation_options_the_strategies_take(small_store):
    """The single process it compares with runs without them: exact adaptation and
    injected slowdowns (ranks of the strategies' runs) are checked, not refused; partial
    reduce is exact, and taken, with --staleness 1."""
    from fullgraph import exactness
    from fullgraph.config import config_from_dict

    cfg = config_from_dict({"data": {"dataset": str(small_store)}, "launch": {"workers": 2},
                            "adapt": {"mode": "adjust", "inject": "sleep:ranks=1,at=2,s=0.01"}})
    exactness.prepare(cfg)  # (refused before: the reference had --adapt and rank 1)
    reference = exactness._reference(cfg)
    assert reference.section("adapt").mode == "off" and reference.section("adapt").inject is None
    assert reference.launch.workers == 1 and reference.runtime.strategy == "single"
    exactness.check_config(config_from_dict({"adapt": {"mode": "adjust+partial", "staleness": 1},
                                             "launch": {"workers": 2}}))


@pytest.mark.parametrize("options,forms,said", [
    ({"task_parallel": {"chunks": 4}}, "tensor",
     ["--chunks has no effect with --strategies tensor (only with task)"]),
    ({"data_parallel": {"mode": "hybrid"}}, "data",
     ["--dep-mode has no effect on a check: each data run sets its own"]),
    ({"data_parallel": {"byte_cost": 2e-9}}, "data",
     ["--byte-cost has no effect without data/hybrid in --strategies"]),
    ({"data_parallel": {"byte_cost": 2e-9}}, "data/depcomm,data/hybrid", []),
    ({"task_parallel": {"chunks": 4, "subgraphs": 2}}, "tensor,task", []),
    ({"task_parallel": {"chunks": 4}}, "tensor,task",  # (task's own: no pipeline to chunk)
     ["--chunks 4 has no effect without --subgraphs 2 or more"]),
])
def test_check_names_the_options_none_of_its_runs_uses(options, forms, said):
    """As ``train`` does for its one strategy: an option that no strategy checked reads
    is named, and ``--dep-mode``, which each data run sets itself."""
    from fullgraph import exactness
    from fullgraph.config import config_from_dict

    cfg = config_from_dict(options)
    got = exactness.unused_options(cfg, exactness.parse_forms(forms))
    assert len(got) == len(said) and all(g.startswith(s) for g, s in zip(got, said))


def test_check_refuses_a_dataset_of_one_class(tmp_path, capsys):
    """Its loss is 0 in every run whatever the model computes: a check would call any
    model exact. ``train`` warns instead."""
    from fullgraph.graph import store

    store.save_dataset(sbm(60, 1, avg_degree=4.0, num_features=3, seed=1), tmp_path / "one")
    assert main(["check", "--dataset", str(tmp_path / "one"), "--strategies", "tensor"]) == 2
    captured = capsys.readouterr()
    assert "has 1 class: cross-entropy over one class is 0" in captured.err
    assert "check: model" not in captured.out
    with pytest.warns(UserWarning, match="has 1 class: .* so nothing trains"):
        fullgraph.fit(str(tmp_path / "one"), epochs=1)


def test_a_model_file_imports_the_modules_beside_it_from_any_directory(
        root, tmp_path, monkeypatch, capsys):
    """As ``python file.py`` would; and a class loaded from the file is named by the
    file again, so workers and a saved model find it."""
    from fullgraph.models.custom import reference_of

    home = tmp_path / "project"
    home.mkdir()
    (home / "helper_stages_xyz.py").write_text(
        "from fullgraph.models import Propagate\nfrom fullgraph.models.layers import Dense\n"
        "def layer(i, o, act):\n    return [Dense(i, o, act=act), Propagate(o, 'gcn')]\n")
    (home / "sib_model.py").write_text(
        "from fullgraph.models import GNN\nfrom helper_stages_xyz import layer\n"
        "class Sib(GNN):\n    def conv(self, layer_, i, o, *, act, residual):\n"
        "        return layer(i, o, act)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the file's directory goes on it
    ref = "../project/sib_model.py:Sib"
    assert main(["train", "--model", ref, "--epochs", "1", "--progress", "off"]) == 0
    assert f"model    Sib ({home / 'sib_model.py'}:Sib)" in capsys.readouterr().out
    assert reference_of(resolve(ref)) == f"{home / 'sib_model.py'}:Sib"


@pytest.mark.parametrize("source,argv,needle", [
    ("class Empty(GNN):\n    pass\n", [], "Empty defines no conv(layer, in_dim, out_dim"),
    ("class NoDecoupled(GNN):\n    def conv(self, layer, i, o, *, act, residual):\n"
     "        return [Dense(i, o, act=act)]\n", ["--decoupled"],
     "NoDecoupled defines no propagation(dim, num_props), the stages of its decoupled form"),
    ("class NeedsAlpha(GNN):\n    def __init__(self, *args, alpha, **kw):\n"
     "        self.alpha = alpha\n        super().__init__(*args, **kw)\n", [],
     "model.options: model {ref} needs option 'alpha' (--model-options alpha=VALUE)"),
    ("class Wide(GNN):\n    def conv(self, layer, i, o, *, act, residual):\n"
     "        return [Dense(i, o), Propagate(i, 'gcn')]\n", [],
     "model Wide: stage 2 (Propagate, layer 1) takes 1433 columns but stage 1 (Dense) "
     "gives 16"),
    ("class Two(Transform):\n    def forward(self, x, ctx):\n        return x\n"
     "class TwoArgs(GNN):\n    def conv(self, layer, i, o, *, act, residual):\n"
     "        return [Dense(i, o), Propagate(o, 'gcn'), Two(o, o)]\n", [],
     "model TwoArgs: stage 3 (Two, layer 1) has forward(x, ctx); a Transform's forward "
     "takes (x, ctx, layer_input=None)"),
])
def test_an_incomplete_model_is_one_line(root, tmp_path, capsys, source, argv, needle):
    path = tmp_path / "incomplete.py"
    path.write_text("from fullgraph.models import GNN, Propagate, Transform\n"
                    "from fullgraph.models.layers import Dense\n" + source)
    ref = f"{path}:{source.split('class ')[-1].split('(')[0]}"
    assert main(["train", "--model", ref, "--epochs", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(ref=ref) in err[0], err


def test_a_class_of_its_own_takes_an_option_named_as_a_built_in_models_flag(tmp_path):
    path = tmp_path / "own_heads.py"
    path.write_text("from fullgraph.models import GCN\nclass Heads(GCN):\n"
                    "    def __init__(self, *args, heads=1, **kw):\n"
                    "        self.heads = heads\n        super().__init__(*args, **kw)\n")
    cfg = ModelConfig(name=f"{path}:Heads", options="heads=4")
    assert build_model(cfg.name, 9, 4, 3, **cfg.build_options()).heads == 4
    with pytest.raises(ConfigError, match="give 'heads' as its own flag, --heads"):
        ModelConfig(name="gat", options="heads=4")  # GAT's own: the flag


def test_a_subclass_of_a_built_in_model_takes_its_options(tmp_path):
    path = tmp_path / "subclasses.py"
    path.write_text("from fullgraph.models import GAT, GIN\n"
                    "class MyGAT(GAT):\n    pass\nclass MyGIN(GIN):\n    pass\n")
    cfg = ModelConfig(name=f"{path}:MyGAT", heads=2)
    assert cfg.family == "gat" and cfg.build_options()["heads"] == 2
    model = build_model(cfg.name, 9, 4, 3, **cfg.build_options())
    assert model.stages[2].heads == 2
    cfg = ModelConfig(name=f"{path}:MyGIN", batch_norm=True)
    assert cfg.build_options()["batch_norm"] is True
    assert ModelConfig(name=FILE_REF).family is None


def test_quoted_values_with_backslashes_and_unclosed_quotes():
    values = {"a": "end\\", "b": 1, "c": 'say "hi"'}
    assert parse_options(format_options(values)) == values
    for text in ('norm="mean', "a=[1,2"):
        with pytest.raises(ConfigError, match="is not JSON .an unclosed quote or bracket"):
            parse_options(text)


@pytest.mark.dist
def test_one_workers_start_up_error_ends_the_run_within_the_grace(root, tmp_path, capsys):
    """Rank 1 cannot import the model, rank 0 waits for it at start-up: the launcher
    names rank 1's error and stops rank 0 after GRACE_S, not after --timeout."""
    import time

    path = tmp_path / "rank_one.py"
    path.write_text("import os\nfrom fullgraph.models import GCN\n"
                    "if os.environ.get('RANK') == '1':\n"
                    "    raise ImportError('only rank 1 lacks this')\n"
                    "class Net(GCN):\n    pass\n")
    start = time.monotonic()
    code = main(["train", "--model", f"{path}:Net", "--strategy", "data", "--workers", "2",
                 "--epochs", "1", "--timeout", "120"])
    assert code == 2 and time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert "worker rank 1 failed during start-up: ConfigError" in err
    assert "only rank 1 lacks this" in err


@pytest.mark.dist
def test_check_from_python_on_in_memory_data(monkeypatch):
    """``fullgraph.check`` takes what ``fit`` takes: the class itself, data in memory;
    it compares the accuracies too."""
    monkeypatch.syspath_prepend(str(MODELS_DIR))
    from user_gnn import EvalMixingGCN

    # a stage wrong in evaluation only: the losses agree, the accuracies do not
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    report = fullgraph.check(small(), model=EvalMixingGCN, strategies=["data/depcomm"],
                             hidden=8, dropout=0.0)
    assert torch.equal(torch.rand(3), expected)  # the caller's generator, untouched
    assert isinstance(report, fullgraph.CheckReport)
    assert not report.exact and report.not_exact == ["data/depcomm"]
    outcome = report.outcomes[0]
    assert len(report.reference) == 3 and outcome.first_epoch is None
    assert outcome.accuracy_epoch is not None and outcome.difference < 1e-5
    assert f"DIFFERS in evaluation from epoch {outcome.accuracy_epoch} (the losses agree; " \
        "the accuracies do not: " in str(report)
    with pytest.raises(ConfigError, match=r"name them with --strategies \(strategies= in "
                       r"Python\), not --strategy"):
        fullgraph.check(small(), strategy="data")
    with pytest.raises(ConfigError, match="strategies=: unknown 'dta'"):
        fullgraph.check(small(), strategies="dta")
    with pytest.raises(ConfigError, match="drop --save-model"):
        fullgraph.check(small(), save_model="m.pt")
    with pytest.raises(ConfigError, match="drop --run-dir"):
        fullgraph.check(small(), run_dir="somewhere")
    with pytest.raises(ConfigError, match="check: unknown option 'epoch'"):
        fullgraph.check(small(), epoch=3)


def test_a_config_file_gives_model_options_as_a_mapping(tmp_path):
    from fullgraph.config import config_from_dict, load_config_file

    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  name: {FILE_REF}\n  options:\n    norm: mean\n")
    cfg = config_from_dict(load_config_file(str(path)))
    assert cfg.model.options == 'norm="mean"'
    assert cfg.model.build_options()["norm"] == "mean"


def test_a_value_error_in_an_epoch_is_a_bug_in_one_process_too(root, tmp_path):
    """As on launched workers: an option's ValueError before training is a usage error
    (exit 2, one line); raised in an epoch by the model's code it is a bug, raised with
    its traceback (exit 1)."""
    model_file = tmp_path / "breaks.py"
    model_file.write_text(
        "from fullgraph.models import GCN\n\n\n"
        "class Breaks(GCN):\n"
        "    calls = 0\n\n"
        "    def forward(self, *args, **kwargs):\n"
        "        type(self).calls += 1\n"
        "        if type(self).calls == 3:\n"
        "            raise ValueError('a bug in the model')\n"
        "        return super().forward(*args, **kwargs)\n")
    with pytest.raises(RuntimeError, match=r"failed during epoch \d+ \w+.*: ValueError: a bug"):
        main(["train", "--model", f"{model_file}:Breaks", "--epochs", "5", "--progress", "off"])
    assert main(["train", "--chunks", "-1", "--strategy", "tensor"]) == 2


def test_a_wrapped_forward_is_checked_by_its_own_signature():
    """A decorator that adapts a 2-argument forward to the walker's 3 (functools.wraps
    copies the inner signature into ``__wrapped__``) is called by its own signature."""
    import functools

    from fullgraph.models.stages import LayerInput, StageProgram, Transform

    def adapt(f):
        @functools.wraps(f)
        def call(self, x, ctx, layer_input=None):
            return f(self, x, ctx)
        return call

    class Twice(Transform):
        @adapt
        def forward(self, x, ctx):
            return 2 * x

    program = StageProgram([LayerInput(4, 0.0), Twice(4, 4)], self_loops=False, name="m")
    assert program.signature() == "TT"


class _Widen(fullgraph.models.Transform):
    """Declares ``dim`` columns and returns one more: a user's slip."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim)

    def forward(self, x, ctx, layer_input=None):
        return torch.cat([x, x[:, :1]], 1)


class _LastWide(fullgraph.models.GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        from fullgraph.models.layers import Dense

        return [Dense(in_dim, out_dim, act=act), fullgraph.models.Propagate(out_dim, "gcn"),
                *([_Widen(out_dim)] if layer == self.num_layers - 1 else [])]


def test_a_stage_returning_another_width_than_it_declares_is_named():
    """In the last layer it trained over a class that does not exist, and check called
    it exact; in a hidden one a later product failed with torch's shape error."""
    with pytest.raises(ConfigError, match=r"model .*: stage \d+ \(_Widen, layer 2\) declares "
                       r"3 output columns but returned a tensor of shape \(67, 4\)"):
        fullgraph.fit(small(), model=_LastWide, epochs=1, hidden=4)


class _PlainLinear(fullgraph.models.GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [torch.nn.Linear(in_dim, out_dim), fullgraph.models.Propagate(out_dim, "gcn")]


class _Slice(fullgraph.models.Transform):
    """The first ``out_dim`` columns: no weights."""

    def forward(self, x, ctx, layer_input=None):
        return x[:, :self.out_dim]


class _NoWeights(fullgraph.models.GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [fullgraph.models.Propagate(in_dim, "gcn"), _Slice(in_dim, out_dim)]


def test_a_stage_of_no_known_kind_and_a_model_without_weights_are_one_error():
    """They ended in AttributeError tracebacks and in Adam's 'optimizer got an empty
    parameter list'."""
    with pytest.raises(ValueError, match=r"stage 1 \(layer 1\) is a Linear, not a "
                       "Transform, EdgeTransform or Propagate"):
        fullgraph.fit(small(), model=_PlainLinear, epochs=1, hidden=4)
    with pytest.raises(ConfigError, match="_NoWeights: it has no trainable parameters"):
        fullgraph.fit(small(), model=_NoWeights, epochs=1, hidden=4)


def test_residual_ignored_by_a_users_conv_is_named_so():
    """The warning blamed the widths, though layer 2 kept its width: the class dropped
    the residual= it was given."""
    with pytest.warns(UserWarning, match=r"GatedGCN's conv\(\) does not apply residual=True, "
                      r"which layer 2 \(keeping its width\) was given"):
        fullgraph.fit(small(), model=FILE_REF, epochs=1, hidden=4, layers=3, residual=True)


def test_check_splits_both_task_groups_where_it_chooses_the_split():
    from fullgraph import exactness
    from fullgraph.config import config_from_dict

    def split(workers, **task):
        return exactness.task_split(config_from_dict(
            {"launch": {"workers": workers}, "task_parallel": task}))

    assert [split(w) for w in (2, 3, 4, 5)] == [(3, "2:1"), (3, "2:1"), (4, "2:2"), (5, "2:3")]
    assert split(4, split="1:3") is None  # the user's


class _CentreUndeclared(fullgraph.models.Transform):
    """Column means over all vertices through ctx.sum_rows, without reduces_rows."""

    def forward(self, x, ctx, layer_input=None):
        return x - ctx.sum_rows(x) / 67.0


class _UndeclaredSum(fullgraph.models.GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        from fullgraph.models.layers import Dense

        return [Dense(in_dim, out_dim, act=act), _CentreUndeclared(out_dim, out_dim),
                fullgraph.models.Propagate(out_dim, "gcn")]


def test_a_stage_summing_rows_without_declaring_it_is_refused_everywhere():
    """p2p's bins and tensor's row blocks summed over their own rows only, silently; one
    process and data parallelism summed over all. Every executor now refuses it."""
    with pytest.raises(ConfigError, match=r"stage 2 \(_CentreUndeclared\) calls ctx.sum_rows "
                       "without declaring reduces_rows = True"):
        fullgraph.fit(small(), model=_UndeclaredSum, epochs=1, hidden=4)


@pytest.mark.dist
def test_check_shows_what_the_models_training_warns_of_once(small_store, capfd):
    """Its runs were all quiet: a model whose conv() drops residual=True passed without
    the word that train says."""
    assert main(["check", "--model", FILE_REF, "--dataset", str(small_store), "--strategies",
                 "data/depcomm", "--hidden", "8", "--layers", "3", "--residual"]) == 0
    err = capfd.readouterr().err
    assert err.count("does not apply residual=True") == 1, err


def test_workers_get_the_directories_the_caller_put_on_its_path(monkeypatch, tmp_path):
    """A model module importing a helper the caller found through ``sys.path.insert``
    or ``append`` (a notebook's habit) trained at workers=1 and failed at 2: "No module
    named 'helpers'". The interpreter's own directories are not passed on, and an
    appended directory stays after site-packages (it would shadow installed
    packages)."""
    import site

    from fullgraph.models.custom import for_workers

    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "helpers.py").write_text("SCALE = 1.0\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "netmod.py").write_text(
        "from helpers import SCALE\nfrom fullgraph.models import GCN\n\n\n"
        "class Net(GCN):\n    scale = SCALE\n")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    sys.path.append(str(tmp_path / "libs"))  # (after site-packages: it stays after them)
    monkeypatch.syspath_prepend(str(tmp_path / "models"))
    from netmod import Net

    env = for_workers("netmod:Net")
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert str((tmp_path / "models").resolve()) in paths
    assert str((tmp_path / "libs").resolve()) in env["FULLGRAPH_PATH_AFTER"].split(os.pathsep)
    assert not set(paths) & {str(Path(p).resolve()) for p in site.getsitepackages()}
    result = fullgraph.fit(small(), model=Net, strategy="data", workers=2, epochs=2, hidden=5)
    assert len(result.losses) == 2


def test_a_class_of_a_script_run_as_a_module_is_imported_by_that_name(tmp_path):
    """``python -m pkg.train`` with ``from .layers import ...``: the class was recorded
    by the script's path, and the workers ran the file alone, where a relative import
    fails."""
    import subprocess

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layers.py").write_text("from fullgraph.models import GCN\n\n\n"
                                   "class Base(GCN):\n    pass\n")
    (pkg / "train.py").write_text(
        "from .layers import Base\n\n\nclass Net(Base):\n    pass\n\n\n"
        "if __name__ == '__main__':\n"
        "    import fullgraph\n"
        "    from fullgraph.graph.synthetic import sbm\n"
        "    data = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)\n"
        "    r = fullgraph.fit(data, model=Net, strategy='data', workers=2, epochs=2, "
        "hidden=5, save_model='net.pt')\n"
        "    print(r.config.model.name, len(r.losses))\n")
    def python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, text=True,
                              capture_output=True, timeout=300)

    done = python("-m", "mypkg.train")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mypkg.train:Net", "2"]
    loaded = python("-c", "import fullgraph; print(type(fullgraph.load_model('net.pt')"
                    ".program).__name__)")
    assert loaded.stdout.strip() == "Net", loaded.stderr
    # unguarded, each worker imported it and started workers of its own
    (pkg / "loose.py").write_text(
        "import fullgraph\nfrom fullgraph.graph.synthetic import sbm\n"
        "from .layers import Base\n\n\nclass Net(Base):\n    pass\n\n\n"
        "fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), model=Net, "
        "strategy='data', workers=2, epochs=1, hidden=5)\n")
    loose = python("-m", "mypkg.loose")
    assert loose.returncode != 0 and "fit: called while mypkg.loose was imported for its " \
        "model class; call fit under `if __name__ == \"__main__\":`" in loose.stderr, \
        loose.stderr


def test_a_model_of_a_notebooks_class_saves_with_a_warning_and_loads_where_it_is_defined(
        tmp_path, monkeypatch):
    """Saved without a word, such a file could be loaded nowhere, and the refusal spoke
    of workers."""
    import types

    from fullgraph.models import GCN, custom

    notebook = types.ModuleType("__main__")  # a notebook's __main__: no file
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    Cell = type("Cell", (GCN,), {"__module__": "__main__"})
    notebook.Cell = Cell
    result = fullgraph.fit(small(), model=Cell, epochs=1, hidden=5)
    with pytest.warns(UserWarning, match="loads only where that class is defined again"):
        result.model.save(tmp_path / "cell.pt")
    monkeypatch.setattr(custom, "_known", {})  # a new session that ran the cell again
    assert type(fullgraph.load_model(tmp_path / "cell.pt").program) is Cell
    del notebook.Cell  # one that did not
    with pytest.raises(ConfigError, match=r"its class __main__:Cell was defined in the "
                       r"process that trained it \(a notebook cell\), not in a module; "
                       "define that class in this process's __main__"):
        fullgraph.load_model(tmp_path / "cell.pt")


STAGE_RULES = '''
import torch
from torch import nn

from fullgraph.models import GNN, EdgeTransform, Propagate, Transform
from fullgraph.models.layers import Dense
from fullgraph.models.stages import LayerInput
from fullgraph.ops.edge_softmax import edge_softmax


class NoWidth(EdgeTransform):
    def __init__(self, dim):
        super().__init__()  # sets neither in_dim nor heads
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, graph, x_dst, x_src, ctx):
        src, dst = graph.indices.long(), graph.dst_index().long()
        return edge_softmax(graph, self.w(x_src)[src] + self.w(x_dst)[dst])


class ThreeHeads(NoWidth):
    heads = 3

    def __init__(self, dim):
        super().__init__(dim)
        self.in_dim = self.out_dim = dim
        self.w = nn.Linear(dim, 3, bias=False)


class NoWidthGNN(GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [Dense(in_dim, out_dim, bias=False), NoWidth(out_dim),
                Propagate(out_dim, "edge"), Dense(out_dim, out_dim, linear=False, act=act)]


class BadHeadsGNN(GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [Dense(in_dim, out_dim, bias=False), ThreeHeads(out_dim),
                Propagate(out_dim, "edge"), Dense(out_dim, out_dim, linear=False, act=act)]


class TiedGNN(GNN):
    """Layers after the first share one weight, kept on self by conv()."""

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        if layer and in_dim == out_dim:
            if not hasattr(self, "tied"):
                self.tied = Dense(in_dim, out_dim, bias=False)
            first = self.tied
        else:
            first = Dense(in_dim, out_dim, bias=False)
        return [first, Propagate(out_dim, "gcn"), Dense(out_dim, out_dim, linear=False, act=act)]


class KeepsFirstRows(GNN):
    """GCNII's initial residual: the first layer opens a layer input of its own (its
    projected rows), which every later layer reads."""

    def conv(self, layer, in_dim, out_dim, *, act, residual):
        if layer == 0:
            return [Dense(in_dim, out_dim, act=act), LayerInput(out_dim, 0.0),
                    Propagate(out_dim, "gcn"), Dense(out_dim, out_dim, linear=False)]
        return [Dense(in_dim, out_dim, bias=False), Propagate(out_dim, "gcn"),
                Dense(out_dim, out_dim, linear=False, act=act)]


class TorchNormGNN(GNN):
    def conv(self, layer, in_dim, out_dim, *, act, residual):
        return [Dense(in_dim, out_dim, bias=False), Propagate(out_dim, "gcn"), Norm(out_dim)]


class Norm(Transform):
    def __init__(self, dim):
        super().__init__(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x, ctx, layer_input=None):
        return self.bn(x)
'''


def test_stage_rules_a_user_meets_are_said_at_build(tmp_path):
    """An E stage without in_dim crashed every run deep in an executor, and heads that
    do not divide the columns crashed mid-epoch; each is now one error at build."""
    (tmp_path / "rules.py").write_text(STAGE_RULES)
    with pytest.raises(ValueError, match=r"model NoWidthGNN: stage 2 \(NoWidth, layer 1\), "
                                         r"an EdgeTransform, sets no in_dim .* call "
                                         r"super\(\).__init__\(5\)"):
        build_model(f"{tmp_path / 'rules.py'}:NoWidthGNN", 9, 5, 3)
    with pytest.raises(ValueError, match=r"stage 3 \(Propagate, layer 1\) weighs 5 columns by "
                                         r"the 3 heads of stage 2 \(ThreeHeads\)"):
        build_model(f"{tmp_path / 'rules.py'}:BadHeadsGNN", 9, 5, 3)


def test_conv_may_keep_a_shared_module_on_self_and_embed_finds_the_layers(tmp_path):
    """conv() ran before nn.Module.__init__, so a layer shared by several (weights
    tied) kept on self raised torch's "cannot assign module before Module.__init__()";
    and embed took the first LayerInputs as the layers' starts, so a conv() opening a
    layer input of its own (GCNII) got the wrong rows."""
    (tmp_path / "rules.py").write_text(STAGE_RULES)
    tied = build_model(f"{tmp_path / 'rules.py'}:TiedGNN", 9, 5, 3, num_layers=4)
    assert tied.stages[5] is tied.stages[9] is tied.tied  # layers 2 and 3 share it
    data = small()
    result = fullgraph.fit(data, model=f"{tmp_path / 'rules.py'}:KeepsFirstRows", epochs=2,
                           layers=3, hidden=5)
    model = result.model
    starts = [s.index for s in model.program.stages if type(s).__name__ == "LayerInput"]
    assert model.program.layer_starts != starts[:3]  # (the layer input conv() opened)
    out = model.embed(data.graph, data.data.features)
    assert out.shape == (data.graph.num_nodes, 5)
    last = model.program.layer_starts[-1]
    assert torch.allclose(out, model._run(data.graph, data.data.features, stop=last))


def test_a_torch_batch_norm_in_a_stage_is_named_where_the_run_is_not_exact(tmp_path, root):
    """nn.BatchNorm1d in a stage differs under every strategy but single (statistics over
    a worker's rows), and plain train ran on without a word."""
    (tmp_path / "rules.py").write_text(STAGE_RULES)
    with pytest.warns(UserWarning, match=r"stage 3 \(Norm\) of TorchNormGNN holds torch's "
                                         r"BatchNorm1d, which --strategy tensor does not run "
                                         r"as one process does .*GlobalBatchNorm"):
        assert main(["train", "--model", f"{tmp_path / 'rules.py'}:TorchNormGNN",
                     "--strategy", "tensor", "--epochs", "1", "--progress", "off"]) == 0


def test_a_saved_module_model_says_where_training_found_it(tmp_path, monkeypatch, capsys, root):
    """A model named module:Class loaded only from the directory it was trained in,
    and the error did not say which."""
    pkg = tmp_path / "lab" / "labmodels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layers.py").write_text((MODELS_DIR / "user_gnn.py").read_text())
    monkeypatch.chdir(tmp_path / "lab")
    assert main(["train", "--model", "labmodels.layers:GatedGCN", "--epochs", "1",
                 "--progress", "off", "--save-model", str(tmp_path / "m.pt")]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path / "lab"))])
    for name in [n for n in sys.modules if n.startswith("labmodels")]:
        monkeypatch.delitem(sys.modules, name)
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tmp_path / "m.pt")]) == 2
    assert f"it was found in {tmp_path / 'lab'}: run from there or add it to PYTHONPATH" in \
        capsys.readouterr().err


@pytest.mark.dist
def test_check_from_python_raises_its_workers_warnings_as_python_warnings(tmp_path, capfd):
    """fullgraph.check printed its launched runs' warnings as CLI lines on stderr where
    fit raises them as Python warnings of the caller."""
    import warnings

    (tmp_path / "rules.py").write_text(STAGE_RULES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fullgraph.check(small(), model=f"{tmp_path / 'rules.py'}:TiedGNN", residual=True,
                        layers=3, hidden=5, strategies=["data"], epochs=1)
    said = [w for w in caught if "--residual has no effect here" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    assert "warning" not in capfd.readouterr().err
