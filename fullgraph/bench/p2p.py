"""G3 Fig. 16 and Fig. 17 at this machine's scale (a script, not a test).

In one run on one machine, for each world size in ``--workers`` (gloo ranks of one
thread each), on one cached R-MAT graph with Reddit-like widths (602 features, 256
hidden, 41 classes, coupled 2-layer GCN; ``--features`` and ``--hidden`` shrink them),
it runs P2P (G3 hybrid) parallelism, ``fullgraph.parallel.p2p.P2PParallel``, for
warm-up + timed epochs in these configurations:

- Fig. 16 (G3 section 7.4, partitioning): schedule ``multi-level`` with the
  partitioners ``random``, ``chunk``, ``metis`` and ``g3``;
- Fig. 17 (G3 section 7.5, scheduling): partitioner ``g3`` with the schedules
  ``sequential``, ``inter-layer``, ``intra-layer`` and ``multi-level`` (g3 +
  multi-level is run once and appears in both figures).

Every configuration builds its model from the same seed; ``setup`` (where rank 0
partitions the graph and every rank builds its bins and push tables) is timed on its
own, and the partitioner call inside it separately (``partition s``), never as part
of an epoch. Per epoch (after a barrier, with ``comm.counter`` reset):

- wall time: the slowest rank's ``perf_counter`` around ``train_step``; the table
  shows the median over the timed epochs;
- CPU time per rank: ``time.process_time`` around the same call (includes gloo's and
  the prefetch loader's threads); the median over epochs, then max/min over ranks;
- bytes: ``comm.counter`` per phase. Vertex data is ``push`` (forward rows) +
  ``push-grad`` (their gradients), summed over ranks counting each byte once (sent);
  the balance column is max/min over ranks of vertex bytes sent + received;
- blocked communication: the ``seconds`` of the ``push`` / ``push-grad`` phases, i.e.
  the time spent blocked in ``wait()`` of the per-bin exchanges (time hidden behind
  computation is not counted); ``barrier wait`` is the ``wait`` phase (the barrier
  before the gradient all-reduce: waiting for slower ranks);
- aggregation work per rank (``Strategy.work``: edges x columns), max/min over ranks.

Every schedule of one partition pushes the same rows, only in other rounds, so the
p2p bytes of a partitioner must be identical across schedules (checked and printed),
and every configuration computes the same sums, so the losses must agree.

Bins: ``--bin-size`` vertices per bin (``bin_memory`` is not used); by default
``ceil(vertices / (workers * --bins-per-worker))``, i.e. about 12 bins per worker and
phase whatever the world size.

Emulated network (``--link-rate``): by default every rank runs on this host and the
ranks exchange rows through gloo over the loopback (``host``), where communication is
cheap. ``--link-rate 1gbit`` instead runs each world size on two Linux network
namespaces joined by a veth pair whose two ends are limited by ``tc tbf`` to that rate
(``fullgraph.bench.netlink``; needs root and iproute2): rank r runs in namespace
r % 2 (started with ``ip netns exec``, gloo bound to the veth), so with 2 workers all
vertex traffic crosses the link and with 4 the pairs of ranks of different parity do;
ranks in one namespace talk unshaped. ``veth`` is the same namespaces and veth without
shaping. Several values run in turn (``--link-rate veth 1gbit``). The link is probed
with TCP streams before use (measured rate printed) and removed afterwards, also on
errors and Ctrl-C. It is an emulation: both "hosts" share this machine's cores.

Prints one JSON object per configuration, then a markdown summary per world size
(and link) and the ratios of the world sizes (and links) side by side.

    python -m fullgraph.bench.p2p --workers 2 4
    python -m fullgraph.bench.p2p --workers 2 4 --link-rate veth 1gbit   # as root
    python -m fullgraph.bench.p2p --vertices 5000 --edges 100000 --epochs 2 --warmup 1 \
        --workers 2

The defaults (60,000 vertices, 2M edges, 1 warm-up + 10 timed epochs, 2 and 4 workers)
take about 2.5 minutes on 2 idle cores (longer when the machine is shared) and about
2 GiB per worker.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fullgraph.bench import entry_point, require_cuda
from fullgraph.bench.p2p_report import (
    FIG16_SCHEDULE,
    FIG17_PARTITIONER,
    HOST,
    PARTITIONERS,
    SCHEDULES,
    VETH,
    bin_size,
    config_name,
    machine_info,
    print_header,
    print_side_by_side,
    print_world,
    summarise,
)
from fullgraph.bench.tensor import CLASSES, HIDDEN, IN_DIM, _rss_mib, timed_epochs


# ------------------------------------------------------------------ data
def load_graph(args: argparse.Namespace) -> Path:
    """Generate the R-MAT dataset once and cache it; returns the cache directory.

    ``bench.tensor.load_graph`` with ``--features`` instead of its fixed 602 (same
    cache name, so the two scripts share a cache at the default width).
    """
    from fullgraph.graph import store, synthetic

    cache = Path(args.cache) / f"rmat-sym-{args.vertices}-{args.edges}-{args.features}-" \
                               f"{CLASSES}-{args.seed}"
    if not store.is_cached(cache):
        ds = synthetic.rmat(args.vertices, args.edges // 2, seed=args.seed,
                            num_features=args.features, num_classes=CLASSES, symmetrize=True)
        store.save_dataset(ds, cache)
    return cache


def configurations(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(partitioner, schedule) pairs to run, each once: Fig. 16's, then Fig. 17's."""
    out = [(p, FIG16_SCHEDULE) for p in args.partitioners]
    out += [(FIG17_PARTITIONER, s) for s in args.schedules]
    return list(dict.fromkeys(out))


# --------------------------------------------------------------- per rank
@contextlib.contextmanager
def timed_partitioner() -> Iterator[dict[str, float]]:
    """Times the partitioner that ``partition_book`` calls (rank 0, inside setup).

    Wraps ``fullgraph.parallel.rows.partition`` in this process only, for the block;
    yields a dict that gets ``"seconds"``.
    """
    from fullgraph.parallel import rows

    timing: dict[str, float] = {}
    original = rows.partition

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            timing["seconds"] = timing.get("seconds", 0.0) + time.perf_counter() - t0

    rows.partition = timed
    try:
        yield timing
    finally:
        rows.partition = original


def plan_info(plan: Any, rank: int) -> dict[str, Any]:
    """Bins and rounds per phase and rows pushed per forward, from the P2P plan."""
    phases = getattr(plan, "phases", [])
    rows_sent = rows_recv = 0
    for ph in phases:
        link = getattr(ph, "link", None)
        if link is not None:
            s, r = link.rows_moved(rank)
            rows_sent, rows_recv = rows_sent + s, rows_recv + r
    return {"bins": [len(ph.bins) for ph in phases], "rounds": [ph.rounds for ph in phases],
            "limits": list(getattr(plan, "limits", [])), "owned": int(plan.rows.owned.numel()),
            "rows_sent": rows_sent, "rows_recv": rows_recv}


def run_config(comm: Any, dataset: Any, partitioner: str, schedule: str,
               args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Set up one configuration on this rank and time its epochs."""
    from fullgraph.comm import primitives as prim
    from fullgraph.models import build_model
    from fullgraph.parallel.p2p import P2PParallel
    from fullgraph.partition import PartitionOptions

    strategy = P2PParallel(
        P2PParallel.Options(schedule=schedule, bin_memory=None, bin_size=bin_size(args, world)),
        PartitionOptions(method=partitioner, seed=args.seed))
    torch.manual_seed(args.seed)  # the same initial parameters on every rank and config
    model = build_model("gcn", args.features, args.hidden, CLASSES, num_layers=2, dropout=0.5)
    prim.barrier(comm, "bench")
    comm.counter.reset()
    t0 = time.perf_counter()
    with timed_partitioner() as timing:
        plan = strategy.setup(dataset, model.to(args.device), torch.device(args.device), comm)
    setup_s = time.perf_counter() - t0
    setup_phases = comm.counter.snapshot()
    work = strategy.work(model, plan)
    epochs = timed_epochs(strategy, model, plan, comm, args)
    return {"setup_s": setup_s, "partition_s": timing.get("seconds"),
            "setup_bytes": sum(v["sent"] + v["recv"] for v in setup_phases.values()),
            "edge_dims": work.edge_dims, "edges_local": work.edges_local,
            "plan": plan_info(plan, comm.rank), "epochs": epochs, "rss_mib": _rss_mib()}


def rank_main(rank: int, args: argparse.Namespace, world: int, store: str, result: str) -> None:
    """One worker: one thread, gloo, every configuration, results gathered on rank 0."""
    from fullgraph.comm import destroy_comm, init_comm
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.graph import store as dstore
    from fullgraph.ops import kernels

    kernels.set_threads(1)  # numba first: its pool resets the OpenMP thread count
    torch.set_num_threads(1)
    if args.no_prefetch:  # the same schedules without their intra-layer prefetch
        from dataclasses import replace

        from fullgraph.schedule import bins

        for name, mode in bins.SCHEDULES.items():
            bins.SCHEDULES[name] = replace(mode, prefetch=False)
    comm = init_comm(backend="gloo", init_method=f"file://{store}", rank=rank,
                     world_size=world, timeout_s=args.timeout)
    try:
        dataset = dstore.load_dataset(args.cache_dir, mmap=False, verify=False)
        results: dict[str, Any] = {}
        for partitioner, schedule in configurations(args):
            name = config_name(partitioner, schedule)
            try:
                results[name] = run_config(comm, dataset, partitioner, schedule, args, world)
            except (ValueError, TypeError, NotImplementedError) as exc:  # same on every rank
                results[name] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
            if args.verbose and rank == 0:
                print(f"[{world} workers] {name} done", file=sys.stderr, flush=True)
        gathered = all_gather_object(results, comm, "bench")
        if rank == 0:
            Path(result).write_text(json.dumps(gathered))
    finally:
        destroy_comm(comm)


def spawn(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    """Run ``rank_main`` on ``world`` processes; per-rank results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-p2p-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(args, world, store, result), nprocs=world, join=True)
        return json.loads(Path(result).read_text())


def spawn_netns(args: argparse.Namespace, world: int, link: Any) -> list[dict[str, Any]]:
    """``spawn`` over an emulated link: rank r in namespace r % 2 (``bench.netlink``).

    Each rank is ``python -m fullgraph.bench.p2p --rank-worker SPEC`` started with
    ``ip netns exec``; SPEC (JSON) holds the arguments, rank, world size and the file
    store and result paths in a temporary directory (the file system is shared).
    """
    from fullgraph.bench import netlink

    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-p2p-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        worker_args = {k: v for k, v in vars(args).items() if k != "rank_worker"}
        for r in range(world):
            Path(tmp, f"rank{r}.json").write_text(json.dumps(
                {"args": worker_args, "rank": r, "world": world, "store": store,
                 "result": result}))
        codes = netlink.run_ranks(
            link, world, lambda r: [sys.executable, "-m", "fullgraph.bench.p2p",
                                    "--rank-worker", os.path.join(tmp, f"rank{r}.json")])
        if any(codes):
            raise RuntimeError(f"{world} workers over {link.rate or 'veth'}: rank exit codes "
                               f"{codes}")
        return json.loads(Path(result).read_text())


def rank_worker(spec_path: str) -> int:
    """The entry of one rank started by ``spawn_netns``."""
    spec = json.loads(Path(spec_path).read_text())
    rank_main(spec["rank"], argparse.Namespace(**spec["args"]), spec["world"], spec["store"],
              spec["result"])
    return 0


# -------------------------------------------------------------- reduction
@contextlib.contextmanager
def link_context(args: argparse.Namespace, link: str) -> Iterator[Any]:
    """None for ``host``; else the emulated link (``netlink.Link``), removed on exit."""
    if link == HOST:
        yield None
        return
    from fullgraph.bench import netlink

    with netlink.two_hosts(None if link == VETH else link, burst=args.link_burst,
                           latency=args.link_latency) as net:
        yield net


def _choices(p: argparse.ArgumentParser, value: str, allowed: tuple[str, ...],
             what: str) -> list[str]:
    items = [c for c in value.split(",") if c]
    unknown = set(items) - set(allowed)
    if unknown:
        p.error(f"unknown {what} {sorted(unknown)}; expected some of {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked (links probed for availability, not yet made)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=60_000)
    p.add_argument("--edges", type=int, default=2_000_000,
                   help="edges after symmetrisation, at most (edges // 2 drawn)")
    p.add_argument("--features", type=int, default=IN_DIM)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4],
                   help="world sizes, each run in turn (default: 2 4)")
    p.add_argument("--bin-size", type=int, default=None,
                   help="vertices per bin (default: ceil(vertices / (workers x "
                        "--bins-per-worker)))")
    p.add_argument("--bins-per-worker", type=int, default=12,
                   help="bins per worker and phase when --bin-size is not given")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10, help="timed epochs (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-collective limit (s)")
    p.add_argument("--partitioners", default=",".join(PARTITIONERS),
                   help="Fig. 16: comma list of " + ", ".join(PARTITIONERS))
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="Fig. 17: comma list of " + ", ".join(SCHEDULES))
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--link-rate", nargs="+", default=[HOST], metavar="LINK",
                   help=f"where the ranks talk, each run in turn: '{HOST}' (default: one "
                        f"host, loopback), '{VETH}' (two network namespaces joined by a veth "
                        "pair, rank r in namespace r %% 2) or a tc rate such as 1gbit or "
                        "500mbit (that veth, each direction shaped with tc tbf); needs root")
    p.add_argument("--link-burst", default="256kb", help="tc tbf burst of a shaped link")
    p.add_argument("--link-latency", default="50ms", help="tc tbf latency of a shaped link")
    p.add_argument("--device", default="cpu", help="cpu or cuda: every rank on the one GPU "
                   "(gloo, CUDA tensors staged through host memory)")
    p.add_argument("--no-prefetch", action="store_true", help="run the schedules without "
                   "loading the next bin ahead (on cuda: the side-stream copy)")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    p.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)  # spawn_netns
    args = p.parse_args(argv)
    if args.rank_worker:
        return args
    require_cuda(p, args.device)  # (here, not in every rank's traceback)
    args.partitioners = _choices(p, args.partitioners, PARTITIONERS, "partitioners")
    args.schedules = _choices(p, args.schedules, SCHEDULES, "schedules")
    if args.bin_size is not None and args.bin_size < 1:
        p.error("--bin-size must be >= 1")
    if min(args.workers) < 2:
        p.error("--workers: P2P needs at least 2 workers to push anything")
    args.link_rate = list(dict.fromkeys(args.link_rate))
    if any(link != HOST for link in args.link_rate):
        from fullgraph.bench import netlink

        bad = [x for x in args.link_rate if x not in (HOST, VETH) and netlink.rate_bits(x) is None]
        if bad:
            p.error(f"--link-rate: not '{HOST}', '{VETH}' or a tc rate (e.g. 1gbit): {bad}")
        why = netlink.available()
        if why:
            p.error(f"--link-rate {' '.join(args.link_rate)}: {why}")
    return args


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_worker:
        return rank_worker(args.rank_worker)
    t0 = time.perf_counter()
    args.cache_dir = str(load_graph(args))
    from fullgraph.graph import store

    meta = store.read_meta(Path(args.cache_dir))
    machine = machine_info()
    info = {"vertices": meta["num_nodes"], "edges": meta["num_edges"],
            "graph_s": time.perf_counter() - t0,
            "command": "python -m fullgraph.bench.p2p "
                       + shlex.join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    by_run: dict[tuple[str, int], list[dict[str, Any]]] = {}
    loads: dict[tuple[str, int], tuple[float, float]] = {}
    run_s: dict[tuple[str, int], float] = {}
    links: dict[str, dict[str, Any]] = {}
    run_info: dict[tuple[str, int], dict[str, Any]] = {}
    for link in args.link_rate:
        with link_context(args, link) as net:
            links[link] = {"description": "every rank on this host, gloo over the loopback"}
            if net is not None:
                from fullgraph.bench import netlink

                links[link] = {"description": net.describe(), "probe": netlink.probe(net)}
                if args.verbose:
                    print(f"[{link}] {links[link]}", file=sys.stderr, flush=True)
            for world in dict.fromkeys(args.workers):
                key = (link, world)
                w0, load0 = time.perf_counter(), os.getloadavg()[0]
                if net is None:
                    per_rank = spawn(args, world)
                else:
                    tx0 = netlink.tx_bytes(net)
                    per_rank = spawn_netns(args, world, net)
                    run_info[key] = {"tx_bytes": [b - a for a, b in
                                                  zip(tx0, netlink.tx_bytes(net))]}
                loads[key], run_s[key] = (load0, os.getloadavg()[0]), time.perf_counter() - w0
                rows = [summarise(part, sched, world,
                                  [r[config_name(part, sched)] for r in per_rank])
                        for part, sched in configurations(args)]
                for row in rows:
                    print(json.dumps({**info, **machine, "link": link, **links[link],
                                      **run_info.get(key, {}), **row}), flush=True)
                by_run[key] = rows
    print_header(args, info, machine, links)
    for (link, world), rows in by_run.items():
        print_world(rows, args, world, machine["cores"], loads[(link, world)], link,
                    run_info.get((link, world)))
    print_side_by_side(by_run, args)
    peak = max((r.get("rss_mib_max", 0) for rows in by_run.values() for r in rows), default=0)
    times = ", ".join(f"{w} workers" + ("" if link == HOST else f" over {link}") + f" {s:.0f} s"
                      for (link, w), s in run_s.items())
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (graph {info['graph_s']:.0f} s; {times}); "
          f"peak RSS of one worker {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
