"""NeutronTask's measurements at this machine's scale (a script, not a test).

On one cached R-MAT graph (``--vertices``, ``--edges``, ``--features``; 16 classes,
hidden 64, 2 layers, 2 propagations when decoupled) every configuration is trained
for ``--epochs`` epochs through the real launcher (``fullgraph train --workers N``,
gloo, one thread per worker) and read back from its ``--metrics-out`` file. Per
configuration:

- ``saved MiB``: the intermediate data autograd holds between forward and backward
  on the worker holding the most (``SavedBytes``: every saved tensor once,
  parameters excluded) -- NeutronTask Fig. 10's "memory per GPU" without the graph;
- ``RSS MiB``: peak resident memory of the largest worker (graph, features,
  replicas, allocator slack included);
- ``MiB/epoch``: bytes sent per epoch, all workers (Fig. 15; MiB = 2**20 bytes, as
  ``fullgraph train`` prints them);
- ``epoch s``: median epoch wall time after the first epoch. Workers share this
  host's cores, so times are for ratios within one run only.

Tables:
1. memory and bytes (Figs. 10 and 15): data parallelism (DepComm, DepCache), tensor
   parallelism, task parallelism coupled, task-decoupled, task-decoupled +
   recomputation, at ``--workers`` workers, coupled and decoupled models;
2. the scheduling model (§5.2): predicted T and P times and the split it picks,
   against the measured per-group compute and the epoch time of every split;
3. the subgraph pipeline (Fig. 14a): ``--subgraphs`` 1 (one serial hand-off), 2 and 4;
4. ``regroup`` (Fig. 14b, not in the default set): on Cora (a real graph, so the
   accuracy means something; GCN, hidden 16, normalised features, 2 workers, 1:1),
   ``--task-deps regroup`` with S = 1..6 subgraphs of ``--chunks 12`` against the
   exact mode, each for ``--regroup-epochs`` epochs and every seed of ``--seeds``:
   median epoch time and mean test accuracy (at the best validation epoch);
5. ``groups`` (Figs. 11 and 19, not in the default set): coupled GCN at
   ``--workers`` workers: data and tensor parallelism, task parallelism with one
   worker per group (2 workers, the rest idle), and the two P-group forms with the
   workers halved between the groups (``--task-split 2:2`` at 4 workers),
   ``--group-parallel data`` (hybrid, section 4.3) and ``tensor`` (task x tensor, section 6.11);
6. ``ablation`` (Fig. 12, not in the default set): naive task parallelism (coupled GCN,
   workers halved between the groups, one hand-off), then + dependency management
   (4 pipelined subgraphs with reuse), + task-decoupled, + the scheduling model.

    python -m fullgraph.bench.task --tables regroup
    python -m fullgraph.bench.task --tables groups,ablation
    python -m fullgraph.bench.task
    python -m fullgraph.bench.task --vertices 4000 --edges 40000 --epochs 3   # quick
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fullgraph.bench import entry_point
from fullgraph.bench.rmat import cached_rmat
from fullgraph.runlog import MIB, read_run_log

CLASSES, HIDDEN = 16, 64


def dataset_dir(args: argparse.Namespace) -> Path:
    """The R-MAT dataset of ``args``, generated once into ``args.cache``."""
    return cached_rmat(args.cache, args.vertices, args.edges, args.features, CLASSES,
                       args.seed)


def run(args: argparse.Namespace, data: Path, workers: int, flags: list[str]) -> dict[str, Any]:
    """Train one configuration through the launcher; its numbers from the metrics file."""
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-task-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "fullgraph.cli", "train", "--dataset", str(data),
               "--hidden", str(HIDDEN), "--epochs", str(args.epochs), "--workers",
               str(workers), "--oversubscribe", "--progress", "off", "--quiet",
               "--metrics-out", str(metrics), "--threads", "1", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # (the error: the last line the run printed)
            last = (done.stderr or done.stdout).strip().splitlines()[-1:]
            return {"error": last[0] if last else f"exit {done.returncode}"}
        log = read_run_log(metrics)
    ranks = {r: recs[1:] or recs for r, recs in log.ranks.items()}  # drop epoch 1 (warm-up)
    epochs = log.epochs[1:] or log.epochs
    ranks = ranks or {0: epochs}  # one process: its epochs are its rank's
    return {
        "saved_mib": max(max(x.get("saved_bytes", 0) for x in recs) for recs in ranks.values())
        / MIB,
        "rss_mib": max(max(x.get("peak_mem", 0) for x in recs) for recs in ranks.values()) / MIB,
        "mib_epoch": statistics.median(
            sum(sum(x.get("bytes_sent", {}).values())
                for x in (recs[i] for recs in ranks.values()))
            for i in range(len(epochs))) / MIB,
        "epoch_s": statistics.median(e["epoch_s"] for e in epochs),
        "compute_s": {r: statistics.median(x["compute_s"] if "compute_s" in x else x["epoch_s"]
                                           for x in recs)
                      for r, recs in ranks.items()},
        "test_acc": (log.summary or {}).get("test_acc"),
    }


MEMORY_ROWS = [
    ("data, DepComm", ["--strategy", "data", "--dep-mode", "depcomm"]),
    ("data, DepCache", ["--strategy", "data", "--dep-mode", "depcache"]),
    ("tensor", ["--strategy", "tensor"]),
    ("task", ["--strategy", "task"]),
    ("task + recompute", ["--strategy", "task", "--recompute"]),
]


def memory_table(args: argparse.Namespace, data: Path) -> list[str]:
    lines = [f"### Memory and bytes per epoch, {args.workers} workers (Figs. 10 and 15)", "",
             "| strategy | model | saved MiB (max worker) | RSS MiB (max worker) | MiB/epoch, "
             "all workers | epoch s |", "|---|---|---:|---:|---:|---:|"]
    for label, flags in MEMORY_ROWS:
        for form, extra in (("coupled", []), ("decoupled", ["--decoupled", "--num-props", "2"])):
            r = run(args, data, args.workers, flags + extra)
            print(json.dumps({"table": "memory", "config": label, "model": form, **r}),
                  flush=True)
            if "error" in r:
                lines.append(f"| {label} | {form} | failed: {r['error']} | | | |")
                continue
            lines.append(f"| {label} | {form} | {r['saved_mib']:.2f} | {r['rss_mib']:.0f} | "
                         f"{r['mib_epoch']:.2f} | {r['epoch_s']:.3f} |")
    return lines


def schedule_table(args: argparse.Namespace, data: Path) -> list[str]:
    """Predicted T / P times and split against every split measured (decoupled GCN)."""
    import torch

    from fullgraph.comm.group import single_comm
    from fullgraph.graph import store
    from fullgraph.models import build_model
    from fullgraph.parallel.taskmodel import choose_split, measure_machine, predict_times

    ds = store.load_dataset(data)
    model = build_model("gcn", ds.data.num_features, HIDDEN, CLASSES, num_layers=2,
                        decoupled=True, num_props=2)
    machine = measure_machine(single_comm())
    t_time, p_time = predict_times(model, ds.graph.num_dst, ds.graph.num_edges, machine, 0.5,
                                   torch.empty(0).element_size())
    pick = choose_split(args.workers, t_time, p_time)
    lines = [f"### Scheduling model, {args.workers} workers, decoupled GCN (§5.2)", "",
             f"{machine.describe()}; predicted forward on one worker: T {t_time * 1e3:.1f} ms, "
             f"P {p_time * 1e3:.1f} ms; split chosen {pick.num_t}:{pick.num_p}", "",
             "| split | epoch s | T-group compute s (max) | P-group compute s (max) |",
             "|---|---:|---:|---:|"]
    for num_t in range(1, args.workers):
        split = f"{num_t}:{args.workers - num_t}"
        r = run(args, data, args.workers, ["--strategy", "task", "--decoupled", "--num-props",
                                           "2", "--task-split", split])
        print(json.dumps({"table": "schedule", "split": split, **r}), flush=True)
        if "error" in r:
            lines.append(f"| {split} | failed: {r['error']} | | |")
            continue
        comp = r["compute_s"]
        t_max = max(comp[k] for k in comp if k < num_t)
        p_max = max(comp[k] for k in comp if k >= num_t)
        mark = " (chosen)" if num_t == pick.num_t else ""
        lines.append(f"| {split}{mark} | {r['epoch_s']:.3f} | {t_max:.3f} | {p_max:.3f} |")
    return lines


def pipeline_table(args: argparse.Namespace, data: Path) -> list[str]:
    lines = [f"### Subgraph pipeline, {args.workers} workers, decoupled GCN (Fig. 14a)", "",
             "| subgraphs | epoch s | MiB/epoch |", "|---:|---:|---:|"]
    for s in (1, 2, 4):
        r = run(args, data, args.workers, ["--strategy", "task", "--decoupled", "--num-props",
                                           "2", "--subgraphs", str(s)])
        print(json.dumps({"table": "pipeline", "subgraphs": s, **r}), flush=True)
        if "error" in r:
            lines.append(f"| {s} | failed: {r['error']} | |")
            continue
        lines.append(f"| {s} | {r['epoch_s']:.3f} | {r['mib_epoch']:.2f} |")
    return lines


def ablation_rows(workers: int) -> list[tuple[str, list[str]]]:
    """(label, flags) of Fig. 12's ablation: each row adds one technique to the last."""
    half = f"{workers // 2}:{workers - workers // 2}"
    naive = ["--strategy", "task", "--task-split", half, "--subgraphs", "1"]
    piped = [*naive[:-1], "4"]
    decoupled = [*piped, "--decoupled", "--num-props", "2"]
    return [(f"naive task parallelism (coupled, {half} by task kind, one hand-off)", naive),
            ("+ dependency management (4 pipelined subgraphs, reuse)", piped),
            ("+ task-decoupled", decoupled),
            ("+ scheduling model (--task-split auto)",
             [x if x != half else "auto" for x in decoupled])]


def ablation_table(args: argparse.Namespace, data: Path) -> list[str]:
    """Fig. 12: from naive task parallelism, one technique added per row."""
    lines = [f"### Ablation, {args.workers} workers, GCN (Fig. 12)", "",
             "| configuration | epoch s | ratio to naive | MiB/epoch, all workers | saved MiB "
             "(max worker) |", "|---|---:|---:|---:|---:|"]
    base = None
    for label, flags in ablation_rows(args.workers):
        r = run(args, data, args.workers, flags)
        print(json.dumps({"table": "ablation", "config": label, **r}), flush=True)
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | |")
            continue
        base = base or r["epoch_s"]
        lines.append(f"| {label} | {r['epoch_s']:.3f} | {r['epoch_s'] / base:.2f} | "
                     f"{r['mib_epoch']:.2f} | {r['saved_mib']:.2f} |")
    return lines


REGROUP_ROWS = [("exact", 1), ("exact", 4)] + [("regroup", s) for s in range(1, 7)]


def regroup_table(args: argparse.Namespace, data: Path) -> list[str]:
    """Epoch time and accuracy of the approximate mode against the exact one (Cora)."""
    seeds = [int(x) for x in args.seeds.split(",")]
    lines = [f"### Subgraph regrouping on Cora, 2 workers, GCN, {args.regroup_epochs} epochs, "
             f"seeds {args.seeds} (Fig. 14b)", "",
             "| dependencies | subgraphs (of 12 chunks) | epoch s (median of seeds) | "
             "test accuracy (mean) | per seed |", "|---|---:|---:|---:|---|"]
    for deps, s in REGROUP_ROWS:
        results = [run(args, Path("cora"), 2, [
            "--strategy", "task", "--task-split", "1:1", "--hidden", "16",
            "--normalize-features", "--epochs", str(args.regroup_epochs), "--seed", str(seed),
            "--subgraphs", str(s), "--chunks", "12", "--task-deps", deps]) for seed in seeds]
        print(json.dumps({"table": "regroup", "deps": deps, "subgraphs": s,
                          "runs": results}), flush=True)
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            lines.append(f"| {deps} | {s} | failed: {failed[0]} | | |")
            continue
        accs = [r["test_acc"] for r in results]
        lines.append(f"| {deps} | {s} | {statistics.median(r['epoch_s'] for r in results):.3f} "
                     f"| {100 * statistics.mean(accs):.1f}% | "
                     f"{', '.join(f'{100 * a:.1f}' for a in accs)} |")
    return lines


def group_rows(workers: int) -> list[tuple[str, int, list[str]]]:
    """(label, workers, flags) of the groups table."""
    half = f"{workers // 2}:{workers - workers // 2}"
    task = ["--strategy", "task"]
    return [("data, DepComm", workers, ["--strategy", "data", "--dep-mode", "depcomm"]),
            ("tensor", workers, ["--strategy", "tensor"]),
            ("task, one worker per group", 2, [*task, "--task-split", "1:1"]),
            (f"task {half}, P group by rows (hybrid)", workers,
             [*task, "--task-split", half, "--group-parallel", "data"]),
            (f"task {half}, P group by columns (task x tensor)", workers,
             [*task, "--task-split", half, "--group-parallel", "tensor"])]


def groups_table(args: argparse.Namespace, data: Path) -> list[str]:
    """Hybrid groups against data, tensor and plain task parallelism (coupled GCN)."""
    lines = [f"### Groups, coupled GCN, {args.workers} workers (Figs. 11 and 19)", "",
             "| configuration | workers | epoch s | MiB/epoch, all workers | saved MiB "
             "(max worker) |", "|---|---:|---:|---:|---:|"]
    for label, workers, flags in group_rows(args.workers):
        r = run(args, data, workers, flags)
        print(json.dumps({"table": "groups", "config": label, **r}), flush=True)
        if "error" in r:
            lines.append(f"| {label} | {workers} | failed: {r['error']} | | |")
            continue
        lines.append(f"| {label} | {workers} | {r['epoch_s']:.3f} | {r['mib_epoch']:.2f} | "
                     f"{r['saved_mib']:.2f} |")
    return lines


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=400_000, help="edges after symmetrisation")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6, help="epochs per run (the first is "
                   "left out of the medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--tables", default="memory,schedule,pipeline",
                   help="comma-separated: memory, schedule, pipeline, regroup, groups, ablation")
    p.add_argument("--regroup-epochs", type=int, default=100)
    p.add_argument("--seeds", default="0,1,2", help="seeds of the regroup table")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers: task parallelism needs at least 2")
    tables = {"memory": memory_table, "schedule": schedule_table, "pipeline": pipeline_table,
              "regroup": regroup_table, "groups": groups_table,
              "ablation": ablation_table}
    names = args.tables.split(",")
    if unknown := [n for n in names if n not in tables]:
        p.error(f"--tables: unknown {', '.join(unknown)}; expected some of {', '.join(tables)}")
    data = dataset_dir(args) if set(names) - {"regroup"} else Path()
    print(f"python -m fullgraph.bench.task {' '.join(sys.argv[1:] if argv is None else argv)}")
    graph = (f"R-MAT {args.vertices} vertices, {args.edges} edges, {args.features} features, "
             f"{args.workers} workers, {args.epochs} epochs per run" if data != Path()
             else "Cora")
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, {graph}\n")
    for name in names:
        print("\n".join(tables[name](args, data)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
