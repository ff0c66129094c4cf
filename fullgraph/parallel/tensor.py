"""Tensor parallelism (NeutronTP): vertex tensors split by columns for propagation.

Every worker holds the whole graph topology. T stages run on ``Shard(0)``: worker r
owns a contiguous block of about N/R vertices and their whole rows. P stages run on
``Shard(1)``: every vertex, a slice of about D/R columns, with the full graph and no
communication (propagation is linear and column-independent). With ``shares`` (or
after ``replan``, which ``--adapt adjust`` calls from measured speeds) both splits
follow given relative speeds instead. The executor keeps
track of the current placement and changes it only when the next stage needs the
other one (NeutronTP §3.1):
- before a P stage on rows: ``split`` (rows -> columns, all-to-all);
- before a T or E stage on columns: ``gather`` (columns -> rows, all-to-all).

So the program decides the communication: a coupled model alternates (naive tensor
parallelism, 2 collectives per layer), a decoupled one runs all T stages, one split,
K propagations, one gather: 4 collective rounds per epoch with the backward,
whatever L and K are (NeutronTP §4.1).

E stages (GAT attention) need whole rows of both endpoints: each worker computes the
coefficients of the in-edges of the destinations it owns, fetching the source rows
it does not own (a halo exchange), and the coefficients are then shared with every
worker (all-gather; its backward sums the coefficient gradients back to the owner),
so each can propagate its column slice. Attention parameters are trained (their
gradients flow through the shared coefficients).

The placement machinery (``ColumnPlan``, the runner, E stages, chunked
propagation) lives in ``parallel/columns.py``, shared with task parallelism; this
module holds the strategy: its options, setup and report.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fullgraph.comm.group import Comm
from fullgraph.comm.placement import check_counts, even_counts, share_counts
from fullgraph.fields import is_device_name, option
from fullgraph.graph.data import Dataset
from fullgraph.memory import MemoryAccount, parse_bytes
from fullgraph.models.stages import StageProgram, propagation_inputs
from fullgraph.models.walk import describe, has_edge_stage, widest_slice
from fullgraph.ops.chunked import build_chunks
from fullgraph.ops.sparse import is_sparse
from fullgraph.ops.spill import Spill
from fullgraph.parallel.assemble import assemble, contiguous_blocks
from fullgraph.parallel.base import DistributedStrategy, LocalResult, Work, feature_rows, register
from fullgraph.parallel.columns import (
    ColumnPlan,
    column_forward,
    column_work,
    count_resident,
    edge_plan,
)
from fullgraph.schedule.chunks import check_one_vertex, spread_chunks
from fullgraph.schedule.pipeline import first_reads

COLUMN_SPLITS = ("balanced", "even")
"""``column_split``: equal work and bytes per worker, or near-equal slices."""


def parse_shares(text: str) -> tuple[float, ...]:
    """``"2,1.5,1"`` -> (2.0, 1.5, 1.0); ValueError unless non-negative numbers, not all 0."""
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        shares = ()
    if not shares or any(not 0 <= w < float("inf") for w in shares) or sum(shares) <= 0:
        raise ValueError(f"shares {text!r}: expected comma-separated non-negative numbers, "
                         f"not all zero, one per worker (e.g. 2,1)")
    return shares


@register
class TensorParallel(DistributedStrategy[ColumnPlan]):
    """Column-split propagation, row-split transforms (NeutronTP)."""

    name = "tensor"
    section = "tensor_parallel"

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of tensor parallelism (NeutronTP §4.2).

        Attributes:
            device_memory: budget for propagation on the device, e.g. ``"2GB"``; the
                graph is then cut into chunks that fit it, its topology and edge
                weights kept in host memory and streamed chunk by chunk. The budget
                bounds the streamed working set only; the rows of transform stages
                that run on the device stay there (``MemoryAccount.resident``)
                (default: None, the whole graph at once).
            num_chunks: cut into this many equal chunks instead (default: None).
            pipeline: cut each split and gather into per-chunk pieces that overlap the
                neighbouring chunk's aggregation, sending each vertex once (§4.2.2);
                uses 4 chunks unless a budget or a count is given (default: False).
            nn_device: run the T / E stages (and keep vertex rows) on this device, e.g.
                ``cpu`` while propagation streams chunks to the GPU, as NeutronTP does
                for graphs beyond device memory (default: None, the training device).
            prefetch: on a GPU, while one chunk computes, load the next (its source
                rows gathered into pinned host memory, its CSR pinned once) and copy
                it on a side stream (§4.2.1); the budget then holds two chunks, so
                each is cut to half of it. Not used with ``pipeline``. On an H100 it
                saved 0-2 % (BENCHMARKS.md, "On a GPU") (default: False).
            column_split: ``balanced``: D // R columns per worker and the D % R
                remaining ones propagated by every worker, so work and bytes are equal
                on every worker; ``even``: near-equal slices, no repeated work, up to
                one column more on some workers (default: ``balanced``).
            shares: relative speeds of the workers, e.g. ``"2,1"``: vertex rows and
                every propagation's columns are split in proportion (at least one row
                each; a worker may get no columns), replacing ``column_split``;
                ``--adapt adjust`` changes them between epochs from measured speeds
                (default: None, even rows and ``column_split`` columns).
            row_block: run the dense (T) stages this many rows at a time and recompute
                them in the backward pass, so no (rows, hidden) activation is held
                whole and memory-mapped dense features are read one block at a time
                from the store, in their stored dtype (fp16 / bf16 too): with a
                decoupled model, a graph whose features and hidden rows exceed memory
                trains (default: None, all rows at once).
            spill_dir: keep the propagation's (N, D) matrices (each hop's output, the
                blocked dense runs' outputs, the logits, and the gradients of all of
                them), the transposed graph and the edge weights in unlinked files
                under this directory, and propagate a column chunk at a time
                (``ops.spill``): with
                ``row_block`` and a decoupled model, no (N, D) tensor is then held in
                memory, only a chunk of its columns. CPU only; learned edge weights
                (GAT) and ``device_memory`` / ``num_chunks`` / ``pipeline`` are not
                supported with it (default: None, in memory).
            spill_memory: memory one column chunk may take, its input and output rows,
                e.g. ``"2GB"`` (default: None, a quarter of this worker's share of the
                host's memory available at setup, within this process's cgroup limit:
                ``fullgraph.memory.ram_per_worker``).
        """

        device_memory: str | None = option(None, "device budget for propagation, e.g. 2GB: "
                                           "the graph streams through it in chunks; unset: the "
                                           "whole graph at once")
        num_chunks: int | None = option(None, "cut the graph into this many equal chunks; "
                                          "unset: as --device-memory needs")
        column_split: str = option("balanced", "how feature columns are split over workers",
                                   choices=COLUMN_SPLITS)
        pipeline: bool = option(False, "overlap each chunk's communication with the next "
                                "chunk's aggregation")
        nn_device: str | None = option(None, "run the dense (T / E) stages on this device, "
                                       "e.g. cpu; unset: --device")
        prefetch: bool = option(False, "on a GPU, copy the next chunk to the device on a side "
                                "stream while the current one computes (each chunk then "
                                "gets half of --device-memory)")
        shares: str | None = option(None, "relative worker speeds, e.g. 2,1: rows and columns "
                                    "split in proportion; unset: even")
        row_block: int | None = option(None, "run the dense stages this many rows at a time, "
                                       "recomputing them in the backward: hidden rows and "
                                       "memory-mapped features are never held whole")
        spill_dir: str | None = option(None, "keep the propagation's (N, D) matrices in files "
                                       "under this directory and propagate a column chunk "
                                       "at a time; unset: in memory")
        spill_memory: str | None = option(None, "memory for one spilled column chunk, e.g. "
                                          "2GB; unset: a quarter of this worker's share of the "
                                          "host's available memory")

        def __post_init__(self) -> None:
            if self.nn_device is not None and not is_device_name(self.nn_device):
                raise ValueError(f"nn_device {self.nn_device!r}; expected cpu, cuda or cuda:N")
            if self.column_split not in COLUMN_SPLITS:
                raise ValueError(f"column_split {self.column_split!r}; expected balanced or even")
            if self.device_memory is not None:
                parse_bytes(self.device_memory)  # raises on a bad size
            if self.num_chunks is not None and self.num_chunks < 1:
                raise ValueError(f"num_chunks must be >= 1, got {self.num_chunks}")
            if self.num_chunks is not None and self.device_memory is not None:
                raise ValueError("give device_memory or num_chunks, not both: the budget "
                                 "decides how many chunks there are")
            if self.shares is not None:
                parse_shares(self.shares)
            if self.row_block is not None and self.row_block < 1:
                raise ValueError(f"row_block must be >= 1, got {self.row_block}")
            if self.spill_memory is not None:
                if parse_bytes(self.spill_memory) < 1:
                    raise ValueError(f"spill_memory {self.spill_memory!r} must be at least "
                                     f"1 byte")
                if self.spill_dir is None:
                    raise ValueError("spill_memory is given without spill_dir")
            if self.spill_dir is not None:
                clash = [name for name, on in (("device_memory", self.device_memory),
                                               ("num_chunks", self.num_chunks),
                                               ("pipeline", self.pipeline)) if on]
                if clash:
                    raise ValueError(f"spill_dir cannot be combined with {', '.join(clash)}: "
                                     f"spilled matrices are propagated in column chunks on "
                                     f"the host, not streamed to a device in row chunks")

        def share_list(self, world: int) -> tuple[float, ...] | None:
            """The shares for ``world`` workers (None: not given)."""
            if self.shares is None:
                return None
            shares = parse_shares(self.shares)
            if len(shares) != world:
                raise ValueError(f"tensor_parallel.shares: {self.shares!r} gives "
                                 f"{len(shares)} shares for {world} workers")
            return shares

    options: Options

    def model_device(self, device: torch.device) -> torch.device:
        """``--nn-device`` where given (refused where torch cannot give it), else ``device``."""
        if self.options.nn_device is None:
            return device
        from fullgraph.comm.group import check_device, env_int, local_gpu

        check_device(self.options.nn_device, "tensor_parallel.nn_device", "--nn-device")
        if self.options.nn_device == "cuda":  # the rank's GPU, as --device cuda gives it
            return device if device.type == "cuda" else \
                local_gpu(env_int("LOCAL_RANK", 0))
        return torch.device(self.options.nn_device)

    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> ColumnPlan:
        if comm is None:
            from fullgraph.comm.group import single_comm

            comm = single_comm()
        shares = self.options.share_list(comm.world_size)
        n = dataset.graph.num_dst
        row_counts = (even_counts(n, comm.world_size) if shares is None
                      else share_counts(n, shares, minimum=1))
        if dataset.shard is not None:  # per-part shards: gather the whole graph and the
            # feature rows of this worker's block from the parts that hold them
            dataset = assemble(dataset, comm, contiguous_blocks(row_counts))
        rows_device = self.model_device(device)  # where T stages and vertex rows live
        spill = self._spill(program, device, rows_device, comm.world_size)
        if spill is not None:
            self._check_spill_memory(spill, n, dtype)
        # with a spill, the edge weights and the transposed CSR are made in files
        graph, norms = propagation_inputs(program, dataset.graph, dtype,
                                          empty=None if spill is None else spill.array)
        if spill is not None:
            spill.keep_graph(graph)
        else:
            graph.transpose()  # the backward CSR, built once
        # chunked propagation streams the topology and edge weights from host memory
        graph_device = torch.device("cpu") if self._chunked else rows_device
        data = dataset.data
        plan = ColumnPlan(
            device=device, labels=data.labels[:0], masks={}, comm=comm,
            num_train_global=int(data.train_mask.sum()),
            graph=graph.to(graph_device),
            norms={k: v.to(graph_device) for k, v in norms.items()},
            row_counts=row_counts, gids=torch.empty(0, dtype=torch.long),
            features=feature_rows(data.features, torch.zeros(0, dtype=torch.long), program,
                                  dtype, rows_device),
            column_split=self.options.column_split, shares=shares, source=data)
        plan.spill = spill
        self._place_rows(program, plan, row_counts, rows_device, dtype)
        return plan

    def chunk_ranges(self, indptr: Tensor, row_counts: list[int], widest: int, itemsize: int,
                     prefetch: bool) -> list[list[tuple[int, int]]]:
        """The chunks a run cuts (``spread_chunks``): to fit ``device_memory`` (half of it
        each with ``prefetch``, which holds two chunks' inputs on the device at once),
        else ``num_chunks`` (default 4). The planner prices the same chunks.

        Raises:
            ValueError: the budget cannot hold one vertex with its in-edges.
        """
        opts = self.options
        budget = parse_bytes(opts.device_memory) if opts.device_memory is not None else None
        count = None if budget is not None else (opts.num_chunks or 4)
        per_chunk = None if budget is None else budget // 2 if prefetch else budget
        return spread_chunks(indptr, row_counts, widest, itemsize, budget=per_chunk,
                             num_chunks=count)

    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        self.options.share_list(workers)  # one share per worker
        self._check_spill(program)
        self.model_device(torch.device("cpu"))  # (a device torch cannot give: refused)

    def check_data(self, program: StageProgram, dataset: Dataset, workers: int) -> None:
        """A ``--device-memory`` that cannot hold one vertex with its in-edges at the
        fewest columns any split gives a worker (a per-part shard lacks the graph)."""
        if self.options.device_memory is None or dataset.shard is not None:
            return
        check_one_vertex(propagation_inputs(program, dataset.graph)[0].indptr,
                         widest_slice(program, workers),
                         parse_bytes(self.options.device_memory))

    def _check_spill(self, program: StageProgram) -> None:
        if self.options.spill_dir is not None and has_edge_stage(program):
            raise ValueError("tensor_parallel.spill_dir: the model learns edge weights "
                             "(attention), whose gradient needs whole rows; spill works with "
                             "fixed edge weights (GCN, GraphSAGE, GIN, TAGCN)")

    def _spill(self, program: StageProgram, device: torch.device,
               rows_device: torch.device, world_size: int) -> Spill | None:
        opts = self.options
        if opts.spill_dir is None:
            return None
        from fullgraph.memory import ram_per_worker

        where = [d for d in (device, rows_device) if d.type != "cpu"]
        if where:
            raise ValueError(f"tensor_parallel.spill_dir keeps matrices in host files; the "
                             f"run computes on {where[0]}: use --device cpu")
        self._check_spill(program)
        memory = (parse_bytes(opts.spill_memory) if opts.spill_memory is not None
                  else max(1, ram_per_worker(world_size) // 4))  # (a host's workers share)
        return Spill(opts.spill_dir, memory)

    @staticmethod
    def _check_spill_memory(spill: Spill, rows: int, dtype: torch.dtype) -> None:
        """A column chunk holds at least one column of its input and output rows: a
        smaller budget would be exceeded, and it sizes the transpose's passes too."""
        itemsize = dtype.itemsize
        least = 2 * rows * itemsize
        if spill.memory < least:
            raise ValueError(f"tensor_parallel.spill_memory: {spill.memory} B holds less than "
                             f"one column of the propagation's input and output rows "
                             f"(2 x {rows} rows x {itemsize} B); give at least {least} B")

    def _place_rows(self, program: StageProgram, plan: ColumnPlan, row_counts: list[int],
                    rows_device: torch.device, dtype: torch.dtype) -> None:
        """This rank's rows, their edge plan (collective) and chunks for ``row_counts``."""
        data, comm = plan.source, plan.comm
        start = sum(row_counts[:comm.rank])
        gids = torch.arange(start, start + row_counts[comm.rank])
        masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
        plan.row_counts, plan.layouts = row_counts, {}
        plan.gids, plan.labels = gids.to(rows_device), data.labels[gids].to(rows_device)
        plan.masks = {k: v[gids].to(rows_device) for k, v in masks.items()}
        x = data.features
        if (self.options.row_block is not None and rows_device.type == "cpu"
                and data.row_ids is None and not is_sparse(x)):
            # a view of this rank's rows, memory-mapped and in their stored dtype: the
            # blocked runs read and convert them one block at a time
            plan.features = x[start:start + row_counts[comm.rank]]
            plan.row_dtype = dtype
        else:  # looked up by id: on shards, ``data`` holds this worker's rows only
            plan.features = feature_rows(data, gids, program, dtype, rows_device)
        plan.row_block = self.options.row_block
        if has_edge_stage(program):
            plan.edges = edge_plan(plan.graph, row_counts, comm)
            plan.edges.block = plan.edges.block.to(rows_device)
        self._chunk(program, plan, dtype)
        if plan.account is not None and rows_device == plan.device:
            count_resident(program, plan, dtype)

    def replan(self, program: StageProgram, plan: ColumnPlan,
               shares: Sequence[float] | None, *, row_counts: Sequence[int] | None = None,
               col_counts: Mapping[int, Sequence[int]] | None = None) -> None:
        """Split rows and columns anew between epochs (collective: every worker calls it
        with the same arguments). Exact: only where rows and columns are computed
        changes, every worker holds the whole input to re-take its rows from.

        Args:
            program: the stage program.
            plan: this worker's plan (from ``setup``).
            shares: relative speeds, one per worker; rows (at least one each) and every
                propagation's columns are split in proportion; None: split as ``setup``
                does without ``--shares`` (even rows, ``--column-split`` columns).
            row_counts: given row counts instead (summing to the vertex count).
            col_counts: given column counts for some P-stage widths (summing to it).
        """
        world, n = plan.comm.world_size, plan.graph.num_dst
        if shares is not None and len(shares) != world:
            raise ValueError(f"replan: {len(shares)} shares for {world} workers")
        shares = None if shares is None else tuple(float(w) for w in shares)
        rows = check_counts(row_counts, n, world, "replan row_counts") if row_counts \
            is not None else even_counts(n, world) if shares is None \
            else share_counts(n, shares, minimum=1)
        cols = {int(d): check_counts(c, int(d), world, f"replan col_counts[{d}]")
                for d, c in (col_counts or {}).items()}
        if plan.source.row_ids is not None and list(rows) != plan.row_counts:
            raise ValueError("tensor parallelism on per-part shards keeps its row blocks: "
                             "each worker holds only its own block's feature rows")
        plan.shares, plan.col_counts = shares, cols
        # the run's dtype: with ``row_block`` the features are a view in their stored one
        dtype = plan.row_dtype or plan.features.dtype
        self._place_rows(program, plan, rows, plan.features.device, dtype)

    @property
    def _chunked(self) -> bool:
        opts = self.options
        return opts.device_memory is not None or opts.num_chunks is not None or opts.pipeline

    def _chunk(self, program: StageProgram, plan: ColumnPlan, dtype: torch.dtype) -> None:
        """Cut the graph into destination chunks when a budget or a count is given."""
        opts = self.options
        why = None if not opts.prefetch else "without chunks (--device-memory or --num-chunks)" \
            if not self._chunked else "with --pipeline" if opts.pipeline \
            else f"on {plan.device.type}" if plan.device.type != "cuda" else None
        if why is not None:
            warnings.warn(f"tensor_parallel option prefetch has no effect {why}: it copies "
                          "chunks to a GPU", UserWarning, stacklevel=2)
        if not self._chunked:
            return
        # the widest slice of any worker, so that every worker cuts the same chunks (the
        # pipelined exchanges go chunk by chunk; shares and an even split differ per rank)
        widest = max((plan.layout(program.stages[i.index].in_dim).local_cols(r)
                      for i in describe(program) if i.is_propagate
                      for r in range(plan.comm.world_size)), default=1)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        plan.prefetch = opts.prefetch and why is None
        ranges = self.chunk_ranges(plan.graph.indptr, plan.row_counts, widest, itemsize,
                                   plan.prefetch)
        if opts.num_chunks is not None and opts.device_memory is None \
                and len(ranges) < opts.num_chunks:
            warnings.warn(f"tensor_parallel num_chunks {opts.num_chunks}: a chunk holds at "
                          f"least one row of a worker's block, the largest has "
                          f"{max(plan.row_counts)} rows; cut into {len(ranges)} chunks",
                          UserWarning, stacklevel=2)
        plan.chunks = build_chunks(plan.graph.to("cpu"), ranges)
        plan.account = MemoryAccount(
            parse_bytes(opts.device_memory) if opts.device_memory is not None else None)
        if opts.pipeline:
            plan.first_reads = first_reads(plan.chunks)

    def outcome(self, model: StageProgram, plan: ColumnPlan) -> list[str]:
        """What the spill made (this rank's files), where the run spilled."""
        return [] if plan.spill is None else [plan.spill.summary()]

    def describe(self, model: StageProgram, plan: ColumnPlan) -> list[str]:
        lines = []
        if plan.shares is not None:
            given = ":".join(f"{w:g}" for w in plan.shares)
            lines.append(f"tensor   shares {given}: rows {'/'.join(map(str, plan.row_counts))}, "
                         f"columns split in the same proportion")
        if plan.spill is not None:
            lines.append(f"tensor   {plan.spill.describe()}")
        return lines + self._describe_chunks(plan)

    def _describe_chunks(self, plan: ColumnPlan) -> list[str]:
        if plan.chunks is None:
            return []
        account = plan.account
        assert account is not None
        budget = "no budget" if account.budget is None else f"budget {account.budget} B"
        chunks = f"{len(plan.chunks)} chunk{'' if len(plan.chunks) == 1 else 's'}"
        line = (f"tensor   {chunks} ({budget}) streamed from host memory"
                f"{', pipelined' if plan.first_reads is not None else ''}"
                f"{', next chunk prefetched on a side stream' if plan.prefetch else ''}")
        if account.resident:
            kept = ", ".join(f"{k} {v} B" for k, v in account.resident.items())
            line += f"; resident on {plan.device} beside them: {kept}"
        return [line]

    def work(self, model: StageProgram, plan: ColumnPlan) -> Work:
        return column_work(model, plan)

    def forward(self, model: StageProgram, plan: ColumnPlan, *, training: bool,
                seed: int) -> LocalResult:
        return column_forward(model, plan, training=training, seed=seed)
