"""The planner's driver: rates measured here, every candidate priced, a recommendation.

``plan_run(cfg, dataset)`` prices every candidate of ``fullgraph.plan.CANDIDATES``
for ``cfg``'s dataset, model and worker count; ``table_lines`` prints it and
``resolve_auto`` gives ``--strategy auto`` its concrete strategy. The memory a
worker process needs besides the strategy's own is the interpreter and libraries
(this process's resident size before the dataset was loaded) plus the whole dataset
(every worker loads it); a strategy fits when that plus its total stays within the
RAM per worker, and its device part within ``--device-memory`` when one is given.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from fullgraph import plan as P
from fullgraph.comm.placement import even_counts
from fullgraph.errors import ConfigError
from fullgraph.fields import changed_fields
from fullgraph.graph.data import Dataset
from fullgraph.graph.sparse import density, is_sparse, nbytes
from fullgraph.launch import threads_per_worker
from fullgraph.memory import available_ram, parse_bytes
from fullgraph.models import build_model
from fullgraph.models.stages import StageProgram, propagation_inputs
from fullgraph.models.walk import describe, reads_sparse
from fullgraph.parallel import costmodel, taskmodel
from fullgraph.partition import PartitionBook, partition
from fullgraph.plan_measure import (
    candidate_config,
    executor_overheads,
    plan_rates,
    rss_bytes,
    run_overrides,
    tiny_dataset,
    tiny_run,
    worker_threads,
    workload_seconds,
)
from fullgraph.plan_probe import RING_PER_WORKER, probe
from fullgraph.runlog import fmt_bytes


@dataclass
class Estimate:
    """One candidate priced: per-worker costs, the epoch, whether it fits."""

    candidate: P.Candidate
    costs: list[P.RankCost]
    seconds: float
    fits: bool = True
    why_not: str = ""
    kept: str = ""
    """Hybrid: the mode its setup trial is predicted to keep (``_price_the_trial``)."""
    refused: bool = False
    """The strategy refuses the run (``refusals``): never probed, its time not shown."""
    split: taskmodel.TaskSplit | None = None
    """Task parallelism: the T:P split priced (the one the run takes where it is given,
    else the one its model chooses from the rates measured here)."""

    @property
    def peak(self) -> P.RankCost:
        return max(self.costs, key=lambda c: c.total)

    @property
    def bytes_moved(self) -> int:
        return max(c.bytes_moved for c in self.costs)


@dataclass
class PlanResult:
    """Every candidate, the recommendation and the facts it rests on."""

    estimates: list[Estimate]
    recommended: Estimate
    rates: P.PlanRates
    process_bytes: int
    ram_per_worker: int
    device_budget: int | None
    workers: int
    unpriced: str = ""
    """The options given that the prices leave out (``unpriced``), as a line; "" none."""


TASK_UNPRICED = ("group_parallel", "pieces", "recompute", "subgraphs", "chunks",
                 "device_memory")
"""Task parallelism's options the task row leaves out (it prices the split alone)."""


def unpriced(cfg: Any) -> str:
    """The options given that no price follows: ``--adapt`` and ``--inject`` (every
    strategy is priced without them), ``--dep-mode`` (each data row is one mode), the
    task form's (``TASK_UNPRICED``), tensor parallelism's uneven shares and column
    split, the overlap of pipelines and bins, and a GPU (timed at the CPU's rates)."""
    adapt, left = cfg.section("adapt"), []
    if adapt.mode != "off":
        left.append(f"--adapt {adapt.mode}")
    if adapt.inject:
        left.append("--inject")
    if changed_fields(cfg.options["data_parallel"], among=("mode",)):
        left.append("--dep-mode (each data row is priced in its own mode)")
    task = changed_fields(cfg.options["task_parallel"], among=TASK_UNPRICED)
    if task:  # (the task row is the column-split form, hand-offs whole, as the split gives)
        from fullgraph.configfile import flag_names

        opts, flags = cfg.options["task_parallel"], flag_names()
        given = [f"--{flags.get(('task_parallel', f), f.replace('_', '-'))}" + (
            "" if getattr(opts, f) is True else f" {getattr(opts, f)}") for f in task]
        left.append(f"{', '.join(given)} (the task row prices the column-split P group and "
                    "whole hand-offs)")
    tp, pp = cfg.options["tensor_parallel"], cfg.options["p2p"]
    if tp.shares:
        left.append(f"--shares {tp.shares} (tensor is priced with even shares)")
    if tp.column_split != "balanced":
        left.append(f"--column-split {tp.column_split} (tensor is priced with the balanced "
                    "split)")
    overlap = [flag for flag, given in (("--pipeline", tp.pipeline),
                                        ("--p2p-schedule", pp.schedule != "multi-level"),
                                        ("--bin-size", pp.bin_size is not None),
                                        ("--bin-memory", pp.bin_memory is not None)) if given]
    if overlap:
        left.append(f"{', '.join(overlap)} (the times leave out overlap and bins)")
    if cfg.train.on_gpu:
        left.append("the GPU (the times use this host's CPU rates and link; memory is the "
                    "device's)")
    return f"not priced: {', '.join(left)}; the rows are the strategies without them" \
        if left else ""


def _program(dataset: Dataset, cfg: Any) -> StageProgram:
    return build_model(cfg.model.name, dataset.data.num_features, cfg.model.hidden,
                       dataset.data.num_classes, **cfg.model.build_options())


def _book(cfg: Any, dataset: Dataset, workers: int) -> PartitionBook:
    opts = cfg.options["partition"]
    if opts.file:
        book = PartitionBook.load(opts.file, num_nodes=dataset.graph.num_nodes)
        if book.num_parts != workers:  # (as train refuses it)
            raise ConfigError(f"partition.file: {opts.file} has {book.num_parts} parts but "
                              f"there are {workers} workers")
        return book
    return partition(dataset.graph, workers, opts.method, seed=opts.seed)


def price(cfg: Any, dataset: Dataset, rates: P.PlanRates,
          per_candidate: dict[str, P.PlanRates] | None = None) -> list[Estimate]:
    """Every candidate for ``cfg.launch.workers`` workers (task needs 2 or more; one
    worker: ``single``), timed with ``per_candidate[label]`` where given, else ``rates``."""
    workers = cfg.launch.workers
    program = _program(dataset, cfg)
    graph, _ = propagation_inputs(program, dataset.graph)
    book = _book(cfg, dataset, workers) if workers > 1 else PartitionBook.from_assignment(
        torch.zeros(graph.num_dst, dtype=torch.int64), 1)
    out = []
    for cand in candidates(workers):
        costs, split = _costs(cfg, cand, program, graph, book, rates,
                              features_of(dataset, program))
        timed = (per_candidate or {}).get(cand.label, rates)
        out.append(Estimate(cand, costs, P.epoch_seconds(cand.label, costs, timed, split),
                            split=split))
    return out


def features_of(dataset: Dataset, program: StageProgram) -> P.Features:
    """How the run will hold ``dataset``'s features for ``program``: CSR where they are
    stored sparse (``--sparse-features``) and the model's first layer reads them so
    (``reads_sparse``), else dense."""
    x = dataset.data.features  # (held in the run's dtype whatever --feature-dtype stored)
    if is_sparse(x) and reads_sparse(program):
        return P.Features(int(x.shape[1]), density(x), True)
    return P.Features(int(x.shape[1]))


def candidates(workers: int) -> list[P.Candidate]:
    return [P.Candidate("single", "single")] if workers == 1 else list(P.CANDIDATES)


def budget_chunks(cfg: Any, cand: P.Candidate, program: StageProgram, graph: Any,
                  workers: int) -> list[list[tuple[int, int]]]:
    """The chunks a tensor-parallel run of ``cand`` cuts to ``--device-memory`` on
    ``graph`` (the program's, ``propagation_inputs``), as the run's setup cuts them
    (``TensorParallel.chunk_ranges``, even rows).

    Raises:
        ValueError: the budget cannot hold one vertex with its in-edges.
    """
    from fullgraph.parallel import build_strategy
    from fullgraph.parallel.tensor import TensorParallel

    with warnings.catch_warnings():  # (options that do not apply to the candidate)
        warnings.simplefilter("ignore")
        strategy = build_strategy(candidate_config(cfg, cand))
    assert isinstance(strategy, TensorParallel), cand.label
    widest = max((P.column_slice(int(s.in_dim), workers)
                  for i, s in zip(describe(program), program.stages) if i.is_propagate),
                 default=1)
    opts = cfg.options["tensor_parallel"]
    prefetch = opts.prefetch and not opts.pipeline and cfg.train.on_gpu
    return strategy.chunk_ranges(graph.indptr, even_counts(graph.num_dst, workers), widest,
                                 4, prefetch)


def refusals(cfg: Any, dataset: Dataset) -> dict[str, str]:
    """Per candidate whose strategy refuses this model, graph or worker count before a
    launch (``Strategy.check_launch``: p2p and batch normalisation, say), or, tensor
    parallelism, a ``--device-memory`` that cannot hold one vertex, its reason, or that
    does not take the run's ``--adapt``, or whose overrides the run's options refuse
    (chunks with ``--spill-dir``). The planner neither runs nor recommends them."""
    from fullgraph.adapt import check_strategy
    from fullgraph.parallel import build_strategy

    workers = cfg.launch.workers
    program = _program(dataset, cfg)
    budgeted = device_budget(cfg) is not None
    graph = propagation_inputs(program, dataset.graph)[0] if budgeted else None
    out = {}
    for cand in candidates(workers):
        try:
            with warnings.catch_warnings():  # (options that do not apply to the candidate)
                warnings.simplefilter("ignore")
                # (its overrides may clash with the run's own: tensor/chunks and
                # --spill-dir, refused together)
                run = candidate_config(cfg, cand)
                strategy = build_strategy(run)
            if workers > 1:  # --adapt on a strategy it does not work on
                check_strategy(run)
            strategy.check_launch(program, dataset.graph.num_nodes, workers)
            if cand.strategy == "tensor" and graph is not None:
                budget_chunks(cfg, cand, program, graph, workers)
        except ValueError as err:
            out[cand.label] = str(err)
    return out


def measured_rates(cfg: Any, dataset: Dataset, rates: P.PlanRates,
                   skip: frozenset[str] = frozenset()
                   ) -> tuple[P.PlanRates, dict[str, P.PlanRates]]:
    """``rates`` with what is measured by running the executors: the calibration of each
    candidate's graph work (``calibration``; the base rates get the median), and for
    several workers the probe's slowdown of workers sharing this machine, its cost of
    a received byte and of an exchange round; per candidate, its fixed cost per epoch
    -- at the real worker count by ``plan_probe`` (falling back to one process, with a
    warning, if its workers fail), in this process for one worker. The candidates
    labelled in ``skip`` (``refusals``) are not run."""
    feat, classes = dataset.data.num_features, dataset.data.num_classes
    workers = cfg.launch.workers
    cands = [c for c in candidates(workers) if c.label not in skip]
    factors, ring_epochs = _calibrate(cfg, dataset, rates, cands)
    bounded = tuple(label for label, f in factors.items() if f in CALIBRATION_BOUNDS)
    rates = replace(rates, calibration=statistics.median(factors.values()), disagreed=bounded)
    if workers > 1:
        try:
            measured = probe(cfg, [c.label for c in cands], feat, classes)
        except RuntimeError as err:
            warnings.warn(f"{err}; the plan's fixed costs are measured in one process instead")
        else:
            with _as_worker(cfg):
                alone = workload_seconds()
            rates = replace(rates, slowdown=max(1.0, measured.workload / alone),
                            byte=measured.byte or rates.byte, worker_bytes=measured.peak)
            ring = tiny_dataset(feat, classes, RING_PER_WORKER * workers)
            program = _program(ring, cfg)
            graph, _ = propagation_inputs(program, ring.graph)
            opts = cfg.options["partition"]
            book = partition(ring.graph, workers, opts.method, seed=opts.seed)
            rounds = {c.label: max(r.rounds for r in _costs(cfg, c, program, graph, book,
                                                               rates, feat)[0]) for c in cands}
            rates = replace(rates, latency=max(rates.latency,
                                               round_seconds(measured.fixed, rounds)))
            return rates, {c.label: replace(rates, overhead=0.0, fixed=measured.fixed[c.label],
                                            rounds_paid=rounds[c.label],
                                            calibration=factors[c.label]) for c in cands}
    overhead = ring_epochs  # one worker: its epoch on the ring, timed by the calibration
    if overhead is None:
        with _as_worker(cfg):
            overhead = executor_overheads(cfg, cands, feat, classes)
    return rates, {c.label: replace(rates, overhead=overhead[c.label],
                                    calibration=factors[c.label]) for c in cands}


def round_seconds(fixed: dict[str, float], rounds: dict[str, int]) -> float:
    """What one exchange round costs the launched workers: the probe's DepComm epoch
    against its DepCache epoch (the same program on the same ring, DepComm adds the
    halo rounds), per extra round; 0 where that cannot be read (no extra rounds, or a
    noisy probe that timed DepComm faster)."""
    comm, cache = "data/depcomm", "data/depcache"
    extra = rounds.get(comm, 0) - rounds.get(cache, 0)
    if comm not in fixed or cache not in fixed or extra <= 0:
        return 0.0
    return max(0.0, fixed[comm] - fixed[cache]) / extra


def _worker_threads(cfg: Any) -> int:
    """The threads each worker of ``cfg`` runs with, as the launcher gives them."""
    return cfg.runtime.threads or threads_per_worker(cfg.launch.workers)


def _as_worker(cfg: Any) -> Any:
    """This process computing as ``cfg``'s workers will: their thread count and SpMM
    backend."""
    return worker_threads(_worker_threads(cfg), cfg.runtime.spmm_backend)


CALIBRATE_MAX_S = 5.0
"""The longest the planner spends on the calibration epochs (predicted, all candidates)."""


def calibration(cfg: Any, dataset: Dataset, rates: P.PlanRates,
                cands: list[P.Candidate] | None = None) -> dict[str, float]:
    """Per candidate (default: ``single``), its measured epoch on the whole graph in one
    process over the predicted graph work of a single-process epoch
    (``PlanRates.calibration``), at the thread count and SpMM backend each worker gets.
    It scales the counted work to what the candidate's executor does with it: what the
    counts leave out (dropout's random numbers, activations, the loss) and the
    executor's own per-row work (p2p's pieces, tensor parallelism's chunks). 1.0 for
    all (with a warning) when those epochs would take over ``CALIBRATE_MAX_S``
    together, or half the RAM."""
    return _calibrate(cfg, dataset, rates, cands)[0]


CALIBRATION_BOUNDS = (0.25, 20.0)
"""The calibration factor's bounds: an epoch measured beyond them against the counted
work says more of the machine's load while measuring than of the strategy."""


def _calibrate(cfg: Any, dataset: Dataset, rates: P.PlanRates,
               cands: list[P.Candidate] | None = None
               ) -> tuple[dict[str, float], dict[str, float] | None]:
    """``calibration``, and per candidate its epoch on the tiny ring in this process
    (what ``executor_overheads`` measures; None where the calibration was skipped)."""
    cands = cands or [P.Candidate("single", "single")]
    program = _program(dataset, cfg)
    graph, _ = propagation_inputs(program, dataset.graph)
    one = PartitionBook.from_assignment(torch.zeros(graph.num_dst, dtype=torch.int64), 1)
    single = P.data_cost(program, graph, P.data_rows(program, graph, one, 0, "depcomm",
                                                     costmodel.Rates(1.0, 1.0, 1.0)),
                         1, features_of(dataset, program))
    predicted = P.graph_seconds(single, rates)
    if 4 * len(cands) * predicted * rates.slowdown > CALIBRATE_MAX_S or \
            rss_bytes() + len(cands) * single.total > available_ram() // 2:
        warnings.warn("the plan's compute rates are not calibrated: one epoch of this graph "
                      "per strategy in one process would take too long or too much memory")
        return {c.label: 1.0 for c in cands}, None
    with _as_worker(cfg):
        epochs = _epochs_here(cfg, cands, dataset)
    low, high = CALIBRATION_BOUNDS
    return ({label: min(high, max(low, (real - ring) / max(predicted, 1e-9)))
             for label, (real, ring) in epochs.items()},
            {label: ring for label, (_, ring) in epochs.items()})


def _epochs_here(cfg: Any, cands: list[P.Candidate], dataset: Dataset,
                 rounds: int = 3) -> dict[str, tuple[float, float]]:
    """Per candidate, (seconds of one epoch on ``dataset`` in this process, the same on
    the tiny ring): the least of ``rounds`` rounds that time every run in turn, so that
    a load spike hits one round, not one run."""
    ring = tiny_dataset(dataset.data.num_features, dataset.data.num_classes)
    runs = {(c.label, i): tiny_run(cfg, c, data)
            for c in cands for i, data in enumerate((dataset, ring))}
    for run in runs.values():
        run(0)  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    for step in range(1, rounds + 1):
        for key, run in runs.items():
            best[key] = min(best[key], _timed(run, step))
    return {c.label: (best[c.label, 0], best[c.label, 1]) for c in cands}


def _timed(fn: Any, arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def _costs(cfg: Any, cand: P.Candidate, program: StageProgram, graph: Any,
           book: PartitionBook, rates: P.PlanRates,
           feat: int | P.Features) -> tuple[list[P.RankCost], taskmodel.TaskSplit | None]:
    """Every worker's costs under ``cand`` (and task parallelism's split)."""
    workers = book.num_parts
    if cand.strategy in ("data", "p2p", "single"):
        mode = cand.overrides.get("data_parallel", {}).get("mode", "depcomm")
        # the hybrid mode's own cost model times its aggregation at 32 columns
        at32 = max(rates.edge, rates.edge_min / 32)
        given = cfg.options["data_parallel"]  # --byte-cost and the others, as the run
        dep_rates = costmodel.Rates(  # takes them, where given
            rates.byte if given.byte_cost is None else given.byte_cost,
            at32 if given.edge_cost is None else given.edge_cost,
            rates.flop * 64 if given.vertex_cost is None else given.vertex_cost)
        plans = [P.data_rows(program, graph, book, r, mode, dep_rates) for r in range(workers)]
        served = P.served_rows(plans, book)
        return [P.data_cost(program, graph, plans[r], workers, feat, served=served[r])
                for r in range(workers)], None
    if cand.strategy == "tensor":
        chunks = cand.overrides.get("tensor_parallel", {}).get(
            "num_chunks", cfg.options["tensor_parallel"].num_chunks)  # the run's, as given
        if device_budget(cfg) is not None:  # the run cuts its chunks to the budget
            try:
                chunks = len(budget_chunks(cfg, cand, program, graph, workers))
            except ValueError:  # refused (``refusals``): priced as one chunk
                chunks = 1
        return [P.tensor_cost(program, graph, r, workers, feat, chunks)
                for r in range(workers)], None
    machine = taskmodel.Machine(1.0 / rates.flop, rates.bandwidth)
    t, p = taskmodel.predict_times(program, graph.num_dst, graph.num_edges, machine,
                                   cfg.options["task_parallel"].gamma)
    from fullgraph.parallel.task import TaskParallel

    task = TaskParallel(cfg.options["task_parallel"])  # (its options as given: no warnings)
    # the split given, else the sizes the run's own choice takes (its chunk grid)
    try:
        split = taskmodel.parse_split(task.options.split, workers)
    except ValueError:  # refused (``refusals``): priced as the automatic split
        split = None
    split = split or taskmodel.choose_split(workers, t, p, task.p_group_fits)
    return P.task_costs(program, graph, workers, feat, split), split


def device_budget(cfg: Any) -> int | None:
    text = cfg.options["tensor_parallel"].device_memory
    return parse_bytes(text) if text else None


def plan_run(cfg: Any, dataset: Dataset, *, base_rss: int | None = None,
             rates: P.PlanRates | None = None, overheads: bool = True) -> PlanResult:
    """Price every candidate, mark the ones that do not fit, recommend the fastest
    (rates measured here unless given; unless ``overheads`` is False, the executors are
    also run to measure what the counts cannot give, see ``measured_rates``)."""
    from fullgraph.adapt import check_general

    workers = cfg.launch.workers
    if workers > 1:  # what no candidate could run, refused here rather than marked NO
        check_general(cfg, workers)
    rates = rates or plan_rates(dataset.graph, workers, _worker_threads(cfg),
                                cfg.runtime.spmm_backend)
    per_candidate = None
    refused = refusals(cfg, dataset)
    if len(refused) == len(candidates(workers)):  # options no strategy takes: not memory
        reasons: dict[str, list[str]] = {}
        for label, why in refused.items():
            reasons.setdefault(why, []).append(label)
        raise ConfigError("no strategy can run these options: " + "; ".join(
            f"{', '.join(labels)}: {why}" for why, labels in reasons.items()))
    if overheads:
        rates, per_candidate = measured_rates(cfg, dataset, rates, frozenset(refused))
    estimates = price(cfg, dataset, rates, per_candidate)
    # a launched worker's own size where the probe measured it, else this process's
    base = max(base_rss if base_rss is not None else rss_bytes(), rates.worker_bytes)
    process = base + dataset_bytes(dataset)
    ram = available_ram() // workers
    budget = device_budget(cfg)
    limit = budget if cfg.train.on_gpu else None  # on the CPU it only cuts tensor chunks
    for e in estimates:
        _mark_fit(e, process, ram, limit)
    if cfg.launch.workers > 1 and cfg.options["data_parallel"].measures_costs:
        hybrid = _price_the_trial(estimates)
        if hybrid is not None:
            _mark_fit(hybrid, process, ram, limit)
    for e in estimates:
        if e.candidate.label in refused:
            e.fits, e.why_not, e.refused = False, refused[e.candidate.label], True
    fitting = [e for e in estimates if e.fits] or \
        [e for e in estimates if e.candidate.label not in refused] or estimates
    best = min(fitting, key=lambda e: e.seconds)
    return PlanResult(estimates, best, rates, process, ram, budget, workers, unpriced(cfg))


def _mark_fit(e: Estimate, process: int, ram: int, budget: int | None) -> None:
    """Whether ``e`` fits the RAM per worker and (``budget``: the device memory a GPU run
    was given) the device. Tensor parallelism is not held to the budget: it cuts its
    propagation into chunks within it, its rows beside them, as ``train`` does."""
    peak = e.peak
    e.fits, e.why_not = True, ""
    if process + peak.total > ram:
        e.fits, e.why_not = False, f"needs {fmt_bytes(process + peak.total)} of RAM per worker"
    elif budget is not None and e.candidate.strategy != "tensor" \
            and max(c.device for c in e.costs) > budget:
        e.fits, e.why_not = False, f"needs {fmt_bytes(peak.device)} of device memory"


def _price_the_trial(estimates: list[Estimate]) -> Estimate | None:
    """Hybrid with measured rates times its cost model's split and the two pure modes
    at setup and trains with the fastest (pure DepCache only where its replicas fit):
    its epoch and bytes are the fastest of the three as priced here, its memory the
    most any of them needs (the trial holds each in turn). Returns the hybrid estimate
    (None where there is none)."""
    by_label = {e.candidate.label: e for e in estimates}
    hybrid = by_label.get("data/hybrid")
    if hybrid is None:
        return None
    tried = [hybrid] + [by_label[label] for label in ("data/depcomm", "data/depcache")
                        if label in by_label and by_label[label].fits]
    kept = min(tried, key=lambda e: e.seconds)
    hybrid.costs = [replace(cost, memory={c: max(e.costs[rank].memory[c] for e in tried)
                                          for c in cost.memory})
                    for rank, cost in enumerate(kept.costs)]
    hybrid.seconds = kept.seconds
    hybrid.kept = kept.candidate.label.split("/")[-1]
    return hybrid


def dataset_bytes(dataset: Dataset) -> int:
    d = dataset.data
    return int(dataset.graph.nbytes() + nbytes(d.features)
               + d.labels.numel() * d.labels.element_size() + 3 * d.num_nodes)


def table_lines(result: PlanResult) -> list[str]:
    """The table (the largest worker's memory per category), the fit, the choice."""
    head = (f"{'strategy':<14}" + "".join(f"{c:>13}" for c in P.CATEGORIES)
            + f"{'total':>11}{'recv/epoch':>13}{'epoch':>10}  fits")
    lines = [f"per worker of {result.workers} (the largest); each worker process also holds "
             f"{fmt_bytes(result.process_bytes)} (interpreter, libraries, the dataset); RAM per "
             f"worker {fmt_bytes(result.ram_per_worker)}"
             + (f", device budget {fmt_bytes(result.device_budget)}"
                if result.device_budget else "")
             + "; recv/epoch: the most bytes one worker receives in an epoch", head]
    for e in result.estimates:
        peak = e.peak
        mark = "yes" if e.fits else f"NO: {e.why_not}"
        if e.kept and e.kept != "hybrid":
            mark += f" (its setup trial keeps {e.kept})"
        if e.split is not None:
            mark += f" (T:P {e.split.num_t}:{e.split.num_p})"
        lines.append(f"{e.candidate.label:<14}" + "".join(f"{fmt_bytes(peak.memory[c]):>13}"
                                                        for c in P.CATEGORIES)
                     + f"{fmt_bytes(peak.total):>11}{fmt_bytes(e.bytes_moved):>13}"
                     + (f"{'-':>10}" if e.refused else f"{e.seconds * 1e3:>8.1f}ms")
                     + f"  {mark}")
    r = result.rates
    lines.append(f"rates: edge x column {r.edge:.3g} s (at least {r.edge_min:.3g} s per edge), "
                 f"GEMM flop {r.flop:.3g} s, byte "
                 f"{r.byte:.3g} s, round {r.latency:.3g} s, cores shared x{r.slowdown:.2f}, "
                 f"graph work x{r.calibration:.2f} " + (
                     "(median over the strategies; one epoch of each measured here)"
                     if r.calibration != 1.0 else "(not calibrated: the counts as they are)")
                 + (f", {r.busy:.1f} cores busy with other processes while measuring"
                    if r.busy is not None else ""))
    if r.disagreed or (r.busy or 0.0) >= 0.5:
        why = [f"other processes kept {r.busy:.1f} cores busy"] if (r.busy or 0) >= 0.5 \
            else []
        if r.disagreed:
            why.append(f"the measured epoch of {', '.join(r.disagreed)} and its counted work "
                       "disagreed beyond the calibration's bounds, x0.25 to x20")
        lines.append(f"unreliable times: {'; '.join(why)}: the times are a hint; plan again "
                     "on a quiet machine")
    lines += explain(result)
    return lines + ([result.unpriced] if result.unpriced else [])


def explain(result: PlanResult, *, under_table: bool = True) -> list[str]:
    """Two lines: what is recommended and why (``under_table``: below the plan's table,
    whose NO rows they point at)."""
    above = " (see NO above)" if under_table else ""
    best = result.recommended
    budget = result.device_budget is not None
    others = sorted((e for e in result.estimates
                     if e is not best and e.fits and not _same_run(e, best, budget)),
                    key=lambda e: e.seconds)
    nxt = (f"{others[0].candidate.label} next at {others[0].seconds * 1e3:.1f} ms"
           if others else "the only one on 1 worker" if result.workers == 1
           else "no other strategy fits")
    # (under the table every NO row; alone, the refused named apart with their reasons)
    skipped = [e.candidate.label for e in result.estimates
               if not e.fits and (under_table or not e.refused)]
    refused: dict[str, list[str]] = {}  # why -> the candidates it refuses
    for e in result.estimates:
        if e.refused and e is not best:
            refused.setdefault(_refusal_reason(e.why_not), []).append(e.candidate.label)
    if not best.fits:
        return [f"recommended: {best.candidate.label} "
                f"({' '.join(candidate_flags(best.candidate, budget))}), the fastest, but "
                "nothing fits",
                f"why: every strategy needs more memory than there is{above}: use a "
                "smaller model or a host with more memory per worker (more workers on this "
                "host each get less), or tensor parallelism's --spill-dir for its "
                "propagation's matrices"]
    return [f"recommended: {best.candidate.label} "
            f"({' '.join(candidate_flags(best.candidate, budget))})",
            f"why: the fastest predicted epoch that fits, {best.seconds * 1e3:.1f} ms ({nxt}); "
            f"its busiest worker receives {fmt_bytes(best.bytes_moved)} an epoch and its "
            f"largest holds {fmt_bytes(best.peak.total)}"
            + (f"; left out {'(NO above)' if under_table else 'as not fitting'}: "
               f"{', '.join(skipped)}" if skipped else "")
            + ("" if under_table or not refused else "; refused: " + "; ".join(
                f"{', '.join(labels)} ({why})" for why, labels in refused.items()))]


def _refusal_reason(why: str) -> str:
    """A refusal's reason without the candidate's own part (``...; the run uses
    'tensor'``), so that the candidates one option refuses share one line."""
    return why.split("; the run uses ")[0]


def _same_run(a: Estimate, b: Estimate, budget: bool) -> bool:
    """Whether ``a`` and ``b`` train the same way: the same flags (under a device
    budget the chunk count is left to it), or hybrid whose setup trial keeps the
    other's pure mode."""
    by_label = {c.label: c for c in P.CANDIDATES}

    def runs(e: Estimate) -> list[str]:
        kept = by_label.get(f"data/{e.kept}") if e.kept and e.kept != "hybrid" else None
        return candidate_flags(kept or e.candidate, budget)
    return runs(a) == runs(b)


def resolve_auto(cfg: Any, dataset: Dataset) -> tuple[P.Candidate, list[str], str]:
    """The candidate ``--strategy auto`` runs, the command-line flags selecting it, and
    why (the plan's reason, as ``fullgraph plan`` words it)."""
    if cfg.launch.workers == 1:
        return P.Candidate("single", "single"), ["--strategy", "single"], "one worker"
    result = plan_run(cfg, dataset)
    best = result.recommended
    cand = best.candidate
    if not best.fits:
        warnings.warn(f"--strategy auto: no strategy fits ({best.why_not} for the fastest, "
                      f"{cand.label}); running it anyway (see `fullgraph plan`)", stacklevel=2)
    why = explain(result, under_table=False)[1].removeprefix("why: ")
    return cand, candidate_flags(cand, device_budget(cfg) is not None), why


def resolve_config(cfg: Any, dataset: Dataset) -> tuple[Any, list[str], str]:
    """``cfg`` with ``--strategy auto`` replaced by the recommendation (unchanged when
    the strategy is a concrete one), the flags that select it, and why."""
    if cfg.runtime.strategy != "auto":
        return cfg, [], ""
    if dataset.shard is not None:  # shards: data parallel (the others train on them too; the
        # planner's estimates need the whole graph)
        import dataclasses

        runtime = dataclasses.replace(cfg.runtime, strategy="data")
        return dataclasses.replace(cfg, runtime=runtime), ["--strategy", "data"], \
            "per-part shards train data parallel here"
    cand, flags, why = resolve_auto(cfg, dataset)
    return candidate_config(cfg, cand), flags, why


def candidate_flags(cand: P.Candidate, device_budget: bool = False) -> list[str]:
    """The ``train`` flags that select ``cand`` (``device_budget``: the run has a
    tensor-parallel device budget, see ``run_overrides``)."""
    from fullgraph.configfile import flag_names

    names = flag_names()
    flags = ["--strategy", cand.strategy]
    for section, values in run_overrides(cand, device_budget).items():
        for key, value in values.items():
            flags += [f"--{names[section, key]}", str(value)]
    return flags
