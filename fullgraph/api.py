"""The Python API: ``fullgraph.fit`` trains a model from a notebook or a script.

``fit`` takes a dataset (a name or processed directory, a fullgraph ``Dataset``, or a
PyG ``Data``: any object with ``x``, ``y``, ``edge_index`` and optionally the three
masks), the options of ``fullgraph train`` as keyword arguments (flag names with
``_`` for ``-``: ``hidden=32``, ``dep_mode="depcache"``, ...), and returns a
``FitResult``: the per-epoch history, the trained model (the best-validation
parameters, on the CPU) and its test accuracy.

With ``workers=1`` it trains in this process. With more it starts local workers with
the launcher of ``fullgraph train --workers N``: an in-memory dataset is first
written once as a processed dataset in a temporary directory, the options go to the
workers as a config file, and rank 0 hands back the history and the model's
parameters through a file. Every strategy replicates the parameters on each worker
and is exact, so rank 0's model is the model (and equals the single-process one up
to float rounding). Run as ``python -m fullgraph.api train --config FILE``, this
module is that worker entry point.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fullgraph.errors import ConfigError, FullgraphError
from fullgraph.exactness import DEFAULT_FORMS as DEFAULT_CHECKED
from fullgraph.worker import WARNINGS_ENV, warnings_recorded

if TYPE_CHECKING:
    from fullgraph.exactness import CheckReport
    from fullgraph.saved import SavedModel

RESULT_ENV = "FULLGRAPH_FIT_RESULT"
"""Where rank 0 of a launched ``fit`` writes its result (set for the workers)."""
QUIET_ENV = "FULLGRAPH_FIT_QUIET"
"""Set for the workers of a ``fit`` that is not verbose: rank 0 prints no table."""
DATA_ENV = "FULLGRAPH_FIT_DATA"
"""The data options as the caller of ``fit`` gave them (JSON), where the workers read a
temporary copy: what ``metrics_out``'s run record names."""


@dataclass
class FitResult:
    """What ``fit`` returns.

    Attributes:
        history: one dict per epoch run (fewer than ``epochs`` where ``patience=``
            stopped the run early): epoch, loss, train_acc, val_acc, test_acc
            (NaN on epochs without evaluation), epoch_s, forward_s, backward_s,
            sync_s (the gradients' all-reduce), optimizer_s, eval_s (the evaluation's
            part of epoch_s), other_s (the rest: the six add up to epoch_s). A run given
            ``resume=`` starts with the checkpoint's epochs, each marked
            ``"restored": True`` (as in ``metrics_out``'s file).
        model: the trained model at its best-validation epoch, on the CPU, in eval
            mode: a ``fullgraph.saved.SavedModel`` (a ``torch.nn.Module``), so
            ``model(edge_index, features)`` gives every vertex's logits,
            ``model.embed(...)`` its last hidden layer, ``model.save(path)`` writes
            what ``fullgraph.load_model`` and ``fullgraph predict`` read, and
            ``model.program`` is the stage program the executors run.
        test_accuracy: test accuracy at the best-validation epoch.
        val_accuracy: the best validation accuracy (NaN without validation vertices).
        train_accuracy: train accuracy at the best-validation epoch.
        best_epoch: the epoch the model is from (the last, without validation
            vertices).
        total_s: seconds of training (without setup; the epochs run here, not those a
            checkpoint brought).
        config: the ``fullgraph.config.Config`` of the run.
    """

    history: list[dict[str, float]]
    model: SavedModel
    test_accuracy: float
    val_accuracy: float
    train_accuracy: float
    best_epoch: int
    total_s: float
    config: Any = field(repr=False)

    def __repr__(self) -> str:  # the history (a dict per epoch) and the model stay out
        return (f"FitResult(test_accuracy={self.test_accuracy:.4f}, "
                f"val_accuracy={self.val_accuracy:.4f}, best_epoch={self.best_epoch}, "
                f"epochs={len(self.history)}, total_s={self.total_s:.2f}, "
                f"model={self.model.meta['model']['name']!r})")

    @property
    def losses(self) -> list[float]:
        """The training loss of every epoch."""
        return [row["loss"] for row in self.history]


def fit(data: Any = "cora", *, model: str | type = "gcn", strategy: str = "single",
        workers: int = 1, epochs: int = 200, verbose: bool = False,
        num_classes: int | None = None, **options: Any) -> FitResult:
    """Train a model on ``data`` and return the history, the model and its accuracy.

    The caller's random number generators are left as they were: the run seeds its
    own (``seed=``), and they are restored after it.

    Args:
        data: a dataset name or processed dataset directory (``fullgraph datasets``),
            a ``fullgraph.graph.data.Dataset``, or a PyG ``Data`` (default: ``"cora"``).
            A ``Data`` without masks is split 60/20/20 at random by ``split_seed``;
            one without ``val_mask`` keeps the last epoch's model.
        model: gcn, sage, gat, gin or tagcn, or your own ``fullgraph.models.GNN``
            subclass: the class itself, or ``"module:Class"`` / ``"file.py:Class"``
            (default: ``"gcn"``). Launched workers import the class by its module or
            file, so with ``workers > 1`` it must live in one (a script's own classes
            do, if it calls ``fit`` under ``if __name__ == "__main__":``).
        strategy: single, data, tensor, p2p, task, or auto (the one ``fullgraph plan``
            recommends) (default: ``"single"``; more than one worker needs another).
        workers: local worker processes; 1 trains in this process (default: 1).
        epochs: training epochs (default: 200).
        verbose: print the run header, the per-epoch table and the summary
            (default: False; launched workers print theirs to this process's stdout).
        num_classes: the class count of a PyG ``Data`` whose labels do not use every
            class (default: ``max(y) + 1``; a stored dataset knows its own).
        **options: any other option of ``fullgraph train``, named as its flag with
            ``_`` for ``-`` (``hidden=32``, ``lr=0.005``, ``partitioner="chunk"``,
            ``metrics_out="run.jsonl"``, ...; ``model_options`` as a dict, too).

    Raises:
        ConfigError: an unknown option or a bad value (the message names it).
        DataError: the data cannot be read or is inconsistent.
        FullgraphError: a launched worker failed (the message names its rank, the
            phase and its error; the whole report is printed to stderr too).
    """
    if not isinstance(verbose, bool):
        raise ConfigError(f"fit: verbose must be True or False, got {verbose!r}")
    options.update(strategy=strategy, workers=workers, epochs=epochs)
    in_memory = _run_options("fit", data, model, num_classes, options)
    from fullgraph import launch

    try:
        with warnings_recorded(), _shown_at(sys._getframe(1)):  # (the launched workers
            # leave out what was shown here)
            return _fit(data, options, workers, verbose, num_classes, in_memory)
    except launch.SignalStop as stop:  # the temporary copy of the data is gone: now end
        launch.send_on(stop, "fit")


def check(data: Any = "cora", *, model: str | type = "gcn",
          strategies: str | Sequence[str] = DEFAULT_CHECKED, workers: int = 2,
          epochs: int = 3, num_classes: int | None = None,
          **options: Any) -> CheckReport:
    """Is ``model`` exact under every strategy? Train it ``epochs`` epochs in this
    process, then under each of ``strategies`` on ``workers`` launched workers, from the
    same seed, and compare the per-epoch losses (``fullgraph check``).

    Args:
        data, model, num_classes, **options: as ``fit``'s, but ``strategy``,
            ``patience``, the outputs (``metrics_out``, ``save_model``), checkpoints
            (``checkpoint_dir``, ``checkpoint_every``, ``resume``) and the run directory
            (``run_dir``, ``keep_run_dir``), which it refuses.
        strategies: some of ``data`` (depcomm and depcache), ``data/depcomm``,
            ``data/depcache``, ``data/hybrid``, ``tensor``, ``p2p``, ``task``, as a list
            or a comma-separated string (default: ``data/depcomm``, ``data/depcache``,
            ``tensor``, ``p2p`` and ``task``).
        workers: workers of each distributed run (default: 2; task without a
            ``task_split=`` runs on at least 3, with at least 2 T workers, so that a
            T stage's rows are split: ``fullgraph.exactness.task_split``).
        epochs: epochs of each run (default: 3).

    Returns:
        A ``fullgraph.exactness.CheckReport``: ``exact`` (every strategy that ran matched),
        ``reference`` (the single process's losses), ``outcomes`` (each strategy's
        losses and difference, or why it did not run); ``print`` gives the table.

    Raises:
        ConfigError: a bad option, one that check does not take, or ``workers < 2``.
    """
    from fullgraph import exactness
    from fullgraph.graph import store

    forms = exactness.parse_forms(strategies if isinstance(strategies, str)
                                  else ",".join(strategies))
    options.update(workers=workers, epochs=epochs, progress="off")
    in_memory = _run_options("check", data, model, num_classes, options)
    from fullgraph import launch

    try:
        with warnings_recorded(), _shown_at(sys._getframe(1)), \
                tempfile.TemporaryDirectory(prefix="fullgraph-check-") as tmp:
            if not isinstance(data, (str, Path)):  # the runs read it from disk, as any
                cfg = config_from_options(options, "check")  # dataset
                dataset = _from_pyg(data, cfg.data.split_seed, num_classes) if in_memory \
                    else data
                store.save_dataset(dataset, Path(tmp) / "dataset")
                options.update(dataset=str(Path(tmp) / "dataset"), split_seed=0)
            cfg = config_from_options(options, "check")
            with _own_process_state():  # building the model seeds torch's generator
                dataset = exactness.prepare(cfg)
                for message in exactness.unused_options(cfg, forms, "strategies="):
                    warnings.warn(message, stacklevel=2)
                warned = Path(tmp) / "warnings"  # the workers' warnings: Python warnings here
                with launch.environment({WARNINGS_ENV: str(warned)}):
                    report = exactness.run_checks(cfg, forms, dataset)
                _warn_as_workers_did(warned)
                return report
    except launch.SignalStop as stop:  # the temporary files are gone: now end
        launch.send_on(stop, "check")


@contextlib.contextmanager
def _shown_at(frame: Any) -> Iterator[None]:
    """Within: a warning raised in this package's code is shown at ``frame``'s current
    line (the caller's call of ``fit``), where a user can act on it, not at the line of
    ``fullgraph`` that raised it. Filters still apply as to the line that raised it."""
    package = str(Path(__file__).resolve().parent) + os.sep
    show = warnings.showwarning

    def at_caller(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, file: Any = None, line: str | None = None) -> None:
        if str(Path(filename).resolve()).startswith(package):
            filename, lineno, line = frame.f_code.co_filename, frame.f_lineno, None
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = at_caller
    try:
        yield
    finally:
        warnings.showwarning = show


def _run_options(caller: str, data: Any, model: str | type, num_classes: int | None,
                 options: dict[str, Any]) -> bool:
    """Complete ``options`` (flag names) with the model and the dataset as ``fit`` and
    ``check`` take them; whether ``data`` is in memory (a PyG ``Data``).

    Raises:
        FullgraphError: called while a model file was imported (an unguarded script).
        ConfigError: ``dataset=`` among the options, or ``num_classes`` for stored data.
    """
    from fullgraph.graph.data import Dataset
    from fullgraph.models.custom import format_options, importing_model_file, reference_of

    inside = importing_model_file()
    if inside is not None:
        raise FullgraphError(
            f"{caller}: called while {inside} was imported for its model class; call "
            f"{caller} under `if __name__ == \"__main__\":` so that importing the file "
            "only defines the model")
    if not isinstance(model, (str, type)):
        raise ConfigError(f"{caller}: model must be a name (gcn, sage, gat, gin, tagcn, "
                          f"'module:Class' or 'file.py:Class') or a fullgraph.models.GNN "
                          f"subclass; got an instance of {type(model).__name__} (pass the "
                          "class, not an object: the run builds its own)")
    options["model"] = reference_of(model) if isinstance(model, type) else model
    options.update({k: plain(v) for k, v in options.items()})  # (np.int64(16): 16)
    if isinstance(options.get("model_options"), dict):
        options["model_options"] = format_options(  # (an empty mapping: none)
            {k: plain(v) for k, v in options["model_options"].items()}) or None
    if "dataset" in options:
        raise ConfigError(f"{caller}: give the dataset as the first argument, not dataset=")
    in_memory = not isinstance(data, (str, Path, Dataset))
    if num_classes is not None and not in_memory:
        raise ConfigError(f"{caller}: num_classes applies to a PyG Data; a stored dataset "
                          "or a fullgraph Dataset has its class count")
    options["dataset"] = str(data) if isinstance(data, (str, Path)) else \
        data.name if isinstance(data, Dataset) else "pyg"
    return in_memory


def _fit(data: Any, options: dict[str, Any], workers: int, verbose: bool,
         num_classes: int | None, in_memory: bool) -> FitResult:
    from fullgraph.checkpoint import resolve_resume
    from fullgraph.graph.data import Dataset

    cfg = resolve_resume(config_from_options(options))
    if workers == 1 and (cfg.launch.run_dir or cfg.launch.keep_run_dir):
        warnings.warn("run_dir and keep_run_dir have no effect with workers=1 (the run "
                      "directory is the launcher's, for more workers)", stacklevel=3)
    if cfg.data.split_seed != 0 and (isinstance(data, Dataset) or (
            in_memory and getattr(data, "train_mask", None) is not None)):
        warnings.warn(f"split_seed={cfg.data.split_seed} has no effect: the data given has "
                      "its own split (split_seed draws one for data without masks)",
                      stacklevel=3)
    if workers > 1:  # a class no worker can import is refused before any start (the
        from fullgraph.models.custom import for_workers  # planner's probe workers too)

        for_workers(cfg.model.name)
    with _own_process_state():
        if isinstance(data, (str, Path)):
            dataset = None
        else:
            dataset = _from_pyg(data, cfg.data.split_seed, num_classes) if in_memory else data
        prepared = None  # the data as the run holds it, where the planner needed it already
        if cfg.runtime.strategy == "auto":  # the planner's choice, made once before any worker
            from fullgraph.graph import datasets
            from fullgraph.planner import resolve_config
            from fullgraph.train import check_before_planning

            prepared = datasets.load_for(cfg.data) if dataset is None else \
                _with_data_options(dataset, cfg)
            check_before_planning(cfg, prepared)
            cfg, flags, why = resolve_config(cfg, prepared)
            if verbose:  # as the command line says it
                print(f"strategy auto: {' '.join(flags)}: {why}", file=sys.stderr)
        if workers == 1:
            return _fit_here(cfg, dataset, verbose, prepared)
        del prepared  # the workers load their own
        return _fit_launched(cfg, dataset, verbose)


@contextlib.contextmanager
def _own_process_state() -> Iterator[None]:
    """Run the block as a worker process would start, and give the caller's state back.

    A run seeds torch's CPU generator (and reads no other), sets the thread counts of
    torch and numba, and builds its parameters in float32 with gradients on. A caller's
    ``torch.set_default_dtype(torch.float64)`` or ``torch.no_grad()`` would otherwise
    give ``workers=1`` another run than launched workers, and the caller's later draws
    and thread count should not depend on having called fit."""
    from fullgraph.ops import kernels

    dtype, threads, numba_threads = torch.get_default_dtype(), torch.get_num_threads(), \
        kernels.get_threads()
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode(False), \
                torch.enable_grad():
            torch.set_default_dtype(torch.float32)
            yield
    finally:
        torch.set_default_dtype(dtype)
        if numba_threads is not None:  # numba first: its pool resets OpenMP's count
            kernels.set_threads(numba_threads)
        torch.set_num_threads(threads)


def plain(value: Any) -> Any:
    """``value`` with numpy and torch scalars (``np.int64(16)``, a 0-d tensor, as a
    sweep's grid gives them) as the Python numbers and bools they hold, in lists too;
    anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if getattr(value, "shape", None) in ((), torch.Size([])) and callable(
            getattr(value, "item", None)):
        return value.item()
    return value


def config_from_options(options: dict[str, Any], caller: str = "fit") -> Any:
    """A ``Config`` from keyword options named as the ``fullgraph train`` flags.

    Raises:
        ConfigError: an option that is no flag of ``fullgraph train`` (the message lists
            them), or a value its section refuses.
    """
    from fullgraph.cli import flag_names
    from fullgraph.config import config_from_dict
    from fullgraph.exactness import NOT_TAKEN

    by_name = {flag.replace("-", "_"): key for key, flag in flag_names().items()}
    refused = {name for name, key in by_name.items() if ".".join(key) in NOT_TAKEN}
    taken = set(by_name) - {"dataset"} - (refused if caller == "check" else set())
    tree: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name not in by_name:
            raise ConfigError(f"{caller}: unknown option {name!r}; expected one of "
                              f"{', '.join(sorted(taken))}")
        section, key = by_name[name]
        tree.setdefault(section, {})[key] = value
    try:
        return config_from_dict(tree, source=caller)
    except ConfigError as exc:  # named as the caller named it: dep_mode=, not section.key
        text = str(exc).removeprefix(f"{caller}: ")
        found = re.match(r"(\w+)\.(\w+): ", text)
        names = {key: name for name, key in by_name.items()}
        if found is not None and (found.group(1), found.group(2)) in names:
            text = f"{names[found.group(1), found.group(2)]}: {text[found.end():]}"
        raise ConfigError(f"{caller}: {text}") from None


def _from_pyg(data: Any, split_seed: int, num_classes: int | None) -> Any:
    from fullgraph.graph.formats.pyg import from_pyg

    if not (hasattr(data, "x") and hasattr(data, "y")
            and (hasattr(data, "edge_index") or hasattr(data, "adj_t"))):
        raise ConfigError(f"fit: data must be a dataset name, a fullgraph Dataset or a PyG "
                          f"Data with x, y and edge_index (or adj_t); got {type(data).__name__}")
    return from_pyg(data, name="pyg", seed=split_seed, num_classes=num_classes)


def _with_data_options(dataset: Any, cfg: Any) -> Any:
    """``dataset``, validated, as ``load_for`` would give it: stored dtype, normalised
    features, held as CSR where ``sparse_features`` says so (``auto``: bag-of-words
    features).

    Raises:
        ValidationError: the dataset is inconsistent (as ``Dataset.validate``).
    """
    import dataclasses

    from fullgraph.graph.data import Dataset
    from fullgraph.graph.sparse import choose_layout
    from fullgraph.partition.shards import require_whole

    require_whole(dataset, "fit(dataset=...)", "or the shards' directory by name (fit(DIR, "
                  "strategy='data', workers=N): each worker opens its own part)")
    dataset.validate()  # as saving it for launched workers does
    data = dataset.data
    if cfg.data.feature_dtype != "stored":
        data = data.with_feature_dtype(cfg.data.feature_dtype)
    if cfg.data.normalize_features:
        data = data.row_normalized()
    features = choose_layout(data.features, cfg.data.sparse_features)
    if features is not data.features:
        data = dataclasses.replace(data, features=features)
    return Dataset(dataset.name, dataset.graph, data, dict(dataset.info))


def _fit_here(cfg: Any, dataset: Any, verbose: bool, prepared: Any = None) -> FitResult:
    import io

    from fullgraph.graph import datasets
    from fullgraph.report import Reporter
    from fullgraph.train import check_before_launch, check_outputs, train

    if prepared is not None:
        dataset = prepared
    elif dataset is None:
        dataset = datasets.load_for(cfg.data)
    else:
        dataset = _with_data_options(dataset, cfg)
    check_outputs(cfg)
    check_before_launch(cfg, dataset, 1)
    reporter = Reporter(cfg.train.epochs, metrics_out=cfg.train.metrics_out,
                        progress=cfg.train.progress if verbose else "off",
                        stream=None if verbose else io.StringIO())
    try:
        result = train(dataset, cfg, reporter=reporter)
    finally:
        reporter.close()
    return _result(_payload(result), result.model.cpu(), cfg, dataset)


def _fit_launched(cfg: Any, dataset: Any, verbose: bool) -> FitResult:
    import dataclasses

    from fullgraph import launch
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets, store
    from fullgraph.models.custom import for_workers
    from fullgraph.train import build, check_before_launch, check_outputs

    launch.check_workers(cfg.launch.workers, cfg.launch.oversubscribe)
    check_outputs(cfg)  # the model file is written here, after the workers
    given = cfg  # what the result reports (not the temporary directory below)
    in_memory = dataset is not None
    with tempfile.TemporaryDirectory(prefix="fullgraph-fit-") as tmp:
        if in_memory:  # the workers read it from disk, as any processed dataset
            store.save_dataset(dataset, Path(tmp) / "dataset")
            # (the split is drawn into the copy already: no seed is left for the workers)
            data = dataclasses.asdict(cfg.data) | {"dataset": str(Path(tmp) / "dataset"),
                                                   "split_seed": 0}
            # (the workers' run record and model file name the data as given: DATA_ENV)
            cfg = dataclasses.replace(cfg, data=DataConfig(**data))
        dataset = datasets.load_for(cfg.data)
        check_before_launch(cfg, dataset, cfg.launch.workers)
        config_file, result_file = Path(tmp) / "config.json", Path(tmp) / "result.pt"
        tree = cfg.to_dict()
        tree["train"]["progress"] = "auto" if verbose else "off"
        config_file.write_text(json.dumps(tree))
        # the launcher hands this process's environment to the workers
        warned = Path(tmp) / "warnings"
        with launch.environment({RESULT_ENV: str(result_file), QUIET_ENV: "" if verbose else "1",
                                 WARNINGS_ENV: str(warned),
                                 DATA_ENV: json.dumps(given.to_dict()["data"]),
                                 **for_workers(cfg.model.name)}):
            code, failure = launch.run_local(
                ["train", "--config", str(config_file)], cfg.launch.workers,
                timeout_s=cfg.launch.timeout_s, run_dir=cfg.launch.run_dir,
                threads=cfg.runtime.threads, keep_run_dir=cfg.launch.keep_run_dir,
                module=__name__, resignal=False)
        try:  # (warnings that are errors here must not hide how the run ended)
            _warn_as_workers_did(warned)
        finally:
            launch.raise_if_signalled(code)  # sent on once the copy above is removed
            if code == 130:  # Ctrl-C: the workers are stopped; the caller sees its interrupt
                raise KeyboardInterrupt
            if code != 0:
                cause = failure.splitlines()[0].removeprefix("fullgraph: ") if failure \
                    else f"exit code {code}"
                raise FullgraphError(f"fit: {cause} (the whole report is printed to stderr)")
        payload = torch.load(result_file, weights_only=True)
        model = build(dataset, cfg)
        model.load_state_dict(payload.pop("state_dict"))
        return _result(payload, model, given, dataset)


def _warn_as_workers_did(prefix: Path) -> None:
    """Raise, as Python warnings in this process, those the workers wrote to
    ``PREFIX-rankR.jsonl`` (each message once), attributed to the caller of ``fit``."""
    import builtins
    import warnings

    seen: dict[tuple[str, str, str], None] = {}
    for path in sorted(prefix.parent.glob(f"{prefix.name}-rank*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                seen[str(record["module"]), str(record["category"]),
                     str(record["message"])] = None
    frame, level = sys._getframe(0), 1  # the first frame outside this package: the caller's
    while frame.f_back is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] == "fullgraph":
        frame, level = frame.f_back, level + 1
    for module, name, message in seen:
        found: Any = builtins if module == "builtins" else sys.modules.get(module)
        for part in name.split("."):  # (a class nested in another: its qualified name)
            found = getattr(found, part, None)
        category = found if isinstance(found, type) and issubclass(found, Warning) else \
            UserWarning  # (of a module this process has not imported)
        warnings.warn(message, category, stacklevel=level)


def _payload(result: Any) -> dict[str, Any]:
    """A ``TrainResult`` as plain types (loadable with ``weights_only=True``)."""
    restored = result.extra.get("restored", 0)  # (the checkpoint's, as the metrics file marks)
    return {"history": [asdict(r) | ({"restored": True} if i < restored else {})
                        for i, r in enumerate(result.epochs)], "best_epoch": result.best_epoch,
            "best_val": result.best_val, "test_at_best": result.test_at_best,
            "train_at_best": result.train_at_best, "total_s": result.total_s}


def _result(payload: dict[str, Any], program: Any, cfg: Any, dataset: Any) -> FitResult:
    from fullgraph.saved import SavedModel, model_meta, run_facts

    trained = run_facts(cfg, cfg.launch.workers, best_epoch=payload["best_epoch"],
                        val_acc=payload["best_val"], test_acc=payload["test_at_best"],
                        train_acc=payload["train_at_best"], epochs=len(payload["history"]))
    model = SavedModel(program, model_meta(program, cfg, dataset, trained)).eval()
    return FitResult(history=payload["history"], model=model,
                     test_accuracy=payload["test_at_best"], val_accuracy=payload["best_val"],
                     train_accuracy=payload["train_at_best"], best_epoch=payload["best_epoch"],
                     total_s=payload["total_s"], config=cfg)


def _worker_main(argv: list[str]) -> int:
    """``fullgraph <argv>`` as a launched worker; rank 0 writes its result to RESULT_ENV.

    The CLI's worker loads the dataset, joins the process group and calls
    ``fullgraph.train.train``; the call is wrapped here to keep what it returns.
    """
    import fullgraph.train as training
    from fullgraph import cli

    if not os.environ.get(RESULT_ENV):
        print(f"fullgraph.api: the entry point of the workers of fullgraph.fit ({RESULT_ENV} "
              "is not set); use `fullgraph train` from a shell", file=sys.stderr)
        return 2
    real_train = training.train  # (its warnings: to the caller of fit, by the CLI's
    # relay_warnings, as Python warnings)

    def train_and_keep(dataset: Any, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        given = os.environ.get(DATA_ENV)
        if given:  # the run record and the model file name the data as given, not the
            import dataclasses  # copy read here (train reads the data from ``dataset``)

            from fullgraph.config import DataConfig

            cfg = dataclasses.replace(cfg, data=DataConfig(**json.loads(given)))
        result = real_train(dataset, cfg, *args, **kwargs)
        if os.environ.get("RANK", "0") == "0":
            out = Path(os.environ[RESULT_ENV])
            tmp = out.with_name(out.name + ".tmp")
            state = {k: v.detach().cpu() for k, v in result.model.state_dict().items()}
            torch.save({**_payload(result), "state_dict": state}, tmp)
            tmp.replace(out)
        return result

    training.train = train_and_keep
    if os.environ.get(QUIET_ENV):  # the table; errors still go to stderr
        sys.stdout = open(os.devnull, "w")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
