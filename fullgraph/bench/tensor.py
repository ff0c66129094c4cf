"""NeutronTP Fig. 10 and Fig. 11 at this machine's scale (a script, not a test).

In one run on one machine, with ``--workers`` gloo ranks of one thread each, on one
cached R-MAT graph with Reddit-like widths (602 features, 256 hidden, 41 classes,
2-layer GCN), it runs every configuration for warm-up + timed epochs:

- ``dp-chunk``: data parallelism, DepComm, chunk partitioning (the Fig. 11 baseline);
- ``dp-metis``: data parallelism, DepComm, METIS partitioning;
- ``tp-naive``: tensor parallelism on the coupled GCN (split / gather every layer);
- ``tp-decoupled``: tensor parallelism on the decoupled GCN (2 MLP layers, K = 2);
- ``tp-pipeline``: decoupled TP with ``pipeline=True``, only if
  ``TensorParallel.Options`` has that field (NeutronTP's inter-chunk pipelining).

Fig. 10 (NeutronTP section 5.3): bytes moved per epoch over all ranks, and per rank
the bytes and the aggregation work (edges x columns, ``Strategy.work``), with the
max/min over ranks. Fig. 11 (section 5.4): epoch wall time and per-rank CPU time
(``time.process_time`` around each epoch; with more workers than cores the wall
time measures the scheduler as much as the strategy). Setup is not timed.

Bytes are ``comm.counter`` totals of one epoch (reset after a barrier before it):
"vertex data" leaves out the phases grad-sync, metrics and wait (parameter
all-reduce, loss, barrier), which every strategy pays alike. A configuration meets
the balance bound when max/min over ranks of both edges x columns and bytes sent +
received (all phases) is at most 1.02.

Prints one JSON object per configuration, then a markdown summary.

    python -m fullgraph.bench.tensor --vertices 120000 --edges 8000000 --workers 4

The defaults take about 3-5 minutes on 2 shared cores and about 2.5 GiB per worker.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fullgraph.bench import entry_point
from fullgraph.runlog import MIB

IN_DIM, HIDDEN, CLASSES = 602, 256, 41  # Reddit's widths (NeutronTP Table 2)
NON_VERTEX_PHASES = ("grad-sync", "metrics", "wait", "bench")  # not vertex data
BALANCE_BOUND = 1.02  # the acceptance bound on max/min for TP
CONFIGS = ("dp-chunk", "dp-metis", "tp-naive", "tp-decoupled", "tp-pipeline")
LABELS = {"dp-chunk": "DP DepComm + chunk", "dp-metis": "DP DepComm + METIS",
          "tp-naive": "TP naive (coupled)", "tp-decoupled": "TP decoupled",
          "tp-pipeline": "TP decoupled + pipelining"}


# ------------------------------------------------------------------ data
def load_graph(args: argparse.Namespace) -> Path:
    """Generate the R-MAT dataset once and cache it; returns the cache directory.

    ``edges // 2`` R-MAT edges are drawn and symmetrised (Reddit is undirected), so
    the graph has at most ``edges`` edges (duplicates removed).
    """
    from fullgraph.graph import store, synthetic

    cache = Path(args.cache) / f"rmat-sym-{args.vertices}-{args.edges}-{IN_DIM}-" \
                               f"{CLASSES}-{args.seed}"
    if not store.is_cached(cache):
        ds = synthetic.rmat(args.vertices, args.edges // 2, seed=args.seed,
                            num_features=IN_DIM, num_classes=CLASSES, symmetrize=True)
        store.save_dataset(ds, cache)
    return cache


def pipeline_supported() -> bool:
    from fullgraph.parallel.tensor import TensorParallel

    return "pipeline" in {f.name for f in dataclasses.fields(TensorParallel.Options)}


def make_config(name: str) -> tuple[Any, bool]:
    """(strategy, decoupled model?) of configuration ``name``."""
    from fullgraph.parallel.data import DataParallel
    from fullgraph.parallel.tensor import TensorParallel
    from fullgraph.partition import PartitionOptions

    if name in ("dp-chunk", "dp-metis"):
        return DataParallel(DataParallel.Options(mode="depcomm"),
                            PartitionOptions(method=name.split("-")[1])), False
    if name == "tp-naive":
        return TensorParallel(), False
    if name == "tp-decoupled":
        return TensorParallel(), True
    return TensorParallel(TensorParallel.Options(pipeline=True)), True


# --------------------------------------------------------------- per rank
def run_config(comm: Any, dataset: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Set up one configuration on this rank and time its epochs."""
    from fullgraph.models import build_model

    strategy, decoupled = make_config(name)
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = build_model("gcn", IN_DIM, HIDDEN, CLASSES, num_layers=2, dropout=0.5,
                        decoupled=decoupled, num_props=2)
    t0 = time.perf_counter()
    plan = strategy.setup(dataset, model, torch.device("cpu"), comm)
    setup_s = time.perf_counter() - t0
    work = strategy.work(model, plan)
    epochs = timed_epochs(strategy, model, plan, comm, args)
    return {"setup_s": setup_s, "edge_dims": work.edge_dims, "edges_local": work.edges_local,
            "edges_redundant": work.edges_redundant, "epochs": epochs,
            "rss_mib": _rss_mib()}


def timed_epochs(strategy: Any, model: Any, plan: Any, comm: Any,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``args.warmup + args.epochs`` epochs (Adam, lr 0.01); per timed epoch the
    wall and CPU seconds of ``train_step``, its loss and timings and the bytes per phase.
    Every rank starts each epoch together (a barrier) with the byte counter reset."""
    from fullgraph.comm import primitives as prim
    from fullgraph.train import step_seed

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(1, args.warmup + args.epochs + 1):
        prim.barrier(comm, "bench")
        comm.counter.reset()
        w0, c0 = time.perf_counter(), time.process_time()
        stats = strategy.train_step(model, plan, opt, seed=step_seed(args.seed, epoch))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if epoch > args.warmup:
            epochs.append({"wall_s": wall, "cpu_s": cpu, "loss": stats.loss,
                           "forward_s": stats.forward_s, "backward_s": stats.backward_s,
                           "phases": comm.counter.snapshot()})
    return epochs


def _rss_mib() -> float:
    from fullgraph.memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def rank_main(rank: int, args: argparse.Namespace, store: str, result: str) -> None:
    """One worker: one thread, gloo, every configuration, results gathered on rank 0."""
    from fullgraph.comm import destroy_comm, init_comm
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.graph import store as dstore
    from fullgraph.ops import kernels

    kernels.set_threads(1)  # numba first: its pool resets the OpenMP thread count
    torch.set_num_threads(1)
    comm = init_comm(backend="gloo", init_method=f"file://{store}", rank=rank,
                     world_size=args.workers, timeout_s=args.timeout)
    try:
        dataset = dstore.load_dataset(args.cache_dir, mmap=False, verify=False)
        results: dict[str, Any] = {}
        for name in args.configs:
            try:
                results[name] = run_config(comm, dataset, name, args)
            except (ValueError, TypeError, NotImplementedError) as exc:  # same on every rank
                results[name] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
        gathered = all_gather_object(results, comm, "bench")
        if rank == 0:
            Path(result).write_text(json.dumps(gathered))
    finally:
        destroy_comm(comm)


def spawn(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``rank_main`` on ``args.workers`` processes; per-rank results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-tensor-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(args, store, result), nprocs=args.workers, join=True)
        return json.loads(Path(result).read_text())


# -------------------------------------------------------------- reduction
def _ratio(values: list[float]) -> float:
    lo = min(values)
    return float("inf") if lo == 0 else max(values) / lo


def _bytes(phases: dict[str, Any], vertex_only: bool) -> tuple[int, int]:
    keep = [v for k, v in phases.items() if not (vertex_only and k in NON_VERTEX_PHASES)]
    return sum(v["sent"] for v in keep), sum(v["recv"] for v in keep)


def summarise(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's record from its per-rank results."""
    if any("error" in r for r in ranks):
        return {"config": name, "error": next(r["error"] for r in ranks if "error" in r)}
    num_epochs = len(ranks[0]["epochs"])
    med = statistics.median
    cpu = [med(e["cpu_s"] for e in r["epochs"]) for r in ranks]
    wall = med(max(r["epochs"][i]["wall_s"] for r in ranks) for i in range(num_epochs))
    out: dict[str, Any] = {"config": name, "label": LABELS[name], "wall_s": wall,
                           "cpu_s_per_rank": cpu, "cpu_s_max": max(cpu),
                           "cpu_s_min": min(cpu), "cpu_s_sum": sum(cpu),
                           "cpu_max_min": _ratio(cpu)}
    for kind, vertex_only in (("all", False), ("vertex", True)):
        moved = [[sum(_bytes(e["phases"], vertex_only)) for e in r["epochs"]] for r in ranks]
        per_rank = [med(m) for m in moved]  # sent + received by the rank
        out[f"bytes_{kind}_per_rank"] = per_rank
        out[f"bytes_{kind}_total"] = sum(med(_bytes(e["phases"], vertex_only)[0]
                                             for e in r["epochs"]) for r in ranks)
        out[f"bytes_{kind}_max_min"] = _ratio(per_rank)
    out["edge_dims_per_rank"] = [r["edge_dims"] for r in ranks]
    out["edge_dims_total"] = sum(out["edge_dims_per_rank"])
    out["edge_dims_max_min"] = _ratio(out["edge_dims_per_rank"])
    out["edges_redundant"] = sum(r["edges_redundant"] for r in ranks)
    out["phases_rank0"] = {k: {"bytes": v["sent"] + v["recv"], "calls": v["calls"]}
                           for k, v in ranks[0]["epochs"][-1]["phases"].items()}
    out["comm_s_max"] = max(med(sum(v["seconds"] for k, v in e["phases"].items()
                                    if k not in ("wait", "bench")) for e in r["epochs"])
                            for r in ranks)
    out["wait_s_max"] = max(med(e["phases"].get("wait", {}).get("seconds", 0.0)
                                for e in r["epochs"]) for r in ranks)
    out["losses"] = [e["loss"] for e in ranks[0]["epochs"]]
    out["setup_s_max"] = max(r["setup_s"] for r in ranks)
    out["rss_mib_max"] = max(r["rss_mib"] for r in ranks)
    out["balanced"] = (out["edge_dims_max_min"] <= BALANCE_BOUND
                       and out["bytes_all_max_min"] <= BALANCE_BOUND)
    return out


# ---------------------------------------------------------------- report
def _mb(x: float) -> str:
    """Bytes as MiB, the unit of every byte figure ``fullgraph train`` prints."""
    return f"{x / MIB:.1f}"


def print_fig10(rows: list[dict[str, Any]]) -> None:
    print("\n### Fig. 10: communication and computation load per epoch\n")
    print("| configuration | MiB moved, all ranks (vertex data) | MiB moved incl. grad sync "
          "| bytes/rank max/min | edges x cols, all ranks (1e6) | edges x cols max/min "
          f"| max/min <= {BALANCE_BOUND} |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | error: {r['error']} ||||||")
            continue
        print(f"| {r['label']} | {_mb(r['bytes_vertex_total'])} | {_mb(r['bytes_all_total'])} "
              f"| {r['bytes_all_max_min']:.3f} | {r['edge_dims_total'] / 1e6:.0f} "
              f"| {r['edge_dims_max_min']:.3f} | {'yes' if r['balanced'] else 'NO'} |")
    by = {r["config"]: r for r in rows if "error" not in r}
    if "tp-decoupled" in by:
        dtp = by["tp-decoupled"]
        for name in ("dp-chunk", "dp-metis", "tp-naive"):
            if name in by:
                v = by[name]["bytes_vertex_total"] / max(1, dtp["bytes_vertex_total"])
                a = by[name]["bytes_all_total"] / max(1, dtp["bytes_all_total"])
                print(f"\n{LABELS[name]} / TP decoupled bytes: {v:.2f}x vertex data, "
                      f"{a:.2f}x incl. grad sync (paper, Reddit: up to 7.23x)", end="")
        print()
    print("\nPer rank (MiB sent+received incl. grad sync; edges x cols in 1e6):")
    for r in rows:
        if "error" not in r:
            print(f"- {r['label']}: bytes {[_mb(b) for b in r['bytes_all_per_rank']]}, "
                  f"work {[round(w / 1e6) for w in r['edge_dims_per_rank']]}")


def _ablation_row(r: dict[str, Any], base: dict[str, Any], prev: dict[str, Any]) -> str:
    return (f"| {r['label']} | {r['wall_s']:.2f} | {r['cpu_s_max']:.2f} | {r['cpu_s_min']:.2f} "
            f"| {r['cpu_max_min']:.2f} | {r['cpu_s_sum']:.2f} | {r['comm_s_max']:.2f} "
            f"| {r['wait_s_max']:.2f} "
            f"| {base['wall_s'] / r['wall_s']:.2f}x / {base['cpu_s_max'] / r['cpu_s_max']:.2f}x "
            f"| {prev['wall_s'] / r['wall_s']:.2f}x / {prev['cpu_s_max'] / r['cpu_s_max']:.2f}x |")


def print_fig11(rows: list[dict[str, Any]], pipeline: bool) -> None:
    print("\n### Fig. 11: ablation, epoch time (median of timed epochs)\n")
    print("| configuration | wall s | CPU s/rank max | min | max/min | CPU s, all ranks "
          "| comm s max | wait s max | speedup vs DP+chunk (wall / CPU max) "
          "| vs previous step (wall / CPU max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = prev = None
    for r in rows:
        if r["config"] == "dp-metis":
            continue
        if "error" in r:
            print(f"| {r['config']} | error: {r['error']} |||||||||")
            continue
        base, prev = base or r, prev or r
        print(_ablation_row(r, base, prev))
        prev = r
    if not pipeline:
        print("| + pipelining | pipelining: not implemented yet |||||||||")
    metis = next((r for r in rows if r["config"] == "dp-metis" and "error" not in r), None)
    if metis:
        print(f"\n(DP DepComm + METIS, not in the ablation: wall {metis['wall_s']:.2f} s, "
              f"CPU max {metis['cpu_s_max']:.2f} s, max/min {metis['cpu_max_min']:.2f})")


def print_summary(rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any],
                  pipeline: bool) -> None:
    print(f"\n## NeutronTP Fig. 10 / Fig. 11 at small scale\n\n"
          f"R-MAT {info['vertices']} vertices, {info['edges']} edges (symmetrised, "
          f"deduplicated; +self-loops for GCN), GCN {IN_DIM}-{HIDDEN}-{CLASSES}, dropout 0.5, "
          f"Adam; {args.workers} gloo workers x 1 thread; {args.warmup} warm-up + "
          f"{args.epochs} timed epochs, medians.")
    if args.workers > info["cores"]:
        print(f"\nNOTE: {args.workers} workers x 1 thread > {info['cores']} cores: workers "
              "time-share the cores, so wall time is inflated and noisy; per-rank CPU time "
              "(process_time, includes gloo's threads) is the compute measure.")
    print(f"\n1-minute load average: {info['load_before']:.1f} before, {info['load_after']:.1f} "
          f"after (the machine is shared; load above {info['cores']} means other jobs ran).")
    print_fig10(rows)
    print_fig11(rows, pipeline)
    coupled = [r for r in rows if r["config"] in ("dp-chunk", "dp-metis", "tp-naive")
               and "error" not in r]
    if len(coupled) > 1:
        ref = coupled[0]["losses"]
        same = all(max(abs(a - b) for a, b in zip(ref, r["losses"])) < 1e-4 for r in coupled)
        print(f"\nCoupled-GCN losses agree across DP/TP (|diff| < 1e-4): "
              f"{'yes' if same else 'NO'} {[[round(x, 5) for x in r['losses']] for r in coupled]}")


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=120_000)
    p.add_argument("--edges", type=int, default=8_000_000,
                   help="edges after symmetrisation, at most (edges // 2 drawn)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-collective limit (s)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; expected some of {', '.join(CONFIGS)}")
    pipeline = pipeline_supported()
    if not pipeline and "tp-pipeline" in args.configs:
        args.configs.remove("tp-pipeline")
        print("pipelining: not implemented yet (TensorParallel.Options has no 'pipeline')",
              file=sys.stderr)
    t0 = time.perf_counter()
    args.cache_dir = str(load_graph(args))
    from fullgraph.graph import store

    meta = store.read_meta(Path(args.cache_dir))
    info = {"vertices": meta["num_nodes"], "edges": meta["num_edges"],
            "cores": len(os.sched_getaffinity(0)), "graph_s": time.perf_counter() - t0,
            "load_before": os.getloadavg()[0]}
    per_rank = spawn(args)
    info["load_after"] = os.getloadavg()[0]
    rows = [summarise(name, [r[name] for r in per_rank]) for name in args.configs]
    for row in rows:
        print(json.dumps({**info, "workers": args.workers, **row}), flush=True)
    print_summary(rows, args, info, pipeline)
    peak = max((r.get("rss_mib_max", 0) for r in rows), default=0)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (graph {info['graph_s']:.0f} s); "
          f"peak RSS of one worker {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
