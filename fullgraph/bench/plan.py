"""Validate the planner (``fullgraph plan``) against measured runs (a script, not a test).

For each graph (Cora, a dense Reddit-shaped R-MAT, a sparse products-shaped R-MAT;
the R-MAT ones generated into a temporary root at the given scale) and each worker
count, it prices every candidate with ``fullgraph.planner.plan_run`` and then trains
each for ``--epochs`` epochs with ``fullgraph train --metrics-out``. Measured memory
is the largest per-rank peak RSS of the metrics file (``peak_mem``), compared with
the predicted worker process (interpreter, libraries, dataset) plus the candidate's
largest per-worker total; measured epoch time is the median over epochs after the
first of the slowest rank's wall time. Each candidate trains ``--rounds`` times (every
candidate once per round, in turn, so that a load spike hits one run of several
candidates rather than every run of one) and the measured figures are the medians
over the rounds. It also checks the recommendation: the
recommended candidate's measured epoch against the fastest measured.

The rates each plan measured (the workers' slowdown, a byte, a round, the
calibration) go to stderr, one line per graph and worker count.

The planner's intermediate data is compared with the bytes autograd saved for the
backward (``saved_bytes`` of the profile, where the run records it), and its bytes
per epoch with the largest rank's received bytes of one epoch (every phase).

Prints one row per (graph, workers, candidate) as markdown, then the target checks
(memory within 25%, time within 1.5x, recommended within 20% of the fastest).

    python -m fullgraph.bench.plan --scale 0.5 --workers 2 4 --epochs 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fullgraph.bench import entry_point
from fullgraph.config import config_from_dict
from fullgraph.graph import datasets, synthetic
from fullgraph.plan_measure import rss_bytes
from fullgraph.planner import candidate_flags, plan_run, table_lines


def graphs(scale: float) -> dict[str, dict[str, int]]:
    """R-MAT shapes: Reddit-like (dense, wide) and products-like (sparse, narrow)."""
    return {"rmat-dense": dict(vertices=int(6000 * scale), edges=int(300_000 * scale),
                               features=256, classes=41),
            "rmat-sparse": dict(vertices=int(20_000 * scale), edges=int(100_000 * scale),
                                features=100, classes=47)}


def make_root(scale: float, root: str) -> None:
    """The graphs of ``graphs(scale)`` and Cora, processed into the dataset root ``root``."""
    for name, shape in graphs(scale).items():
        ds = synthetic.rmat(shape["vertices"], shape["edges"], num_features=shape["features"],
                            num_classes=shape["classes"], symmetrize=True, seed=0)
        datasets.save_processed(ds, Path(root), name)
    cora = datasets.load_for(config_from_dict({}).data)
    datasets.save_processed(cora, Path(root), "cora")


def measure(root: str, dataset: str, workers: int, flags: list[str], epochs: int,
            model: str) -> dict[str, float] | None:
    """Train once; the slowest rank's median epoch and the largest peak RSS."""
    out = Path(root) / "metrics.jsonl"
    cmd = [sys.executable, "-m", "fullgraph.cli", "train", "--root", root, "--dataset", dataset,
           "--model", model, "--workers", str(workers), "--epochs", str(epochs),
           "--metrics-out", str(out), "--log-level", "warning", "--oversubscribe", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"# failed: {' '.join(flags)}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    walls: dict[int, float] = {}
    peak = saved = recv = 0
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "rank_epoch":
            peak = max(peak, int(rec["peak_mem"]))
            saved = max(saved, int(rec.get("saved_bytes", 0)))
            recv = max(recv, sum(rec["bytes_recv"].values()))
            if rec["epoch"] > 1:
                walls[rec["epoch"]] = max(walls.get(rec["epoch"], 0.0), rec["wall_s"])
    return {"epoch_s": statistics.median(walls.values()), "peak": peak, "saved": saved,
            "recv": recv}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every graph's rows, trained in a temporary dataset root that is removed after."""
    with tempfile.TemporaryDirectory(prefix="fullgraph-plan-bench-") as root:
        make_root(args.scale, root)
        return run_in(args, root)


def run_in(args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    rounds = max(1, args.rounds)
    base = rss_bytes()
    rows = []
    for dataset in args.graphs:
        for workers in args.workers:
            cfg = config_from_dict({"data": {"dataset": dataset, "root": root},
                                    "model": {"name": args.model},
                                    "launch": {"workers": workers}})
            result = plan_run(cfg, datasets.load_for(cfg.data), base_rss=base)
            rates = next(line for line in table_lines(result) if line.startswith("rates:"))
            print(f"# {dataset} W={workers} {rates}", file=sys.stderr, flush=True)
            runs: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(result.estimates))}
            for _ in range(rounds):  # every candidate once per round, in turn
                for i, est in enumerate(result.estimates):
                    flags = candidate_flags(est.candidate, result.device_budget is not None)
                    got = measure(root, dataset, workers, flags, args.epochs, args.model)
                    if got is not None:
                        runs[i].append(got)
            for i, est in enumerate(result.estimates):
                if not runs[i]:
                    continue
                got = {k: statistics.median(r[k] for r in runs[i]) for k in runs[i][0]}
                rows.append({"graph": dataset, "workers": workers,
                             "strategy": est.candidate.label,
                             "recommended": est is result.recommended,
                             "mem_pred": result.process_bytes + est.peak.total,
                             "mem_meas": got["peak"], "time_pred": est.seconds,
                             "inter_pred": max(c.memory["intermediate"] for c in est.costs),
                             "inter_meas": got["saved"], "moved_pred": est.bytes_moved,
                             "moved_meas": got["recv"],
                             "time_meas": got["epoch_s"],
                             "time_runs": [r["epoch_s"] for r in runs[i]]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _pair(row: dict[str, Any], key: str) -> str:
    meas = row.get(f"{key}_meas", 0)
    text = f"{row[f'{key}_pred'] / 2**20:.2f} / {meas / 2**20:.2f}" if meas else "- / -"
    return text


def report(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| graph | W | strategy | peak pred MiB | peak meas MiB | ratio | intermediate "
             "pred / saved MiB | moved pred / recv MiB | epoch pred ms | epoch meas ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (rec.)" if r["recommended"] else ""
        lines.append(f"| {r['graph']} | {r['workers']} | {r['strategy']}{mark} | "
                     f"{r['mem_pred'] / 2**20:.0f} | {r['mem_meas'] / 2**20:.0f} | "
                     f"{r['mem_pred'] / r['mem_meas']:.2f} | {_pair(r, 'inter')} | "
                     f"{_pair(r, 'moved')} | {r['time_pred'] * 1e3:.1f} | "
                     f"{r['time_meas'] * 1e3:.1f} | {r['time_pred'] / r['time_meas']:.2f} |")
    mem_ok = sum(abs(r["mem_pred"] / r["mem_meas"] - 1) <= 0.25 for r in rows)
    time_ok = sum(1 / 1.5 <= r["time_pred"] / r["time_meas"] <= 1.5 for r in rows)
    lines.append(f"\nmemory within 25%: {mem_ok}/{len(rows)}; epoch within 1.5x: "
                 f"{time_ok}/{len(rows)}")
    for key in sorted({(r["graph"], r["workers"]) for r in rows}):
        group = [r for r in rows if (r["graph"], r["workers"]) == key]
        fastest = min(group, key=lambda r: r["time_meas"])
        rec = next((r for r in group if r["recommended"]), None)
        if rec is not None:
            gap = rec["time_meas"] / fastest["time_meas"] - 1
            lines.append(f"{key[0]} W={key[1]}: recommended {rec['strategy']} measured "
                         f"{gap:+.0%} vs fastest {fastest['strategy']}"
                         f"{'' if gap <= 0.2 else '  (misses the 20% target)'}")
    return lines


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=["cora", "rmat-dense", "rmat-sparse"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scale", type=float, default=0.5, help="R-MAT size factor")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs per candidate, one candidate after the other per round; "
                        "the measured numbers are their medians")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("\n".join(report(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
