"""Data parallelism over a vertex partition: DepComm, DepCache and their hybrid.

Worker i owns the rows V_i of a partition and the in-edges of its vertices
(NeutronStar, DistDGL-style full-graph training). For every remote in-neighbour u of
V_i the dependency plan says how its rows are obtained (NeutronCloud §2.3,
Algorithm 1):
- DepComm: fetched from u's owner at every P / E stage that needs it (halo fetch
  forward, scatter-add of its gradient to the owner backward);
- DepCache: computed locally from replicated inputs, recursively through its
  L-hop in-neighbourhood: no communication, redundant computation;
- hybrid: a per-vertex choice, initialised by the cost model of
  ``fullgraph.parallel.costmodel`` (the L-hop neighbourhood to recompute against the
  bytes to move, with unit costs given or measured at start) and held in a
  ``DependencyPlan`` that ``replan`` swaps between epochs without moving any vertex
  data (every worker holds the replicated inputs).

Parameter gradients are all-reduced once per step; the loss is normalised by the
global training count, so N workers reproduce the single-process executor.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.comm import primitives as prim
from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import Comm
from fullgraph.comm.halo import halo_join
from fullgraph.comm.reduce import row_sum
from fullgraph.fields import changed_fields, option
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset, Shard
from fullgraph.models.stages import Propagate, StageContext, StageProgram, propagation_inputs
from fullgraph.models.walk import Runner, describe, walk
from fullgraph.ops.sparse import take_rows
from fullgraph.parallel import costmodel
from fullgraph.parallel.base import LocalResult, Plan, Work, feature_rows, register
from fullgraph.parallel.halo_spmm import halo_spmm
from fullgraph.parallel.rowplan import RowPlan, plan_rows, stage_weights
from fullgraph.parallel.rows import (
    RowPartitioned,
    check_shard_rows,
    partition_book,
    whole_edge_ids,
)
from fullgraph.partition import PartitionBook

MODES = ("depcomm", "depcache", "hybrid")
COST_NAMES = ("byte_cost", "edge_cost", "vertex_cost")
"""The hybrid cost model's unit costs that ``--byte-cost`` etc. may give."""


@dataclass
class DependencyPlan:
    """How this worker obtains each of its direct remote dependencies.

    Attributes:
        direct: (R,) gids of the remote in-neighbours of V_i, ascending.
        cached: (R,) bool; True = DepCache (recompute), False = DepComm (fetch).
        rates: the unit costs the hybrid cost model used (None for the other modes).
        per_rank: ``summary()`` of every worker's plan, in rank order (set by
            ``replan``, for the run header).
        trial: hybrid with measured rates: seconds of a training step (the slowest
            worker's) under each plan tried, and the one kept (see
            ``DataParallel.TRIAL_STEPS``).
        twins: plans tried that equal another on every worker, each mapped to the
            one that was timed for it (its time is that one's).
        modes: the plans tried at setup, by name (hybrid with measured rates).
        epochs: seconds of the training epochs run under each plan still in the
            running (the slowest worker's; ``DataParallel.between_epochs``); empty
            when no plan is being tried over training epochs.
        timed: once one is kept, the median of each plan's timed training epochs.
        last: the plan of the epoch before the one that just ended.
        budget_cut: the starting plan cached more than ``--cache-budget`` and was cut
            to fit it (by ``--adapt adjust``, before the first epoch).
    """

    direct: Tensor
    cached: Tensor
    rates: costmodel.Rates | None = None
    per_rank: list[dict[str, int]] = field(default_factory=list)
    trial: dict[str, float] = field(default_factory=dict)
    twins: dict[str, str] = field(default_factory=dict)
    kept: str | None = None
    modes: dict[str, Tensor] = field(default_factory=dict)
    epochs: dict[str, list[float]] = field(default_factory=dict)
    timed: dict[str, float] = field(default_factory=dict)
    last: str | None = None
    budget_cut: bool = False

    def fetch_mask(self, num_nodes: int) -> Tensor:
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[self.direct[~self.cached]] = True
        return mask

    def summary(self) -> dict[str, int]:
        return {"remote": int(self.direct.numel()), "cached": int(self.cached.sum()),
                "fetched": int((~self.cached).sum())}


@dataclass
class DataPlan(Plan):
    """A worker's state for data-parallel execution."""

    comm: Comm
    graph: Graph
    norms: dict[str, Tensor]
    book: PartitionBook
    deps: DependencyPlan
    rows: RowPlan
    features: Tensor
    source: Any = None
    dtype: torch.dtype = torch.float32
    tables: list[ExchangeTable | None] = field(default_factory=list)
    weights: list[Tensor | None] = field(default_factory=list)
    edge_pos: list[Tensor | None] = field(default_factory=list)
    clock: StageClock | None = None
    shard: Shard | None = None
    """The dataset's part when it is a per-part shard (``partition.shards``)."""
    edge_ids: Tensor | None = None
    """On a shard: the id in the whole propagation graph of each edge of ``graph``
    (the key of edge-keyed dropout, as attention dropout); None: the same ids."""
    stale: Any = None
    """A ``comm.stale.StaleHalo`` for partial computation (``--adapt adjust+partial``):
    the training forward's halo exchanges go through it. None: exact exchanges."""


@dataclass
class StageClock:
    """Seconds and work of this worker's training forward passes, per stage kind.

    ``seconds["T"]`` over ``units["T"]`` (rows x output columns of T stages) and
    ``seconds["PE"]`` over ``units["PE"]`` (edges x input columns of P / E stages) are
    the measured per-vertex and per-edge costs of NeutronCloud's formulas 5-6.
    Exchanges are outside the timed spans. Set ``DataPlan.clock`` to turn it on.
    """

    seconds: dict[str, float] = field(default_factory=lambda: {"T": 0.0, "PE": 0.0})
    units: dict[str, float] = field(default_factory=lambda: {"T": 0.0, "PE": 0.0})

    def add(self, kind: str, seconds: float, units: float) -> None:
        self.seconds[kind] += seconds
        self.units[kind] += units

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """The totals since the last take, and reset."""
        out = (dict(self.seconds), dict(self.units))
        self.seconds, self.units = {"T": 0.0, "PE": 0.0}, {"T": 0.0, "PE": 0.0}
        return out


@register
class DataParallel(RowPartitioned[DataPlan]):
    """Row-partitioned execution with DepComm / DepCache / hybrid dependencies."""

    name = "data"
    section = "data_parallel"
    flags = {"mode": "dep-mode"}

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of data parallelism.

        Attributes:
            mode: ``depcomm``, ``depcache`` or ``hybrid`` (default: ``depcomm``).
            byte_cost: seconds per byte moved, for the hybrid cost model (default:
                None, measured at start).
            edge_cost: seconds per edge x column aggregated (default: None, measured).
            vertex_cost: seconds per vertex x column computed (default: None, measured).
                While any of the three is measured, a timed trial on every worker keeps
                the fastest of the cost model's plan and the two pure modes; with all
                three given, the cost model's plan runs as it is.
        """

        mode: str = option("depcomm", "how remote in-neighbours are obtained: fetched each "
                           "layer, replicated and recomputed, or a cost-model mix",
                           choices=MODES)
        byte_cost: float | None = option(None, "hybrid: seconds per byte moved, and a "
                                         "timed trial keeps the fastest of the model's plan, "
                                         "depcomm and depcache unless all three costs are "
                                         "given; unset: measured at start")
        edge_cost: float | None = option(None, "hybrid: seconds per edge x column aggregated; "
                                         "unset: measured")
        vertex_cost: float | None = option(None, "hybrid: seconds per vertex x column "
                                           "computed; unset: measured")

        def __post_init__(self) -> None:
            if self.mode not in MODES:
                raise ValueError(f"data parallel mode {self.mode!r}; expected one of "
                                 f"{', '.join(MODES)}")
            for name in COST_NAMES:
                value = getattr(self, name)
                if value is not None and not 0 <= value < float("inf"):
                    raise ValueError(f"data parallel {name} must be a finite number >= 0, "
                                     f"got {value}")

        @property
        def measures_costs(self) -> bool:
            """Whether hybrid measures a unit cost at setup (one is not given), and so,
            on several workers, tries its split against the pure modes (``_trial``)."""
            return any(getattr(self, name) is None for name in COST_NAMES)

    options: Options

    def unused_options(self) -> list[str]:
        from fullgraph.configfile import flags_of

        costs = changed_fields(self.options, among=COST_NAMES)
        if costs and self.options.mode != "hybrid":
            return [f"{flags_of(self.section, costs)} no effect with --dep-mode "
                    f"{self.options.mode} (only with hybrid)"]
        return []

    # ------------------------------------------------------------------ setup
    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> DataPlan:
        if comm is None:
            from fullgraph.comm.group import single_comm

            comm = single_comm()
        shard = dataset.shard
        graph, norms = propagation_inputs(program, dataset.graph, dtype,
                                          None if shard is None else shard.in_degree)
        book = partition_book(dataset, comm, self.partition)
        owned = book.part_to_gids(comm.rank)
        direct = _remote_in_neighbours(graph, owned, book.part_of, comm.rank)
        deps = DependencyPlan(direct, torch.zeros(direct.numel(), dtype=torch.bool))
        plan = DataPlan(
            **self.owned_targets(dataset, owned, device), comm=comm, graph=graph,
            norms=norms, book=book, deps=deps, rows=None, features=None,  # type: ignore[arg-type]
            source=dataset.data, dtype=dtype, shard=shard,
            edge_ids=None if shard is None else whole_edge_ids(
                graph, shard.in_degree, program.self_loops).to(device))
        if shard is not None and self.options.mode != "depcomm":
            check_shard_hops(program, dataset, f"dep-mode {self.options.mode}")
        if self.options.mode == "depcache":
            deps.cached[:] = True
        elif self.options.mode == "hybrid":
            deps.cached = self._cost_model(program, plan, owned)
            if self.options.measures_costs and comm.world_size > 1:
                self.replan(program, plan, deps.cached)
                deps.cached = self._trial(program, plan)
        self.replan(program, plan, deps.cached)
        return plan

    TRIAL_STEPS = 3
    """Hybrid with measured rates: timed rounds (after one untimed) in which the cost
    model's split and the two pure modes each run a step in turn (a training forward
    and backward and an evaluation forward); the fastest (least over the rounds,
    slowest worker) is kept. The unit costs are
    measured on small kernels in isolation and the model leaves out per-round and
    per-row overheads, so on one host its split was slower than either pure mode;
    trying costs a few steps once."""

    def _trial(self, program: StageProgram, plan: DataPlan) -> Tensor:
        """The cost model's split (current) or a pure mode, whichever trains fastest
        (collective; forward and backward without an update: parameters and buffers,
        such as batch normalisation's running statistics, unchanged)."""
        deps = plan.deps
        buffers = [(b, b.clone()) for b in program.buffers()]
        options = {"hybrid": deps.cached.clone(),
                   "depcomm": torch.zeros_like(deps.cached),
                   "depcache": torch.ones_like(deps.cached)}
        if not self._fits_all_cached(program, plan):  # replicas beyond memory: not tried
            del options["depcache"]
        # a plan equal to another on every worker is timed once, as the pure mode
        deps.twins = _twins(options, plan.comm)
        timed = [n for n in options if n not in deps.twins]
        seconds = dict.fromkeys(timed, float("inf"))
        for round_ in range(self.TRIAL_STEPS + 1):  # round 0 warms up; in turn, so that a
            for name in timed:  # load spike hits a round, not a mode
                self.replan(program, plan, options[name])
                took = self._trial_step(program, plan)
                if round_:
                    seconds[name] = min(seconds[name], took)
        slowest = torch.tensor(list(seconds.values()), dtype=torch.float64,
                               device=plan.comm.device)
        prim.all_reduce_(slowest, plan.comm, "setup", op="max")
        measured = dict(zip(timed, slowest.tolist()))
        deps.trial = {n: measured[deps.twins.get(n, n)] for n in options}
        deps.kept = min(timed, key=measured.__getitem__)
        deps.modes = options
        close = [n for n in timed if measured[n] <= self.ONLINE_MARGIN * measured[deps.kept]]
        deps.epochs = {n: [] for n in close} if len(close) > 1 else {}
        with torch.no_grad():
            for buf, before in buffers:
                buf.copy_(before)
        return options[deps.kept]

    ONLINE_EPOCHS = 2
    """Training epochs timed under each plan that the setup trial found within
    ``ONLINE_MARGIN`` of its fastest. Setup steps of tens of milliseconds did not tell
    plans 5-15 % apart on a noisy host (BENCHMARKS.md); training epochs are the same
    under every plan (the switch is exact), so timing them costs only the slower
    plans' extra seconds."""
    ONLINE_MARGIN = 1.25

    def between_epochs(self, model: StageProgram, plan: DataPlan, epoch: int,
                       profile: Any) -> None:
        """Hybrid with measured rates, until one plan is kept: each plan in the running
        trains ``ONLINE_EPOCHS`` timed epochs in a row, after one that is not timed
        (the first epoch of the run, or the first after a switch, ran 10-30 % slower
        on a 40 ms epoch); an epoch's time is the slowest worker's wall seconds. Then
        the plan with the least median is kept (collective). Stops, keeping the plan in
        use, if something else replanned (the online adjuster)."""
        deps = plan.deps
        if not deps.epochs:
            return
        current = deps.kept
        # (replanned elsewhere on any worker, this epoch's seconds): one max over workers
        state = torch.tensor([float(current is None or not torch.equal(
            deps.cached, deps.modes[current])), float(profile.wall_s)],
            dtype=torch.float64, device=plan.comm.device)
        if plan.comm.world_size > 1:
            prim.all_reduce_(state, plan.comm, "adjust", op="max")
        replanned, took = state.tolist()
        if replanned or current is None:
            deps.epochs = {}
            return
        warm, deps.last = deps.last == current, current
        if warm and current in deps.epochs:
            deps.epochs[current].append(took)
        waiting = [n for n, ts in deps.epochs.items() if len(ts) < self.ONLINE_EPOCHS]
        if waiting:
            following = current if current in waiting else waiting[0]
        else:
            deps.timed = {n: statistics.median(ts) for n, ts in deps.epochs.items()}
            following = min(deps.timed, key=deps.timed.__getitem__)
            deps.epochs = {}
        if following != current:
            self.replan(model, plan, deps.modes[following])
        deps.kept = following

    def outcome(self, model: StageProgram, plan: DataPlan) -> list[str]:
        if not plan.deps.timed:
            return []
        each = ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in plan.deps.timed.items())
        return [f"deps     kept {plan.deps.kept} after {self.ONLINE_EPOCHS} training epochs "
                f"under each plan close at setup (median, slowest worker): {each}"]

    def _fits_all_cached(self, program: StageProgram, plan: DataPlan) -> bool:
        """Whether every worker can hold the replicated input rows of pure DepCache in
        half of its share of free memory (collective)."""
        rows = plan_rows(program, plan.graph, plan.book.part_to_gids(plan.comm.rank),
                         torch.zeros(plan.graph.num_dst, dtype=torch.bool),
                         owner=plan.book.part_of)
        itemsize = torch.empty(0, dtype=plan.dtype).element_size()
        need = rows.input_rows.numel() * program.in_dim * itemsize
        if plan.device.type == "cuda":
            from fullgraph.comm.group import gpu_share

            free = gpu_share(plan.device, plan.comm)
        else:
            from fullgraph.memory import ram_per_worker

            free = ram_per_worker(plan.comm.world_size)
        over = torch.tensor([float(need > free // 2)], device=plan.comm.device)
        prim.all_reduce_(over, plan.comm, "setup", op="max")
        return not bool(over)

    def _trial_step(self, program: StageProgram, plan: DataPlan) -> float:
        """Seconds of what an epoch does with the plan: a training forward and
        backward, and an evaluation forward (its exchanges too)."""
        program.train()
        t0 = time.perf_counter()
        self.loss(self.forward(program, plan, training=True, seed=0), plan).backward()
        for p in program.parameters():
            p.grad = None
        program.eval()
        with torch.no_grad():
            self.forward(program, plan, training=False, seed=0)
        program.train()
        if plan.device.type == "cuda":  # the kernels' time, not their launches'
            torch.cuda.synchronize(plan.device)
        return time.perf_counter() - t0

    def replan(self, program: StageProgram, plan: DataPlan, cached: Tensor) -> None:
        """Switch the dependency plan to ``cached`` (collective: every worker calls it).

        Only index tables change: every worker holds the inputs it may need.
        """
        if cached.shape != plan.deps.direct.shape or cached.dtype != torch.bool:
            raise ValueError(f"replan: cached must be a bool tensor of shape "
                             f"{tuple(plan.deps.direct.shape)}, got {cached.dtype} "
                             f"{tuple(cached.shape)}")
        plan.deps.cached = cached
        if plan.comm.world_size > 1:
            plan.deps.per_rank = prim.all_gather_object(plan.deps.summary(), plan.comm, "setup")
        else:
            plan.deps.per_rank = [plan.deps.summary()]
        fetch = plan.deps.fetch_mask(plan.graph.num_dst)
        plan.rows = plan_rows(program, plan.graph, plan.book.part_to_gids(plan.comm.rank),
                              fetch, owner=plan.book.part_of, local_first=True)
        _check_rows(plan, plan.rows, "replan")
        if plan.device.type != "cpu":
            plan.rows.blocks = [None if b is None else b.to(plan.device)
                                for b in plan.rows.blocks]
        plan.features = feature_rows(plan.source, plan.rows.input_rows, program,
                                     plan.dtype, plan.device)
        plan.tables = self._tables(program, plan)
        plan.weights, plan.edge_pos = stage_weights(program, plan.rows, plan.norms, plan.device)

    def _tables(self, program: StageProgram, plan: DataPlan) -> list[ExchangeTable | None]:
        """One exchange table per P / E stage that fetches anything on any worker."""
        comm, book = plan.comm, plan.book
        tables: list[ExchangeTable | None] = []
        for s, info in enumerate(describe(program)):
            if info.is_transform or plan.rows.shares_halo[s] or comm.world_size == 1:
                tables.append(None)
                continue
            fetched = plan.rows.fetched[s]
            total = torch.tensor([fetched.numel()], dtype=torch.int64)
            prim.all_reduce_(total, comm, "setup")
            if int(total) == 0:
                tables.append(None)
                continue
            owners = book.part_of[fetched]
            needed_from = [fetched[owners == p] for p in range(comm.world_size)]
            needed_by = prim.all_to_all_sized(needed_from, comm, "setup")
            send_idx = [book.gid_to_lid(g) for g in needed_by]
            tables.append(ExchangeTable(send_idx=send_idx,
                                        recv_rows=[t.numel() for t in needed_from],
                                        recv_ids=needed_from, send_ids=list(needed_by)))
        return tables

    def _cost_model(self, program: StageProgram, plan: DataPlan, owned: Tensor) -> Tensor:
        """Cache a dependency when recomputing its L-hop neighbourhood is cheaper than
        moving it (``fullgraph.parallel.costmodel``); rates given or measured here."""
        opts = self.options
        plan.deps.rates = costmodel.resolve_rates(plan.comm, plan.graph, opts.byte_cost,
                                                  opts.edge_cost, opts.vertex_cost)
        itemsize = torch.empty(0, dtype=plan.dtype).element_size()
        cache, comm = costmodel.dependency_costs(program, plan.graph, owned, plan.deps.direct,
                                                 plan.deps.rates, itemsize)
        return costmodel.choose_cached(cache, comm)

    def describe(self, model: StageProgram, plan: DataPlan) -> list[str]:
        """The partition and the dependency split over all workers (from ``replan``)."""
        source = self.partition_source(plan.shard)
        ranks = plan.deps.per_rank
        total = {k: sum(r[k] for r in ranks) for k in ("remote", "cached", "fetched")}
        split = "/".join(f"{r['cached']}:{r['fetched']}" for r in ranks)
        line = (f"deps     {self.options.mode}, {source}; remote dependencies {total['remote']}: "
                f"{total['cached']} cached (DepCache), {total['fetched']} fetched (DepComm); "
                f"cached:fetched per rank {split}")
        if plan.deps.rates is not None:
            line += f"; costs {plan.deps.rates.describe()}"
        if plan.deps.trial:
            twins = plan.deps.twins
            tried = ", ".join(f"{k} = {twins[k]}" if k in twins else f"{k} {1000 * v:.1f} ms"
                              for k, v in plan.deps.trial.items())
            line += f"; a training step tried under each: {tried}; kept {plan.deps.kept}"
        if plan.deps.budget_cut:
            line += "; then cut to --cache-budget (the counts above)"
        return [line]

    # ---------------------------------------------------------------- execute
    def forward(self, model: StageProgram, plan: DataPlan, *, training: bool,
                seed: int) -> LocalResult:
        h = walk(model, _RowRunner(plan, seed, training), plan.features)
        return LocalResult(h[: plan.rows.owned.numel()], plan.rows.owned)

    def work(self, model: StageProgram, plan: DataPlan) -> Work:
        local, redundant = plan.rows.edges_computed()
        dims = sum(b.graph.num_edges * s.in_dim for s, b in zip(model.stages, plan.rows.blocks)
                   if b is not None)
        return Work(local, redundant, dims)



class _RowRunner(Runner):
    """Stage hooks over one worker's row sets: T stages pick their rows, P / E stages
    read their block's sources, local rows then fetched ones (a P stage right after
    an E stage reuses the E stage's fetched rows)."""

    def __init__(self, plan: DataPlan, seed: int, training: bool) -> None:
        self.plan, self.rows, self.seed, self.training = plan, plan.rows, seed, training
        self.owned_sum = partial(row_sum, comm=plan.comm, rows=plan.rows.owned.numel(),
                                 phase="row-sum")
        self.src: Tensor | None = None  # the last P / E stage's sources, and of what rows
        self.src_of: Tensor | None = None
        self.clock = plan.clock if training else None

    def _timed(self, kind: str, units: int, run: Any) -> Tensor:
        if self.clock is None:
            return run()
        prim.settle(self.plan.device)  # (on a GPU: the stage's kernels, not their launches)
        t0 = time.perf_counter()
        out = run()
        prim.settle(self.plan.device)
        self.clock.add(kind, time.perf_counter() - t0, units)
        return out

    def _ctx(self, s: int, eids: Tensor | None = None) -> StageContext:
        return StageContext(self.rows.rows[s], self.seed, self.training, eids,
                            row_sum=self.owned_sum)

    def transform(self, s: int, stage: Any, h: Tensor, layer_input: Tensor | None) -> Tensor:
        rows = self.rows
        in_pos, layer_pos = rows.in_pos[s], rows.layer_pos[s]
        x = h if in_pos is None else take_rows(h, in_pos)  # CSR: sparse features
        if layer_input is not None and layer_pos is not None:
            layer_input = take_rows(layer_input, layer_pos)
        return self._timed("T", x.shape[0] * stage.out_dim,
                           lambda: stage(x, self._ctx(s), layer_input))

    def _sources(self, s: int, h: Tensor) -> Tensor:
        """Stage s's source rows: ``h`` then the fetched halo, in one tensor (the halo
        lands right after the own rows); a P stage that shares the E stage's halo reads
        the same tensor again."""
        if not self.rows.shares_halo[s]:
            table, stale = self.plan.tables[s], self.plan.stale
            if table is None:
                self.src = h
            elif stale is not None and self.training:
                self.src = torch.cat([h, stale.fetch(h, table, s)])
            else:
                self.src = halo_join(h, table, self.plan.comm, "halo")
            self.src_of = h
        assert self.src is not None and self.src_of is h, \
            f"stage {s} shares a halo fetched for other rows"
        return self.src

    def edge(self, s: int, stage: Any, h: Tensor) -> Tensor:
        block = self.rows.block(s)
        src = self._sources(s, h)
        ids = self.plan.edge_ids
        eids = block.eids if ids is None or block.eids is None else ids[block.eids]
        return self._timed("PE", block.graph.num_edges * stage.in_dim,
                           lambda: stage(block.graph, h[block.dst_pos], src,
                                         self._ctx(s, eids)))

    def propagate(self, s: int, stage: Any, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        plan = self.plan
        if edge_weights is None:
            weight = plan.weights[s]
        else:
            pos = plan.edge_pos[s]
            weight = edge_weights if pos is None else edge_weights[pos]
        graph = self.rows.block(s).graph
        table = plan.tables[s]
        if (type(stage) is Propagate and table is not None and not self.rows.shares_halo[s]
                and (plan.stale is None or not self.training)
                and (weight is None or not weight.requires_grad)):
            # join and aggregate as one autograd step, whose backward adds the returned
            # halo gradient in place (no copy of the own rows' gradient)
            self.src = self.src_of = None
            return self._timed("PE", graph.num_edges * stage.in_dim,
                               lambda: halo_spmm(graph, h, weight, table, plan.comm, "halo"))
        src = self._sources(s, h)
        return self._timed("PE", graph.num_edges * stage.in_dim,
                           lambda: stage(graph, src, weight))


def _twins(options: dict[str, Tensor], comm: Comm) -> dict[str, str]:
    """Plans equal to another on every worker (collective): each such name mapped to
    the first equal one, pure modes before ``hybrid`` (so a cost-model split that
    caches nothing, or everything, is named after its pure mode)."""
    names = sorted(options, key=lambda n: n == "hybrid")
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    if not pairs:
        return {}
    same = torch.tensor([float(torch.equal(options[a], options[b])) for a, b in pairs],
                        device=comm.device)
    prim.all_reduce_(same, comm, "setup", op="min")
    twins: dict[str, str] = {}
    for (a, b), eq in zip(pairs, same.tolist()):
        if eq and b not in twins and a not in twins:
            twins[b] = a
    return twins


def check_shard_hops(program: StageProgram, dataset: Dataset, what: str) -> None:
    """On a per-part shard: refuse (ValueError) when pure DepCache, the most any plan
    replicates, needs rows or in-edges the part does not hold (too few hops). Local:
    every part has the same hops, so every worker decides alike."""
    sh = dataset.shard
    if sh is None:
        return
    graph, _ = propagation_inputs(program, dataset.graph, in_degree=sh.in_degree)
    owned = torch.nonzero(sh.part_of == sh.part).flatten()
    rows = plan_rows(program, graph, owned, torch.zeros(graph.num_dst, dtype=torch.bool),
                     owner=sh.part_of)
    check_shard_rows(sh, rows, what)
    dataset.data.row_positions(rows.input_rows)


def _check_rows(plan: DataPlan, rows: RowPlan, what: str) -> None:
    """On a per-part shard: the rows ``rows`` aggregates have their in-edges there and
    the input rows it reads are held (ValueError naming what lacks)."""
    if plan.shard is None:
        return
    check_shard_rows(plan.shard, rows, f"data parallel, {what}")
    plan.source.row_positions(rows.input_rows)


def _remote_in_neighbours(graph: Graph, owned: Tensor, part_of: Tensor, rank: int) -> Tensor:
    _, src, _ = in_edges(graph, owned.numpy().astype(np.int64))
    src = np.unique(src)
    return torch.from_numpy(src[part_of.numpy()[src] != rank])
