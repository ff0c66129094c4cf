"""Saved models: ``train --save-model``, ``fullgraph.load_model``, predict and evaluate.

A saved model is the best-validation model of a run in its single-process form (every
strategy keeps a whole replica of the parameters, so rank 0 writes it whatever the
strategy and worker count), with the options to rebuild it and the data options it
was trained under (feature storage, row normalisation, split seed). It is a
``torch.save`` dict of tensors and plain containers, read with ``weights_only=True``.

``load_model(path)`` gives a ``SavedModel``: a plain ``torch.nn.Module`` that maps
(graph, features) of a whole graph to logits on one device. ``fullgraph.fit`` returns
its model as one too, which ``SavedModel.save`` writes in the same form.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fullgraph.checkpoint import FORMAT as CHECKPOINT_FORMAT
from fullgraph.checkpoint import (
    dataset_fingerprint,
    differences,
    load_file,
    load_parameters,
    to_cpu,
    write_atomic,
)
from fullgraph.config import Config
from fullgraph.errors import ConfigError, DatasetNotFoundError
from fullgraph.graph import store
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.models import build_model
from fullgraph.models.base import GNN
from fullgraph.models.stages import LayerInput, StageContext, propagation_inputs
from fullgraph.models.walk import GraphRunner, walk
from fullgraph.parallel.base import feature_rows

FORMAT = "fullgraph-model"
VERSION = 1
META_KEYS = ("model", "data", "dataset", "trained")
"""What a saved model records besides its parameters and the file's header."""
DATA_OPTIONS = ("dataset", "feature_dtype", "normalize_features", "split_seed")
"""The ``data`` options a saved model keeps: which dataset, and how it was prepared."""


class SavedModel(nn.Module):
    """A trained model as a plain module: ``model(graph, features)`` -> (N, C) logits.

    Args:
        program: the stage program (a ``GNN``) with its trained parameters.
        meta: what the file says about the model and its training, as
            ``model_meta`` builds it: ``model`` (``name``, ``in_dim``, ``hidden``,
            ``out_dim``, ``options``, ``dtype``), ``data`` (the data options it was
            trained under), ``dataset`` (its fingerprint) and ``trained`` (best epoch,
            accuracies, strategy, workers). ``save`` needs all four.

    Attributes:
        program: the model's stages (its parameters are this module's).
        meta: as given.
    """

    def __init__(self, program: GNN, meta: dict[str, Any]) -> None:
        super().__init__()
        self.program = program
        self.meta = meta
        self._steps = 0  # calls in training mode: each draws new dropout masks

    def forward(self, graph: Graph | Tensor, features: Tensor) -> Tensor:
        """Logits of every vertex.

        Args:
            graph: a fullgraph ``Graph``, or a (2, E) ``edge_index`` (row 0 sources,
                row 1 destinations) over ``features.shape[0]`` vertices.
            features: (N, F) input features, dense or CSR (a numpy or scipy matrix
                is taken too), prepared as the run prepared its own (row-normalised
                where it was trained with ``normalize_features``).

        In training mode (``model.train()``) every call draws new dropout masks.

        Raises:
            ValueError: features that are not an (N, F) matrix of the model's F
                columns, or whose rows are not the graph's vertices.
            FormatError: an ``edge_index`` that is not a (2, E) integer tensor.
            ValidationError: vertex ids out of range.
        """
        return self._run(graph, features, stop=None)

    def embed(self, graph: Graph | Tensor, features: Tensor) -> Tensor:
        """The last hidden layer's rows (the input of the last layer), (N, hidden), or
        (N, hidden x heads) for a coupled GAT, whose heads are concatenated.

        Raises:
            ValueError: the model has one layer, so no hidden layer; and as ``forward``
                (as do ``FormatError`` and ``ValidationError``).
        """
        # the template opens each of the num_layers layers with a LayerInput (a GNN
        # records which); a conv() or a decoupled propagation may add its own (GCNII's
        # first layer's rows, TAGCN's filter input)
        starts = getattr(self.program, "layer_starts", None) or [
            s.index for s in self.program.stages
            if isinstance(s, LayerInput)][:self.program.num_layers]
        if len(starts) < 2:
            raise ValueError("a one-layer model has no hidden layer to take embeddings from")
        return self._run(graph, features, stop=starts[-1])

    def save(self, path: str | Path) -> None:
        """Write this model to ``path`` (atomically) as ``train --save-model`` does, for
        ``load_model`` and ``fullgraph predict`` / ``evaluate``.

        Raises:
            ValueError: ``meta`` lacks one of ``model``, ``data``, ``dataset``,
                ``trained``.
        """
        missing = [k for k in META_KEYS if k not in self.meta]
        if missing:
            raise ValueError(f"SavedModel.save: meta lacks {', '.join(missing)}")
        meta = {k: self.meta[k] for k in META_KEYS}
        name = meta["model"]["name"]
        if name.startswith("__main__:") or "<locals>" in name:
            warnings.warn(f"the model's class {name} is this process's own (a notebook "
                          f"cell or a function): {path} loads only where that class is "
                          "defined again in __main__; a class in a module loads anywhere",
                          stacklevel=2)
        param = next(self.program.parameters())  # the dtype it has now (after .double())
        meta["model"] = {**meta["model"], "dtype": str(param.dtype).replace("torch.", "")}
        payload = {**meta, "format": FORMAT, "version": VERSION,
                   "state_dict": to_cpu(self.program.state_dict())}
        write_atomic(Path(path).expanduser(), payload)

    def _run(self, graph: Graph | Tensor, features: Tensor, stop: int | None) -> Tensor:
        if not isinstance(features, Tensor):  # numpy and scipy features, as fit takes them
            from fullgraph.graph.formats.pyg import feature_tensor

            features = feature_tensor(features, "model input")
        if features.dim() != 2:
            raise ValueError(f"features must be an (N, F) matrix; got shape "
                             f"{tuple(features.shape)}")
        param = next(self.program.parameters())
        if param.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"a SavedModel runs in float32 or float64; its parameters are "
                             f"{str(param.dtype).replace('torch.', '')} (use .float())")
        n = int(features.shape[0])
        if not isinstance(graph, Graph):
            from fullgraph.graph.formats.pyg import edge_index_array

            edge_index = edge_index_array(graph, "model input")
            graph = Graph.from_edges(edge_index[0], edge_index[1], n)
        if graph.num_nodes != n:
            raise ValueError(f"the graph has {graph.num_nodes} vertices but features have {n} rows")
        if features.shape[1] != self.program.in_dim:
            raise ValueError(f"the model takes {self.program.in_dim} feature columns, "
                             f"got {features.shape[1]}")
        seed = 0
        if self.training:  # a new dropout mask for every call, as nn.Dropout draws
            self._steps += 1
            seed = self._steps
        graph, norms = propagation_inputs(self.program, graph.to(param.device), param.dtype)
        ctx = StageContext(torch.arange(n, device=param.device), seed, self.training,
                           torch.arange(graph.num_edges, device=param.device))
        x = feature_rows(features, None, self.program, param.dtype, param.device)  # CSR or dense
        return walk(self.program, GraphRunner(graph, norms, ctx), x, stop=stop)


def model_meta(model: GNN, cfg: Config, dataset: Dataset,
               trained: dict[str, Any]) -> dict[str, Any]:
    """What a saved model records besides its parameters (``SavedModel.meta``).

    Args:
        model: the trained model.
        cfg: the run's options (model and data sections are kept).
        dataset: the dataset it was trained on (its fingerprint is kept).
        trained: facts about the run (best epoch, accuracies, strategy, workers).
    """
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k in DATA_OPTIONS}
    given = Path(data["dataset"]).expanduser()
    if any((given / name).is_file() for name in (store.META_FILE, store.SHARDS_FILE)):
        data["dataset"] = str(given.resolve())  # a directory: found from any directory later
    elif cfg.data.root:  # a name under a root given for the run: looked up there later too
        data["root"] = str(Path(cfg.data.root).expanduser().resolve())
    param = next(model.parameters())
    found = _import_root(cfg.model.name)
    return {
        "model": {"name": cfg.model.name, "in_dim": model.in_dim, "hidden": cfg.model.hidden,
                  "out_dim": model.out_dim, "options": cfg.model.build_options(),
                  "dtype": str(param.dtype).replace("torch.", ""),
                  **({"found_in": found} if found else {})},
        "data": data,
        "dataset": dataset_fingerprint(dataset),
        "trained": trained}


def _import_root(name: str) -> str | None:
    """For a ``module:Class`` model (not a file's, which names its path), the directory
    its top package was imported from: where a later process must look for it."""
    import sys

    from fullgraph.models.custom import is_reference

    target = name.rpartition(":")[0]
    if not is_reference(name) or target.endswith(".py") or "/" in target \
            or target == "__main__" or target not in sys.modules:
        return None
    file = getattr(sys.modules[target], "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(target.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent  # pkg/sub/mod.py for pkg.sub.mod: up to what holds pkg
    return str(root)


def run_facts(cfg: Config, workers: int, *, best_epoch: int, val_acc: float, test_acc: float,
              train_acc: float, epochs: int) -> dict[str, Any]:
    """The ``trained`` facts of a run: its best epoch and accuracies there, its epochs,
    strategy and worker count."""
    return {"best_epoch": best_epoch, "val_acc": val_acc, "test_acc": test_acc,
            "train_acc": train_acc, "epochs": epochs, "strategy": cfg.runtime.strategy,
            "workers": workers}


def save_model(path: str | Path, model: GNN, cfg: Config, dataset: Dataset,
               trained: dict[str, Any]) -> None:
    """Write ``model`` (single-process form) with its options to ``path``, atomically
    (arguments as ``model_meta``'s)."""
    SavedModel(model, model_meta(model, cfg, dataset, trained)).save(path)


def load_model(path: str | Path) -> SavedModel:
    """The model saved at ``path`` (by ``train --save-model``), on the CPU, in eval mode.

    Raises:
        ConfigError: the file is missing or not a saved fullgraph model.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"model: {path} is a directory, not a model file")
    if not path.is_file():
        raise ConfigError(f"model: {path} not found")
    saved = load_file(path, "model", "model file")
    if isinstance(saved, dict) and saved.get("format") == CHECKPOINT_FORMAT:
        raise ConfigError(f"model: {path} is a training checkpoint, not a saved model: "
                          f"`fullgraph train ... --resume {path} --epochs {saved.get('epoch')} "
                          "--save-model FILE` with the run's options writes its best model so "
                          "far without training")
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError(f"model: {path} is not a saved fullgraph model")
    if saved.get("version") != VERSION:
        raise ConfigError(f"model: {path} has format version {saved.get('version')}; this "
                          f"fullgraph reads version {VERSION}")
    missing = [k for k in (*META_KEYS, "state_dict") if k not in saved]
    if missing:
        raise ConfigError(f"model: {path} lacks {', '.join(missing)}: not a complete saved "
                          "model")
    m = _check_record(saved, path)
    try:
        program = build_model(m["name"], m["in_dim"], m["hidden"], m["out_dim"],
                              **m["options"])
    except ConfigError as exc:
        if "<locals>" in m["name"]:
            raise ConfigError(f"model: {path}: its class {m['name']} was defined inside a "
                              "function of the process that trained it, which no other "
                              "process can import; move the class to a module before "
                              "training") from None
        if m.get("found_in") and "no module named" in str(exc):  # a module reference
            # that training found elsewhere: say where
            raise ConfigError(f"{exc}; when {path} was saved it was found in "
                              f"{m['found_in']}: run from there or add it to "
                              "PYTHONPATH") from None
        if m["name"].startswith("__main__:"):
            raise ConfigError(f"model: {path}: its class {m['name']} was defined in the "
                              "process that trained it (a notebook cell), not in a module; "
                              "define that class in this process's __main__ under the same "
                              "name (in a notebook: run its cell), or move it to a module "
                              "before training") from None
        raise
    from fullgraph.models.custom import unknown_options

    unknown = unknown_options(type(program), m["options"])
    if unknown:
        raise ConfigError(f"model: {path}: its options {', '.join(unknown)} are not ones "
                          f"this fullgraph's {m['name']} takes (a file from another version?)")
    dtype = getattr(torch, m["dtype"])
    if dtype in (torch.float16, torch.bfloat16):  # saved after .half(): run in float32
        warnings.warn(f"model: {path} holds {m['dtype']} parameters; they are loaded as "
                      "float32, which a SavedModel runs in", stacklevel=2)
        dtype = torch.float32
    program = program.to(dtype)
    load_parameters(program, {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point()
                              else v for k, v in saved["state_dict"].items()},
                    f"model: {path}")
    meta = {k: saved[k] for k in META_KEYS}
    return SavedModel(program, meta).eval()


_DTYPES = ("float32", "float64", "float16", "bfloat16")
_MODEL_KEYS = {"name": str, "in_dim": int, "hidden": int, "out_dim": int, "options": dict,
               "dtype": str}


def _check_record(saved: dict[str, Any], path: Path) -> dict[str, Any]:
    """The saved file's ``model`` record, its keys and types checked.

    Raises:
        ConfigError: naming the file and what in it is damaged.
    """
    m = saved["model"]
    bad = "" if isinstance(m, dict) else "its model record is not a mapping"
    if not bad:
        wrong = [k for k, kind in _MODEL_KEYS.items() if not isinstance(m.get(k), kind)]
        if wrong:
            bad = f"its model record lacks or has a wrong type for {', '.join(wrong)}"
        elif m["dtype"] not in _DTYPES:
            bad = f"model.dtype {m['dtype']!r} is not one of {', '.join(_DTYPES)}"
        elif not isinstance(saved["state_dict"], dict):
            bad = "its state_dict is not a mapping"
        elif not all(isinstance(saved[k], dict) for k in META_KEYS):
            bad = "its " + ", ".join(k for k in META_KEYS if not isinstance(saved[k], dict)) \
                + " record is not a mapping"
    if bad:
        raise ConfigError(f"model: {path} is damaged: {bad}")
    return m


def load_dataset_for(model: SavedModel, dataset: str | None = None,
                     root: str | None = None) -> Dataset:
    """``dataset`` (default: the one trained on) prepared as the model's training data was.

    ``root`` given wins. Else the dataset (the one trained on, or ``dataset`` by name)
    is looked up under the ``--root`` its training run was given, where that directory
    is here, then under the usual root
    (``$FULLGRAPH_DATA``, else the user cache)."""
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets
    from fullgraph.partition.shards import require_whole, whole_source

    if root is not None and not Path(root).expanduser().is_dir():  # (read, never made)
        raise DatasetNotFoundError(f"root {root}: no such directory")
    opts = dict(model.meta["data"])
    trained_root = opts.pop("root", None)  # the --root of its training run, if one was given
    roots: list[str | None] = [root]
    if dataset is not None:
        opts["dataset"] = dataset
    if root is None and trained_root is not None and Path(trained_root).is_dir() and (
            dataset is None or (Path(trained_root) / dataset).is_dir()):  # (a dataset named
        roots = [trained_root, None]  # is looked for there, not fetched there); then the
        # usual root, where it may have moved
    loaded = None
    with warnings.catch_warnings():  # the seed is the model's, said when it trained
        warnings.filterwarnings("ignore", message="--split-seed has no effect")
        for where in roots:
            try:
                loaded = datasets.load_for(DataConfig(root=where, **opts))
                break
            except DatasetNotFoundError as exc:
                err = exc
    if loaded is None:
        if dataset is not None:
            raise err
        raise DatasetNotFoundError(
            err.problem, source=err.source, field=err.field, found=err.found,
            expected=err.expected,
            hint=f"the model was trained on {opts['dataset']!r}"
                 + (f" under --root {trained_root}" if trained_root else "")
                 + "; give the root it is under (--root, or root= in Python), or, where "
                 "that was data held in memory, name a stored dataset (--dataset, or "
                 "dataset=)") from None
    source = whole_source(loaded) if dataset is None and root is None else None
    if source is not None and Path(source[1]).is_dir():  # trained on shards: the whole
        try:                                             # dataset they were written from
            loaded = datasets.load_for(DataConfig(root=source[1],
                                                  **{**opts, "dataset": source[0]}))
        except DatasetNotFoundError:
            pass  # (named by require_whole below)
    require_whole(loaded, "predict / evaluate", "with --dataset (dataset= in Python)")
    if dataset is None:
        _check_trained_on(model, loaded)
    width = int(model.meta["model"]["in_dim"])
    if loaded.data.num_features != width:
        raise ConfigError(f"model: it takes {width} feature columns and dataset "
                          f"{(dataset or loaded.name)!r} has {loaded.data.num_features}: give "
                          "a dataset "
                          "with the features it was trained on")
    classes = int(model.meta["model"]["out_dim"])
    if loaded.data.num_classes > classes:
        warnings.warn(f"{dataset or loaded.name} has {loaded.data.num_classes} classes and "
                      f"the model predicts {classes}: classes {classes}-"
                      f"{loaded.data.num_classes - 1} are never predicted, and their "
                      "vertices count as misses", stacklevel=2)
    return loaded


def _check_trained_on(model: SavedModel, loaded: Dataset) -> None:
    """Refuse, naming each difference, a dataset found under the trained-on name that
    is not the data the model was trained on (its content digests differ: another
    split, other features, or another dataset of that name). A model trained on shards
    is compared by sizes only (its record says how the shards held their features)."""
    trained = dict(model.meta.get("dataset") or {})
    here = dataset_fingerprint(loaded)
    if trained.get("sharded"):
        keys = ("vertices", "edges", "features", "classes")
        trained, here = ({k: d.get(k) for k in keys} for d in (trained, here))
    diffs = differences(trained, here, saved_in="then")
    if diffs:
        raise ConfigError(f"model: the dataset {loaded.name!r} found is not the data it was "
                          f"trained on ({'; '.join(diffs)}); give --dataset (dataset= in "
                          "Python) to use it anyway")


@torch.no_grad()
def accuracy(model: SavedModel, dataset: Dataset) -> dict[str, tuple[int, int]]:
    """(correct, total) of ``model`` on each split of ``dataset``."""
    d = dataset.data
    pred = model(dataset.graph, d.features).argmax(dim=1)
    hit = pred == d.labels
    return {name: (int((hit & mask).sum()), int(mask.sum()))
            for name, mask in (("train", d.train_mask), ("val", d.val_mask),
                               ("test", d.test_mask))}
