"""NeutronCloud's measurements at this machine's scale (a script, not a test).

On one cached R-MAT graph (``--vertices``, ``--edges``, ``--features``; 16 classes,
GCN, hidden 64, 2 layers) every configuration is trained for ``--epochs`` epochs
through the real launcher (``fullgraph train --workers N``, gloo, one thread per
worker) and read back from its ``--metrics-out`` file; all configurations run in
one invocation, one after the other, so their ratios are comparable.

Tables:
1. per-epoch time (Figs. 7 and 8): static DepComm, static DepCache, static hybrid
   (the cost model at start), hybrid + online adjustment (``--adapt adjust``), and
   + partial reduce (``--adapt adjust+partial``, approximate), each
   stable, under compute injection (the paper's: sleep, ``--sleep``) and under a CPU
   throttle (``--throttle``); the mean epoch after the first (the paper averages
   its epochs), and the fluctuation-induced delay: mean epoch under injection minus
   the same configuration's stable mean;
2. preprocessing (Table 2): Algorithm 2's time on the slowest worker against the
   run's whole training time, scaled to 100 epochs;
3. cost breakdown over a long run with injection (Fig. 17): per epoch, the throttled
   worker's compute split into local and DepCache parts by its edge counts, and its
   time in halo exchanges (transfer + waiting); a PNG plot beside the table when
   matplotlib is installed (``--plot``).

Workers share this host's cores: times are for ratios within one run only.

    python -m fullgraph.bench.cloud
    python -m fullgraph.bench.cloud --vertices 4000 --edges 40000 --epochs 6   # quick
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fullgraph.bench import entry_point, names
from fullgraph.bench.figures import NO_MATPLOTLIB, new_figure, save_figure
from fullgraph.bench.rmat import cached_rmat
from fullgraph.runlog import read_run_log

CLASSES, HIDDEN = 16, 64
TABLES = ("time", "breakdown")

CONFIGS = [
    ("static DepComm", ["--dep-mode", "depcomm"]),
    ("static DepCache", ["--dep-mode", "depcache"]),
    ("static hybrid", ["--dep-mode", "hybrid"]),
    ("hybrid + online adjustment", ["--dep-mode", "hybrid", "--adapt", "adjust"]),
    ("+ partial reduce (K = 3)", ["--dep-mode", "hybrid", "--adapt", "adjust+partial"]),
]


def dataset_dir(args: argparse.Namespace) -> Path:
    """The R-MAT dataset of ``args``, generated once into ``args.cache``."""
    return cached_rmat(args.cache, args.vertices, args.edges, args.features, CLASSES,
                       args.seed)


def run(args: argparse.Namespace, data: Path, flags: list[str], epochs: int) -> dict[str, Any]:
    """Train one configuration through the launcher (or, with ``--link``, one process per
    rank in the emulated hosts, as torchrun would start them); the parsed metrics."""
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-cloud-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "fullgraph.cli", "train", "--dataset", str(data),
               "--model", "gcn", "--hidden", str(HIDDEN), "--epochs", str(epochs),
               "--progress", "off", "--quiet", "--metrics-out", str(metrics), "--threads", "1",
               "--strategy", "data", "--partitioner", "metis", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.link_ctx is not None:
            failed = run_in_hosts(args, cmd, env)
        else:
            done = subprocess.run([*cmd, "--workers", str(args.workers), "--oversubscribe"],
                                  env=env, capture_output=True, text=True)
            failed = None if done.returncode == 0 else \
                (done.stderr or done.stdout).strip().splitlines()[-1:]
        if failed:
            return {"error": failed}
        log = read_run_log(metrics)
    walls = [e["epoch_s"] for e in log.epochs[1:] or log.epochs]
    total = (log.summary or {}).get("total_s", sum(e["epoch_s"] for e in log.epochs))
    between = max(0.0, total - sum(e["epoch_s"] for e in log.epochs))
    return {"mean_s": statistics.fmean(walls) + between / max(1, len(log.epochs) - 1),
            "median_s": statistics.median(walls), "between_s": between, "total_s": total,
            "ranks": log.ranks}


def run_in_hosts(args: argparse.Namespace, cmd: list[str], env: dict[str, str]) -> list[str] | None:
    """Rank r in emulated host r % 2 (``bench.netlink``); None, or why it failed."""
    from fullgraph.bench import netlink

    codes = netlink.run_ranks(args.link_ctx, args.workers, lambda r: cmd, env=env,
                              timeout_s=args.run_timeout,
                              master_port=29700 + secrets.randbelow(200))
    bad = [r for r, c in enumerate(codes) if c != 0]
    return [f"ranks {bad} exited with {[codes[r] for r in bad]}"] if bad else None


def injections(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """The columns of table 1: stable first, then those ``--injections`` names."""
    out = [("stable", []), ("sleep", ["--inject", args.sleep]),
           ("cpu throttle", ["--inject", args.throttle])]
    if args.link_ctx is not None:
        out.append(("network", ["--inject", args.net]))
    wanted = set(args.injections.split(",")) if args.injections else None
    unknown = (wanted or set()) - {name for name, _ in out}
    if unknown:
        raise SystemExit(f"--injections: no column {sorted(unknown)} here; expected some of "
                         f"{', '.join(name for name, _ in out[1:])}")
    return [c for c in out if c[0] == "stable" or wanted is None or c[0] in wanted]


def time_table(args: argparse.Namespace, data: Path) -> tuple[list[str], dict[Any, Any]]:
    injections_ = injections(args)
    results = {(c, i): run(args, data, flags + inj, args.epochs)
               for c, flags in CONFIGS for i, inj in injections_}
    base = results["static DepComm", "stable"]
    lines = [f"### Per-epoch time and fluctuation-induced delay, {args.workers} workers "
             "(Figs. 7 and 8)", "",
             f"sleep: `{args.sleep}`; cpu throttle: `{args.throttle}`"
             + (f"; network: `{args.net}` over a {args.link} emulated link (ranks 0, 2 in "
                "one namespace, 1, 3 in the other)" if args.link_ctx is not None else "")
             + ". Mean epoch after the first, s, with the time between epochs (the "
             "adjustment, metrics) spread over them (x: against static DepComm stable); "
             "delay: mean under injection minus the same configuration stable.", "",
             "| configuration | stable | " + " | ".join(f"{i} | delay" for i, _ in
                                                       injections_[1:]) + " |",
             "| --- " * (2 * len(injections_)) + "|"]
    for c, _ in CONFIGS:
        cells = []
        stable = results[c, "stable"]
        for i, _ in injections_:
            r = results[c, i]
            if "error" in r:
                cells.append(f"failed: {r['error']}")
                continue
            cells.append(f"{r['mean_s']:.3f} ({r['mean_s'] / base['mean_s']:.2f}x)"
                         if "mean_s" in base else f"{r['mean_s']:.3f}")
            if i != "stable":
                cells.append(f"{r['mean_s'] - stable['mean_s']:+.3f}" if "mean_s" in stable
                             else "")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines, results


def preprocess_table(args: argparse.Namespace, results: dict[Any, Any]) -> list[str]:
    r = results["hybrid + online adjustment", "stable"]
    if "error" in r:
        return [f"preprocessing: run failed: {r['error']}"]
    seconds = max(e["seconds"] for recs in r["ranks"].values() for rec in recs
                  for e in rec.get("events", []) if e["kind"] == "preprocess")
    per_epoch = r["total_s"] / args.epochs
    return ["### Preprocessing against training (Table 2)", "",
            "| Algorithm 2, slowest worker | 100 epochs of training (mean epoch x 100) | ratio |",
            "| --- | --- | --- |",
            f"| {seconds:.3f} s | {100 * per_epoch:.1f} s | {seconds / (100 * per_epoch):.2%} |"]


def breakdown_table(args: argparse.Namespace, data: Path) -> list[str]:
    flags = ["--dep-mode", "hybrid", "--adapt", "adjust", "--inject", args.throttle]
    r = run(args, data, flags, args.long_epochs)
    if "error" in r:
        return [f"breakdown: run failed: {r['error']}"]
    ranks = r["ranks"]
    injected = {rank: sum(any(e["kind"] == "inject" for e in rec.get("events", []))
                          for rec in recs) for rank, recs in ranks.items()}
    rank = max(injected, key=lambda k: (injected[k], -k))
    rows = []
    for rec in ranks[rank]:
        edges = rec["edges_local"] + rec["edges_redundant"]
        cache_share = rec["edges_redundant"] / edges if edges else 0.0
        comm = sum(rec["comm_by_phase"].get(p, 0) + rec["wait_by_phase"].get(p, 0)
                   for p in ("halo", "halo-grad"))
        slowed = any(e["kind"] == "inject" for e in rec.get("events", []))
        rows.append((rec["epoch"], rec["compute_s"] * (1 - cache_share),
                     rec["compute_s"] * cache_share, comm, slowed))
    lines = [f"### Cost breakdown over {args.long_epochs} epochs, rank {rank} (Fig. 17)", "",
             f"`{' '.join(flags)}`; rank {rank} was throttled in {injected[rank]} epochs. "
             "T_local / T_cache: its compute split by its local / redundant edges; T_comm: "
             "its halo exchange time, transfer and waiting. Medians:", "",
             "| epochs | T_local s | T_cache s | T_comm s |", "| --- | --- | --- | --- |"]
    for name, keep in (("throttled", True), ("not throttled", False)):
        sel = [row for row in rows if row[4] == keep]
        if sel:
            lines.append(f"| {name} ({len(sel)}) | " + " | ".join(
                f"{statistics.median(row[k] for row in sel):.4f}" for k in (1, 2, 3)) + " |")
    if args.plot:
        lines.append("")
        lines.append(plot_breakdown(rows, rank, Path(args.plot)))
    return lines


def plot_breakdown(rows: list[tuple], rank: int, out: Path) -> str:
    fig = new_figure(8, 3.5)
    if fig is None:
        return NO_MATPLOTLIB
    ax = fig.add_subplot()
    epochs = [row[0] for row in rows]
    for k, label in ((1, "T_local"), (2, "T_cache"), (3, "T_comm")):
        ax.plot(epochs, [row[k] for row in rows], label=label)
    for row in rows:
        if row[4]:
            ax.axvspan(row[0] - 0.5, row[0] + 0.5, color="0.9", lw=0)
    ax.set_xlabel("epoch (shaded: throttled)")
    ax.set_ylabel("seconds")
    ax.set_title(f"rank {rank}: cost breakdown under CPU throttling, online adjustment on")
    ax.legend()
    return save_figure(fig, out, "cost breakdown")


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=400_000, help="edges after symmetrisation")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30, help="epochs per run of table 1")
    p.add_argument("--long-epochs", type=int, default=100, help="epochs of the Fig. 17 run")
    p.add_argument("--sleep", default="sleep:p=0.1,s=auto,n=5,seed=1")
    p.add_argument("--throttle", default="cpu:p=0.1,load=2,n=5,seed=1")
    p.add_argument("--link", default="", help="run the workers in two emulated hosts joined "
                   "by a link of this rate (e.g. 1gbit; needs root and iproute2) and add "
                   "network injection (--net)")
    p.add_argument("--net", default="net:rate=20mbit,p=0.1,n=5,seed=1,ranks=0+1")
    p.add_argument("--injections", default="", help="comma list of the injected columns of "
                   "table 1 (sleep, cpu throttle, network; default: all)")
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--plot", default="", help="PNG path for the Fig. 17 plot")
    p.add_argument("--tables", default="time,breakdown", help=f"comma list of {', '.join(TABLES)}")
    args = p.parse_args(argv)
    args.tables = names(p, "--tables", args.tables, TABLES)
    if args.workers < 2:
        p.error("--workers: needs at least 2")
    data = dataset_dir(args)
    with contextlib.ExitStack() as stack:
        args.link_ctx = None
        if args.link:
            from fullgraph.bench import netlink

            args.link_ctx = stack.enter_context(netlink.two_hosts(args.link))
        return report(args, data, argv)


def report(args: argparse.Namespace, data: Path, argv: list[str] | None) -> int:
    print(f"python -m fullgraph.bench.cloud {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"R-MAT {args.vertices} vertices, {args.edges} edges, {args.features} features, "
          f"{args.workers} workers\n", flush=True)
    tables = args.tables
    if "time" in tables:
        lines, results = time_table(args, data)
        print("\n".join(lines) + "\n", flush=True)
        print("\n".join(preprocess_table(args, results)) + "\n", flush=True)
    if "breakdown" in tables:
        print("\n".join(breakdown_table(args, data)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
