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

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from fullgraph import plan as P
from fullgraph.graph.data import Dataset
from fullgraph.memory import parse_bytes
from fullgraph.models import build_model
from fullgraph.graph.csr import Graph
from fullgraph.models.stages import StageContext, StageProgram, propagation_inputs
from fullgraph.parallel import costmodel, taskmodel
from fullgraph.partition import PartitionBook, partition


@dataclass
class Estimate:
    """One candidate priced: per-worker costs, the epoch, whether it fits."""

    candidate: P.Candidate
    costs: list[P.RankCost]
    seconds: float
    fits: bool = True
    why_not: str = ""

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


def rss_bytes() -> int:
    """This process's resident size now (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_ram() -> int:
    """MemAvailable of /proc/meminfo (or physical memory where it is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_link(nbytes: int = 8 << 20) -> tuple[float, float]:
    """(seconds per byte, seconds per round) over a local socket pair, as local workers'
    gloo traffic moves."""
    a, b = socket.socketpair()
    payload = bytes(nbytes)

    def drain(sock: socket.socket, total: int) -> None:
        got = 0
        while got < total:
            got += len(sock.recv(1 << 20))

    def round_trip(size: int) -> float:
        reader = threading.Thread(target=drain, args=(b, size))
        reader.start()
        t0 = time.perf_counter()
        a.sendall(payload[:size])
        reader.join()
        return time.perf_counter() - t0

    try:
        round_trip(nbytes)  # warm-up
        per_byte = min(round_trip(nbytes) for _ in range(2)) / nbytes
        latency = min(round_trip(64) for _ in range(5))
    finally:
        a.close()
        b.close()
    return per_byte, latency


def measure_overhead(program: StageProgram, feat_dim: int, n: int = 16) -> float:
    """Seconds of one epoch (forward, backward, evaluation forward) of ``program`` on a
    ring of ``n`` vertices: the part of an epoch that does not grow with the graph."""
    ids = torch.arange(n)
    graph, norms = propagation_inputs(program, Graph(torch.arange(n + 1), (ids + 1) % n, n))
    x = torch.randn(n, feat_dim)
    ctx = StageContext(ids, 0, True, torch.arange(graph.num_edges))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        program(graph, norms, x, ctx).sum().backward()
        with torch.no_grad():
            program(graph, norms, x, StageContext(ids, 0, False, ctx.eids))
        best = min(best, time.perf_counter() - t0)
    program.zero_grad(set_to_none=True)
    return best


def plan_rates(graph: Graph, workers: int, program: StageProgram,
               feat_dim: int) -> P.PlanRates:
    """Rates measured here at the thread count each worker gets: aggregation, GEMM,
    the local link, the fixed per-epoch overhead; cores shared by workers."""
    from fullgraph.comm.group import single_comm

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (cores or 1) // workers))
    try:
        machine = taskmodel.measure_machine(single_comm())
        edge = costmodel.measure_edge_cost(graph)
        overhead = measure_overhead(program, feat_dim)
    finally:
        torch.set_num_threads(before)
    byte, latency = measure_link()
    return P.PlanRates(edge, 1.0 / machine.flops, byte, latency,
                       slowdown=max(1.0, workers / (cores or 1)), overhead=overhead)


def _program(dataset: Dataset, cfg: Any) -> StageProgram:
    return build_model(cfg.model.name, dataset.data.num_features, cfg.model.hidden,
                       dataset.data.num_classes, **cfg.model.build_options())


def _book(cfg: Any, dataset: Dataset, workers: int) -> PartitionBook:
    opts = cfg.options["partition"]
    if opts.file:
        return PartitionBook.load(opts.file, num_nodes=dataset.graph.num_nodes)
    return partition(dataset.graph, workers, opts.method, seed=opts.seed)


def price(cfg: Any, dataset: Dataset, rates: P.PlanRates) -> list[Estimate]:
    """Every candidate for ``cfg.launch.workers`` workers (task needs 2 or more)."""
    workers = cfg.launch.workers
    program = _program(dataset, cfg)
    graph, _ = propagation_inputs(program, dataset.graph)
    feat = dataset.data.num_features
    if workers == 1:
        return [Estimate(P.Candidate("single", "single"), [c := P.data_cost(
            program, graph, P.data_rows(program, graph, PartitionBook.from_assignment(
                torch.zeros(graph.num_dst, dtype=torch.int64), 1), 0, "depcomm"), 1, feat)],
            P.predict_seconds(c, rates))]
    book = _book(cfg, dataset, workers)
    dep_rates = costmodel.Rates(rates.byte, rates.edge, rates.flop * 64)
    out = []
    for cand in P.CANDIDATES:
        split = None
        if cand.strategy in ("data", "p2p"):
            mode = cand.overrides.get("data_parallel", {}).get("mode", "depcomm")
            costs = [P.data_cost(program, graph, P.data_rows(program, graph, book, r, mode,
                                                             dep_rates), workers, feat)
                     for r in range(workers)]
        elif cand.strategy == "tensor":
            chunks = cand.overrides.get("tensor_parallel", {}).get("num_chunks")
            costs = [P.tensor_cost(program, graph, r, workers, feat, chunks)
                     for r in range(workers)]
        else:
            machine = taskmodel.Machine(1.0 / rates.flop, 1.0 / max(rates.byte, 1e-12))
            t, p = taskmodel.predict_times(program, graph.num_dst, graph.num_edges, machine,
                                           cfg.options["task_parallel"].gamma)
            split = taskmodel.choose_split(workers, t, p)
            costs = P.task_costs(program, graph, workers, feat, split)
        out.append(Estimate(cand, costs, P.epoch_seconds(cand.label, costs, rates, split)))
    return out


def device_budget(cfg: Any) -> int | None:
    text = cfg.options["tensor_parallel"].device_memory
    return parse_bytes(text) if text else None


def plan_run(cfg: Any, dataset: Dataset, *, base_rss: int | None = None,
             rates: P.PlanRates | None = None) -> PlanResult:
    """Price every candidate, mark the ones that do not fit, recommend the fastest."""
    workers = cfg.launch.workers
    rates = rates or plan_rates(dataset.graph, workers, _program(dataset, cfg),
                                dataset.data.num_features)
    estimates = price(cfg, dataset, rates)
    process = (base_rss if base_rss is not None else rss_bytes()) + dataset_bytes(dataset)
    ram = available_ram() // workers
    budget = device_budget(cfg)
    for e in estimates:
        peak = e.peak
        if process + peak.total > ram:
            e.fits, e.why_not = False, f"needs {_fmt(process + peak.total)} of RAM per worker"
        elif budget is not None and max(c.device for c in e.costs) > budget:
            e.fits, e.why_not = False, f"needs {_fmt(peak.device)} of device memory"
    fitting = [e for e in estimates if e.fits] or estimates
    best = min(fitting, key=lambda e: e.seconds)
    return PlanResult(estimates, best, rates, process, ram, budget, workers)


def dataset_bytes(dataset: Dataset) -> int:
    d = dataset.data
    return int(dataset.graph.nbytes() + d.features.numel() * d.features.element_size()
               + d.labels.numel() * d.labels.element_size() + 3 * d.num_nodes)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def table_lines(result: PlanResult) -> list[str]:
    """The table (the largest worker's memory per category), the fit, the choice."""
    head = (f"{'strategy':<14}" + "".join(f"{c:>13}" for c in P.CATEGORIES)
            + f"{'total':>11}{'moved/epoch':>13}{'epoch':>10}  fits")
    lines = [f"per worker of {result.workers} (the largest); each worker process also holds "
             f"{_fmt(result.process_bytes)} (interpreter, libraries, the dataset); RAM per "
             f"worker {_fmt(result.ram_per_worker)}"
             + (f", device budget {_fmt(result.device_budget)}"
                if result.device_budget else ""), head]
    for e in result.estimates:
        peak = e.peak
        mark = "yes" if e.fits else f"NO: {e.why_not}"
        lines.append(f"{e.candidate.label:<14}" + "".join(f"{_fmt(peak.memory[c]):>13}"
                                                        for c in P.CATEGORIES)
                     + f"{_fmt(peak.total):>11}{_fmt(e.bytes_moved):>13}"
                     f"{e.seconds * 1e3:>8.1f}ms  {mark}")
    r = result.rates
    lines.append(f"rates: edge x column {r.edge:.3g} s, GEMM flop {r.flop:.3g} s, byte "
                 f"{r.byte:.3g} s, round {r.latency:.3g} s, cores shared x{r.slowdown:.2f}")
    lines += explain(result)
    return lines


def explain(result: PlanResult) -> list[str]:
    """Two lines: what is recommended and why."""
    best = result.recommended
    others = sorted((e for e in result.estimates if e is not best and e.fits),
                    key=lambda e: e.seconds)
    nxt = (f"{others[0].candidate.label} next at {others[0].seconds * 1e3:.1f} ms"
           if others else "no other strategy fits")
    skipped = [e.candidate.label for e in result.estimates if not e.fits]
    return [f"recommended: {best.candidate.label} ({' '.join(candidate_flags(best.candidate))})",
            f"why: the fastest predicted epoch that fits, {best.seconds * 1e3:.1f} ms ({nxt}); "
            f"it moves {_fmt(best.bytes_moved)} and needs {_fmt(best.peak.total)} per worker"
            + (f"; does not fit: {', '.join(skipped)}" if skipped else "")]


def resolve_auto(cfg: Any, dataset: Dataset) -> tuple[P.Candidate, list[str]]:
    """The candidate ``--strategy auto`` runs, and the command-line flags selecting it."""
    if cfg.launch.workers == 1:
        return P.Candidate("single", "single"), ["--strategy", "single"]
    cand = plan_run(cfg, dataset).recommended.candidate
    return cand, candidate_flags(cand)


def resolve_config(cfg: Any, dataset: Dataset) -> tuple[Any, list[str]]:
    """``cfg`` with ``--strategy auto`` replaced by the recommendation (unchanged when
    the strategy is a concrete one), and the flags that select it."""
    if cfg.runtime.strategy != "auto":
        return cfg, []
    cand, flags = resolve_auto(cfg, dataset)
    options = dict(cfg.options)
    for section, values in cand.overrides.items():
        options[section] = dataclasses.replace(options[section], **values)
    runtime = dataclasses.replace(cfg.runtime, strategy=cand.strategy)
    return dataclasses.replace(cfg, runtime=runtime, options=options), flags


def candidate_flags(cand: P.Candidate) -> list[str]:
    """The ``train`` flags that select ``cand``."""
    from fullgraph.configfile import flag_names

    names = flag_names()
    flags = ["--strategy", cand.strategy]
    for section, values in cand.overrides.items():
        for key, value in values.items():
            flags += [f"--{names[section, key]}", str(value)]
    return flags
