"""Hybrid parallelism (G3): row partitions that push layer outputs peer to peer, in bins.

Worker i computes every stage for the rows V_i of a partition (the data-parallel
dimension). A P or E stage reads the rows of remote in-neighbours; they are never
replicated or recomputed: their owners push them, peer to peer, as soon as they are
computed (the model-parallel dimension), along send / receive tables built once from
the partition (for each peer, which of my vertices it reads, in its order). The
backward pushes the gradients of those rows back to their owners along the same
tables reversed, and parameter gradients are all-reduced once per step (G3 §3.1).

The program is cut into *phases* at the stages that read remote rows: phase 0 is
the stages before the first P / E stage, phase k >= 1 starts at the k-th such stage
(an E stage and the P stage reusing its rows count as one) and runs the T stages
after it. Inside a phase the vertices are processed in *bins* (G3 §5.1): for a bin,
the stage inputs are loaded (its rows and its in-neighbours' rows, local or
pushed), its stages run, and its output rows go to the peers that read them.
``schedule.bins.build_schedule`` fixes the bins, their order, and the exchange round
every row travels in, from the graph and the partition alone, so every worker
knows what arrives when (G3 §5.3). Each worker bins its own part from its vertices'
in-edges, and learns when the rows it reads are pushed through a few collectives at
setup, so a worker may hold only its part (a per-part shard):

- bins follow the priority list (BFS order, boundary vertices first) and hold at
  most half the device budget (``bin_memory``) over a vertex's input + output bytes
  of that phase, or ``bin_size`` vertices;
- each bin's output is pushed in its own round as soon as it is computed
  (per-bin asynchronous all-to-all-v, the same rounds on every worker);
- eager computation (inter-layer pipeline): a receiver computes a bin as soon as the
  rounds it reads from have arrived, ready bins first;
- prefetch (intra-layer pipeline): the next bin's inputs are loaded while the
  current one is computed (a side CUDA stream on GPU, a loader thread on CPU);
- ``sequential`` turns it all off: bins in vertex-id order, one blocking exchange
  per phase after its last bin.

The backward walks the phases and bins in reverse, each bin's stages
differentiated on their own (``torch.autograd.grad`` on the graph kept from the
forward), pushing a remote row's gradient in the round of the last bin that reads
it. Every schedule computes the same sums as the single-process executor, only in
another order: the results match it to float tolerance.

Pieces: ``p2p_plan`` builds the phases, bins and links (each link round an
``ExchangeTable`` from ``schedule.links``), ``p2p_run`` runs the forward and
``p2p_backward`` the backward; every push is a ``comm.halo`` exchange
(``start_fetch`` forward, ``start_return`` backward), the same mechanism as the
data-parallel halo fetch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fullgraph.comm.group import Comm
from fullgraph.fields import option
from fullgraph.graph.data import Dataset
from fullgraph.memory import parse_bytes
from fullgraph.models.stages import StageProgram, propagation_inputs
from fullgraph.models.walk import out_dim
from fullgraph.parallel.base import LocalResult, Work, feature_rows, register
from fullgraph.parallel.p2p_backward import Backward
from fullgraph.parallel.p2p_plan import (
    P2PPlan,
    build_phases,
    phase_bounds,
    plan_to_device,
    reduce_max,
)
from fullgraph.parallel.p2p_run import Forward
from fullgraph.parallel.rowplan import plan_rows, stage_weights
from fullgraph.parallel.rows import (
    RowPartitioned,
    check_shard_rows,
    partition_book,
    whole_edge_ids,
)
from fullgraph.schedule.bins import SCHEDULES, bin_limit, build_schedule

RAM_SHARE = 4
"""Without a device or a given bin size, a worker's bins may use 1 / (RAM_SHARE x the
workers on its host) of the RAM available at setup: one bin per phase on graphs that
fit, which on one host ran faster than G3's 5,000-vertex bins (the pipeline has no
slow link to hide; each bin costs an exchange round)."""


# ---------------------------------------------------------------- the strategy
@register
class P2PParallel(RowPartitioned[P2PPlan]):
    """G3 hybrid parallelism: row partitions, peer-to-peer pushes, bins, pipelines."""

    name = "p2p"
    section = "p2p"
    flags = {"schedule": "p2p-schedule"}

    @dataclass(frozen=True, kw_only=True)
    class Options:
        """Options of P2P (G3) execution.

        Attributes:
            schedule: ``multi-level`` (inter- and intra-layer pipelines),
                ``inter-layer``, ``intra-layer`` or ``sequential`` (G3 Fig. 17)
                (default: ``multi-level``).
            bin_memory: device memory for bins, e.g. ``"2GB"``: a bin of phase k holds
                half of it over a vertex's input + output bytes (G3 §5.3 step 2)
                (default: None, then ``bin_size``).
            bin_size: vertices per bin when no ``bin_memory`` is given (default: None:
                from the free memory of the CUDA device, or on CPU from a share of the
                available RAM, ``RAM_SHARE``; the smallest over the workers).
        """

        schedule: str = option("multi-level", "which pipelines overlap communication with "
                               "compute (G3 Fig. 17)", choices=SCHEDULES)
        bin_memory: str | None = option(None, "memory for a bin's rows (the device's, or "
                                        "RAM on the CPU), e.g. 4GB; not with --bin-size; "
                                        "unset: see --bin-size")
        bin_size: int | None = option(None, "vertices per bin; unset: from free device "
                                      "memory on cuda, else from available RAM (one bin "
                                      "when the graph fits; set it to pipeline over a "
                                      "slow link)")

        def __post_init__(self) -> None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"p2p schedule {self.schedule!r}; expected one of "
                                 f"{', '.join(SCHEDULES)}")
            if self.bin_memory is not None:
                parse_bytes(self.bin_memory)  # raises on a bad size
            if self.bin_size is not None and self.bin_size < 1:
                raise ValueError(f"bin_size must be >= 1, got {self.bin_size}")
            if self.bin_size is not None and self.bin_memory is not None:
                raise ValueError("give bin_memory or bin_size, not both: the memory decides "
                                 "how many vertices a bin holds")

    options: Options

    # ------------------------------------------------------------------ setup
    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        super().check_launch(program, num_nodes, workers)
        if program.reduces_rows:
            raise ValueError(f"strategy p2p cannot run model {program.name!r} with "
                             "statistics over all rows (batch normalisation, reduces_rows): "
                             "p2p computes T stages in bins of rows, and the statistics need "
                             "all rows at once; use strategy single, data, tensor or task")

    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> P2PPlan:
        self.check_launch(program, dataset.graph.num_nodes,
                          1 if comm is None else comm.world_size)
        if comm is None:
            from fullgraph.comm.group import single_comm

            comm = single_comm()
        shard = dataset.shard  # a per-part shard: this worker's rows and their in-edges
        graph, norms = propagation_inputs(program, dataset.graph, dtype,
                                          None if shard is None else shard.in_degree)
        book = partition_book(dataset, comm, self.partition)
        owned = book.part_to_gids(comm.rank)
        fetch = torch.ones(graph.num_dst, dtype=torch.bool)  # every remote row is pushed
        rows = plan_rows(program, graph, owned, fetch, owner=book.part_of)
        check_shard_rows(shard, rows, "p2p")
        bounds = phase_bounds(program, rows.shares_halo)
        mode = SCHEDULES[self.options.schedule]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        limits = [self._limit(program, a, b, itemsize, device, comm) for a, b in bounds]
        if comm.world_size > 1:  # one bin size on every worker: the tightest
            from fullgraph.comm.primitives import all_gather_object

            limits = [min(per) for per in zip(*all_gather_object(limits, comm, "setup"))]
        # each worker bins its own part from its vertices' in-edges and learns from the
        # others when the rows it reads are pushed (the same schedule as from the whole
        # graph, which no worker needs)
        schedule = build_schedule(graph, book.part_of, comm.world_size, limits, mode,
                                  parts=[comm.rank], reduce_max=reduce_max(comm))
        phases = build_phases(program, graph, book, rows, bounds, schedule, comm)
        if shard is not None:  # dropout keys of edges: their ids in the whole graph
            ids = whole_edge_ids(graph, shard.in_degree, program.self_loops)
            for ph in phases:
                for b in ph.bins:
                    if b.eids is not None:
                        b.eids = ids[b.eids]
        weights, _ = stage_weights(program, rows, norms, torch.device("cpu"))
        plan = P2PPlan(
            **self.owned_targets(dataset, owned, device), comm=comm, graph=graph, book=book,
            rows=rows, features=feature_rows(dataset.data, owned, program, dtype, device),
            phases=phases,
            weights=[None if w is None else w.to(device) for w in weights], mode=mode,
            schedule=self.options.schedule, limits=limits, shard=shard)
        if device.type != "cpu":
            plan_to_device(plan, device)
        return plan

    def _limit(self, program: StageProgram, start: int, stop: int, itemsize: int,
               device: torch.device, comm: Comm) -> int:
        """Vertices per bin of phase [start, stop): from ``bin_memory``, else
        ``bin_size``, else this worker's share of a CUDA device's free memory, else its share
        of the available RAM (``RAM_SHARE``)."""
        opts = self.options
        in_dim = program.stages[start].in_dim
        width = out_dim(program, start, stop)
        if opts.bin_memory is not None:
            return bin_limit(parse_bytes(opts.bin_memory), in_dim, width, itemsize)
        if opts.bin_size is not None:
            return opts.bin_size
        if device.type == "cuda":
            from fullgraph.comm.group import gpu_share

            return bin_limit(gpu_share(device, comm), in_dim, width, itemsize)
        from fullgraph.memory import ram_per_worker

        return bin_limit(ram_per_worker(comm.world_size) // RAM_SHARE, in_dim, width, itemsize)

    # ---------------------------------------------------------------- execute
    def forward(self, model: StageProgram, plan: P2PPlan, *, training: bool,
                seed: int) -> LocalResult:
        params = [p for p in model.parameters() if p.requires_grad]
        run = P2PRun(model, plan, seed, training)
        if torch.is_grad_enabled() and params:
            logits = _P2PFunction.apply(run, *params)
        else:
            logits = run.forward(keep=False)
        return LocalResult(logits, plan.rows.owned)

    def describe(self, model: StageProgram, plan: P2PPlan) -> list[str]:
        spans = " | ".join(f"{ph.start}-{ph.stop - 1}" for ph in plan.phases)
        largest = int(plan.book.part_sizes().max())  # a limit above every part's rows: one
        limits = "/".join(str(n) if n < largest else "all" for n in plan.limits)  # bin each
        rounds = "/".join(str(ph.rounds) for ph in plan.phases)
        source = self.partition_source(plan.shard)
        line = (f"p2p      schedule {plan.schedule}, {source}; phases (stages) {spans}; "
                f"vertices per bin at most {limits}; exchange rounds per phase {rounds}")
        return [line]

    def work(self, model: StageProgram, plan: P2PPlan) -> Work:
        edges = dims = 0
        for s, block in enumerate(plan.rows.blocks):
            if block is not None:
                edges += block.graph.num_edges
                dims += block.graph.num_edges * model.stages[s].in_dim
        return Work(edges, 0, dims)


class P2PRun:
    """One forward (and backward) of the program over phases and bins."""

    def __init__(self, model: StageProgram, plan: P2PPlan, seed: int, training: bool) -> None:
        self.model, self.plan = model, plan
        self._forward = Forward(model, plan, seed, training)

    def forward(self, keep: bool) -> Tensor:
        """The output rows; with ``keep`` each bin's autograd graph is kept."""
        return self._forward.run(keep)

    def backward(self, grad_logits: Tensor, params: list[torch.nn.Parameter]) -> list[Tensor]:
        """Gradients of ``params`` (this worker's share) from the output gradient."""
        return Backward(self.model, self.plan, self._forward.saved, params).run(grad_logits)


class _P2PFunction(torch.autograd.Function):
    """The whole program as one autograd node: forward and backward run the schedule."""

    @staticmethod
    def forward(ctx: Any, run: P2PRun, *params: Tensor) -> Tensor:
        ctx.run = run
        ctx.params = params
        return run.forward(keep=True)

    @staticmethod
    def backward(ctx: Any, grad_logits: Tensor) -> tuple[Any, ...]:
        grads = ctx.run.backward(grad_logits.contiguous(), list(ctx.params))
        ctx.run = None
        return (None, *grads)
