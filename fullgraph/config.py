"""Typed, frozen options: one dataclass per component, one tree per run.

The CLI and config files (YAML or TOML) build the same ``Config``; each component is
handed only its own section. ``__post_init__`` validates and raises ``ConfigError``
naming the field, the value and what is allowed. Unknown sections or keys in a
config file are errors, never ignored.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fullgraph.errors import ConfigError
from fullgraph.fields import (
    SEED_RANGE,
    TIMEOUT_MAX_S,
    changed_fields,
    choices_of,
    is_device_name,
    is_seed,
    option,
    or_else_of,
)

FEATURE_DTYPES = ("stored", "float32", "bfloat16", "float16")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
SPMM_BACKENDS = ("auto", "numba", "torch")
BACKENDS = ("auto", "gloo", "nccl")


def model_names() -> tuple[str, ...]:
    """The names ``model.name`` accepts: those of ``fullgraph.models.MODELS``."""
    from fullgraph.models import MODELS

    return tuple(MODELS)


def strategy_names() -> tuple[str, ...]:
    """The names ``runtime.strategy`` accepts: the registered strategies."""
    from fullgraph.parallel import STRATEGIES

    return tuple(STRATEGIES)


def strategy_choices() -> tuple[str, ...]:
    """What ``runtime.strategy`` accepts: the registered strategies, and ``auto`` (the
    planner's recommendation, resolved before the workers start: ``fullgraph.planner``)."""
    return (*strategy_names(), "auto")


def activation_names() -> tuple[str, ...]:
    """The names ``model.activation`` accepts: those of ``models.layers.ACTIVATIONS``."""
    from fullgraph.models.layers import ACTIVATIONS

    return tuple(ACTIVATIONS)


def _require_seed(section: str, name: str, value: Any) -> None:
    _require(is_seed(value), section, name, value, SEED_RANGE)


def _require(cond: bool, section: str, name: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{section}.{name}: got {value!r}; expected {expected}")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: torch's optimisers refuse a larger step size or weight decay
(a traceback, not a message) for float32 parameters."""
MAX_LR = FLOAT32_MAX * (1 - 0.9)
"""The largest learning rate: Adam's first step is the rate over 1 - beta1 (0.1)."""

SPARSE_FEATURES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Which dataset, where it lives and how its features are stored.

    ``normalize_features`` divides each feature row by its sum, as Kipf & Welling and
    PyG's ``NormalizeFeatures`` do for the citation graphs.
    """

    dataset: str = option("cora", "dataset name (see `fullgraph datasets`) or processed "
                          "directory")
    root: str | None = option(None, "dataset root; unset: $FULLGRAPH_DATA, else the user cache")
    feature_dtype: str = option("stored", "dtype the features are held in: as the dataset "
                                "stores them, or converted once at load (layers compute in "
                                "the run's dtype either way, converting rows as they read "
                                "them)", choices=FEATURE_DTYPES)
    normalize_features: bool = option(False, "divide each feature row by its sum (as PyG's "
                                      "NormalizeFeatures)")
    split_seed: int = option(0, "seed of the split drawn for the datasets without a public "
                            "one (amazon_*, coauthor_*); others keep the split they were "
                            "made with")
    sparse_features: str = option("auto", "hold the features as CSR (their non-zeros) through "
                                  "the first layer: on, off, or auto (on at 5% non-zeros or "
                                  "fewer and 64+ columns, as bag-of-words features)",
                                  choices=SPARSE_FEATURES)

    def __post_init__(self) -> None:
        _require(bool(self.dataset), "data", "dataset", self.dataset, "a dataset name or path")
        _require_seed("data", "split_seed", self.split_seed)
        _require(self.sparse_features in SPARSE_FEATURES, "data", "sparse_features",
                 self.sparse_features, " | ".join(SPARSE_FEATURES))
        _require(self.feature_dtype in FEATURE_DTYPES, "data", "feature_dtype",
                 self.feature_dtype, " | ".join(FEATURE_DTYPES))

    def resolved_root(self) -> Path:
        """``root``, else ``$FULLGRAPH_DATA``, else the user cache directory.

        Raises:
            ConfigError: the root is there but is no directory.
        """
        if self.root:
            root, given = Path(self.root).expanduser(), "data.root"
        elif os.environ.get("FULLGRAPH_DATA"):
            root, given = Path(os.environ["FULLGRAPH_DATA"]).expanduser(), "$FULLGRAPH_DATA"
        else:
            import platformdirs

            root, given = Path(platformdirs.user_cache_dir("fullgraph")) / "datasets", \
                "the user cache directory"
        if root.exists() and not root.is_dir():
            raise ConfigError(f"{given}: the dataset root {root} is a file, not a directory")
        return root


FAMILY_FLAGS = {"heads": "gat", "out_heads": "gat", "attn_dropout": "gat", "batch_norm": "gin",
                "hops": "tagcn"}
"""The model options with flags that belong to one built-in model (and its subclasses)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Model architecture; ``heads``/``out_heads``/``attn_dropout`` are GAT's only,
    ``batch_norm`` (inside the MLP, statistics over all vertices) GIN's only, ``hops``
    the coupled TAGCN's only (its decoupled form has ``num_props`` hops)."""

    name: str = option("gcn", "model architecture: a built-in one, or your own GNN "
                       "subclass as module:Class or path/to/file.py:Class",
                       choices=model_names, or_else=("module:Class", "file.py:Class"))
    hidden: int = option(16, "hidden width (per head for the coupled gat)")
    layers: int = option(2, "number of layers")
    dropout: float = option(0.5, "dropout probability between layers")
    input_dropout: float | None = option(None, "dropout on the input features; unset: "
                                         "--dropout")
    activation: str = option("relu", "activation between layers", choices=activation_names)
    residual: bool = option(False, "add residual connections between hidden layers")
    decoupled: bool = option(False, "an MLP, then --num-props propagation steps (NeutronTP)")
    num_props: int = option(2, "propagation steps of a decoupled model")
    heads: int = option(8, "gat: attention heads of the hidden layers")
    out_heads: int = option(1, "gat: attention heads of the output layer")
    attn_dropout: float | None = option(None, "gat: dropout on attention weights; unset: "
                                        "--dropout")
    batch_norm: bool = option(False, "gin: batch normalisation inside the MLP")
    hops: int = option(3, "tagcn: hops K of each coupled layer's filter")
    options: str | None = option(None, "the model class's own options as key=value,key=value "
                          "(values as JSON; a mapping in a config file), e.g. eps=0.1 for "
                          "gin")

    def __post_init__(self) -> None:
        from fullgraph.models.custom import (
            REFERENCE,
            canonical,
            check_options,
            family,
            is_reference,
            parse_options,
            resolve,
        )

        names = model_names()
        _require(self.name in names or is_reference(self.name), "model", "name", self.name,
                 f"{' | '.join(names)}, or {REFERENCE}")
        object.__setattr__(self, "name", canonical(self.name))
        model = resolve(self.name)  # a reference that does not import is refused here
        given = parse_options(self.options or "")
        # the options with a flag: every model's, and those of the built-in it derives
        # from (another class may take, say, its own `heads` as a model option)
        own = family(model)
        flags = [f.name for f in dataclasses.fields(self)
                 if FAMILY_FLAGS.get(f.name, own) == own]
        flagged = sorted(set(given) & set(flags))
        if flagged:
            from fullgraph.configfile import flag_names

            raise ConfigError(f"model.options: give {flagged[0]!r} as its own flag, "
                              f"--{flag_names()['model', flagged[0]]}")
        check_options(model, given, self.name, flags)
        _require(self.hidden >= 1, "model", "hidden", self.hidden, ">= 1")
        _require(self.layers >= 1, "model", "layers", self.layers, ">= 1")
        _require(self.num_props >= 1, "model", "num_props", self.num_props, ">= 1")
        _require(self.hops >= 1, "model", "hops", self.hops, ">= 1")
        _require(self.heads >= 1, "model", "heads", self.heads, ">= 1")
        _require(self.out_heads >= 1, "model", "out_heads", self.out_heads, ">= 1")
        activations = activation_names()
        _require(self.activation in activations, "model", "activation", self.activation,
                 " | ".join(activations))
        for name in ("dropout", "input_dropout", "attn_dropout"):
            p = getattr(self, name)
            _require(p is None or 0.0 <= p < 1.0, "model", name, p, "0 <= p < 1")
        gat_only = [n for n, default in (("heads", 8), ("out_heads", 1), ("attn_dropout", None))
                    if getattr(self, n) != default]
        if gat_only and self.family != "gat":
            from fullgraph.configfile import flags_of

            warnings.warn(f"{flags_of('model', gat_only)} no effect with --model {self.name} "
                          "(only with gat)", stacklevel=3)
        heads = [n for n in gat_only if n != "attn_dropout"]
        if heads and self.family == "gat" and self.decoupled:
            from fullgraph.configfile import flags_of

            warnings.warn(f"{flags_of('model', heads)} no effect with --decoupled: the "
                          "decoupled gat computes one attention head over the MLP's output "
                          "(and --hidden is the MLP's width, not per head)", stacklevel=3)
        _require(not self.batch_norm or self.family == "gin", "model", "batch_norm",
                 self.batch_norm, f"False for model {self.name!r} (batch_norm is GIN's)")
        _require(not (self.batch_norm and self.decoupled), "model", "batch_norm",
                 self.batch_norm, "False with decoupled=True (the coupled GIN has it)")
        if self.hops != 3 and (self.family != "tagcn" or self.decoupled):
            warnings.warn("--hops has no effect here (only with the coupled tagcn; a "
                          "decoupled model has --num-props hops)", stacklevel=3)
        if self.num_props != 2 and not self.decoupled:
            warnings.warn("--num-props has no effect without --decoupled", stacklevel=3)

    @property
    def family(self) -> str | None:
        """The built-in model the class is or derives from (``gat`` for a subclass of
        GAT), whose own options (``--heads``, ``--batch-norm``, ``--hops``) it takes;
        None for a model of its own."""
        from fullgraph.models.custom import family, resolve

        return family(resolve(self.name))

    def build_options(self) -> dict[str, Any]:
        """Keyword options for ``fullgraph.models.build_model``."""
        opts: dict[str, Any] = dict(num_layers=self.layers, dropout=self.dropout,
                                    input_dropout=self.input_dropout,
                                    activation=self.activation, residual=self.residual,
                                    decoupled=self.decoupled, num_props=self.num_props)
        if self.family == "gat":
            opts.update(heads=self.heads, out_heads=self.out_heads,
                        attn_dropout=self.attn_dropout)
        if self.family == "gin":
            opts.update(batch_norm=self.batch_norm)
        if self.family == "tagcn":
            opts.update(hops=self.hops)
        from fullgraph.models.custom import parse_options

        opts.update(parse_options(self.options or ""))
        return opts


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimiser, epochs, seed, device and reporting; checkpoints and the saved model.

    ``checkpoint_dir`` gets a checkpoint every ``checkpoint_every`` epochs and after the
    last; ``resume`` names a checkpoint directory to continue from (see
    ``fullgraph.checkpoint``); ``save_model`` is where the best-validation model goes
    (see ``fullgraph.saved``).
    """

    epochs: int = option(200, "training epochs (one optimiser step each)")
    lr: float = option(0.01, "Adam learning rate")
    weight_decay: float = option(5e-4, "Adam weight decay")
    seed: int = option(0, "seed of parameter initialisation and dropout")
    device: str = option("cpu", "cpu, cuda, cuda:N or auto (cuda when available)")
    eval_every: int = option(1, "evaluate every N epochs")
    patience: int | None = option(None, "stop early once the validation accuracy has not "
                                  "improved for this many epochs (checked at each "
                                  "evaluation); unset: train every epoch")
    metrics_out: str | None = option(None, "write per-epoch JSON lines (every rank's "
                                     "accounting) to this file; unset: none")
    progress: str = option("auto", "progress bar on stderr (auto: when it is a terminal)",
                           choices=PROGRESS)
    log_level: str = option("info", "what is printed: debug (also tracebacks), info (header, "
                            "epochs, summary), warning (warnings and errors only), error",
                            choices=LOG_LEVELS)
    checkpoint_dir: str | None = option(None, "write checkpoints into this directory "
                                        "(every --checkpoint-every epochs and at the end)")
    checkpoint_every: int = option(10, "epochs between checkpoints")
    resume: str | None = option(None, "continue the run from the checkpoint in this directory "
                                "(auto: from --checkpoint-dir where it holds one, else start "
                                "anew)")
    save_model: str | None = option(None, "write the best-validation model to this file "
                                    "(load it with fullgraph.load_model)")

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train", "epochs", self.epochs, ">= 1")
        _require_seed("train", "seed", self.seed)
        _require(self.checkpoint_every >= 1, "train", "checkpoint_every", self.checkpoint_every,
                 ">= 1")
        if self.checkpoint_every != 10 and self.checkpoint_dir is None:
            warnings.warn("--checkpoint-every has no effect without --checkpoint-dir",
                          stacklevel=3)
        _require(0 < self.lr <= MAX_LR, "train", "lr", self.lr,
                 "> 0 and at most 3.4e37 (Adam's first step is 10x the rate, finite in "
                 "float32)")
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise ConfigError("train.resume: 'auto' resumes from --checkpoint-dir where it "
                              "holds a checkpoint; give --checkpoint-dir too")
        _require(0 <= self.weight_decay <= FLOAT32_MAX, "train", "weight_decay",
                 self.weight_decay, ">= 0 and finite in float32 (at most 3.4e38)")
        _require(self.eval_every >= 1, "train", "eval_every", self.eval_every, ">= 1")
        _require(self.patience is None or self.patience >= 1, "train", "patience",
                 self.patience, ">= 1")
        _require(self.progress in PROGRESS, "train", "progress", self.progress,
                 " | ".join(PROGRESS))
        _require(self.log_level in LOG_LEVELS, "train", "log_level", self.log_level,
                 " | ".join(LOG_LEVELS))
        dev = self.device
        _require(is_device_name(dev, auto=True), "train", "device",
                 dev, "cpu | cuda | cuda:N | auto")

    @property
    def on_gpu(self) -> bool:
        """Whether the run's device is a GPU (``auto``: where CUDA is available)."""
        if self.device.startswith("cuda"):
            return True
        if self.device != "auto":
            return False
        import torch

        return torch.cuda.is_available()


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Which executor runs the program, and process-wide kernel / thread settings."""

    strategy: str = option("single", "how the work is split over workers (auto: the one "
                           "`fullgraph plan` recommends)", choices=strategy_choices)
    spmm_backend: str = option("auto", "CPU SpMM kernels (auto: the faster one measured on "
                               "this machine, remembered; numba: pip install "
                               "'fullgraph[fast]')", choices=SPMM_BACKENDS)
    threads: int | None = option(None, "threads per worker; unset: the cores / workers")

    def __post_init__(self) -> None:
        strategies = strategy_choices()
        _require(self.strategy in strategies, "runtime", "strategy", self.strategy,
                 " | ".join(strategies))
        _require(self.spmm_backend in SPMM_BACKENDS, "runtime", "spmm_backend",
                 self.spmm_backend, " | ".join(SPMM_BACKENDS))
        _require(self.threads is None or self.threads >= 1, "runtime", "threads", self.threads,
                 ">= 1")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How many workers, which backend, and how long a blocking call may wait.

    ``workers > 1`` starts local worker processes unless the process already runs
    under a launcher (torchrun sets RANK / WORLD_SIZE). ``timeout_s`` bounds every
    collective and peer-to-peer wait; a dead or hung peer is reported within it.
    ``run_dir`` (logs, status files) defaults to a temporary directory that is removed
    after a successful run unless ``keep_run_dir``. More workers than 4 per core, or
    than the memory can hold, are refused unless ``oversubscribe``.
    """

    workers: int = option(1, "local worker processes (under torchrun: its world size)")
    backend: str = option("auto", "communication backend (auto: nccl on cuda with a GPU per "
                          "worker, else gloo)",
                          choices=BACKENDS)
    timeout_s: float = option(300.0, "seconds any blocking call may wait for a peer (1 to "
                              "1e6)")
    run_dir: str | None = option(None, "directory for worker logs and status files, always "
                                 "kept; unset: a temporary one, removed after a successful "
                                 "run")
    keep_run_dir: bool = option(False, "keep the temporary run directory after a successful "
                                "run (a --run-dir is always kept)")
    oversubscribe: bool = option(False, "allow more than 4 workers per core or beyond memory")

    def __post_init__(self) -> None:
        _require(self.workers >= 1, "launch", "workers", self.workers, ">= 1")
        _require(self.backend in BACKENDS, "launch", "backend", self.backend,
                 " | ".join(BACKENDS))
        _require(TIMEOUT_MIN_S <= self.timeout_s <= TIMEOUT_MAX_S, "launch", "timeout_s",
                 self.timeout_s, f"seconds in [{TIMEOUT_MIN_S:g}, {TIMEOUT_MAX_S:g}]")


TIMEOUT_MIN_S = 1.0
"""``--timeout``'s lower end: a worker's heartbeat is written every half second (less
than that reads a busy worker as hung). The upper end is ``fields.TIMEOUT_MAX_S``."""

ADAPT_MODES = ("off", "adjust", "adjust+partial")
LATE_GRADIENTS = ("reuse", "rescale")


@dataclass(frozen=True, kw_only=True)
class AdaptConfig:
    """The resource-aware runtime (NeutronCloud): injected slowdowns and adaptation.

    ``mode=adjust+partial`` adds partial reduce (approximate, data parallelism):
    historical halo rows past a deadline and gradient sync among the ready majority,
    bounded by ``staleness`` (see ``fullgraph.adapt.partial``).
    ``mode=adjust`` re-chooses DepCache / DepComm for every remote dependency after
    each epoch from measured costs (data parallelism), or re-splits rows and columns
    in proportion to measured speed (tensor parallelism); both exact. ``inject`` makes chosen
    workers slow on a seeded schedule (sleep or a real CPU throttle), for studying
    adaptation; see ``fullgraph.adapt.inject`` for the spec.
    """

    mode: str = option("off", "adapt to measured worker speed: off, adjust (exact: online "
                       "DepCache/DepComm choice for --strategy data, speed-proportional "
                       "shares for tensor), or adjust+partial (data; approximate: also go "
                       "on without stragglers for up to --staleness epochs)",
                       choices=ADAPT_MODES)
    cache_budget_mb: float | None = option(None, "adjust: most MB of DepCache storage cost "
                                           "(NeutronCloud formula 12) per worker; unset: no "
                                           "limit")
    inject: str | None = option(None, "slow workers down on a seeded schedule, e.g. "
                                "'sleep:p=0.1,s=auto,n=5' or 'cpu:load=1,ranks=1,at=3'")
    staleness: int = option(3, "adjust+partial: K, the oldest historical halo rows used, in "
                            "epochs; every worker synchronises every K epochs")
    slack: float = option(0.5, "adjust+partial: alpha, the tolerated wait as a share of "
                          "each stage's and step's warm-up time")
    late_gradients: str = option("reuse", "adjust+partial: what stands in for a left-out "
                                 "worker's gradient: reuse (its latest gradient, at most "
                                 "--staleness epochs old; the rest rescaled) or rescale (the "
                                 "paper's formula 14 only: the members' sum scaled up)",
                                 choices=LATE_GRADIENTS)

    def __post_init__(self) -> None:
        _require(self.mode in ADAPT_MODES, "adapt", "mode", self.mode, " | ".join(ADAPT_MODES))
        _require(self.cache_budget_mb is None or self.cache_budget_mb >= 0, "adapt",
                 "cache_budget_mb", self.cache_budget_mb, ">= 0 or unset")
        _require(self.staleness >= 1, "adapt", "staleness", self.staleness, ">= 1")
        _require(self.late_gradients in LATE_GRADIENTS, "adapt", "late_gradients",
                 self.late_gradients, " | ".join(LATE_GRADIENTS))
        _require(0 <= self.slack < float("inf"), "adapt", "slack", self.slack,
                 "a finite number >= 0")
        partial_only = changed_fields(self, among=("staleness", "slack", "late_gradients"))
        if partial_only and self.mode != "adjust+partial":
            from fullgraph.configfile import flags_of

            warnings.warn(f"{flags_of('adapt', partial_only)} no effect without --adapt "
                          "adjust+partial", stacklevel=3)
        if self.inject is not None:
            from fullgraph.adapt.inject import parse

            try:
                parse(self.inject)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None  # (it names --inject)


CORE_SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig,
                                  "train": TrainConfig, "runtime": RuntimeConfig,
                                  "launch": LaunchConfig, "adapt": AdaptConfig}


def option_sections() -> dict[str, type]:
    """The sections the strategies declare (their own and shared ones), by name."""
    import fullgraph.parallel  # noqa: F401  (registers the strategies)
    from fullgraph.parallel.base import option_sections as declared

    return declared()


def _default_options() -> dict[str, Any]:
    return {name: cls() for name, cls in option_sections().items()}


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole option tree of a run.

    Attributes:
        options: the strategy sections (``partition``, ``data_parallel``,
            ``tensor_parallel``, ``p2p``, ...), each the options dataclass its
            strategy declares; ``section(name)`` reads one.
    """

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    options: dict[str, Any] = field(default_factory=_default_options)

    def __post_init__(self) -> None:
        merged = _default_options()
        merged.update(self.options)
        object.__setattr__(self, "options", merged)

    def section(self, name: str) -> Any:
        """One section by name, core or strategy-declared."""
        return getattr(self, name) if name in CORE_SECTIONS else self.options[name]

    def to_dict(self) -> dict[str, Any]:
        """Every section as a plain dict, in the layout of a config file."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in CORE_SECTIONS}
        out.update({name: dataclasses.asdict(v) for name, v in self.options.items()})
        return out


def sections() -> dict[str, type]:
    """Section name -> its options dataclass (strategy sections included)."""
    return {**CORE_SECTIONS, **option_sections()}


def config_from_dict(tree: dict[str, Any], source: str = "config") -> Config:
    """Build a ``Config`` from nested dicts, refusing unknown sections, keys and types.

    Options may also be named by their flags (``configfile.normalize``)."""
    from fullgraph.configfile import normalize

    tree = normalize(tree, source)
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(tree).__name__}")
    known = sections()
    built = {}
    for name, values in tree.items():
        if name not in known:
            from fullgraph.configfile import flag_names

            negated = str(name)[3:].replace("_", "-") if str(name)[:3] in ("no-", "no_") \
                and str(name)[3:].replace("_", "-") in flag_names().values() else ""
            hint = f" (to switch --{negated} off, write {negated}: false)" if negated else ""
            raise ConfigError(f"{source}: unknown section or option {name!r}; expected a "
                              f"section ({', '.join(known)}) or a train flag without --"
                              + hint)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {name!r} must be a mapping")
        if name == "model" and isinstance(values.get("options"), dict):
            from fullgraph.models.custom import format_options  # a file's mapping, as text

            values = {**values, "options": format_options(values["options"],  # ({}: none)
                                                          f"{source}: model.options") or None}
        built[name] = _build_section(known[name], values, f"{source}: {name}")
    core = {k: v for k, v in built.items() if k in CORE_SECTIONS}
    return Config(**core, options={k: v for k, v in built.items() if k not in CORE_SECTIONS})


def _build_section(cls: type, values: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for key, value in list(values.items()):
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; expected one of "
                              f"{', '.join(sorted(known))}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not _type_ok(value, hints[key]) and _type_ok("", hints[key]):
            value = values[key] = str(value)  # a size or a name written as a number
        if isinstance(value, str) and value.lower() in _YES_NO and \
                not _type_ok(value, hints[key]) and _type_ok(True, hints[key]):
            value = values[key] = _YES_NO[value.lower()]  # YAML 1.1's words for a switch
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{where}.{key}: got {value!r} ({type(value).__name__}); "
                              f"expected {_type_name(hints[key])}")
        if isinstance(value, str) and not value.strip() and _type_ok(None, hints[key]):
            raise ConfigError(f"{where.rsplit(': ', 1)[-1]}.{key}: got an empty value "
                              f"{value!r}; leave the option out for none (an unset variable "
                              "in a script?)")
        choices = choices_of(known[key])
        if choices is not None and value not in choices and not or_else_of(known[key]):
            raise ConfigError(f"{where}.{key}: got {value!r}; expected one of "
                              f"{', '.join(choices)}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:  # a strategy's own validation: named as the others are
        field, rest = _field_of(str(exc), cls, values)  # where it names one option
        if field is not None:
            raise ConfigError(f"{where.rsplit(': ', 1)[-1]}.{field}: {rest}") from None
        raise ConfigError(f"{where}: {exc}") from None


def _field_of(text: str, cls: type, values: dict[str, Any]) -> tuple[str | None, str]:
    """The one field of ``cls`` a validation error's ``text`` is about, and the text
    after its name ("data parallel byte_cost must be ..." -> byte_cost, "must be
    ..."); or the field whose given value it quotes ("cannot read 'lots' as a size"),
    with the whole text. (None, text) where it names none, or several."""
    names = [f.name for f in dataclasses.fields(cls)]
    named = [(n, m) for n in names
             if (m := re.search(rf"(?<![\w.]){re.escape(n).replace('_', '[_ ]')}\b:?\s*",
                                text))]
    if len(named) == 1:
        return named[0][0], text[named[0][1].end():]
    quoted = [n for n in names if isinstance(values.get(n), str) and
              f"{values[n]!r}" in text]
    if not named and len(quoted) == 1:
        return quoted[0], text
    return None, text


_YES_NO = {"yes": True, "no": False, "on": True, "off": False, "y": True, "n": False}
"""Words YAML 1.1 read as booleans, still taken for an on/off option (the file is read
as YAML 1.2, where they are words, so that ``progress: off`` keeps its word)."""


def _type_name(hint: Any) -> str:
    """``int``, ``float | None``, ``tuple[int, ...]``: a type as it is written."""
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else \
        str(hint).replace("typing.", "").replace("NoneType", "None")


def _type_ok(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (json keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out


def yaml_load_unique(text: str) -> Any:
    """``yaml.safe_load``, refusing a mapping key given twice (PyYAML keeps the last,
    so the first would be dropped without a word), and reading plain scalars as YAML
    1.2 does, i.e. as the flags read them: only ``true``/``false`` are booleans (``off``
    stays the word ``off``), ``1:3`` is text (YAML 1.1 reads base 60, 63), and ``1e-3``
    is a number (YAML 1.1 wants ``1.0e-3``)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers
                if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                               "tag:yaml.org,2002:float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, pattern, firsts in (
            ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
            ("tag:yaml.org,2002:int", r"^[-+]?[0-9][0-9_]*$", "-+0123456789"),
            ("tag:yaml.org,2002:float",
             r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?$"
             r"|^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$|^[-+]?\.(?:inf|Inf|INF)$"
             r"|^\.(?:nan|NaN|NAN)$", "-+0123456789.")):
        Loader.add_implicit_resolver(tag, re.compile(pattern), list(firsts))
    # decimal, as int() reads a flag: YAML 1.1's constructor reads 010 as octal 8
    Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(
        str(loader.construct_scalar(node)).replace("_", ""), 10))

    def mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"key {key!r} is given twice (again on line "
                                 f"{key_node.start_mark.line + 1})")
            seen.add(key)
        return loader.construct_mapping(node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON file into dicts."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a config file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # (a byte-order mark is dropped)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save the file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            tree = yaml_load_unique(text)
            tree = {} if tree is None else tree  # (an empty file; 0 or false is refused)
        elif path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:
                import tomli as tomllib
            tree = tomllib.loads(text)
        elif path.suffix == ".json":
            tree = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            raise ConfigError(f"{path}: unknown config format {path.suffix!r}; "
                              "expected .yaml, .yml, .toml or .json")
    except ConfigError:
        raise
    except Exception as exc:  # parser errors carry line numbers in their text
        raise ConfigError(f"{path}: cannot parse: {' '.join(str(exc).split())}") from None
    return tree


def merge(tree: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``tree`` (sections of fields, as ``configfile.normalize`` gives) with
    ``overrides`` (section -> key -> value) laid over it."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for section, values in overrides.items():
        if values:
            out.setdefault(section, {}).update(values)
    return out
