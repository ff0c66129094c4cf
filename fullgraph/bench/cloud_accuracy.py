"""NeutronCloud's accuracy measurements: partial reduce against the exact run (a script).

Every run goes through the real launcher (``fullgraph train --workers N``, gloo, one
thread per worker), GCN (hidden 16, 2 layers, dropout 0.5, lr 0.01, weight decay
5e-4), data parallelism with a hybrid plan, the paper's compute injection (each
worker, each epoch, a 10 % chance of a slowdown of twice its clean epoch lasting 5
epochs), and is read back from its ``--metrics-out`` file. Tables:

1. accuracy: Cora and Coauthor CS, ``--adapt adjust`` (exact) against
   ``--adapt adjust+partial`` at K = 3: test accuracy at the best validation epoch,
   mean and spread over ``--seeds`` seeds, and the runs' wall time;
2. Fig. 11: Cora, K = 1..5: test accuracy (mean over the seeds) and mean epoch;
3. Fig. 14: epoch-to-accuracy on Cora, one seed: validation accuracy against elapsed
   time with and without partial reduce, the time each needs to reach 98 % of the
   exact run's best validation accuracy, and a PNG (``--plot``);
4. ``classes`` (not in the default set, seconds): how each class's training vertices
   are spread over the workers' METIS parts.

Coauthor CS is read from ``--root`` (``<root>/coauthor_cs/coauthor_cs.npz``, copied
into a scratch dataset root). Workers share this host's cores: times are for ratios
within one run.

    python -m fullgraph.bench.cloud_accuracy --root DATASETS
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from fullgraph.bench import add_root, entry_point, names
from fullgraph.bench.figures import NO_MATPLOTLIB, new_figure, save_figure
from fullgraph.runlog import read_run_log

INJECT = "sleep:p=0.1,n=5,seed={seed}"
TABLES = ("accuracy", "staleness", "convergence", "classes")


def run(args: argparse.Namespace, dataset: list[str], mode: str, seed: int, epochs: int,
        staleness: int = 3) -> dict[str, Any]:
    """One training run; its per-epoch records and summary."""
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-acc-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "fullgraph.cli", "train", *dataset, "--model", "gcn",
               "--epochs", str(epochs), "--seed", str(seed), "--strategy", "data",
               "--dep-mode", "hybrid", "--adapt", mode, "--staleness", str(staleness),
               "--inject", INJECT.format(seed=seed), "--workers", str(args.workers),
               "--oversubscribe", "--threads", "1", "--progress", "off", "--quiet",
               "--metrics-out", str(metrics)]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: "
                               f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        log = read_run_log(metrics)
    summary = log.summary or {}
    return {"epochs": log.epochs, "test": summary["test_acc"], "total_s": summary["total_s"],
            "mean_epoch_s": statistics.fmean(e["epoch_s"] for e in log.epochs)}


def cell(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.2f} +- {100 * spread:.2f}"


def accuracy_table(args: argparse.Namespace, datasets: dict[str, list[str]]) -> list[str]:
    lines = ["### Partial reduce against the exact run (acceptance)", "",
             f"{args.workers} workers, `--inject {INJECT.format(seed='<seed>')}`, K = 3, "
             f"seeds 0-{args.seeds - 1}. Test accuracy at the best validation epoch, %; time: "
             "mean total seconds of a run.", "",
             "| dataset | epochs | exact (adjust) | adjust+partial | difference, points | "
             "time exact / partial |", "| --- | --- | --- | --- | --- | --- |"]
    for name, flags in datasets.items():
        epochs = args.epochs if name == "cora" else args.cs_epochs
        runs = {m: [run(args, flags, m, s, epochs) for s in range(args.seeds)]
                for m in ("adjust", "adjust+partial")}
        acc = {m: [r["test"] for r in rs] for m, rs in runs.items()}
        secs = {m: statistics.fmean(r["total_s"] for r in rs) for m, rs in runs.items()}
        diff = 100 * (statistics.fmean(acc["adjust+partial"]) - statistics.fmean(acc["adjust"]))
        lines.append(f"| {name} | {epochs} | {cell(acc['adjust'])} | "
                     f"{cell(acc['adjust+partial'])} | {diff:+.2f} | "
                     f"{secs['adjust']:.0f} / {secs['adjust+partial']:.0f} s |")
        print(lines[-1], file=sys.stderr, flush=True)  # progress
    return lines


def staleness_table(args: argparse.Namespace, cora: list[str]) -> list[str]:
    lines = ["### Accuracy against the staleness bound K, Cora (Fig. 11)", "",
             f"{args.workers} workers, adjust+partial, seeds 0-{args.seeds - 1}; K = 1 "
             "synchronises every epoch (the exact run).", "",
             "| K | test accuracy, % | mean epoch, s |", "| --- | --- | --- |"]
    for k in range(1, 6):
        runs = [run(args, cora, "adjust+partial", s, args.epochs, staleness=k)
                for s in range(args.seeds)]
        lines.append(f"| {k} | {cell([r['test'] for r in runs])} | "
                     f"{statistics.fmean(r['mean_epoch_s'] for r in runs):.3f} |")
        print(lines[-1], file=sys.stderr, flush=True)  # progress
    return lines


def curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(elapsed seconds, validation accuracy) at every evaluated epoch."""
    out, elapsed = [], 0.0
    for rec in records:
        elapsed += rec["epoch_s"]
        if rec["val_acc"] == rec["val_acc"]:  # not NaN: evaluated
            out.append((elapsed, rec["val_acc"]))
    return out


def convergence_table(args: argparse.Namespace, cora: list[str]) -> list[str]:
    curves = {m: curve(run(args, cora, m, 0, args.epochs)["epochs"])
              for m in ("adjust", "adjust+partial")}
    target = 0.98 * max(v for _, v in curves["adjust"])
    lines = ["### Epoch-to-accuracy with and without partial reduce, Cora (Fig. 14)", "",
             f"{args.workers} workers, seed 0; time until the validation accuracy first "
             f"reaches {100 * target:.1f} % (98 % of the exact run's best).", "",
             "| mode | time to target, s | best validation, % |", "| --- | --- | --- |"]
    for mode, points in curves.items():
        hit = next((t for t, v in points if v >= target), None)
        lines.append(f"| {mode} | {'not reached' if hit is None else f'{hit:.1f}'} | "
                     f"{100 * max(v for _, v in points):.1f} |")
    if args.plot:
        lines += ["", plot_curves(curves, args)]
    return lines


def plot_curves(curves: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> str:
    """Fig. 14 as a PNG at ``--plot``; its Markdown link."""
    fig = new_figure(6, 3.5)
    if fig is None:
        return NO_MATPLOTLIB
    ax = fig.add_subplot()
    for mode, points in curves.items():
        ax.plot([t for t, _ in points], [100 * v for _, v in points], label=mode)
    ax.set_xlabel("elapsed training time, s")
    ax.set_ylabel("validation accuracy, %")
    ax.set_title(f"Cora, {args.workers} workers, compute injection")
    ax.legend()
    return save_figure(fig, Path(args.plot), "epoch-to-accuracy")


def class_spread_table(args: argparse.Namespace, datasets: dict[str, list[str]]) -> list[str]:
    """How the training vertices of each class are spread over the workers' METIS parts:
    an update without one worker loses the classes that worker holds most of."""
    from fullgraph.cli import build_parser, config_from_args
    from fullgraph.graph import datasets as store
    from fullgraph.partition import partition

    lines = ["### Training vertices of each class over the workers' parts", "",
             f"METIS, {args.workers} parts, as the runs above. Per dataset: the classes "
             "with at least 80 % of their training vertices in one part, and the largest "
             "share.", "", "| dataset | classes | classes >= 80 % in one part | largest "
             "share |", "| --- | --- | --- | --- |"]
    for name, flags in datasets.items():
        cfg = config_from_args(build_parser().parse_args(["train", *flags]))
        ds = store.load_for(cfg.data)
        part = partition(ds.graph, args.workers, "metis", seed=0).part_of
        labels, train = ds.data.labels[ds.data.train_mask], part[ds.data.train_mask]
        counts = torch.zeros(args.workers, ds.data.num_classes)
        counts.index_put_((train, labels), torch.ones(labels.numel()), accumulate=True)
        share = counts.max(0).values / counts.sum(0).clamp(min=1)
        lines.append(f"| {name} | {ds.data.num_classes} | {int((share >= 0.8).sum())} | "
                     f"{100 * float(share.max()):.0f} % |")
    return lines


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_root(p, "holds coauthor_cs/*.npz; without it, Cora only")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=200, help="Cora epochs")
    p.add_argument("--cs-epochs", type=int, default=60, help="Coauthor CS epochs")
    p.add_argument("--tables", default="accuracy,staleness,convergence",
                   help=f"comma list of {', '.join(TABLES)}")
    p.add_argument("--plot", default="", help="PNG path for the Fig. 14 plot")
    args = p.parse_args(argv)
    tables = names(p, "--tables", args.tables, TABLES)
    print(f"python -m fullgraph.bench.cloud_accuracy "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores\n",
          flush=True)
    cora = ["--dataset", "cora", "--normalize-features"]
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-data-") as root:
        datasets = {"cora": cora}
        npz = Path(args.root) / "coauthor_cs" / "coauthor_cs.npz"
        if npz.is_file():
            raw = Path(root) / "coauthor_cs" / "raw"
            raw.mkdir(parents=True)
            shutil.copyfile(npz, raw / "coauthor_cs.npz")
            datasets["coauthor_cs"] = ["--dataset", "coauthor_cs", "--root", root,
                                       "--normalize-features"]
        else:
            print(f"(no {npz}: Coauthor CS left out)")
        for name, make in (("classes", lambda: class_spread_table(args, datasets)),
                           ("accuracy", lambda: accuracy_table(args, datasets)),
                           ("staleness", lambda: staleness_table(args, cora)),
                           ("convergence", lambda: convergence_table(args, cora))):
            if name in tables:
                print("\n".join(make()) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
