"""Defaults that fit the machine, and workers against threads (a script, not a test).

On cached R-MAT graphs, every configuration is trained through the real launcher
(``fullgraph.bench.task.run``: ``fullgraph train``, gloo, one thread per worker unless
said) for ``--epochs`` epochs; its median epoch after the first is read back from the
metrics file. Configurations of one table run in turn, ``--repeats`` rounds, and each
cell is the median over the rounds, so a load spike hits one round, not one option.

1. ``defaults``: the data strategy's ``--dep-mode hybrid`` (the cost model's split,
   checked at setup against the pure modes) against ``depcomm`` and ``depcache``; p2p
   with its default bins (CPU: from the available RAM) against G3's 5,000-vertex bins.
   The target: no default slower than the plain alternative by more than 5 %.
2. ``threads``: per strategy, ``--workers 2 --threads 1`` against one process with
   ``--threads 2`` (``--strategy single``): what splitting one host into workers costs.

    python -m fullgraph.bench.defaults --tables defaults,threads
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
from pathlib import Path
from typing import Any

from fullgraph.bench import entry_point
from fullgraph.bench.rmat import cached_rmat
from fullgraph.bench.task import CLASSES, run

DEFAULT_ROWS = [
    ("data, DepComm", ["--strategy", "data", "--dep-mode", "depcomm"]),
    ("data, DepCache", ["--strategy", "data", "--dep-mode", "depcache"]),
    ("data, hybrid (default costs)", ["--strategy", "data", "--dep-mode", "hybrid"]),
    ("p2p, --bin-size 5000", ["--strategy", "p2p", "--bin-size", "5000"]),
    ("p2p, default bins", ["--strategy", "p2p"]),
]
THREAD_ROWS = [
    ("single, 1 process x 2 threads", 1, ["--strategy", "single", "--threads", "2"]),
    ("data DepComm, 2 workers x 1 thread", 2, ["--strategy", "data"]),
    ("data DepCache, 2 workers x 1 thread", 2, ["--strategy", "data", "--dep-mode",
                                                 "depcache"]),
    ("tensor, 2 workers x 1 thread", 2, ["--strategy", "tensor"]),
    ("p2p, 2 workers x 1 thread", 2, ["--strategy", "p2p"]),
    ("task, 2 workers x 1 thread", 2, ["--strategy", "task"]),
    ("task --task-pieces 3, 2 workers x 1 thread", 2, ["--strategy", "task", "--task-pieces",
                                                        "3"]),
]


def rounds(args: argparse.Namespace, data: Path,
           rows: list[tuple[str, int, list[str]]]) -> dict[str, list[dict[str, Any]]]:
    """Every row ``--repeats`` times, in turn; per row its runs."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in rows}
    for _ in range(args.repeats):
        for name, workers, flags in rows:
            out[name].append(run(args, data, workers, flags))
    return out


def epoch(runs: list[dict[str, Any]]) -> float | None:
    """The median epoch over the rounds that ran; None when none did."""
    good = [r["epoch_s"] for r in runs if "epoch_s" in r]
    return statistics.median(good) if good else None


def cells(runs: list[dict[str, Any]], ref: float | None) -> str:
    """A row's ``epoch s | ratio`` cells: the median over the rounds that ran, with how
    many of them did when fewer than all, or ``failed: <reason>`` (the last line the
    failing run printed, as ``bench.task``) when none did."""
    t = epoch(runs)
    error = next((r["error"] for r in runs if "error" in r), "no round ran")
    if t is None:
        return f"failed: {error} | -"
    good = sum("epoch_s" in r for r in runs)
    short = "" if good == len(runs) else f" ({good} of {len(runs)} rounds; failed: {error})"
    ratio = "-" if ref is None else f"{t / ref:.2f}"
    return f"{t:.3f}{short} | {ratio}"


def defaults_table(args: argparse.Namespace, data: Path, graph: str) -> list[str]:
    lines = []
    for workers in args.workers:
        got = rounds(args, data, [(n, workers, f) for n, f in DEFAULT_ROWS])
        t = {n: epoch(rs) for n, rs in got.items()}
        data_times = [x for x in (t["data, DepComm"], t["data, DepCache"]) if x is not None]
        base = {"data": min(data_times, default=None), "p2p": t["p2p, --bin-size 5000"]}
        for name, _ in DEFAULT_ROWS:
            ref = base[name.split(",")[0]]
            lines.append(f"| {graph} | {workers} | {name} | {cells(got[name], ref)} |")
    return lines


def threads_table(args: argparse.Namespace, data: Path, graph: str) -> list[str]:
    got = rounds(args, data, THREAD_ROWS)
    one = epoch(got[THREAD_ROWS[0][0]])
    return [f"| {graph} | {name} | {cells(got[name], one)} |" for name, _, _ in THREAD_ROWS]


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default="20000:400000,100000:2000000",
                   help="R-MAT graphs as vertices:edges, comma-separated")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "fullgraph-bench"))
    p.add_argument("--tables", default="defaults,threads")
    args = p.parse_args(argv)
    tables = args.tables.split(",")
    for table in tables:
        if table not in ("defaults", "threads"):
            p.error(f"--tables: unknown table {table!r}; expected defaults, threads")
    print(f"<!-- {datetime.date.today()} {platform.node()}, {args.epochs} epochs, median "
          f"of {args.repeats} rounds -->")
    graphs = [tuple(int(v) for v in g.split(":")) for g in args.graphs.split(",")]
    heads = {"defaults": ("| graph | workers | configuration | epoch s | vs the plain "
                          "alternative |\n| --- | --- | --- | --- | --- |", defaults_table),
             "threads": ("| graph | configuration | epoch s | vs 1 process x 2 threads |\n"
                         "| --- | --- | --- | --- |", threads_table)}
    for table in tables:
        head, rows_of = heads[table]
        print(f"\n{head}")
        for n, e in graphs:
            data = cached_rmat(args.cache, n, e, args.features, CLASSES, args.seed)
            for line in rows_of(args, data, f"R-MAT {n} / {e}"):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
