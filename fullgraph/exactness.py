"""``fullgraph check`` and ``fullgraph.check``: is a model exact under every strategy?
A check trains a few epochs in one process and under each distributed strategy, from
the same seed, and compares the per-epoch losses.

Every strategy is exact for a model whose stages keep the rules of the stage
program (a transform maps each row on its own, a propagation is a weighted sum over
in-edges; README, "Your own model"). The built-in models are tested so; a user's
model is checked here, on the options and data it will train with. The first
epoch's loss depends on the forward pass only, the later ones on the gradients and
their synchronisation too. Float32 runs differ in the order of their sums, about
1e-7 of the loss; a stage that breaks a rule moves the loss by far more.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from fullgraph.errors import ConfigError, DataError, FullgraphError

TOLERANCE = 1e-5
"""The largest relative loss difference counted as exact: float32 runs differ by about
1e-7 in a few epochs; a transform that mixes rows moved a loss by 1e-6 in its first
epoch and 1e-4 in its third, where its rows were split in blocks of thousands."""

FORMS: dict[str, dict[str, dict[str, Any]]] = {
    "data/depcomm": {"runtime": {"strategy": "data"}, "data_parallel": {"mode": "depcomm"}},
    "data/depcache": {"runtime": {"strategy": "data"}, "data_parallel": {"mode": "depcache"}},
    "data/hybrid": {"runtime": {"strategy": "data"}, "data_parallel": {"mode": "hybrid"}},
    "tensor": {"runtime": {"strategy": "tensor"}},
    "p2p": {"runtime": {"strategy": "p2p"}},
    "task": {"runtime": {"strategy": "task"}},
}
"""The runs ``--strategies`` names, as the options each sets over the given ones."""
DEFAULT_FORMS = ("data/depcomm", "data/depcache", "tensor", "p2p", "task")
DEFAULTS = {"train.epochs": 3, "launch.workers": 2}
"""The options whose defaults a check has of its own (``section.key``)."""
NOT_TAKEN = ("runtime.strategy", "train.metrics_out", "train.save_model",
             "train.checkpoint_dir", "train.checkpoint_every", "train.resume",
             "train.patience", "launch.run_dir", "launch.keep_run_dir")
"""Options of ``train`` that a check does not take: it runs every strategy, compares
every epoch (no early stopping), and its runs write nothing the user keeps."""


@dataclasses.dataclass
class Outcome:
    """One strategy's run: its losses and largest relative difference from the single
    process's, or why it did not run (``refused``: the strategy does not take this
    model or setup; else it failed)."""

    label: str
    losses: list[float] | None = None
    difference: float = math.nan
    refused: str | None = None
    failed: str | None = None
    first_epoch: int | None = None  # the first epoch whose loss differs
    accuracy_epoch: int | None = None  # the first whose accuracies differ by 2+ vertices

    @property
    def exact(self) -> bool:
        return self.losses is not None and self.difference <= TOLERANCE and \
            self.accuracy_epoch is None


@dataclasses.dataclass
class CheckReport:
    """What ``fullgraph check`` found: the single process's per-epoch losses and each
    strategy's outcome. ``exact`` is True when every strategy that ran matched; its
    ``str`` is the table the command prints."""

    reference: list[float]
    outcomes: list[Outcome]

    @property
    def exact(self) -> bool:
        """Whether a strategy ran and every one that ran matched (none failed)."""
        ran = [o for o in self.outcomes if o.refused is None]
        return bool(ran) and all(o.exact for o in ran)

    @property
    def not_exact(self) -> list[str]:
        """The strategies that ran and differed."""
        return [o.label for o in self.outcomes if o.losses is not None and not o.exact]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The single process's losses, then one line per run: its loss difference and
        the verdict (where the difference starts), or why it did not run."""
        ref = self.reference
        last = f", {ref[-1]:.6f} at epoch {len(ref)}" if len(ref) > 1 else ""
        lines = [f"single process: loss {ref[0]:.6f} at epoch 1{last}",
                 f"{'strategy':<15} {'loss difference':>15}  result"]
        for o in self.outcomes:
            if o.losses is None:
                what = f"refused: {o.refused}" if o.refused is not None else \
                    f"failed: {o.failed}"
                lines.append(f"{o.label:<15} {'-':>15}  {what}")
                continue
            if o.exact:
                verdict = "exact"
            elif o.first_epoch is not None:
                verdict = f"DIFFERS from epoch {o.first_epoch}" + \
                    (" (already in the forward pass)" if o.first_epoch == 1 else "")
            else:
                verdict = f"DIFFERS in evaluation from epoch {o.accuracy_epoch} (the losses " \
                    "agree; the accuracies do not: a stage that treats rows unlike one " \
                    "process, or predictions tied within rounding that flip together)"
            lines.append(f"{o.label:<15} {o.difference:>15.2e}  {verdict}")
        if self.not_exact:
            lines.append(f"not exact: {', '.join(self.not_exact)} (a loss further than "
                         f"{TOLERANCE:.0e} from one process's, or an accuracy by 2 vertices "
                         "or more; README, 'Your own model', has the rules a stage keeps)")
        if not any(o.refused is None for o in self.outcomes):
            lines.append("nothing compared: every strategy refused this model or setup")
        return lines


def check_config(cfg: Any) -> None:
    """Refuse what a check cannot compare: a strategy of its own, outputs that each run
    would overwrite, a checkpoint to resume, an approximate mode, early stopping, fewer
    than 2 workers.

    Raises:
        ConfigError: naming the option (as its flag).
    """
    if cfg.runtime.strategy != "single":
        raise ConfigError("check runs every strategy: name them with --strategies "
                          "(strategies= in Python), not --strategy")
    adapt = cfg.section("adapt")
    approximate = [flag for flag, on in (
        ("--adapt adjust+partial", adapt.mode == "adjust+partial" and adapt.staleness > 1),
        ("--task-deps regroup", cfg.section("task_parallel").deps == "regroup")) if on]
    if approximate:
        raise ConfigError(f"check compares exact runs, and {approximate[0]} is approximate "
                          "by design (with --staleness above 1): drop it"
                          if approximate[0].startswith("--adapt") else
                          f"check compares exact runs, and {approximate[0]} is approximate "
                          "by design: drop it")
    outputs = [f"--{flag}" for name, flag in (("metrics_out", "metrics-out"),
                                              ("save_model", "save-model"),
                                              ("checkpoint_dir", "checkpoint-dir"),
                                              ("resume", "resume"))
               if getattr(cfg.train, name) is not None]
    outputs += ["--run-dir"] if cfg.launch.run_dir is not None else []
    outputs += ["--keep-run-dir"] if cfg.launch.keep_run_dir else []
    if outputs:
        raise ConfigError(f"check writes nothing and resumes nothing: drop {', '.join(outputs)}")
    if cfg.train.patience is not None:
        raise ConfigError("check compares every epoch of each run: drop --patience (early "
                          "stopping)")
    if cfg.launch.workers < 2:
        raise ConfigError(f"check: --workers {cfg.launch.workers}; the strategies need 2 or "
                          "more (it compares them with one process; a config file's workers "
                          "stands over check's own default of 2, as its epochs over 3)")


def parse_forms(text: str, option: str = "strategies=") -> list[str]:
    """``data,tensor`` -> the runs named (``data`` is depcomm and depcache); ``option``
    is how error messages name where the text came from.

    Raises:
        ConfigError: a name that is no run, or none at all.
    """
    out: list[str] = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        named = [f for f in FORMS if f == name or f.split("/")[0] == name and f != "data/hybrid"]
        if not named:
            raise ConfigError(f"{option}: unknown {name!r}; expected some of "
                              f"{', '.join(['data', *FORMS])}")
        out += [f for f in named if f not in out]
    if not out:
        raise ConfigError(f"{option}: give at least one strategy")
    return out


def unused_options(cfg: Any, forms: list[str], option: str = "--strategies") -> list[str]:
    """What a check of ``forms`` would take and not use: options of a section that no
    strategy checked reads, ``--dep-mode`` (each data run sets its own), the hybrid
    cost model's options without ``data/hybrid``, and what the other strategies say of
    their own options (``Strategy.unused_options``). ``option`` names the list of
    strategies as the caller gave it."""
    from fullgraph.configfile import flags_of
    from fullgraph.fields import changed_fields
    from fullgraph.parallel.base import get_strategy, unused_sections
    from fullgraph.parallel.data import COST_NAMES

    names = {FORMS[f]["runtime"]["strategy"] for f in forms}
    out = [f"{flags_of(section, changed)} no effect with {option} {','.join(forms)} (only "
           f"with {', '.join(users)})" for section, changed, users in unused_sections(
               cfg.options, names, skip={"data_parallel": ("mode",)})]
    if changed_fields(cfg.options["data_parallel"], among=("mode",)):
        out.append("--dep-mode has no effect on a check: each data run sets its own; name "
                   f"data/depcomm, data/depcache or data/hybrid in {option}")
    costs = changed_fields(cfg.options["data_parallel"], among=COST_NAMES)
    if costs and "data" in names and "data/hybrid" not in forms:
        out.append(f"{flags_of('data_parallel', costs)} no effect without data/hybrid in "
                   f"{option} (the hybrid dependency mode's cost model)")
    for label in (f for f in forms if not f.startswith("data/")):  # data's: above
        run = _with(cfg, **_form(cfg, label)[0])  # (as run_checks runs it)
        try:
            strategy = get_strategy(run.runtime.strategy).from_sections(run.options)
        except (ConfigError, ValueError):  # the run refuses it: its outcome will say so
            continue
        out += strategy.unused_options()
    return out


def relative_differences(losses: list[float], reference: list[float]) -> list[float]:
    """``|a - b| / max(|b|, 1e-12)`` per epoch (0 where both are NaN, inf where a loss
    is not finite in one run only)."""
    out = []
    for a, b in zip(losses, reference, strict=True):
        if math.isnan(a) and math.isnan(b):
            out.append(0.0)
        else:
            out.append(abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a - b) else math.inf)
    return out


def prepare(cfg: Any) -> Any:
    """Check ``cfg`` (``check_config``), load its dataset and find, in this process, what
    its single-process run would refuse (the device, a model that does not build):
    the dataset.

    Raises:
        ConfigError, DataError: as ``fullgraph train`` would, before any worker starts;
            DataError too for a dataset of one class (its loss is 0 in every run).
    """
    from fullgraph.graph import datasets
    from fullgraph.train import build, check_before_launch

    check_config(cfg)
    dataset = datasets.load_for(cfg.data)
    if dataset.data.num_classes < 2:
        raise DataError(f"check compares the runs' losses, and {cfg.data.dataset} has "
                        f"{dataset.data.num_classes} class: cross-entropy over one class "
                        "is 0 whatever the model computes, so nothing would be compared")
    if dataset.shard is not None:
        raise ConfigError(f"check compares each strategy with one process, which needs the "
                          f"whole dataset, and {cfg.data.dataset} is per-part shards: check "
                          "the dataset they were written from")
    single = _reference(cfg)
    check_before_launch(single, dataset, 1)
    build(dataset, single)
    return dataset


def run_checks(cfg: Any, forms: list[str], dataset: Any) -> CheckReport:
    """Train ``cfg`` in one process, then as each of ``forms`` on ``cfg.launch.workers``
    workers (task as ``task_split`` says where no split is given; each run a
    ``fullgraph train`` of the local launcher, quiet, its losses and accuracies read
    from its metrics file), and compare. ``dataset`` is ``prepare``'s.

    Raises:
        FullgraphError: the single-process run failed (nothing to compare with).
        KeyboardInterrupt: a run was interrupted (Ctrl-C): the check stops there.
    """
    from fullgraph.train import check_before_launch

    sizes = {k: int(v.sum()) for k, v in (("train_acc", dataset.data.train_mask),
                                          ("val_acc", dataset.data.val_mask),
                                          ("test_acc", dataset.data.test_mask)) if v is not None}
    with tempfile.TemporaryDirectory(prefix="fullgraph-check-") as tmp:
        single = _reference(cfg)
        reference = _epochs(single, 1, Path(tmp) / "single", warn=True)
        outcomes = []
        for label in forms:
            outcome = Outcome(label)
            sections, n = _form(cfg, label)
            try:
                run = _with(cfg, **sections, launch={"workers": n})
                check_before_launch(run, dataset, n)
            except (ConfigError, ValueError) as exc:  # the strategy does not take it
                outcome.refused = str(exc)
            else:
                try:
                    rows = _epochs(run, n, Path(tmp) / label.replace("/", "-"))
                except FullgraphError as exc:
                    outcome.failed = str(exc)
                else:
                    _compare(outcome, rows, reference, sizes)
            outcomes.append(outcome)
    return CheckReport([r["loss"] for r in reference], outcomes)


def task_split(cfg: Any) -> tuple[int, str] | None:
    """The workers and split of the check's task run where it chooses them (no
    ``--task-split`` given): at least 2 T workers, so that a T stage's rows are split as
    a row-wise rule needs (an automatic split of 2 workers is 1:1: one T worker holding
    every row, under which a stage mixing rows passed), and from 4 workers on at least
    2 P workers too: 2:1 on 3 workers (where ``--workers`` is 2 or 3), else half and
    half. None where the split is given."""
    if cfg.section("task_parallel").split != "auto":
        return None
    n = max(cfg.launch.workers, 3)
    t = 2 if n == 3 else n // 2
    return n, f"{t}:{n - t}"


def _form(cfg: Any, label: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The options ``label``'s run sets over ``cfg``, and its workers."""
    sections = {k: dict(v) for k, v in FORMS[label].items()}
    chosen = task_split(cfg) if label == "task" else None
    if chosen is None:
        return sections, cfg.launch.workers
    sections["task_parallel"] = {"split": chosen[1]}
    return sections, chosen[0]


def _compare(outcome: Outcome, rows: list[dict[str, Any]], reference: list[dict[str, Any]],
             sizes: dict[str, int]) -> None:
    """Fill ``outcome`` from a run's epoch rows against the single process's: the loss
    differences, and the first epoch whose accuracies differ by 2 vertices or more on
    a split (one vertex may tip either way where two classes' logits tie to rounding)."""
    outcome.losses = [r["loss"] for r in rows]
    diffs = relative_differences(outcome.losses, [r["loss"] for r in reference])
    outcome.difference = max(diffs)
    outcome.first_epoch = next((e for e, d in enumerate(diffs, 1) if d > TOLERANCE), None)
    for epoch, (row, ref) in enumerate(zip(rows, reference, strict=True), 1):
        if any(abs(row[k] - ref[k]) * n >= 1.5 for k, n in sizes.items()
               if row.get(k) is not None and ref.get(k) is not None):
            outcome.accuracy_epoch = epoch
            break


def _reference(cfg: Any) -> Any:
    """``cfg`` as the single process that the strategies are compared with runs it:
    one worker, none of ``--adapt``'s options (which the strategies take, as exact
    adaptation or slowdowns, and one process does not), and the other strategies'
    sections at their defaults (its run warned that the checked strategy's options,
    ``--spill-dir`` say, have no effect)."""
    import dataclasses

    from fullgraph.config import AdaptConfig
    from fullgraph.parallel.base import unused_sections

    others = {section: dataclasses.asdict(type(cfg.options[section])())
              for section, _, _ in unused_sections(cfg.options, {"single"})}
    return _with(cfg, runtime={"strategy": "single"}, launch={"workers": 1},
                 adapt=dataclasses.asdict(AdaptConfig()), **others)


def _with(cfg: Any, **sections: dict[str, Any]) -> Any:
    """``cfg`` with the options of ``sections`` set."""
    from fullgraph.config import config_from_dict

    tree = cfg.to_dict()
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return config_from_dict(tree, source="check")


def _epochs(cfg: Any, workers: int, stem: Path, warn: bool = False) -> list[dict[str, Any]]:
    """The epoch rows (loss, accuracies) of ``cfg`` trained by ``fullgraph train`` on
    ``workers`` local workers, quiet but for warnings where ``warn`` (the reference
    run's: what the model's training warns of, said once; a failure is raised, named
    as the launcher names it)."""
    from fullgraph import launch
    from fullgraph.models.custom import for_workers

    tree = cfg.to_dict()
    metrics = stem.with_suffix(".jsonl")
    tree["train"].update(metrics_out=str(metrics), progress="off",
                         log_level="warning" if warn else "error")
    stem.with_suffix(".json").write_text(json.dumps(tree))
    with launch.environment(for_workers(cfg.model.name)):  # the model's module, as here
        code, failure = launch.run_local(
            ["train", "--config", str(stem.with_suffix(".json"))], workers,
            timeout_s=cfg.launch.timeout_s, run_dir=None, threads=cfg.runtime.threads,
            resignal=False)
    launch.raise_if_signalled(code)  # unwinds through the check's temporary directory
    if code == 130:  # Ctrl-C: the workers are stopped; so is the check
        raise KeyboardInterrupt
    if code != 0:
        raise FullgraphError(failure.splitlines()[0].removeprefix("fullgraph: ") if failure
                             else f"exit code {code}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if r.get("event") == "epoch"]


__all__ = ["DEFAULTS", "DEFAULT_FORMS", "FORMS", "NOT_TAKEN", "TOLERANCE", "CheckReport",
           "Outcome", "check_config", "parse_forms", "prepare", "relative_differences",
           "run_checks", "task_split", "unused_options"]
