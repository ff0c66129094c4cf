"""Checkpoints of a training run: written atomically by one worker (one per host that
does not see rank 0's directory, under torchrun), resumable anywhere.

Every strategy keeps a whole replica of the model on every worker (gradients are
all-reduced), so rank 0's parameters are the model in its single-process form: a
checkpoint belongs to the model, not to the strategy, and a run checkpointed with one
strategy and worker count may resume with another.

A checkpoint holds what the loop needs to go on as if never stopped: parameters and
buffers, the Adam state, the epoch, the best-validation state (its accuracies and
parameters) and the epoch records so far. Every dropout mask is a function of
(seed, epoch, stage, vertex) (``fullgraph.ops.dropout``), so the seed and the epoch
are the whole random state of training; the torch CPU generator is saved as well, for
anything else that draws from it. On CPU, a resumed run with the same strategy and
worker count is bit-equal to the uninterrupted one; under ``--adapt adjust`` only to
float rounding: the adjusted plan follows measured times and is not kept, so a resumed
run starts from the starting plan again.

It also holds a fingerprint: digests of the dataset (topology, features, labels,
masks), the model options and the optimisation options (lr, weight decay, seed). A
resume with another fingerprint is refused, naming the differences. The strategy,
worker count and partition are recorded but not checked: they decide where rows are
computed, not what is computed.

File: ``DIR/checkpoint.pt``, tensors and plain containers only (read with
``torch.load(weights_only=True)``). It is written to ``DIR/.checkpoint.pt.<host>-<pid>.tmp``,
flushed to disk, then renamed over the previous one: a reader finds the previous
checkpoint or the new one, never part of one, even when the writer is killed.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from fullgraph.config import Config
from fullgraph.errors import ConfigError
from fullgraph.graph.data import Dataset
from fullgraph.graph.digest import digest, topology_digest
from fullgraph.graph.sparse import row_blocks
from fullgraph.paths import process_alive, process_space, unfinished, write_in_place
from fullgraph.report import EpochRecord

FORMAT = "fullgraph-checkpoint"
VERSION = 1
FILE_NAME = "checkpoint.pt"

Best = tuple  # (val, epoch, test, train, params or None), as kept by ``train``


def no_best() -> Best:
    """The best-validation state before any evaluation."""
    return (-1.0, 0, float("nan"), float("nan"), None)


@dataclass
class LoopState:
    """Where the training loop stands after ``epoch`` epochs."""

    epoch: int = 0
    best: Best = field(default_factory=no_best)
    records: list[EpochRecord] = field(default_factory=list)


def feature_digest(x: Tensor) -> str:
    """``digest(x)`` of the dense matrix, read in row blocks: the same for features held
    dense or as CSR (a checkpoint belongs to the model, not to the layout)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{x.dtype}{tuple(x.shape)};".encode())
    for _, block in row_blocks(x):
        if block.numel():
            h.update(block.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                     .data)
    return h.hexdigest()


def dataset_fingerprint(dataset: Dataset) -> dict[str, Any]:
    """Sizes and content digests of a dataset as trained on (options applied).

    A per-part shard gives the whole dataset's, recorded when the shards were
    written, marked as sharded (and row-normalised when it was): a checkpoint moves
    between shard sets of any part count, not between shards and the whole dataset.
    """
    sh = dataset.shard
    if sh is not None:
        out = {**sh.fingerprint, "sharded": True}
        dtype = str(dataset.data.features.dtype).replace("torch.", "")
        out["feature values"] = (f"{out.get('feature values')} as written, held as {dtype}"
                                 + (", row-normalised" if sh.normalized else ""))
        return out
    g, d = dataset.graph, dataset.data
    return {"vertices": g.num_nodes, "edges": g.num_edges, "features": d.num_features,
            "classes": d.num_classes, "topology": topology_digest(g),
            "feature values": feature_digest(d.features), "labels": digest(d.labels),
            "masks": digest(d.train_mask, d.val_mask, d.test_mask)}


def model_fingerprint(cfg: Config, dtype: torch.dtype) -> dict[str, Any]:
    """The options the model is built from (those with an effect) and its dtype."""
    return {"name": cfg.model.name, "hidden": cfg.model.hidden,
            **cfg.model.build_options(), "dtype": str(dtype).replace("torch.", "")}


def run_fingerprint(dataset: Dataset, cfg: Config, dtype: torch.dtype) -> dict[str, Any]:
    """What must match for a checkpoint to continue this run."""
    return {"dataset": dataset_fingerprint(dataset), "model": model_fingerprint(cfg, dtype),
            "optimiser": {"lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay,
                          "seed": cfg.train.seed}}


def differences(saved: Any, current: Any, where: str = "", *,
                saved_in: str = "in the checkpoint",
                say: Callable[[str, Any, Any], str] | None = None) -> list[str]:
    """``where.key: A <saved_in>, B here`` (or ``say(where.key, A, B)``) for every leaf
    that differs."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            out += differences(saved.get(key), current.get(key),
                               f"{where}.{key}" if where else str(key), saved_in=saved_in,
                               say=say)
        return out
    if saved == current:
        return []
    return [say(where, saved, current) if say is not None else
            f"{where}: {saved!r} {saved_in}, {current!r} here"]


WHERE_OPTIONS = ("data.root", "train.resume", "train.checkpoint_dir", "train.metrics_out",
                 "train.save_model", "train.progress", "train.log_level", "launch.run_dir",
                 "launch.keep_run_dir", "partition.file")
"""Options that say where a run reads and writes, or how it talks, not what it trains:
a resumed run may well give others (``changed_options`` leaves them out)."""


def changed_options(saved_json: str | None, cfg: Any) -> list[str]:
    """The options of ``cfg`` other than those of the run that wrote a checkpoint
    (its ``config_json``), as ``section.key: A -> B``; where and how a run reads and
    writes (``WHERE_OPTIONS``) left out. The fingerprint refuses what must match; the
    rest (more epochs, another strategy) may change, and the run header says so."""
    if not saved_json:
        return []
    try:
        saved = json.loads(saved_json)
    except ValueError:
        return []
    current = json.loads(json.dumps(cfg.to_dict(), default=str))
    changed = differences(saved, current,
                          say=lambda key, a, b: "" if key in WHERE_OPTIONS else
                          f"{key} {a!r} -> {b!r}")
    return [line for line in changed if line]


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint of another dataset, model or optimisation, naming each difference.

    Raises:
        ConfigError: some part differs.
    """
    diffs = differences(saved, current)
    if diffs:
        parts = sorted({d.split(".", 1)[0] for d in diffs})
        hint = ""
        if any(d.startswith("dataset.feature values:") for d in diffs):
            hint = (" (the features' values differ: other data, or another "
                    "--normalize-features or --feature-dtype than the checkpoint's run had)")
        raise ConfigError(f"{source}: the checkpoint is of another {' and '.join(parts)}: "
                          + "; ".join(diffs) + hint)


def load_parameters(module: torch.nn.Module, state: dict[str, Any], what: str) -> None:
    """``module.load_state_dict(state)``, or one ConfigError naming ``what`` and the first
    names that differ: the parameters of another program of the same model (one written
    by a fullgraph whose layers of this model were built differently) do not fit."""
    mine = module.state_dict()
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    shapes = [f"{k} {tuple(state[k].shape)} there, {tuple(v.shape)} here"
              for k, v in mine.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{label} {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                 for label, names in (("missing", missing), ("not in this model", unexpected),
                                      ("shapes differ:", shapes)) if names]
        raise ConfigError(f"{what}: its parameters do not fit this model's program "
                          f"({'; '.join(parts)}); it was written for another build of the "
                          "model (an earlier fullgraph, or other options): train anew")
    module.load_state_dict(state)


def run_facts(cfg: Config, world: int, plan: Any) -> dict[str, Any]:
    """Strategy, worker count and partition of a run (recorded, never checked)."""
    book = getattr(plan, "book", None)
    return {"strategy": cfg.runtime.strategy, "workers": world,
            "partition": None if book is None else digest(torch.as_tensor(book.part_of))}


def to_cpu(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (dicts, lists and tuples followed)."""
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def remove_stale_temporaries(path: Path) -> None:
    """Remove ``write_atomic``'s temporaries beside ``path`` whose writer, a process of
    this host (and pid namespace), no longer runs: one killed outright (SIGKILL, the
    OOM killer) leaves its file, which no clean-up of its own survives. Another host's
    (a shared file system) are left alone: their pids mean nothing here."""
    prefix = f".{path.name}.{process_space()}-"
    for stale in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = stale.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            stale.unlink(missing_ok=True)


def write_atomic(path: Path, payload: Any) -> None:
    """``torch.save`` of ``payload`` to ``path`` (``write_with``)."""
    write_with(path, lambda f: torch.save(payload, f))


def write_with(path: Path, save: Callable[[IO[bytes]], Any]) -> None:
    """What ``save`` writes to a file object, to a temporary file beside ``path``,
    fsync, then rename over it; then remove the temporaries of ``path`` that writers
    killed outright left. A pipe or a device is written into (``write_in_place``); a
    symbolic link's target is replaced, not the link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if write_in_place(path, save):
        return
    if path.is_symlink():  # (a link to a regular file, or a dangling one: its target's
        path = Path(os.path.realpath(path))  # folder is not made)
    tmp = path.with_name(f".{path.name}.{process_space()}-{os.getpid()}.tmp")
    try:
        with unfinished(tmp):
            with open(tmp, "wb") as f:
                save(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        remove_stale_temporaries(path)
    except BaseException as exc:
        cause = _os_error(exc)
        if cause is None or cause is exc and exc.filename is not None:
            raise
        # torch.save reports a failed write (a full disk, a file size limit) as its own
        # RuntimeError, the OS error only chained: name the file and the OS's reason
        raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from exc
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _os_error(exc: BaseException) -> OSError | None:
    """The OS error that ``exc`` is or was raised from (its chain followed), else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def load_file(path: Path, what: str, kind: str) -> Any:
    """What ``torch.save`` wrote to ``path``, read with ``weights_only=True`` on the CPU.

    Raises:
        ConfigError: ``{what}: {path} is not a readable {kind}``, saying whether the file
            is no torch file at all or a damaged one (never torch's advice to read it
            with ``weights_only=False``, which would run code from the file).
    """
    import zipfile

    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{what}: {path} is not a readable {kind}: not a whole file of "
                          "torch.save (no zip archive: another kind of file, or one cut short)")
    try:  # torch.load does not check the members' CRC-32s: damaged bytes would load
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} is not a readable {kind}: damaged ({exc})") from None
    if bad is not None:
        raise ConfigError(f"{what}: {path} is not a readable {kind}: damaged (its part "
                          f"{bad} does not match the checksum written with it)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors of every kind
        first = str(exc).splitlines()[0].split(". ")[0] if str(exc) else type(exc).__name__
        if "weights_only" in str(exc):
            first = "it holds objects other than tensors and plain containers"
        raise ConfigError(f"{what}: {path} is not a readable {kind}: damaged or truncated "
                          f"({first})") from None


def checkpoint_file(directory: str | Path) -> Path:
    """The checkpoint's path in ``directory`` (``~`` expanded: a config file's is not
    the shell's), where every run writes, reads and looks for it."""
    return Path(directory).expanduser() / FILE_NAME


def given_file(given: str | Path) -> Path:
    """The checkpoint a ``--resume`` names: the file itself, or the one in a directory."""
    path = Path(given).expanduser()
    return path if path.is_file() else checkpoint_file(path)


def read(directory: str | Path, what: str = "train.resume") -> dict[str, Any]:
    """The checkpoint in ``directory``, loaded with ``weights_only=True``.

    Raises:
        ConfigError: there is none, or the file is not a fullgraph checkpoint.
    """
    path = given_file(directory)
    if path.is_dir():
        raise ConfigError(f"{what}: {path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise ConfigError(f"{what}: no checkpoint in {directory} ({FILE_NAME} not found)")
    ckpt = load_file(path, what, "checkpoint")
    if isinstance(ckpt, dict) and ckpt.get("format") == "fullgraph-model":  # saved.FORMAT
        raise ConfigError(f"{what}: {path} is a saved model (--save-model), not a "
                          "checkpoint: it holds no optimiser state to resume from; give "
                          "the run's --checkpoint-dir")
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError(f"{what}: {path} is not a fullgraph checkpoint")
    if ckpt.get("version") != VERSION:
        raise ConfigError(f"{what}: {path} has checkpoint version {ckpt.get('version')}; "
                          f"this fullgraph reads version {VERSION}")
    damage = _damage(ckpt)
    if damage:
        raise ConfigError(f"{what}: {path} is not a whole checkpoint ({damage}); resume from "
                          "another or train anew")
    return ckpt


_PARTS = {"epoch": int, "model": dict, "optimizer": dict, "best": dict, "records": list,
          "rng": torch.Tensor, "fingerprint": dict, "run": dict}
"""The parts ``Checkpointer.after_epoch`` writes, and their types."""


def _damage(ckpt: dict[str, Any]) -> str:
    """What is missing or inconsistent in a checkpoint of the right format and version
    (one changed by hand or by another program), else ''."""
    missing = [k for k in _PARTS if k not in ckpt]
    if missing:
        return f"no {', '.join(missing)}"
    wrong = [f"{k} is a {type(ckpt[k]).__name__}" for k, kind in _PARTS.items()
             if not isinstance(ckpt[k], kind) or (kind is int and isinstance(ckpt[k], bool))]
    if wrong:
        return "; ".join(wrong)
    if ckpt["epoch"] < 1 or len(ckpt["records"]) != ckpt["epoch"]:
        return (f"epoch {ckpt['epoch']} with {len(ckpt['records'])} epoch records; a "
                "checkpoint after epoch N holds N")
    best = [k for k in ("val", "epoch", "test", "train", "params") if k not in ckpt["best"]]
    if best:
        return f"its best state lacks {', '.join(best)}"
    fields = dataclasses.fields(EpochRecord)
    known = {f.name for f in fields}
    needed = {f.name for f in fields if f.default is dataclasses.MISSING and
              f.default_factory is dataclasses.MISSING}
    bad = [i + 1 for i, r in enumerate(ckpt["records"])
           if not isinstance(r, dict) or not needed <= set(r) <= known]
    if bad:
        return f"the record of epoch {bad[0]} is not an epoch record"
    run = [k for k in ("strategy", "workers") if k not in ckpt["run"]]
    return f"its run facts lack {', '.join(run)}" if run else ""


AUTO = "auto"
"""``--resume auto``: resume from ``--checkpoint-dir`` where it holds a checkpoint (a job
requeued after preemption), else start anew (its first launch), in one command."""


def resolve_resume(cfg: Config) -> Config:
    """``cfg`` with ``--resume auto`` made ``--checkpoint-dir`` (it holds a checkpoint)
    or unset (it holds none yet); any other ``cfg`` as it is."""
    t = cfg.train
    if t.resume != AUTO:
        return cfg
    assert t.checkpoint_dir is not None  # (TrainConfig refuses auto without it)
    found = checkpoint_file(t.checkpoint_dir).is_file()
    return dataclasses.replace(cfg, train=dataclasses.replace(
        t, resume=t.checkpoint_dir if found else None))


def check_not_replaced(cfg: Config) -> None:
    """Refuse a run whose ``--checkpoint-dir`` holds a checkpoint other than the one it
    resumes: it would replace it at its first checkpoint, and a command run again
    without ``--resume`` would lose the run it meant to continue.

    Raises:
        ConfigError: naming the directory, the checkpoint's epoch where it is readable,
            and the ways on.
    """
    t = cfg.train
    if t.checkpoint_dir is None:
        return
    path = checkpoint_file(t.checkpoint_dir)
    if not path.is_file():
        return
    if t.resume is not None:
        source = Path(t.resume).expanduser()
        if (source if source.is_file() else checkpoint_file(source)).resolve() == \
                path.resolve():
            return  # the run it continues
    try:
        held = f"a checkpoint after epoch {read(path)['epoch']}"
    except ConfigError:  # damaged or of another version: still not this run's to replace
        held = FILE_NAME
    run = "this new run" if t.resume is None else f"this run (resumed from {t.resume})"
    raise ConfigError(f"train.checkpoint_dir: {t.checkpoint_dir} holds {held}, which {run} "
                      f"would replace: continue it with --resume {t.checkpoint_dir} (or "
                      "--resume auto), or write into another --checkpoint-dir, or remove "
                      f"{path} first")


def check_resumable(cfg: Config, dataset: Dataset, dtype: torch.dtype = torch.float32) -> None:
    """Refuse ``train.resume`` if it holds no checkpoint of this run (see ``Checkpointer``).

    Raises:
        ConfigError: as ``Checkpointer.resume`` would.
    """
    if cfg.train.resume is not None:
        _checked(read(cfg.train.resume), run_fingerprint(dataset, cfg, dtype), cfg)


def _checked(ckpt: dict[str, Any], fingerprint: dict[str, Any], cfg: Config) -> dict[str, Any]:
    source = cfg.train.resume
    check_fingerprint(ckpt["fingerprint"], fingerprint, f"train.resume: {source}")
    if ckpt["epoch"] > cfg.train.epochs:
        raise ConfigError(f"train.resume: {source} is at epoch {ckpt['epoch']}, past "
                          f"train.epochs {cfg.train.epochs}")
    return ckpt


def _boot_id() -> str:
    """This host's boot id (Linux), which tells apart hosts that share a name; "" where
    there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class Checkpointer:
    """Resumes a run from ``train.resume`` and writes checkpoints to ``train.checkpoint_dir``.

    Args:
        dataset: the run's dataset (for the fingerprint, computed only when needed).
        cfg: the run's options.
        rank: this worker's rank; rank 0 writes (and, under torchrun, one worker of
            each host that does not see its directory: ``find_other_hosts``).
        dtype: of the parameters.
        facts: strategy, worker count and partition (``run_facts``).
    """

    def __init__(self, dataset: Dataset, cfg: Config, rank: int, dtype: torch.dtype,
                 facts: dict[str, Any]) -> None:
        self.dataset, self.cfg, self.dtype, self.facts = dataset, cfg, dtype, facts
        self.writer = rank == 0 and cfg.train.checkpoint_dir is not None
        self.resumed_from: dict[str, Any] | None = None
        self._fingerprint: dict[str, Any] | None = None
        self.other_writers: list[int] = []  # ranks writing a copy on hosts of their own
        self.overdue = False  # one was due at an epoch not ready for it (``after_epoch``)

    def find_other_hosts(self, comm: Any) -> None:
        """Under torchrun, where hosts may not share storage: make one worker of each
        host that does not see rank 0's ``--checkpoint-dir`` write its own copy, so that
        every host finds the checkpoint to resume from (``--resume auto`` after a
        requeue). Rank 0 leaves a marker there; a worker that cannot see it writes,
        the lowest rank of each (host, directory). Collective."""
        import socket
        import uuid

        from fullgraph.comm.primitives import all_gather_object

        given = self.cfg.train.checkpoint_dir
        where = Path(given).expanduser() if given else None
        marker = None
        try:
            if comm.rank == 0 and where is not None:
                try:
                    where.mkdir(parents=True, exist_ok=True)
                    for old in where.glob(".fullgraph-host-*"):  # a killed run's
                        old.unlink(missing_ok=True)
                    marker = where / f".fullgraph-host-{uuid.uuid4().hex}"
                    marker.write_bytes(b"")
                except OSError:  # (its checkpoint's write will say why)
                    marker = None
            name = all_gather_object(marker.name if marker else None, comm, "setup")[0]
            unseen = None
            if comm.rank and name and where is not None and not (where / name).exists():
                unseen = (socket.gethostname(), _boot_id(), str(where.resolve()))
            every = all_gather_object(unseen, comm, "setup")
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)
        first: dict[tuple[str, ...], int] = {}
        for r, key in enumerate(every):
            if key is not None:
                first.setdefault(tuple(key), r)
        self.other_writers = sorted(first.values())
        self.writer = self.writer or comm.rank in self.other_writers

    @property
    def fingerprint(self) -> dict[str, Any]:
        if self._fingerprint is None:
            self._fingerprint = run_fingerprint(self.dataset, self.cfg, self.dtype)
        return self._fingerprint

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LoopState:
        """Restore ``model`` and ``optimizer`` from ``train.resume``; a fresh state if unset.

        Raises:
            ConfigError: no usable checkpoint there, one of another run (see
                ``check_fingerprint``), or one past ``train.epochs``.
        """
        source = self.cfg.train.resume
        if source is None:
            return LoopState()
        ckpt = _checked(read(source), self.fingerprint, self.cfg)
        load_parameters(model, ckpt["model"], f"train.resume: {source}")
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        best = ckpt["best"]
        self.resumed_from = {"epoch": ckpt["epoch"], **ckpt["run"],
                             "changed": changed_options(ckpt.get("config_json"), self.cfg)}
        return LoopState(ckpt["epoch"],
                         (best["val"], best["epoch"], best["test"], best["train"], best["params"]),
                         [EpochRecord(**r) for r in ckpt["records"]])

    def header_lines(self) -> list[str]:
        """Report lines on where the run resumed from, if it did, and on the hosts that
        keep a checkpoint of their own."""
        lines = []
        if self.other_writers:
            ranks = ", ".join(map(str, self.other_writers))
            lines.append(f"checkpt  rank 0 writes {self.cfg.train.checkpoint_dir}; rank(s) "
                         f"{ranks}, whose hosts do not see it, each write a copy there too")
        r = self.resumed_from
        if r is None:
            return lines
        lines.append(f"resume   from {self.cfg.train.resume} after epoch {r['epoch']} "
                     f"(saved by strategy {r['strategy']} on {r['workers']} worker(s))")
        if r.get("changed"):
            lines.append("resume   options other than the checkpoint's run had: "
                         + "; ".join(r["changed"]))
        return lines

    def after_epoch(self, epoch: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    best: Best, records: list[EpochRecord], *, last: bool = False,
                    ready: bool = True) -> None:
        """Write a checkpoint after every ``checkpoint_every``-th epoch and the last one
        (``train.epochs``, or ``last``: where the run stops early). One due where not
        ``ready`` (a partial-reduce epoch: rows and gradients in flight, the workers'
        records not yet exchanged) is written at the next epoch that is."""
        t = self.cfg.train
        due = not epoch % t.checkpoint_every or epoch == t.epochs or last or self.overdue
        if not ready:
            self.overdue = due
            return
        self.overdue = False
        if not self.writer or not due:
            return
        assert t.checkpoint_dir is not None
        payload = {
            "format": FORMAT, "version": VERSION, "epoch": epoch,
            "model": to_cpu(model.state_dict()), "optimizer": to_cpu(optimizer.state_dict()),
            "best": {"val": best[0], "epoch": best[1], "test": best[2], "train": best[3],
                     "params": to_cpu(best[4])},
            "records": [dataclasses.asdict(r) for r in records],
            "rng": torch.get_rng_state(), "fingerprint": self.fingerprint, "run": self.facts,
            "config_json": json.dumps(self.cfg.to_dict(), default=str)}
        path = checkpoint_file(t.checkpoint_dir)
        write_atomic(path, payload)
