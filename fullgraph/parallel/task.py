"""Task parallelism (NeutronTask): T and E stages on one group of workers, P stages on
another.

Instead of splitting the graph, the work is split by kind (NeutronTask §4.1): ranks
``0..N_t-1`` (the T group) run the transform and edge stages, the compute-bound
GEMMs, on contiguous row blocks of the vertices; ranks ``N_t..N-1`` (the P group)
run the propagate stages, the memory-bound SpMMs, each on a column slice of every
vertex with the whole graph, so no worker replicates neighbours of a partition.
Every hand-off between the groups is a placement change of the shared column
machinery (``parallel/columns.py``): rows of the T group to columns of the P group
before a P stage (``rows_to_cols``), columns back to rows before a T or E stage, and
gradients the same way back. A program that ends on a P stage gathers its output
rows inside the P group, where the loss is taken.

So the program decides the traffic (§5.1, Fig. 9): a coupled (alternating) program
hands every vertex embedding over at each of its 2L-1 boundaries; a decoupled one
(``T...T [E] P...P``) once each way. Inside a group the work is split by rows (T
group) or by columns (P group), so with more workers than the two tasks, groups form
as in §4.3 (Fig. 7).

The group sizes come from the task scheduling model (``taskmodel``, §5.2) measured
at start, or are given (``--task-split 1:3``). With ``--subgraphs S`` the vertices
are cut into S pieces and every hand-off into the P group is pipelined over them:
the piece of subgraph s is sent while the P group aggregates the rows that arrived
before, and each source row is sent once and reused by every later subgraph that
reads it (Algorithm 1's reuse). The subgraphs are groups of a grid of ``--chunks M``
chunks (``schedule/regroup.py``). With ``--task-deps exact`` (the default) every
block is aggregated: equals single-process training. ``--task-deps regroup`` is the
paper's approximate mode: in training the chunks are regrouped every epoch and the
blocks whose source chunk is in a later subgraph are skipped; evaluation is exact.
With ``--task-pieces K`` (``taskpieces.py``) the groups work at once instead of in
turn: each run of T stages is transformed and handed over in K row pieces, and the P
group aggregates each piece as it arrives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fullgraph.comm.group import Comm
from fullgraph.comm.placement import even_counts
from fullgraph.fields import changed_fields, option
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.memory import MemoryAccount, parse_bytes
from fullgraph.models.stages import StageProgram, propagation_inputs
from fullgraph.models.walk import describe, has_edge_stage, widest_slice
from fullgraph.parallel.assemble import assemble, contiguous_blocks, whole_graph
from fullgraph.parallel.base import DistributedStrategy, LocalResult, Work, feature_rows, register
from fullgraph.parallel.columns import ColumnPlan, column_forward, column_work, edge_plan
from fullgraph.parallel.taskmodel import (
    TaskSplit,
    choose_split,
    measure_machine,
    parse_split,
    predict_times,
    split_counts,
)
from fullgraph.parallel.taskpieces import (
    Pieces,
    PiecesRunner,
    build_pieces,
    describe_pieces,
    piecewise_runs,
)
from fullgraph.parallel.taskrows import (
    RowGroups,
    check_row_chunks,
    row_chunks_problem,
    row_groups,
    row_work,
    rows_forward,
)
from fullgraph.schedule.chunks import check_one_vertex, spread_chunks
from fullgraph.schedule.regroup import DEPS, ChunkGrid, Subgraphs

GROUP_PARALLEL = ("tensor", "data")


@dataclass
class TaskPlan(ColumnPlan):
    """A ``ColumnPlan`` whose row ranks are the T group and column ranks the P group."""

    split: TaskSplit | None = None
    machine: str = ""
    grid: ChunkGrid | None = None
    rows: RowGroups | None = None
    pieces: Pieces | None = None


@register
class TaskParallel(DistributedStrategy[TaskPlan]):
    """T / E stages on the T group's rows, P stages on the P group's columns."""

    name = "task"
    section = "task_parallel"
    flags = {"split": "task-split", "gamma": "task-gamma", "deps": "task-deps",
             "pieces": "task-pieces",
             "group_parallel": "group-parallel", "device_memory": "task-device-memory"}

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of task parallelism (NeutronTask §4-5).

        Attributes:
            split: ``auto``: group sizes from the task scheduling model measured at
                start (formulas 5-8); or ``T:P`` worker counts, e.g. ``1:3``, that sum
                to the number of workers (default: ``auto``).
            gamma: the scheduling model's overlap of a propagation's memory traffic
                with its arithmetic, in [0, 1] (default: 0.5).
            subgraphs: pipeline every hand-off into the P group over this many
                subgraphs, each source row sent once and reused (default: 1, no
                pipeline).
            recompute: the T group keeps no activations of its runs of T stages and
                recomputes them in the backward pass (§5.1, Fig. 8c); exact (default:
                False).
            chunks: M, the chunks of the grid the subgraphs are grouped from (§4.2,
                Fig. 6), at least ``subgraphs`` (default: 0, one chunk per subgraph).
            deps: ``exact``: every block is aggregated; ``regroup`` (approximate, in
                training only): the chunks are regrouped into subgraphs every epoch and
                blocks from later subgraphs skipped (``schedule/regroup.py``)
                (default: ``exact``).
            group_parallel: how a P group of several workers splits its work (sections 4.3
                and 6.11): ``tensor``, by columns (every P worker a column slice of every
                vertex, the whole graph); ``data``, by rows (every P worker a row range,
                the in-edges of its rows and their sources fetched from the T group)
                (default: ``tensor``).
            pieces: K > 1 cuts every T worker's rows into K pieces and hands each to
                the P group as soon as it is transformed, where the first P stage
                aggregates it at once, so the T group transforms a piece while the P
                group aggregates the one before (``parallel/taskpieces.py``); exact up to
                the order of float additions; the P workers hold the graph a second
                time, cut by source piece; tensor form only, not with ``subgraphs``,
                ``device_memory`` or ``recompute`` (default: 1, off).
            device_memory: a P worker's budget for one chunk's propagation, e.g.
                ``"2GB"``: the chunks are the fewest whose footprint (rows, in-edges and
                source rows at the worker's widest column slice, as tensor
                parallelism's ``--device-memory``) fits, each chunk a subgraph of the
                pipeline, so one chunk at a time is held (a subgraph of several chunks
                holds more: 1.4x the budget in a test); tensor form only, not with
                ``chunks`` or ``subgraphs`` (default: None, chunks from those).
        """

        split: str = option("auto", "workers of the T and P groups as T:P, e.g. 1:3; auto: "
                            "from the task scheduling model measured at start")
        gamma: float = option(0.5, "the scheduling model's overlap of a propagation's "
                              "memory traffic with its arithmetic, in [0, 1]")
        subgraphs: int = option(1, "pipeline each hand-off into the P group over this many "
                                "subgraphs; 1: no pipeline")
        recompute: bool = option(False, "recompute the T stages' activations in the backward "
                                 "pass instead of keeping them")
        chunks: int = option(0, "cut the vertices into this many chunks, grouped into the "
                             "subgraphs; 0: one chunk per subgraph (--group-parallel "
                             "tensor), subgraphs x the P group's workers (data)")
        deps: str = option("exact", "exact: every block aggregated; regroup (approximate): "
                           "chunks regrouped every epoch, blocks from later subgraphs skipped "
                           "in training", choices=DEPS)
        group_parallel: str = option("tensor", "how the P group splits its work: tensor (by "
                                     "columns) or data (by rows, each P worker fetching the "
                                     "sources of its rows' in-edges)",
                                     choices=GROUP_PARALLEL)
        pieces: int = option(1, "hand each run of T stages to the P group in this many row "
                             "pieces, aggregated as they arrive, so that the groups work at "
                             "once; 1: whole")
        device_memory: str | None = option(None, "a P worker's budget for one chunk's "
                                           "propagation, e.g. 2GB: the chunks and subgraphs "
                                           "(one chunk each) follow from it")

        def __post_init__(self) -> None:
            split_counts(self.split)  # raises on a malformed split
            if not 0.0 <= self.gamma <= 1.0:
                raise ValueError(f"task gamma must be in [0, 1], got {self.gamma}")
            if self.subgraphs < 1:
                raise ValueError(f"subgraphs must be >= 1, got {self.subgraphs}")
            if self.chunks < 0:
                raise ValueError(f"--chunks must be >= 1 (0: one per subgraph), got {self.chunks}")
            if 0 < self.chunks < self.subgraphs:
                raise ValueError(f"--subgraphs {self.subgraphs} is more than --chunks "
                                 f"{self.chunks}: every subgraph needs at least one chunk")
            if self.pieces < 1:
                raise ValueError(f"--task-pieces must be >= 1, got {self.pieces}")
            if self.pieces > 1:
                clash = [flag for flag, on in (
                    ("--subgraphs", self.subgraphs > 1), ("--chunks", self.chunks > 0),
                    ("--task-device-memory", self.device_memory is not None),
                    ("--recompute", self.recompute),
                    ("--group-parallel data", self.group_parallel == "data")) if on]
                if clash:
                    raise ValueError(f"--task-pieces {self.pieces} overlaps the T and P groups "
                                     "in the tensor form's own way: it does not combine with "
                                     f"{', '.join(clash)}")
            if self.deps not in DEPS:
                raise ValueError(f"--task-deps must be one of {', '.join(DEPS)}, got "
                                 f"{self.deps!r}")
            if self.group_parallel not in GROUP_PARALLEL:
                raise ValueError(f"--group-parallel must be one of "
                                 f"{', '.join(GROUP_PARALLEL)}, got {self.group_parallel!r}")
            if self.device_memory is not None:
                parse_bytes(self.device_memory)  # raises on a bad size
                if self.group_parallel == "data":
                    raise ValueError("--task-device-memory sizes the chunks of the column-split "
                                     "P group: use it with --group-parallel tensor, or give "
                                     "--chunks with --group-parallel data")
                if self.deps == "regroup":
                    raise ValueError("--task-device-memory with --task-deps regroup: the "
                                     "edges skipped would depend on the budget; give "
                                     "--chunks and --subgraphs for regroup")
                if self.chunks or self.subgraphs > 1:
                    raise ValueError(f"--task-device-memory {self.device_memory} sets the "
                                     "chunks and the subgraphs (one chunk each, so that one "
                                     "chunk at a time is on the device): leave --chunks and "
                                     "--subgraphs unset")

    options: Options

    def unused_options(self) -> list[str]:
        opts, unused = self.options, []
        if opts.split != "auto" and changed_fields(opts, among=("gamma",)):
            unused.append(f"--task-gamma has no effect with --task-split {opts.split} (it "
                          "sizes the groups only under auto)")
        if opts.chunks and not self._pipelined and opts.group_parallel == "tensor":
            unused.append(f"--chunks {opts.chunks} has no effect without --subgraphs 2 or more "
                          "(the chunks are grouped into the pipeline's subgraphs)")
        return unused

    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> TaskPlan:
        self._check_program(program)
        if comm is None or comm.world_size < 2:
            raise ValueError("strategy 'task' runs the T and P stages on different workers: "
                             "it needs at least 2 workers (--workers 2)")
        shard = dataset.shard  # per-part shards: the whole graph gathered from the parts
        stored = dataset.graph if shard is None else whole_graph(dataset, comm)
        graph, norms = propagation_inputs(program, stored, dtype)
        n = graph.num_dst
        self.check_sizes(n)
        split, machine = self._split(program, graph.num_dst, graph.num_edges, comm, dtype,
                                     device)
        row_counts = even_counts(n, split.num_t) + [0] * split.num_p
        if shard is not None:  # each T worker's block of feature rows, from their parts
            dataset = assemble(dataset, comm, contiguous_blocks(row_counts), stored)
        rows = None
        if self.options.group_parallel == "data":  # the P workers hold their in-edges only
            opts = self.options
            check_row_chunks(opts.chunks, opts.subgraphs, split.num_p)
            rows = row_groups(graph, row_counts, split.num_p, comm, opts.subgraphs,
                              opts.chunks, device, has_edge_stage(program),
                              opts.deps == "regroup")
            a, b = rows.own_edges
            held, norms = rows.exact.block, {k: v[a:b] for k, v in norms.items()}
        else:
            graph.transpose()  # the backward CSR, built once
            held = graph
        plan = self._plan(dataset, program, held, norms, split, row_counts, comm, device, dtype)
        plan.machine, plan.rows = machine, rows
        if self.options.pieces > 1:
            plan.pieces = build_pieces(graph, norms, row_counts, self.options.pieces, comm.rank,
                                       comm.rank in split.p_ranks, device)
        if has_edge_stage(program):
            plan.edges = edge_plan(graph, row_counts, comm)
            plan.edges.block = plan.edges.block.to(device)
        if rows is None and self._pipelined:
            opts = self.options
            budget = None if opts.device_memory is None else parse_bytes(opts.device_memory)
            if budget is not None:  # the fewest chunks a P worker's widest slice fits
                widest = widest_slice(program, split.num_p)
                try:
                    ranges = spread_chunks(graph.indptr, row_counts, widest,
                                           torch.empty(0, dtype=dtype).element_size(),
                                           budget=budget)
                except ValueError as err:  # name this strategy's flag, not tensor's
                    raise ValueError(str(err).replace("--device-memory",
                                                      "--task-device-memory")) from None
            else:
                ranges = spread_chunks(graph.indptr, row_counts, 1,
                                       num_chunks=opts.chunks or opts.subgraphs)
            subgraphs = opts.subgraphs if budget is None else len(ranges)
            plan.grid = ChunkGrid(graph.to("cpu"), ranges, min(subgraphs, len(ranges)))
            plan.account = MemoryAccount(budget)
            _use(plan, plan.grid.exact)
        return plan

    @property
    def _pipelined(self) -> bool:
        """Whether the hand-offs into the P group run over a chunk grid (tensor form)."""
        return self.options.subgraphs > 1 or self.options.device_memory is not None

    def _plan(self, dataset: Dataset, program: StageProgram, graph: Graph,
              norms: dict[str, Tensor], split: TaskSplit, row_counts: list[int], comm: Comm,
              device: torch.device, dtype: torch.dtype) -> TaskPlan:
        """The plan: this rank's T rows, and its output rows (and labels) when a program
        ends on a P stage whose output stays on the P group's rows (not pipelined in
        the tensor form, whose pipeline ends with a gather to the T rows; always in the
        data form)."""
        n, rank = sum(row_counts), comm.rank
        start = sum(row_counts[:rank])
        gids = torch.arange(start, start + row_counts[rank])
        on_p = describe(program)[-1].is_propagate and (
            not self._pipelined or self.options.group_parallel == "data")
        out_rows = [0] * split.num_t + even_counts(n, split.num_p) if on_p else None
        out_gids = None
        if out_rows is not None:
            lo = sum(out_rows[:rank])
            out_gids = torch.arange(lo, lo + out_rows[rank])
        label_gids = gids if out_gids is None else out_gids
        data = dataset.data
        masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
        return TaskPlan(
            device=device, labels=data.labels[label_gids].to(device),
            masks={k: v[label_gids].to(device) for k, v in masks.items()},
            num_train_global=int(data.train_mask.sum()), comm=comm, graph=graph.to(device),
            norms={k: v.to(device) for k, v in norms.items()}, row_counts=row_counts,
            gids=gids.to(device),
            features=feature_rows(data, gids, program, dtype, device),
            col_ranks=split.p_ranks, out_rows=out_rows,
            out_gids=None if out_gids is None else out_gids.to(device),
            split=split, recompute=self.options.recompute)

    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        self._check_program(program)
        self.check_sizes(num_nodes, workers)

    def check_data(self, program: StageProgram, dataset: Dataset, workers: int) -> None:
        """A ``--task-device-memory`` that cannot hold one vertex with its in-edges at
        the fewest columns a P worker can get (the P group is at most ``workers - 1``,
        or as ``--task-split`` gives it)."""
        opts = self.options
        if opts.device_memory is None or opts.group_parallel == "data" \
                or dataset.shard is not None or workers < 2:
            return
        split = parse_split(opts.split, workers)
        check_one_vertex(propagation_inputs(program, dataset.graph)[0].indptr,
                         widest_slice(program, split.num_p if split else workers - 1),
                         parse_bytes(opts.device_memory), "--task-device-memory")

    def _check_program(self, program: StageProgram) -> None:
        """Refuse what the options cannot run on ``program``; before launch and in setup."""
        if self.options.pieces > 1 and not piecewise_runs(program):
            raise ValueError(f"--task-pieces {self.options.pieces}: no T stages of this model "
                             "hand off to a propagation that can start on a piece (its "
                             "propagations weigh edges by attention, which needs every row "
                             "first, or its T stages sum over all rows, or no propagation "
                             "follows them); leave --task-pieces unset")
        if self.options.recompute and program.reduces_rows:
            raise ValueError("--recompute: this model's T stages reduce over all rows (batch "
                             "normalisation, reduces_rows), a collective that cannot run "
                             "again in the backward pass; train without --recompute (or "
                             "--batch-norm)")

    def check_sizes(self, num_vertices: int, workers: int | None = None) -> None:
        """Refuse subgraph and chunk counts the graph (or, in the data form with a
        given split, the P group) cannot hold; called before launch and in setup."""
        opts = self.options
        for flag, value in (("--subgraphs", opts.subgraphs), ("--chunks", opts.chunks),
                            ("--task-pieces", opts.pieces)):
            if value > num_vertices:
                raise ValueError(f"{flag} {value} is more than the graph's {num_vertices} "
                                 "vertices")
        split = None if workers is None else parse_split(opts.split, workers)
        if split is not None and opts.group_parallel == "data":
            check_row_chunks(opts.chunks, opts.subgraphs, split.num_p)

    def p_group_fits(self, num_p: int) -> bool:
        """Whether a P group of ``num_p`` workers can run the options (the data form's
        chunk grid; one worker always can, the options having at least as many chunks
        as subgraphs): the automatic split takes such a size."""
        opts = self.options
        return opts.group_parallel != "data" or \
            row_chunks_problem(opts.chunks, opts.subgraphs, num_p) is None

    def _split(self, program: StageProgram, num_vertices: int, num_edges: int, comm: Comm,
               dtype: torch.dtype, device: torch.device) -> tuple[TaskSplit, str]:
        """The group sizes: given, or from the scheduling model (collective)."""
        given = parse_split(self.options.split, comm.world_size)
        if given is not None:
            return given, ""
        machine = measure_machine(comm, device=device)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        t_time, p_time = predict_times(program, num_vertices, num_edges, machine,
                                       self.options.gamma, itemsize)
        return choose_split(comm.world_size, t_time, p_time, self.p_group_fits), machine.describe()

    def describe(self, model: StageProgram, plan: TaskPlan) -> list[str]:
        split = plan.split
        assert split is not None
        infos = describe(model)
        t_stages = [i.index for i in infos if not i.is_propagate]
        p_stages = [i.index for i in infos if i.is_propagate]
        p_form = ("data: rows, each P worker fetching the sources of its rows' in-edges"
                  if plan.rows is not None else "tensor: columns of every vertex")
        lines = [f"task     T/E stages {t_stages} on {_span(split.t_ranks)} (T group, "
                 f"rows), P stages {p_stages} on {_span(split.p_ranks)} (P group, "
                 f"{p_form}): each group runs one kind of task"]
        if split.how == "auto":
            assert split.predicted_t is not None and split.predicted_p is not None
            lines.append(f"task     split {split.num_t}:{split.num_p} from the scheduling "
                         f"model ({plan.machine}, gamma {self.options.gamma}): predicted "
                         f"forward T {split.predicted_t * 1e3:.2f} ms, P "
                         f"{split.predicted_p * 1e3:.2f} ms on one worker")
        else:
            lines.append(f"task     split {split.num_t}:{split.num_p} given (--task-split)")
        if plan.recompute:
            lines.append("task     T-stage activations recomputed in the backward pass")
        if plan.pieces is not None:
            lines.append(describe_pieces(plan.pieces, model))
        elif (plan.rows is None and plan.grid is None and not plan.recompute
              and not self.options.chunks and piecewise_runs(model)):
            # (where --task-pieces would be accepted, and some hand-off would go in pieces)
            lines.append("task     the groups take turns, each waiting while the other works; "
                         "--task-pieces K (e.g. 3) lets them overlap (exact up to float rounding)")
        pipeline = plan.rows.pipeline if plan.rows is not None else (
            None if plan.grid is None else (plan.grid.num_subgraphs, plan.grid.num_chunks))
        if pipeline is not None:
            subgraphs, chunks = pipeline
            per = ""
            if plan.rows is not None:  # the grid's chunks are stripes over the P workers
                chunks, per = chunks * split.num_p, f" ({chunks} per P worker)"
            sized = ""
            if plan.account is not None and plan.account.budget is not None:
                sized = f" (the fewest within a budget of {plan.account.budget} B)"
            lines.append(f"task     {subgraphs} subgraphs of {chunks} chunks{per}{sized}, "
                         "pipelined into the P group, each source row sent once and reused")
            if self.options.deps == "regroup":
                lines.append("task     dependencies: regroup (APPROXIMATE): in training the "
                             "chunks are regrouped every epoch and blocks from later subgraphs "
                             "skipped; evaluation exact")
        elif self.options.deps == "regroup":
            lines.append("task     dependencies: regroup with one subgraph skips no block: exact")
        return lines

    def work(self, model: StageProgram, plan: TaskPlan) -> Work:
        if plan.rows is not None:
            return row_work(model, plan, plan.rows)
        return column_work(model, plan)

    def forward(self, model: StageProgram, plan: TaskPlan, *, training: bool,
                seed: int) -> LocalResult:
        """The program forward. With ``--task-deps regroup`` a training pass uses the
        grouping its ``seed`` (the epoch's step seed, the same on every worker) draws;
        evaluation (``training=False``) always aggregates every block, exactly."""
        regroup = training and self.options.deps == "regroup"
        if plan.rows is not None:
            return rows_forward(model, plan, plan.rows, training=training, seed=seed,
                                regroup=regroup)
        if plan.grid is not None:
            _use(plan, plan.grid.regrouped(seed) if regroup else plan.grid.exact)
        runner = None if plan.pieces is None else PiecesRunner(plan, plan.pieces, seed, training)
        return column_forward(model, plan, training=training, seed=seed, runner=runner)


def _use(plan: TaskPlan, subgraphs: Subgraphs) -> None:
    """Pipeline the next forward pass over ``subgraphs``."""
    plan.chunks, plan.first_reads = subgraphs.chunks, subgraphs.first_reads
    plan.edge_keep = subgraphs.keep


def _span(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
