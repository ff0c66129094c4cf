"""The strategy-agnostic training loop: build -> epoch -> evaluate -> report.

Full-graph training: one optimiser step (Adam) per epoch, evaluation on the train,
validation and test masks after it, and the model with the best validation accuracy
kept (its test accuracy is the reported result; without validation vertices, the
last epoch's). Fixed seeds give identical results
on CPU: parameters come from the CPU generator seeded by ``seed``, and every dropout mask is
keyed by (seed, epoch, stage, vertex), see ``fullgraph.ops.dropout``. So a run
resumed from a checkpoint (``fullgraph.checkpoint``) goes on bit for bit.
"""
from __future__ import annotations

import copy
import importlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fullgraph import launch
from fullgraph.adapt import build_adapters, check_local_launch
from fullgraph.adapt import check_strategy as check_adapt_strategy
from fullgraph.checkpoint import Checkpointer, run_facts
from fullgraph.comm.group import Comm, check_device, env_int, resolve_device
from fullgraph.comm.primitives import all_gather_object
from fullgraph.config import Config
from fullgraph.errors import ConfigError, ValidationError
from fullgraph.extras import MissingExtraError, missing_message
from fullgraph.fields import changed_fields
from fullgraph.graph.data import Dataset
from fullgraph.graph.digest import digest
from fullgraph.graph.sparse import density, is_sparse
from fullgraph.models import build_model
from fullgraph.models.base import GNN
from fullgraph.models.walk import dense_reader
from fullgraph.ops import gpu_kernels, kernels
from fullgraph.ops.spmm import auto_choice, describe_backend, set_auto, set_backend
from fullgraph.parallel import build_strategy
from fullgraph.parallel.base import EpochHook, Plan, Strategy, get_strategy, section_users
from fullgraph.partition import PartitionBook, shards
from fullgraph.paths import check_distinct, check_output
from fullgraph.profile import EpochProfile, Profiler, split_waiting, summary_lines
from fullgraph.report import EpochRecord, Reporter
from fullgraph.worker import SAVING_PHASE


@dataclass
class TrainResult:
    """What a run produced."""

    epochs: list[EpochRecord]
    best_epoch: int
    best_val: float
    test_at_best: float
    train_at_best: float
    total_s: float
    model: GNN
    extra: dict[str, Any] = field(default_factory=dict)


OUTPUTS = (("save_model", "--save-model", False), ("metrics_out", "--metrics-out", False),
           ("checkpoint_dir", "--checkpoint-dir", True))
"""The run's outputs (``train`` options, their flags, whether a directory): rank 0
alone writes them, at the paths rank 0 was given (and the checkpoint, under torchrun,
one worker of each host that does not see rank 0's directory)."""


def check_outputs(cfg: Config) -> None:
    """Refuse an output path the run could not write (``--save-model`` a directory, a
    ``--checkpoint-dir`` that is a file, ...) now, not when it is written after the
    training; and a ``--checkpoint-dir`` whose checkpoint a new run would replace.

    Raises:
        ConfigError: naming the option and the path.
    """
    for key, flag, directory in OUTPUTS:
        path = getattr(cfg.train, key)
        if path:
            check_output(path, flag, directory=directory)
    if cfg.launch.run_dir:  # (the launcher's, or under torchrun each host's)
        check_output(cfg.launch.run_dir, "--run-dir", directory=True)
    from fullgraph.checkpoint import check_not_replaced, checkpoint_file, given_file

    t = cfg.train
    outputs = [(flag, getattr(t, key)) for key, flag, directory in OUTPUTS
               if getattr(t, key) and not directory]
    if t.checkpoint_dir:
        outputs.append(("--checkpoint-dir", checkpoint_file(t.checkpoint_dir)))
    book = cfg.options["partition"].file
    inputs = [("--partition-file", book)] if book else []
    if t.resume and t.resume != "auto":  # (resumed and written again: as meant)
        read = given_file(t.resume)
        if not t.checkpoint_dir or read.resolve() != checkpoint_file(t.checkpoint_dir).resolve():
            inputs.append(("--resume", read))
    check_distinct(outputs, inputs)
    check_not_replaced(cfg)


PER_PROCESS_OPTIONS = {
    "data": ("dataset", "root"), "launch": None, "partition": ("file",),
    "runtime": ("spmm_backend", "threads"), "tensor_parallel": ("spill_dir",),
    "train": ("device", "metrics_out", "progress", "log_level", "checkpoint_dir", "resume",
              "save_model")}
"""Options that may differ between the workers of one run (None: the whole section):
paths on each host, what a worker prints, its threads and kernel, its device."""


def check_same_options(cfg: Config, comm: Comm) -> None:
    """Refuse a run whose workers were given different options (under torchrun each
    host has its own command line): a different seed, model or strategy would train
    different models on the ranks, silently. Collective.

    Raises:
        ConfigError: on every rank, naming each option that differs and its value on
            which ranks.
    """
    tree = cfg.to_dict()
    mine = {f"{section}.{key}": value for section, values in tree.items()
            for key, value in values.items()
            if section not in PER_PROCESS_OPTIONS or
            (PER_PROCESS_OPTIONS[section] is not None and
             key not in PER_PROCESS_OPTIONS[section])}  # type: ignore[operator]
    # a partition file's path is each host's, but given on some hosts only, the workers
    # would set up different partitions (and wait on each other in different calls)
    mine["--partition-file given"] = tree.get("partition", {}).get("file") is not None
    outputs = [flag for key, flag, _ in OUTPUTS if getattr(cfg.train, key) is not None]
    every = all_gather_object((mine, outputs), comm, "options")
    diffs = _differing([options for options, _ in every])
    if diffs:
        raise ConfigError("the workers were given different options (" + "; ".join(diffs) +
                          "): give every worker the same command line or config file")
    given = {flag: [r for r, (_, outs) in enumerate(every) if flag in outs]
             for _, flag, _ in OUTPUTS}
    lost = [f"{flag} given on rank(s) {_ranks(ranks)}" for flag, ranks in given.items()
            if ranks and ranks[0] != 0]
    if lost:
        raise ConfigError(f"{', '.join(lost)} but not on rank 0, which alone writes the run's "
                          "outputs: give them on rank 0's host (its paths are the ones used)")


def check_same_data(dataset: Dataset, comm: Comm) -> None:
    """Refuse a run whose workers loaded different data: under torchrun each host reads
    its own copy of the dataset and of ``--partition-file``, and a stale copy trains
    a wrong model with no error. Compares the sizes and split sizes, and what names the
    contents: the checksums the store recorded for each array file (read with the
    metadata, nothing hashed here); a shard's whole-dataset fingerprint, recorded when
    the shards were written; for a dataset made in memory, digests of its graph, labels
    and masks (not of its features). Partition files: ``rows.partition_book``.
    Collective.

    Raises:
        ConfigError: on every rank, naming each fact that differs and its value on
            which ranks.
    """
    sh = dataset.shard
    if sh is not None:
        mine: dict[str, Any] = {**sh.fingerprint, "parts": sh.parts, "shard hops": sh.hops,
                                "shard partition": digest(sh.part_of)}
    else:
        g, d = dataset.graph, dataset.data
        mine = {"vertices": g.num_nodes, "edges": g.num_edges, "features": d.num_features,
                "classes": d.num_classes,
                **{f"{k} vertices": int(m.sum()) for k, m in
                   (("train", d.train_mask), ("val", d.val_mask), ("test", d.test_mask))}}
        if dataset.checksums is not None:
            mine.update({f"{name}.npy": value[:16] for name, value in dataset.checksums.items()})
        else:
            mine.update({"graph": digest(g.indptr, g.indices), "labels": digest(d.labels),
                         "masks": digest(d.train_mask, d.val_mask, d.test_mask)})
    diffs = _differing(all_gather_object(mine, comm, "setup"))
    if diffs:
        fix = ("give every host parts of one shard set (copy them from the directory "
               "`fullgraph partition --shards` wrote, or write the shards again)"
               if sh is not None else
               "give every host the same dataset (copy one host's processed directory to "
               "the others: its checksums name its files)")
        raise ConfigError("the workers loaded different data (" + "; ".join(diffs) + "): "
                          + fix)


def _differing(every: list[dict[str, Any]]) -> list[str]:
    """``key: A on rank(s) 0-2, B on rank(s) 3`` for each key whose values differ."""
    diffs = []
    for key in sorted(set().union(*every)):
        ranks: dict[str, list[int]] = {}
        for rank, values in enumerate(every):
            ranks.setdefault(repr(values.get(key)), []).append(rank)
        if len(ranks) > 1:
            diffs.append(f"{key}: " + ", ".join(f"{value} on rank(s) {_ranks(r)}"
                                                 for value, r in ranks.items()))
    return diffs


def check_same_start(epoch: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     comm: Comm) -> None:
    """Refuse a run whose workers start from different points: ``--resume`` given to some
    workers only, or checkpoints of other epochs or contents on the hosts (the path may
    differ per host; what it holds may not). Compares the epoch resumed after (0: a
    fresh start) and, where a worker resumed, a digest of the restored parameters and
    optimiser state. Collective.

    Raises:
        ConfigError: on every rank, naming the start of each group of ranks.
    """
    digest = _state_digest(model, optimizer) if epoch else ""
    every = all_gather_object((epoch, digest), comm, "options")
    if len(set(every)) == 1:
        return
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, start in enumerate(every):
        groups.setdefault(start, []).append(rank)
    named = [(f"a checkpoint of epoch {e} ({d[:8]})" if e else "a fresh start")
             + f" on rank(s) {_ranks(r)}" for (e, d), r in groups.items()]
    copies = ("; under torchrun each host that does not see rank 0's --checkpoint-dir "
              "keeps its own copy: one behind the others (a host that stopped or failed "
              "to write) must be replaced by the newest") if launch.under_torchrun() else ""
    raise ConfigError("the workers start from different points (" + "; ".join(named) +
                      "): give every worker the same --resume checkpoint, or none" + copies)


def _state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of the parameters' and the optimiser's tensors and numbers."""
    import hashlib

    h = hashlib.sha256()

    def add(obj: Any) -> None:
        if isinstance(obj, Tensor):
            h.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                     if obj.numel() else b"")
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                h.update(str(key).encode())
                add(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                add(item)
        else:
            h.update(repr(obj).encode())

    add(model.state_dict())
    add(optimizer.state_dict()["state"])
    return h.hexdigest()


def _ranks(ranks: list[int]) -> str:
    """``0-3, 5``: ranks as ranges."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_patience(cfg: Config, dataset: Dataset) -> None:
    """Refuse ``train.patience`` on a dataset without validation vertices (early stopping
    watches the validation accuracy; a per-part shard keeps the whole graph's masks).

    Raises:
        ConfigError: patience is set and no vertex is in the validation set.
    """
    if cfg.train.patience is not None and not bool(dataset.data.val_mask.any()):
        raise ConfigError(f"train.patience: {dataset.name} has no validation vertices, and "
                          "early stopping watches the validation accuracy; leave out "
                          "--patience, or give the data a validation set")


def check_any_strategy(cfg: Config, dataset: Dataset, workers: int, *,
                       launching: bool = True) -> None:
    """Find the user errors that a ``workers``-worker run of any strategy would hit
    (for ``fullgraph plan`` and ``--strategy auto``, before they measure anything): the
    device and backend, ``--adapt``'s and ``--inject``'s options as any strategy reads
    them, more workers than vertices, and what the local launcher's workers cannot
    honour (``workers`` > 1 is such a launch; ``launching`` False: a plan, which
    injects nothing).

    Raises:
        ConfigError: naming the option.
    """
    from fullgraph.adapt import check_general

    check_device(cfg.train.device, local_workers=workers if launching else 1)
    if cfg.launch.backend == "nccl" and not cfg.train.on_gpu:
        raise ConfigError(f"launch.backend: 'nccl' needs CUDA devices, and the run is on "
                          f"{'the CPU' if cfg.train.device != 'auto' else 'the CPU (auto)'}; "
                          "use --backend gloo, or --device cuda")
    if cfg.launch.backend == "nccl" and launching and workers > torch.cuda.device_count():
        raise ConfigError(f"launch.backend: 'nccl' needs a GPU for each worker, and this host "
                          f"has {torch.cuda.device_count()} for --workers {workers}; use "
                          "--backend gloo (or auto: gloo where workers share a GPU), or fewer "
                          "workers")
    check_general(cfg, workers)
    nodes = dataset.graph.num_nodes
    if workers > nodes:
        raise ConfigError(f"{workers} workers for a graph of {nodes} vertices: every strategy "
                          f"splits the vertices or their work; use at most {nodes} workers")
    if workers > 1 and launching:  # (the local launcher's: under torchrun none is launched)
        check_local_launch(cfg)


def check_before_planning(cfg: Config, dataset: Dataset, *, launching: bool = True) -> None:
    """What ``plan``, ``--strategy auto`` and ``fit(strategy="auto")`` refuse before they
    measure anything: more workers than this host starts (``launch.check_workers``), then
    ``check_any_strategy``."""
    from fullgraph import launch

    if cfg.launch.workers > 1:
        launch.check_workers(cfg.launch.workers, cfg.launch.oversubscribe)
    require_training(dataset)
    check_any_strategy(cfg, dataset, cfg.launch.workers, launching=launching)


def require_training(dataset: Dataset) -> None:
    """Refuse a dataset without training vertices (``VertexData.require_training``).

    Raises:
        ValidationError: naming the dataset.
    """
    dataset.data.require_training(dataset.name)


def check_before_launch(cfg: Config, dataset: Dataset, workers: int) -> None:
    """Find the user errors a ``workers``-worker run would hit, before starting any.

    Checks that the dataset has training vertices, the device and backend, what the
    strategy would refuse of this model, graph
    and worker count (``Strategy.check_launch``), the optional packages the options
    need (pymetis for METIS partitions, numba for the numba SpMM), a partition file
    against the dataset, and what workers of the local launcher cannot honour
    (``--inject net``; ``workers`` > 1 is such a launch). The output paths are the caller's to check
    (``check_outputs``: they are written where the caller runs).

    Raises:
        ConfigError: an option needs a missing package, or the partition file has
            another number of parts than there are workers.
        DataError: the partition file is unreadable or for another graph.
    """
    require_training(dataset)
    check_any_strategy(cfg, dataset, workers)  # (check_general of --adapt among them)
    check_adapt_strategy(cfg)
    check_patience(cfg, dataset)
    shards.check_use(dataset, cfg.runtime.strategy, workers)
    program = build(dataset, cfg)
    try:  # what the strategy's setup would refuse, found before any worker starts
        chosen = get_strategy(cfg.runtime.strategy).from_sections(cfg.options)
        chosen.check_launch(program, dataset.graph.num_nodes, workers)
        chosen.check_data(program, dataset, workers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dataset.shard is not None:
        if cfg.options["partition"].file:
            raise ConfigError(f"partition.file: {cfg.options['partition'].file}: the dataset "
                              "is per-part shards, which carry their own partition; leave "
                              "out --partition-file")
        check_shard_hops(cfg, dataset, program)
        unused = changed_fields(cfg.options["partition"], skip=("file",))
        if unused:
            from fullgraph.configfile import flags_of

            warnings.warn(f"{flags_of('partition', unused)} no effect on per-part shards: "
                          "they carry the partition they were written with", stacklevel=2)
        if cfg.runtime.strategy == "tensor" and cfg.adapt.mode != "off":
            raise ConfigError(f"adapt.mode: --adapt {cfg.adapt.mode} with --strategy tensor "
                              "moves rows between workers, and on per-part shards a worker "
                              "holds only its own block of feature rows; train without "
                              "--adapt, or on the unsharded dataset")
    if cfg.train.resume:  # a checkpoint of another run: refused before any worker starts
        from fullgraph.checkpoint import check_resumable

        check_resumable(cfg, dataset)
    if cfg.runtime.spmm_backend == "numba" and not kernels.HAVE_NUMBA:
        raise MissingExtraError(missing_message("numba", "runtime.spmm_backend: 'numba'") +
                                " (or use --spmm-backend torch)")
    if cfg.runtime.strategy not in section_users()["partition"] or workers < 2 \
            or dataset.shard is not None:  # shards carry their partition
        return
    opts = cfg.options["partition"]
    if opts.file:
        book = PartitionBook.load(opts.file, num_nodes=dataset.graph.num_nodes)
        try:
            book.check_made_for(dataset.graph, opts.file)
        except ValidationError as exc:
            raise ConfigError(f"partition.file: {exc}") from None
        if book.num_parts != workers:
            raise ConfigError(f"partition.file: {opts.file} has {book.num_parts} parts but "
                              f"there are {workers} workers")
    elif opts.method in ("metis", "g3"):  # g3 starts from a METIS partition
        try:
            importlib.import_module("pymetis")
        except ImportError:
            raise ConfigError(f"partition.method: {opts.method!r} needs pymetis, a dependency "
                              "of fullgraph that is not installed (pip install pymetis, or use "
                              "--partitioner chunk or random)") from None


def check_shard_hops(cfg: Config, dataset: Dataset, model: GNN) -> None:
    """On per-part shards, when a plan may replicate rows (DepCache, hybrid, or any mode
    under ``--adapt``): refuse shards written with fewer hops than the model needs."""
    if dataset.shard is None or cfg.runtime.strategy != "data":
        return
    mode = cfg.options["data_parallel"].mode
    if mode == "depcomm" and cfg.adapt.mode == "off":
        return
    from fullgraph.parallel.data import check_shard_hops as check

    what = f"dep-mode {mode}" + (f" with --adapt {cfg.adapt.mode}" if cfg.adapt.mode != "off"
                                 else "")
    try:
        check(model, dataset, what)
    except ValueError as exc:
        needed = model.signature().count("P")  # each propagation reaches one hop further
        raise ConfigError(f"{exc} (this model propagates {needed} times: --shard-hops "
                          f"{needed} holds every row a replicating plan reads)") from None


def _warn_of_unkeyed_modules(model: GNN, strategy: str) -> None:
    """Warn of torch modules in stages that no strategy but ``single`` runs as one
    process does: a batch norm's statistics are over the rows a worker (or a bin)
    holds, and ``nn.Dropout`` draws its mask from each process's generator, where the
    executors' dropout is keyed by (seed, stage, vertex)."""
    for stage in model.stages:
        for module in stage.modules():
            fix = ("fullgraph.models.norm.GlobalBatchNorm, over every vertex"
                   if isinstance(module, nn.modules.batchnorm._BatchNorm) else
                   "fullgraph.ops.dropout.keyed_dropout(x, p, ctx.gids, fullgraph.models."
                   "stages.stage_seed(ctx.seed, self.index), ctx.training)"
                   if isinstance(module, nn.modules.dropout._DropoutNd) else None)
            if fix is not None:
                warnings.warn(f"stage {stage.index} ({type(stage).__name__}) of "
                              f"{model.name} holds torch's {type(module).__name__}, which "
                              f"--strategy {strategy} does not run as one process does (the "
                              f"run is not exact): use {fix}", stacklevel=3)
                return


def step_seed(seed: int, epoch: int) -> int:
    """The dropout seed of an epoch."""
    return (int(seed) * 100_003 + epoch) & 0xFFFFFFFF


def configure_runtime(cfg: Config) -> None:
    """Process-wide kernel and thread settings."""
    set_backend(cfg.runtime.spmm_backend)
    threads = cfg.runtime.threads or env_int("FULLGRAPH_THREADS", 0)
    threads = threads or torch.get_num_threads()  # else: the launcher's share of the cores
    # numba first: starting its OpenMP pool resets the process-wide OpenMP count
    kernels.set_threads(threads)
    torch.set_num_threads(threads)


def build(dataset: Dataset, cfg: Config) -> GNN:
    """The model ``cfg.model`` describes, initialised from ``cfg.train.seed``."""
    # the CPU generator only: the parameters are drawn on the CPU, and every dropout mask is
    # keyed, so no other generator is read (nor reseeded under a caller of fit)
    torch.random.default_generator.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.name, dataset.data.num_features, cfg.model.hidden,
                        dataset.data.num_classes, **cfg.model.build_options())
    if not any(p.requires_grad for p in model.parameters()):  # (Adam: "an empty list")
        raise ConfigError(f"model {cfg.model.name}: it has no trainable parameters, so "
                          "there is nothing to train (a stage's weights are nn.Parameters "
                          "or layers it holds as attributes)")
    return model


def train(dataset: Dataset, cfg: Config, *, reporter: Reporter | None = None,
          comm: Comm | None = None, header: list[str] | None = None,
          strategy: Strategy | None = None, local_rank: int = 0,
          status: Any = None, adapters: Sequence[EpochHook] = (),
          dtype: torch.dtype = torch.float32) -> TrainResult:
    """Train ``cfg.model`` on ``dataset`` with ``cfg.runtime.strategy``.

    Args:
        dataset: the graph and its vertex data.
        cfg: the whole option tree.
        reporter: where epochs are reported (default: a silent one).
        comm: the communication handle of distributed strategies (default: None).
        header: extra header lines (allocator, launcher facts) (default: None).
        strategy: an already built strategy (default: from the registry).
        local_rank: GPU index on this host for ``device=cuda`` (default: 0).
        status: a worker status to which phases are reported (default: None).
        adapters: runtime adapters called between epochs after the strategy, in order,
            with the epoch's profile (default: none).
        dtype: of the parameters and vertex rows (default: float32).
    """
    require_training(dataset)  # (also under torchrun, where no launcher checked it)
    configure_runtime(cfg)
    device = resolve_device(cfg.train.device, local_rank)
    if device.type == "cuda":  # this rank's GPU is the current one: streams, events and
        torch.cuda.set_device(device)  # allocations without a device go to it
    if device.type == "cpu" and cfg.runtime.spmm_backend == "auto" and comm is not None \
            and comm.world_size > 1:  # every worker runs the kernel rank 0 chose
        set_auto(all_gather_object(auto_choice() if comm.rank == 0 else None, comm,
                                   "setup")[0])
    reporter = reporter or Reporter(cfg.train.epochs, enabled=False)
    phase = status.set_phase if status is not None else (lambda _: None)
    strategy = strategy or build_strategy(cfg)
    shards.check_use(dataset, strategy.name, comm.world_size if comm is not None else 1)
    check_patience(cfg, dataset)
    model = build(dataset, cfg).to(strategy.model_device(device), dtype)
    if strategy.name != "single" and (comm is None or comm.rank == 0):
        _warn_of_unkeyed_modules(model, strategy.name)
    if device.type != "cpu" and cfg.runtime.spmm_backend == "numba" \
            and (comm is None or comm.rank == 0):
        warnings.warn(f"--spmm-backend numba has no effect on {device}: its kernels are "
                      "the CPU's; a GPU runs torch's sparse kernels", stacklevel=2)
    if cfg.model.residual and (comm is None or comm.rank == 0) and not any(
            getattr(s, "residual", False) for s in model.stages):
        kept = [layer + 1 for layer in sorted(set(model.layer_of))
                if len(set(_layer_width(model, layer))) == 1]
        if kept:  # a user's conv() that does not apply the residual= it is given
            warnings.warn(f"--residual has no effect here: {cfg.model.name}'s conv() does "
                          f"not apply residual=True, which layer {kept[0]} (keeping its "
                          "width) was given (a stage that adds the layer's input keeps "
                          "residual = True, as Dense(..., residual=residual) does: that is "
                          "how a run tells)", stacklevel=2)
        else:
            warnings.warn("--residual has no effect here: it adds a layer's input to its "
                          "output where the layer keeps its width, and no layer of this "
                          f"model does ({dataset.data.num_features} features, --hidden "
                          f"{cfg.model.hidden}, {dataset.data.num_classes} classes, "
                          f"--layers {cfg.model.layers})", stacklevel=2)
    note = model.stored_self_loops_note()
    if note and (comm is None or comm.rank == 0) and dataset.graph.has_self_loops():
        warnings.warn(f"--model {cfg.model.name} {note}: convert (or generate) the graph "
                      "with --self-loops remove to match", stacklevel=2)
    if dataset.data.num_classes < 2 and (comm is None or comm.rank == 0):
        warnings.warn(f"the dataset has {dataset.data.num_classes} class: cross-entropy over "
                      "one class is 0 whatever the model computes, so nothing trains",
                      stacklevel=2)
    check_shard_hops(cfg, dataset, model)
    if comm is not None and comm.world_size > 1:
        check_same_data(dataset, comm)
    phase("setup")
    t_setup = time.perf_counter()
    plan = strategy.setup(dataset, model, device, comm, dtype=dtype)
    setup_s = time.perf_counter() - t_setup
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr,
                                 weight_decay=cfg.train.weight_decay)
    world = comm.world_size if comm is not None else 1
    rank = comm.rank if comm is not None else 0
    ckpt = Checkpointer(dataset, cfg, rank, dtype, run_facts(cfg, world, plan))
    if comm is not None and comm.world_size > 1 and launch.under_torchrun():
        ckpt.find_other_hosts(comm)  # (hosts that may not share --checkpoint-dir)
    state = ckpt.resume(model, optimizer)
    if comm is not None and comm.world_size > 1:
        check_same_start(state.epoch, model, optimizer, comm)
    profiler = Profiler(comm, device, strategy.work(model, plan))
    hooks = [*adapters, *build_adapters(cfg, strategy, model, plan, rank, world, profiler.note)]
    strategy.step_hooks = [h for h in hooks if hasattr(h, "on_loss")]
    if state.records:
        for hook in hooks:
            getattr(hook, "resumed", lambda _: None)(state.records)
    try:
        reporter.resumed_after = state.epoch  # (its file's rank records are carried)
        reporter.header(_header_lines(dataset, model, cfg, device, setup_s, world)
                        + strategy.describe(model, plan) + (header or [])
                        + [line for h in hooks for line in getattr(h, "header", list)()]
                        + ckpt.header_lines(),
                        {"config": cfg.to_dict(), "dataset": dataset.summary(),
                         "program": model.signature(), "device": str(device), "workers": world,
                         "threads": torch.get_num_threads(), "setup_s": setup_s,
                         "resumed_after": state.epoch})
        if state.records:
            reporter.restored(state.records)
        save = None
        if cfg.train.save_model and rank == 0:  # before the summary, which says the run ended
            def save(result: TrainResult) -> None:
                phase(SAVING_PHASE)
                _save_model(cfg, result, dataset, world)
                phase("done")
        result = _epochs(strategy, model, plan, optimizer, cfg, state, ckpt, profiler, hooks,
                         reporter, comm, phase, save)
    except BaseException:  # the hooks let go without waiting on peers: the error stands
        for hook in hooks:
            getattr(hook, "abort", getattr(hook, "close", lambda: None))()
        raise
    for hook in hooks:
        getattr(hook, "close", lambda: None)()
    return result


def _epochs(strategy: Strategy, model: GNN, plan: Plan, optimizer: torch.optim.Optimizer,
            cfg: Config, state: Any, ckpt: Checkpointer, profiler: Profiler,
            hooks: Sequence[Any], reporter: Reporter, comm: Comm | None,
            phase: Any, save: Callable[[TrainResult], None] | None = None) -> TrainResult:
    """The epochs after ``state.epoch``: step, evaluate, report, adapt, checkpoint;
    then ``save`` (the model kept) and the summary.

    Under partial reduce only some epochs are collective (a hook's
    ``collective_epoch``): the others skip evaluation, their profiles are exchanged at
    the next collective epoch, and the adaptation hooks that communicate run only
    at the start of a collective epoch, inside its profile, after the hooks'
    ``before_epoch`` (which brings every worker there), so a new plan starts on it.
    """
    records: list[EpochRecord] = state.records
    profiles: list[Any] = []
    unsent: list[EpochProfile] = []
    best: tuple[float, int, float, float, dict[str, Any] | None] = state.best
    start = time.perf_counter()
    deferred: tuple[int, EpochProfile] | None = None

    def is_collective(epoch: int) -> bool:
        return all(getattr(h, "collective_epoch", lambda _: True)(epoch) for h in hooks)

    # under partial reduce only a collective epoch's loss is known to be every rank's, and
    # only there is nothing in flight between the ranks: a divergence stops the run there
    partial = any(hasattr(h, "collective_epoch") for h in hooks)

    patience = cfg.train.patience

    def out_of_patience(epoch: int, val: float) -> bool:
        """Whether early stopping ends the run at ``epoch``, evaluated at ``val``."""
        return patience is not None and not math.isnan(val) and epoch - best[1] >= patience

    last, diverged = cfg.train.epochs, None
    if records and out_of_patience(state.epoch, records[-1].val_acc):
        last = state.epoch  # the run resumed had already stopped early
    for epoch in range(state.epoch + 1, last + 1):
        collective = is_collective(epoch)
        profiler.begin()
        phase(f"epoch {epoch} start")  # (partial reduce waits here for a straggler's backlog)
        for hook in hooks:
            getattr(hook, "before_epoch", lambda _: None)(epoch)
        if deferred is not None and collective:
            phase(f"epoch {deferred[0]} adjustment")
            _between(strategy, hooks, model, plan, *deferred, which="communicating")
            profiler.work = strategy.work(model, plan)
            deferred = None
        phase(f"epoch {epoch} training step")
        stats = strategy.train_step(model, plan, optimizer, seed=step_seed(cfg.train.seed, epoch))
        acc = {"train": float("nan"), "val": float("nan"), "test": float("nan")}
        eval_s = 0.0
        if collective and (epoch % cfg.train.eval_every == 0 or epoch == cfg.train.epochs):
            phase(f"epoch {epoch} evaluation")
            t_eval = time.perf_counter()
            acc = _accuracy(strategy, model, plan)
            eval_s = time.perf_counter() - t_eval
            # (a step that made the parameters non-finite, as any after a non-finite loss
            # does: the classes NaN logits happen to give score something, and must not
            # make such parameters the model kept)
            finite = math.isfinite(stats.loss) and all(
                bool(torch.isfinite(p).all()) for p in model.parameters())
            if finite and acc["val"] > best[0]:
                best = (acc["val"], epoch, acc["test"], acc["train"],
                        copy.deepcopy(model.state_dict()))
            elif finite and math.isnan(acc["val"]):  # no validation vertices: the last one
                # (kept, so that a later non-finite step falls back to it)
                best = (acc["val"], epoch, acc["test"], acc["train"],
                        copy.deepcopy(model.state_dict()))
            # the accuracies are every rank's (reduced counts): every rank stops here
            if out_of_patience(epoch, acc["val"]):
                last = epoch
        prof = profiler.end(epoch)
        prof.saved_bytes = int(stats.extra.get("saved_bytes", 0))
        named = stats.forward_s + stats.backward_s + stats.sync_s + stats.optimizer_s + eval_s
        rec = EpochRecord(epoch, stats.loss, acc["train"], acc["val"], acc["test"], prof.wall_s,
                          stats.forward_s, stats.backward_s, stats.optimizer_s, eval_s,
                          stats.sync_s, max(0.0, prof.wall_s - named))
        records.append(rec)
        reporter.epoch(rec)
        unsent.append(prof)
        if collective:
            phase(f"epoch {epoch} metrics")
            prof = _exchange_profiles(unsent, comm, profiles, reporter)
            unsent = []
        if epoch < last:
            phase(f"epoch {epoch} adjustment")
            both = collective and is_collective(epoch + 1)
            _between(strategy, hooks, model, plan, epoch, prof,
                     which="all" if both else "local")
            if not both and is_collective(epoch + 1):
                deferred = (epoch, prof)
            profiler.work = strategy.work(model, plan)  # the plan may have changed
        if not math.isfinite(stats.loss) and (collective or not partial):  # every rank stops
            if best[4] is None:  # no model was kept before: the one kept is this epoch's
                best = (best[0], epoch, acc["test"], acc["train"], None)  # (the last one)
            _diverged(epoch, stats.loss, best[1], best[4] or model.state_dict())
            diverged = epoch
            break
        phase(f"epoch {epoch} checkpoint")  # (by rank 0, or a host's own, where due)
        ckpt.after_epoch(epoch, model, optimizer, best, records, last=epoch == last,
                         ready=collective)
        if epoch == last:  # stopped early (the range was drawn to train.epochs)
            break
    phase("done")
    stopped = None
    if diverged is not None:
        stopped = f"stopped after epoch {diverged}: its loss is {records[-1].loss} (the " \
            "training diverged; a smaller --lr may help)"
    elif last < cfg.train.epochs:
        stopped = f"stopped early after epoch {last}: no better validation accuracy in " \
            f"{last - best[1]} epochs (--patience {patience})"
    return _finish(records, profiles, best, time.perf_counter() - start, model, reporter,
                   strategy.outcome(model, plan), restored=state.epoch, stopped=stopped,
                   save=save, diverged=diverged)


def _layer_width(model: GNN, layer: int) -> tuple[int, int]:
    """(input, output) columns of ``layer`` of ``model``'s program."""
    stages = [st for st, of in zip(model.stages, model.layer_of) if of == layer]
    return stages[0].in_dim, stages[-1].out_dim


def _count(n: int, noun: str) -> str:
    """``1 epoch``, ``3 epochs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _pct(share: float) -> str:
    """``81.20%``, or ``n/a`` for a split without vertices (NaN) or an accuracy never
    measured (-1)."""
    return "n/a" if math.isnan(share) or share < 0 else f"{share:.2%}"


def _diverged(epoch: int, loss: float, best_epoch: int, kept: dict[str, Tensor]) -> None:
    """Say that the training stopped at ``epoch`` on a non-finite loss, and which model
    is kept (``kept``: its parameters)."""
    which = f"the model kept is epoch {best_epoch}'s" if best_epoch != epoch else \
        "no validation accuracy kept an earlier model, so the model kept is this one"
    if not all(bool(torch.isfinite(v).all()) for v in kept.values() if v.is_floating_point()):
        which += ", and it has non-finite parameters too"
    warnings.warn(f"epoch {epoch}: the loss is {loss}: the training diverged (a smaller --lr "
                  f"may help) and stops here; {which}", stacklevel=2)


def _between(strategy: Strategy, hooks: Sequence[Any], model: GNN, plan: Plan, epoch: int,
             prof: EpochProfile, *, which: str) -> None:
    """``between_epochs`` of the strategy and the hooks: ``which`` is "all", "local"
    (the hooks that communicate nothing, ``local_between``) or "communicating" (the
    others)."""
    for hook in (strategy, *hooks):
        local = bool(getattr(hook, "local_between", False))
        if which == "all" or local == (which == "local"):
            hook.between_epochs(model, plan, epoch, prof)


def _exchange_profiles(unsent: list[EpochProfile], comm: Comm | None, profiles: list[Any],
                       reporter: Reporter) -> EpochProfile:
    """Gather every rank's profiles of the epochs since the last exchange (collective),
    report them and add them to ``profiles``; this rank's last one, waiting split."""
    if comm is None or comm.world_size == 1:
        return unsent[-1]
    per_rank = all_gather_object(unsent, comm, "metrics")
    for i in range(len(unsent)):
        gathered = split_waiting([ranks[i] for ranks in per_rank])
        profiles.append(gathered)
        reporter.ranks([p.record() for p in gathered])
    return profiles[-1][comm.rank]  # the hooks see waiting split from transfer


def _save_model(cfg: Config, result: TrainResult, dataset: Dataset, world: int) -> None:
    from fullgraph.saved import run_facts, save_model

    save_model(cfg.train.save_model, result.model, cfg, dataset,  # type: ignore[arg-type]
               run_facts(cfg, world, best_epoch=result.best_epoch, val_acc=result.best_val,
                         test_acc=result.test_at_best, train_acc=result.train_at_best,
                         epochs=len(result.epochs)))


def _finish(records: list[EpochRecord], profiles: list[list[EpochProfile]], best: tuple,
            total: float, model: GNN, reporter: Reporter,
            outcome: list[str] | None = None, restored: int = 0,
            stopped: str | None = None,
            save: Callable[[TrainResult], None] | None = None,
            diverged: int | None = None) -> TrainResult:
    """The result and the summary; ``restored``: epochs a checkpoint brought (their
    records are the result's too, but ``total`` is the time of the epochs after);
    ``stopped``: why the run stopped before its last epoch (early stopping, or
    ``diverged``: the epoch whose loss was not finite); ``save``:
    writes the result's model, before the summary (a run whose model could not be
    written has none)."""
    if best[4] is not None:
        model.load_state_dict(best[4])
    result = TrainResult(records, best[1], best[0], best[2], best[3], total, model)
    if save is not None:
        save(result)
    times = sorted(r.epoch_s for r in records[restored:]) or [float("nan")]
    per_rank = [list(col) for col in zip(*profiles)] if profiles else []
    if restored == len(records):
        timing = f"no epochs after the checkpoint of epoch {restored}"
    else:
        ran = _count(len(records) - restored, "epoch")
        if restored:
            ran += f" ({restored + 1}-{len(records)}, after the checkpoint)"
        timing = f"{ran} in {total:.2f} s, median epoch {times[len(times) // 2]:.4f} s"
    if math.isnan(result.best_val):  # no validation vertices to choose an epoch by
        kept = [f"no validation vertices: the model kept is the last epoch's "
                f"(epoch {result.best_epoch}): test {_pct(result.test_at_best)} "
                f"(train {_pct(result.train_at_best)})",
                f"final test accuracy {_pct(result.test_at_best)} (test accuracy at epoch "
                f"{result.best_epoch}, the last); {timing}"]
    else:
        kept = [f"best epoch {result.best_epoch}: val {_pct(result.best_val)}, "
                f"test {_pct(result.test_at_best)} (train {_pct(result.train_at_best)})",
                f"final test accuracy {_pct(result.test_at_best)} (test accuracy at epoch "
                f"{result.best_epoch}, the best validation accuracy); {timing}"]
    reporter.summary(
        summary_lines(per_rank) + (outcome or []) + ([stopped] if stopped else []) + kept,
        {"best_epoch": result.best_epoch, "best_val": result.best_val,
         "test_acc": result.test_at_best, "train_acc": result.train_at_best,
         "total_s": total, "median_epoch_s": times[len(times) // 2],
         "epochs": len(records), "stopped_early": stopped is not None and diverged is None,
         **({"diverged_at": diverged} if diverged is not None else {})})
    result.extra["profiles"] = per_rank
    result.extra["restored"] = restored
    return result


def _accuracy(strategy: Strategy, model: GNN, plan: Plan) -> dict[str, float]:
    return strategy.reduce_counts(strategy.evaluate(model, plan), plan)


def _model_source(cfg: Config) -> str:
    """`` (file.py:Class, options k=v)``: where a user's model class comes from and the
    model options given (empty for a built-in model without options)."""
    from fullgraph.models import MODELS

    parts = [] if cfg.model.name in MODELS else [cfg.model.name]
    if cfg.model.options:
        parts.append(f"options {cfg.model.options}")
    return f" ({', '.join(parts)})" if parts else ""


def _header_lines(dataset: Dataset, model: GNN, cfg: Config, device: torch.device,
                  setup_s: float, world: int) -> list[str]:
    s = dataset.summary()
    params = sum(p.numel() for p in model.parameters())
    x = dataset.data.features
    layout = ""
    if is_sparse(x):
        why = dense_reader(model)
        layout = (f" (sparse: {100 * density(x):.2f}% non-zero, held as CSR"
                  + (")" if why is None else f"; made dense for this model: {why})"))
    sh = dataset.shard
    held = "" if sh is None else (
        f"; per-part shards ({sh.parts} parts, {sh.hops} hops): this worker's part holds "
        f"{x.shape[0]} feature rows and {dataset.graph.num_edges} edges")
    gpu = "" if device.type == "cpu" else f"gpu kernels {gpu_kernels.describe(device)}, "
    return [
        f"dataset  {s['name']}: {s['vertices']} vertices, {s['edges']} edges, "
        f"{s['features']} features{layout}, {s['classes']} "
        f"class{'es' if s['classes'] != 1 else ''} (train {s['train']} / val {s['val']} / "
        f"test {s['test']}){held}",
        f"model    {model.name}{_model_source(cfg)}: {cfg.model.layers} layers, hidden "
        f"{cfg.model.hidden}, {params} parameters, stages {model.signature()}",
        f"run      strategy {cfg.runtime.strategy}, {world} worker(s), device {device}, "
        f"{torch.get_num_threads()} threads, spmm {describe_backend(device)}, {gpu}"
        f"lr {cfg.train.lr}, weight decay {cfg.train.weight_decay}, seed {cfg.train.seed}, "
        f"setup {setup_s:.2f} s",
    ]
