"""The one interface every parallel strategy implements, and the strategy registry.

A strategy is an executor of a model's stage program: it owns where vertex data lives,
the re-placements between stages and the gradient sync, never the model math, the
optimiser, the loop or the CLI. The training loop calls only ``setup``,
``train_step`` and ``evaluate``. In full-graph training one
optimiser step is one epoch.

Losses are normalised by the global number of training vertices, so that N workers
reproduce the single-process result exactly.
"""
from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from fullgraph.comm.primitives import settle
from fullgraph.fields import changed_fields
from fullgraph.graph.data import Dataset, VertexData
from fullgraph.memory import SavedBytes
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe, reads_sparse
from fullgraph.ops.loss import masked_cross_entropy
from fullgraph.ops.sparse import convert, is_sparse, take_rows
from fullgraph.partition.options import PartitionOptions

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

SPLITS = ("train", "val", "test")


@dataclass
class Plan:
    """What a strategy prepared once for a run; subclasses add their own fields.

    Attributes:
        device: where this worker computes.
        labels: (R,) labels of the rows this worker outputs.
        masks: split name -> (R,) bool mask over those rows.
        num_train_global: number of training vertices over all workers.
    """

    device: torch.device
    labels: Tensor
    masks: dict[str, Tensor]
    num_train_global: int

    def matrix_maker(self) -> Callable[[int, int, torch.dtype], Tensor] | None:
        """How this plan makes (R, C) matrices kept out of memory (``Spill.empty``), or
        None: in memory, as usual."""
        return None


@dataclass
class LocalResult:
    """The output rows a worker owns after a forward pass.

    Attributes:
        logits: (R, C) output rows.
        gids: (R,) their global vertex ids.
    """

    logits: Tensor
    gids: Tensor


@dataclass
class Work:
    """Aggregation work of one forward pass on one worker.

    Attributes:
        edges_local: edges into vertices this worker owns, summed over P / E stages.
        edges_redundant: edges into vertices recomputed here for another owner.
        edge_dims: sum over P / E stages of edges x columns aggregated here (the
            load measure of NeutronTP Fig. 10a).
    """

    edges_local: int = 0
    edges_redundant: int = 0
    edge_dims: int = 0


@dataclass
class StepStats:
    """Timings and loss of one training step (one epoch); ``extra["saved_bytes"]``: the
    intermediate data autograd held between the forward and the backward pass;
    ``sync_s``: making the gradients global after the backward (the barrier before it
    included: a rank that finished early waits there for the others)."""

    loss: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    sync_s: float = 0.0


class EpochHook(Protocol):
    """Anything ``train`` calls between two epochs: a strategy, or a runtime adapter."""

    def between_epochs(self, model: StageProgram, plan: Plan, epoch: int, profile: Any) -> None:
        """Called on every worker after epoch ``epoch`` (not after the last) with this
        worker's ``EpochProfile`` of it; may change ``plan`` for the next epoch
        (collectively: every worker is called)."""


PlanT = TypeVar("PlanT", bound="Plan")


class Strategy(ABC, Generic[PlanT]):
    """Base class of the executors; see the module docstring."""

    name: ClassVar[str]
    section: ClassVar[str | None] = None
    """The name of this strategy's own config section (its ``Options``), if any."""
    shared_sections: ClassVar[tuple[str, ...]] = ()
    """Sections of shared components it also reads (keys of ``SHARED_SECTIONS``)."""
    flags: ClassVar[dict[str, str]] = {}
    """Option field -> command-line flag (without ``--``) where ``--field`` is unclear."""

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Strategy-specific options (none for the base)."""

    options: Any
    """This strategy's ``Options`` (subclasses narrow the type)."""
    step_hooks: Sequence[Any] = ()
    """Runtime adapters called inside ``train_step`` (``before_forward``, ``on_loss``);
    set by ``train``."""
    grad_sync: Callable[[StageProgram, Any, Tensor], float] | None = None
    """Replaces ``sync_grads`` and ``reduce_loss`` when set: called after the backward
    pass with the local loss, it makes the gradients global and returns the loss value
    to report (partial update, ``fullgraph.adapt.partial``)."""

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_sections(cls, sections: Mapping[str, Any]) -> "Strategy":
        """Build from the run's option sections, taking only the ones it declares."""
        return cls(sections[cls.section]) if cls.section else cls()

    def unused_options(self) -> list[str]:
        """Warnings for options of the strategy's own section that the others make
        ineffective (a hybrid cost under another dependency mode, say); none by default."""
        return []

    def model_device(self, device: torch.device) -> torch.device:
        """Where the model's parameters (the T / E stages) live; ``device`` by default."""
        return device

    @property
    def distributed(self) -> bool:
        """Whether the strategy runs on several workers (False: exactly one)."""
        return True

    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        """Refuse, before any worker starts, what ``setup`` would refuse of ``program``
        on a graph of ``num_nodes`` vertices and ``workers`` workers (nothing by
        default).

        Raises:
            ValueError: naming the option or model that cannot run so.
        """

    def check_data(self, program: StageProgram, dataset: Dataset, workers: int) -> None:
        """Refuse, before any worker starts, what ``setup`` would refuse of ``program``
        on ``dataset``'s graph (a device budget that cannot hold one vertex with its
        in-edges, say; nothing by default). Where the refusal depends on what only setup
        decides, it checks what must hold whatever that is, never more.

        Raises:
            ValueError: naming the option that cannot run so.
        """

    @abstractmethod
    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> PlanT:
        """Place data and build whatever the epochs reuse (vertex data in ``dtype``)."""

    @abstractmethod
    def forward(self, model: StageProgram, plan: PlanT, *, training: bool,
                seed: int) -> LocalResult:
        """Run the program forward; return the rows this worker owns."""

    def loss(self, result: LocalResult, plan: PlanT) -> Tensor:
        """Cross-entropy summed over local training rows / global training count."""
        total = masked_cross_entropy(result.logits, plan.labels, plan.masks["train"],
                                     grad_into=plan.matrix_maker())
        return total / plan.num_train_global

    def work(self, model: StageProgram, plan: PlanT) -> Work:
        """This worker's aggregation work per forward pass (all edges, every column)."""
        graph = plan.graph  # type: ignore[attr-defined]
        stages = [model.stages[i.index] for i in describe(model) if i.reads_neighbours]
        return Work(graph.num_edges * len(stages), 0,
                    sum(graph.num_edges * s.in_dim for s in stages))

    def describe(self, model: StageProgram, plan: PlanT) -> list[str]:
        """Report lines on how the plan splits the work (none by default)."""
        return []

    def outcome(self, model: StageProgram, plan: PlanT) -> list[str]:
        """Report lines, at the end of training, on what ``between_epochs`` decided
        (none by default)."""
        return []

    def between_epochs(self, model: StageProgram, plan: PlanT, epoch: int, profile: Any) -> None:
        """Adjust ``plan`` after epoch ``epoch`` given this worker's measured profile of
        it (see ``EpochHook``); nothing by default."""

    def sync_grads(self, model: StageProgram, plan: PlanT) -> None:
        """Make parameter gradients global (no-op on one process)."""

    def reduce_loss(self, loss: Tensor, plan: PlanT) -> float:
        """The global loss value for reports (the local one on one process)."""
        return float(loss.detach())

    def train_step(self, model: StageProgram, plan: PlanT, optimizer: torch.optim.Optimizer,
                   *, seed: int) -> StepStats:
        """Forward, loss, backward, gradient sync, optimiser step."""
        model.train()
        optimizer.zero_grad(set_to_none=True)
        device = next(iter(model.parameters()), torch.empty(0)).device
        settle(device)  # (on a GPU: each phase's kernels, not only their launches)
        t0 = time.perf_counter()
        for hook in self.step_hooks:
            hook.before_forward()
        with SavedBytes(model.parameters()) as saved:
            result = self.forward(model, plan, training=True, seed=seed)
            loss = self.loss(result, plan)
            del result  # the logits: (R, C) that the backward does not read
        settle(device)
        t1 = time.perf_counter()
        for hook in self.step_hooks:
            loss = hook.on_loss(loss)
        loss.backward()
        settle(device)
        t_sync = time.perf_counter()
        value = None
        if self.grad_sync is None:
            self.sync_grads(model, plan)
        else:
            value = self.grad_sync(model, plan, loss)
        settle(device)
        t2 = time.perf_counter()
        optimizer.step()
        settle(device)
        t3 = time.perf_counter()
        if value is None:
            value = self.reduce_loss(loss, plan)
        return StepStats(value, t1 - t0, t_sync - t1, t3 - t2, {"saved_bytes": saved.bytes},
                         sync_s=t2 - t_sync)

    @torch.no_grad()
    def evaluate(self, model: StageProgram, plan: PlanT) -> dict[str, tuple[int, int]]:
        """(correct, total) per split over the rows this worker owns."""
        model.eval()
        result = self.forward(model, plan, training=False, seed=0)
        pred = result.logits.argmax(dim=1)
        hit = pred == plan.labels
        return {s: (int((hit & plan.masks[s]).sum()), int(plan.masks[s].sum())) for s in SPLITS}

    def reduce_counts(self, counts: dict[str, tuple[int, int]], plan: PlanT) -> dict[str, float]:
        """Accuracy per split from (correct, total) counts (global on one process)."""
        return {s: (c / t if t else float("nan")) for s, (c, t) in counts.items()}


class DistributedStrategy(Strategy[PlanT]):
    """A strategy whose plan holds a ``comm``: global loss, counts and gradients."""

    def sync_grads(self, model: StageProgram, plan: PlanT) -> None:
        from fullgraph.comm.placement import all_reduce_grads
        from fullgraph.comm.primitives import barrier
        from fullgraph.profile import WAIT_PHASE

        comm = plan.comm  # type: ignore[attr-defined]
        # the barrier's time is this worker's wait for slower ones (profiled as "wait")
        barrier(comm, WAIT_PHASE)
        all_reduce_grads(list(model.parameters()), comm, "grad-sync")

    def reduce_loss(self, loss: Tensor, plan: PlanT) -> float:
        from fullgraph.comm.primitives import all_reduce_

        value = loss.detach().reshape(1).to(torch.float64).clone()
        all_reduce_(value, plan.comm, "metrics")  # type: ignore[attr-defined]
        return float(value)

    def reduce_counts(self, counts: dict[str, tuple[int, int]], plan: PlanT) -> dict[str, float]:
        from fullgraph.comm.primitives import all_reduce_

        keys = sorted(counts)
        flat = torch.tensor([v for k in keys for v in counts[k]], dtype=torch.int64)
        all_reduce_(flat, plan.comm, "metrics")  # type: ignore[attr-defined]
        totals = {k: (int(flat[2 * i]), int(flat[2 * i + 1])) for i, k in enumerate(keys)}
        return super().reduce_counts(totals, plan)


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy to the registry under ``cls.name``."""
    STRATEGIES[cls.name] = cls
    return cls


SHARED_SECTIONS: dict[str, type] = {"partition": PartitionOptions}
"""Options of components that several strategies share, by config section."""
SHARED_FLAGS: dict[str, dict[str, str]] = {
    "partition": {"method": "partitioner", "file": "partition-file", "seed": "partition-seed"}}


def option_sections() -> dict[str, type]:
    """Config section -> options dataclass, for the shared components and every
    registered strategy (in registration order)."""
    out = {name: cls for name, cls in SHARED_SECTIONS.items()
           if any(name in s.shared_sections for s in STRATEGIES.values())}
    for strategy in STRATEGIES.values():
        if strategy.section:
            out[strategy.section] = strategy.Options
    return out


def section_flags() -> dict[str, dict[str, str]]:
    """Config section -> its own flag names (field -> flag) where they are not ``--field``."""
    out = {name: dict(flags) for name, flags in SHARED_FLAGS.items()}
    for strategy in STRATEGIES.values():
        if strategy.section:
            out[strategy.section] = dict(strategy.flags)
    return out


def section_users() -> dict[str, tuple[str, ...]]:
    """Config section -> the strategies that read it."""
    users: dict[str, list[str]] = {}
    for strategy in STRATEGIES.values():
        for section in (strategy.section, *strategy.shared_sections):
            if section:
                users.setdefault(section, []).append(strategy.name)
    return {k: tuple(v) for k, v in users.items()}


def unused_sections(options: Mapping[str, Any], names: set[str],
                    skip: Mapping[str, tuple[str, ...]] | None = None
                    ) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """The option sections given changes (``changed_fields``, less ``skip[section]``)
    that none of the strategies ``names`` reads: (section, fields, the strategies that
    read it)."""
    out = []
    for section, users in section_users().items():
        changed = changed_fields(options[section], skip=(skip or {}).get(section, ()))
        if changed and not names & set(users):
            out.append((section, changed, users))
    return out


def build_strategy(cfg: Any) -> Strategy:
    """The strategy ``cfg.runtime.strategy`` names, with the option sections it reads.

    Options of a section the chosen strategy does not read are not ignored silently:
    a warning names them.
    """
    from fullgraph.configfile import flags_of

    name = cfg.runtime.strategy
    for section, changed, users in unused_sections(cfg.options, {name}):
        warnings.warn(f"{flags_of(section, changed)} no effect with --strategy {name} "
                      f"(only with {', '.join(users)})", stacklevel=2)
    strategy = get_strategy(name).from_sections(cfg.options)
    for message in strategy.unused_options():
        warnings.warn(message, stacklevel=2)
    return strategy


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def feature_rows(features: Tensor | VertexData, rows: Tensor | None, program: StageProgram,
                 dtype: torch.dtype, device: torch.device) -> Tensor:
    """The input rows ``rows`` (global ids; None: all) of ``features`` as ``program``'s
    first layer takes them, in ``dtype`` on ``device``: CSR when the features are
    sparse and the program reads CSR rows (``walk.reads_sparse``: dropout, then a
    dense layer), dense otherwise (a model that propagates the raw features first, as
    GIN). Given a ``VertexData``, rows are looked up by id (a shard holds some)."""
    if isinstance(features, VertexData):
        x = features.features if rows is None else features.take_features(rows)
    else:
        x = features if rows is None else take_rows(features, rows)
    if is_sparse(x) and not reads_sparse(program):
        x = x.to_dense()
    return convert(x, dtype, device)
