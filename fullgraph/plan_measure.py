"""What the planner measures on this machine at start (``fullgraph.planner``).

- aggregation (per edge x column) and GEMM (per flop) rates at the thread count each
  worker will get (``costmodel.measure_edge_cost``, ``taskmodel.measure_machine``);
- the local link: per byte and per round trip between two processes over a socket
  pair (a forked echo process), as local gloo workers talk;
- each executor's fixed cost per epoch: one training step and one evaluation of the
  real strategy, at world size 1, on a ring of a few vertices with the dataset's
  widths (interpreter, autograd and the executor's own bookkeeping: the part of an
  epoch that does not grow with the graph);
- the share of the cores each worker gets (workers and the machine's current load),
  which the planner replaces, for several workers, by the slowdown the probe measures
  (``workload_seconds`` alone here against on every worker at once, ``plan_probe``);
- this process's resident size and the RAM available.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fullgraph import plan as P
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset, VertexData
from fullgraph.launch import available_cores, threads_per_worker
from fullgraph.models import build_model
from fullgraph.parallel import build_strategy, costmodel, taskmodel


def rss_bytes() -> int:
    """This process's resident size now (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _echo(sock: socket.socket, other: socket.socket) -> None:
    """Child: send back a one-byte ack for every message (length-prefixed)."""
    other.close()  # the parent's end, inherited: the child sees EOF when the parent closes
    while True:
        head = sock.recv(8)
        if len(head) < 8:
            return
        size, got = int.from_bytes(head, "little"), 0
        while got < size:
            got += len(sock.recv(min(1 << 20, size - got)))
        sock.sendall(b"k")


def measure_link(nbytes: int = 4 << 20, trips: int = 10) -> tuple[float, float]:
    """(seconds per byte, seconds per round trip) to a forked process over a socket pair."""
    a, b = socket.socketpair()
    child = multiprocessing.get_context("fork").Process(target=_echo, args=(b, a),
                                                         daemon=True)
    child.start()

    def send(size: int) -> float:
        t0 = time.perf_counter()
        a.sendall(size.to_bytes(8, "little") + bytes(size))
        a.recv(1)
        return time.perf_counter() - t0

    try:
        send(nbytes)  # warm-up
        latency = sorted(send(1) for _ in range(trips))[trips // 2]
        per_byte = max(0.0, min(send(nbytes) for _ in range(2)) - latency) / nbytes
    finally:
        a.close()
        b.close()
        child.join(timeout=5)
    return per_byte, latency


def tiny_dataset(feat_dim: int, classes: int, n: int = 32) -> Dataset:
    """A symmetric ring of ``n`` vertices with the given widths."""
    ids = torch.arange(n)
    indptr = torch.arange(0, 2 * n + 1, 2)
    indices = torch.stack([(ids - 1) % n, (ids + 1) % n], dim=1).reshape(-1)
    third = n // 3
    masks = [torch.zeros(n, dtype=torch.bool) for _ in range(3)]
    for i, m in enumerate(masks):
        m[i * third:(i + 1) * third] = True
    train, val, test = masks
    data = VertexData(torch.randn(n, feat_dim), torch.arange(n) % classes, train, val, test,
                      classes)
    return Dataset("plan-ring", Graph(indptr, indices, n), data)


def run_overrides(cand: P.Candidate, device_budget: bool) -> dict[str, dict[str, Any]]:
    """The option overrides a run of ``cand`` takes: a chunk count yields to a device
    budget the user gave (``device_budget``), which decides the chunks (the two are
    refused together), and the estimate prices the chunks the budget cuts
    (``planner.budget_chunks``)."""
    if not device_budget:
        return cand.overrides
    return {section: {k: v for k, v in values.items()
                      if not (section == "tensor_parallel" and k == "num_chunks")}
            for section, values in cand.overrides.items()}


def candidate_config(cfg: Any, cand: P.Candidate) -> Any:
    """``cfg`` running ``cand``: its strategy and its option overrides (``run_overrides``)."""
    options = dict(cfg.options)
    budget = cfg.options["tensor_parallel"].device_memory is not None
    for section, values in run_overrides(cand, budget).items():
        options[section] = dataclasses.replace(options[section], **values)
    runtime = dataclasses.replace(cfg.runtime, strategy=cand.strategy)
    return dataclasses.replace(cfg, runtime=runtime, options=options)


def one_process(cfg: Any) -> Any:
    """``cfg`` for a run in this one process: without the options that describe the
    whole run's workers (a partition file of W parts, one tensor share per worker)."""
    options = dict(cfg.options)
    for section, field in (("partition", "file"), ("tensor_parallel", "shares")):
        if section in options and getattr(options[section], field) is not None:
            options[section] = dataclasses.replace(options[section], **{field: None})
    return dataclasses.replace(cfg, options=options)


def executor_overhead(cfg: Any, cand: P.Candidate, feat_dim: int, classes: int) -> float:
    """Seconds of one epoch (training step and evaluation) of ``cand``'s executor at world
    size 1 on ``tiny_dataset`` (see ``executor_overheads``)."""
    return executor_overheads(cfg, [cand], feat_dim, classes)[cand.label]


def tiny_run(cfg: Any, cand: P.Candidate, dataset: Dataset) -> Any:
    """A closure running one epoch of ``cand`` on ``dataset`` in this process."""
    if cand.strategy == "task":  # needs 2 workers; it shares tensor parallelism's executor,
        # without tensor parallelism's chunks (--device-memory is not task's budget)
        options = dict(cfg.options)
        options["tensor_parallel"] = dataclasses.replace(
            options["tensor_parallel"], device_memory=None, num_chunks=None)
        cfg, cand = dataclasses.replace(cfg, options=options), P.Candidate("tensor", "tensor")
    run = candidate_config(cfg, cand)
    data = dataset.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = build_strategy(one_process(run))
        program = build_model(cfg.model.name, data.num_features, cfg.model.hidden,
                              data.num_classes, **cfg.model.build_options())
        plan = strategy.setup(dataset, program, torch.device("cpu"), None)
    optimizer = torch.optim.Adam(program.parameters(), lr=0.0)

    def epoch(step: int) -> None:
        strategy.train_step(program, plan, optimizer, seed=step)
        strategy.evaluate(program, plan)
    return epoch


def executor_overheads(cfg: Any, cands: list[P.Candidate], feat_dim: int, classes: int,
                       rounds: int = 5) -> dict[str, float]:
    """Per candidate, seconds of one epoch of its executor at world size 1 on
    ``tiny_dataset``: the least over ``rounds`` rounds that time every candidate in
    turn (a load spike then hits one round, not one candidate)."""
    dataset = tiny_dataset(feat_dim, classes)
    runs = {c.label: tiny_run(cfg, c, dataset) for c in cands}
    for run in runs.values():
        run(0)  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    for step in range(1, rounds + 1):
        for label, run in runs.items():
            t0 = time.perf_counter()
            run(step)
            best[label] = min(best[label], time.perf_counter() - t0)
    return best


NARROW, WIDE = 4, 128
"""Columns of the planner's two aggregation timings: the per-edge floor of narrow
aggregations (``PlanRates.edge_min``) and the per-column cost of wide ones."""


def plan_rates(graph: Graph, workers: int, threads: int | None = None,
               backend: str = "auto") -> P.PlanRates:
    """Rates measured here as a worker computes (``threads`` each, default the
    launcher's share; SpMM ``backend``): aggregation and GEMM, the local link; cores
    shared by workers (``overhead`` is per candidate, see ``executor_overhead``)."""
    from fullgraph.comm.group import single_comm

    with worker_threads(threads or threads_per_worker(workers), backend):
        machine = taskmodel.measure_machine(single_comm())
        narrow, wide = costmodel.measure_edge_costs(graph, (NARROW, WIDE))
    byte, latency = measure_link()
    busy = busy_cores()
    return P.PlanRates(wide, 1.0 / machine.flops, byte, latency, edge_min=narrow * NARROW,
                       slowdown=core_share(workers, available_cores(),
                                           None if busy is None else busy + 1.0),
                       bandwidth=machine.bandwidth, busy=busy)


@contextlib.contextmanager
def worker_threads(threads: int, backend: str | None = None) -> Iterator[None]:
    """This process computing as a worker does: at its thread count, torch's and
    numba's (numba's parallel kernels otherwise wait for threads the workers do not
    have: 16 ms per Cora aggregation beside a busy core, against 0.1 ms), and with its
    SpMM ``backend`` (``--spmm-backend``; None: this process's)."""
    from fullgraph.ops import kernels
    from fullgraph.ops.spmm import current_backend, set_backend

    before = torch.get_num_threads()
    numba_before = kernels.numba.get_num_threads() if kernels.HAVE_NUMBA else 1
    backend_before = current_backend()
    try:
        torch.set_num_threads(threads)
        kernels.set_threads(threads)
        if backend is not None:
            set_backend(backend)
        yield
    finally:
        torch.set_num_threads(before)
        kernels.set_threads(numba_before)
        set_backend(backend_before)


def workload_seconds(rounds: int = 3) -> float:
    """The least of ``rounds`` timings of a fixed mix of graph work (a GEMM and an
    aggregation over a seeded random graph, eight times: about 20 ms on one core, longer
    than a scheduler time slice, so that workers taking turns on a core see it). Timed
    alone here and on every probe worker at once, the ratio is how much the workers
    slow each other down (shared cores, memory bandwidth and caches), measured instead
    of assumed.

    Both write into buffers allocated before the timing: with glibc's malloc a fresh
    output is faulted in page by page until its adaptive mmap threshold has grown,
    which took the same work from 2.6 to 6.4 ms depending on what the process had
    allocated before (the planner's probe read that as a 2.5x slowdown of two workers
    on two idle cores)."""
    from fullgraph.ops import kernels
    from fullgraph.ops.spmm import resolve_backend

    gen = torch.Generator().manual_seed(0)
    n, degree, dim = 20_000, 10, 64
    indptr = torch.arange(0, n * degree + 1, degree)
    indices = torch.randint(0, n, (n * degree,), generator=gen)
    x, w = torch.randn(n, dim, generator=gen), torch.randn(dim, dim, generator=gen)
    h, out = torch.empty(n, dim), torch.empty(n, dim)
    if resolve_backend(torch.device("cpu")) == "numba":
        args = (indptr.numpy(), indices.numpy(), h.numpy(), out.numpy(), False)

        def aggregate() -> None:
            kernels.spmm_unweighted(*args)
    else:
        adj = torch.sparse_csr_tensor(indptr, indices, torch.ones(n * degree), (n, n),
                                      check_invariants=False)

        def aggregate() -> None:
            torch.mm(adj, h, out=out)
    best = float("inf")
    for _ in range(rounds + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        for _ in range(8):
            torch.mm(x, w, out=h)
            aggregate()
        best = min(best, time.perf_counter() - t0)
    return best


def busy_cores(window: float = 0.5, stat: str = "/proc/stat") -> float | None:
    """Cores busy with other processes now: the CPU time ``/proc/stat`` counts over
    ``window`` seconds while this process sleeps (None where there is no
    ``/proc/stat``). Unlike the load average, which trails by a minute, it does not
    count work that has just ended (the workers of a run that finished)."""
    def sample() -> tuple[int, int]:
        with open(stat) as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # all time, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(window)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    if total <= 0:
        return None
    return (total - (idle1 - idle0)) / total * (os.cpu_count() or 1)


def core_share(workers: int, cores: int, load: float | None = None) -> float:
    """How much slower a worker computes than this process measured: the rates were
    measured beside the other processes running now (``load``: this process plus
    the cores others keep busy, from ``busy_cores``, or the 1-minute load average
    where that cannot be read), the workers will run beside them and each other."""
    if load is None:
        busy = busy_cores()
        if busy is not None:
            load = busy + 1.0
        else:
            try:
                load = os.getloadavg()[0]
            except OSError:
                load = 1.0
    others = max(0.0, load - 1.0)
    return max(1.0, (others + workers) / max(float(cores), others + 1.0))
