"""Epoch time and peak memory against graph size (a script, not a test).

For R-MAT graphs of ``--sizes`` vertices at average degree ``--degree`` (symmetrised,
one self-loop per vertex, 128 features, 47 classes, written once into ``--cache`` by
the streaming generator), one single-process training run each, in a child process:
GCN, 2 layers, hidden ``--hidden``, ``--epochs`` epochs. The table gives the median
epoch time, the time per million edges, the peak resident memory of the run (sampled
every 50 ms from ``/proc``; "anon" leaves out the page cache of the memory-mapped
dataset) and the memory per million vertices, then a least-squares line of epoch time
against edges and each size's deviation from it. ``--plot FILE`` draws both against
edges (needs matplotlib). ``--row-block N`` trains each size with ``--strategy tensor
--workers 1 --row-block N`` instead: the dense stages between propagations run N rows
at a time and are recomputed in the backward pass, so no (N, hidden) activation is
held whole (the largest-graph measurement). The children start as ``fullgraph`` does
from a shell, so they get the same allocator and huge-page set-up.

    python -m fullgraph.bench.growth
    python -m fullgraph.bench.growth --sizes 250000,500000 --epochs 2   # quick
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from fullgraph.bench import entry_point
from fullgraph.bench.figures import NO_MATPLOTLIB, new_figure, save_figure

CHILD = "import sys; from fullgraph.cli import main; sys.exit(main())"
"""The child runs as ``fullgraph`` does from the shell: ``main()`` reads its arguments
and first sets up the allocator and huge pages (see ``fullgraph.allocator``)."""
MEDIAN = re.compile(r"median epoch ([0-9.]+) s")


def dataset(cache: Path, vertices: int, degree: int, seed: int) -> tuple[Path, int]:
    """The cached graph's directory and its edge count (generated on first use)."""
    from fullgraph.graph import store, synthetic

    where = cache / f"rmat-{vertices}-deg{degree}-loops-{seed}"
    if not store.is_cached(where):
        synthetic.write_rmat(where, vertices, vertices * degree // 2, seed=seed,
                             symmetrize=True, self_loops="add", num_classes=47)
    return where, int(store.read_meta(where)["num_edges"])


def status_bytes(pid: int, keys) -> dict[str, int]:
    """The memory fields ``keys`` (e.g. VmRSS, RssAnon) of ``/proc/PID/status`` in
    bytes; none where the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            try:
                out[key] = int(value.split()[0]) * 1024
            except (ValueError, IndexError):
                pass
    return out


def peak_run(cmd: list[str]) -> tuple[str, int, int, dict[str, float]]:
    """Run ``cmd``; its stdout, its peak VmRSS and RssAnon in bytes, and its CPU times
    and page faults (``user``, ``sys`` in seconds, ``minflt``, ``majflt``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"growth-{os.getpid()}.out"
    with open(out_file, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        peak = {"VmRSS": 0, "RssAnon": 0}
        while child.poll() is None:
            for key, value in status_bytes(child.pid, peak).items():
                peak[key] = max(peak[key], value)
            time.sleep(0.05)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    usage = {"user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
             "minflt": after.ru_minflt - before.ru_minflt,
             "majflt": after.ru_majflt - before.ru_majflt}
    text = out_file.read_text()
    out_file.unlink()
    if child.returncode:  # e.g. -9 from the kernel when memory ran out: a row says so
        text += f"\n(exit {child.returncode})"
    return text, peak["VmRSS"], peak["RssAnon"], usage


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def plot(rows: list[dict], out: Path) -> str:
    fig = new_figure(9, 3.5)
    if fig is None:
        return NO_MATPLOTLIB
    edges = [r["edges"] / 1e6 for r in rows]
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(edges, [r["epoch"] for r in rows], "o-")
    ax.set_xlabel("edges (millions)")
    ax.set_ylabel("median epoch (s)")
    ax = fig.add_subplot(1, 2, 2)
    ax.plot(edges, [r["rss"] / 2**30 for r in rows], "o-", label="peak RSS")
    ax.plot(edges, [r["anon"] / 2**30 for r in rows], "s--", label="of it anonymous")
    ax.set_xlabel("edges (millions)")
    ax.set_ylabel("GiB")
    ax.legend()
    return save_figure(fig, out, "growth")


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="250000,500000,1000000,2000000,4000000")
    p.add_argument("--degree", type=int, default=20)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--row-block", type=int, default=None,
                   help="train with --strategy tensor --workers 1 --row-block N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--plot", help="write the figure here (PNG)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# growth: GCN hidden {args.hidden}, {args.epochs} epochs, degree {args.degree}, "
          f"{f'row blocks of {args.row_block}, ' if args.row_block else ''}"
          f"{platform.node()}, {os.cpu_count()} cores, {datetime.date.today()}", flush=True)
    rows: list[dict] = []
    failed: list[tuple[int, int, int]] = []
    for n in sizes:
        t0 = time.perf_counter()
        where, edges = dataset(Path(args.cache), n, args.degree, args.seed)
        made = time.perf_counter() - t0
        cmd = [sys.executable, "-c", CHILD, "train", "--dataset", str(where), "--model", "gcn",
               "--hidden", str(args.hidden), "--epochs", str(args.epochs),
               "--eval-every", str(args.epochs), "--progress", "off"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.row_block:
            cmd += ["--strategy", "tensor", "--workers", "1", "--row-block", str(args.row_block)]
        text, rss, anon, usage = peak_run(cmd)
        match = MEDIAN.search(text)
        if match is None:
            print(f"# {n} vertices: did not finish, peak {rss / 2**30:.2f} GiB; the run "
                  f"ended with:\n{text[-600:]}", flush=True)
            failed.append((n, edges, rss))
            continue
        rows.append({"vertices": n, "edges": edges, "epoch": float(match.group(1)),
                     "rss": rss, "anon": anon, **usage})
        print(f"# {n} vertices: dataset {made:.0f} s, epoch {rows[-1]['epoch']:.2f} s, "
              f"peak {rss / 2**30:.2f} GiB", flush=True)
    if not rows:
        return 1
    a, b = fit([r["edges"] for r in rows], [r["epoch"] for r in rows])
    print("\n| vertices | edges | median epoch s | s per M edges | deviation from fit | "
          "peak RSS GiB (anon) | GiB per M vertices |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        line = a + b * r["edges"]
        print(f"| {r['vertices']:,} | {r['edges']:,} | {r['epoch']:.2f} | "
              f"{r['epoch'] / r['edges'] * 1e6:.3f} | {(r['epoch'] - line) / line:+.1%} | "
              f"{r['rss'] / 2**30:.2f} ({r['anon'] / 2**30:.2f}) | "
              f"{r['rss'] / 2**30 / r['vertices'] * 1e6:.2f} |")
    for n, edges, rss in failed:
        print(f"| {n:,} | {edges:,} | did not finish | | | {rss / 2**30:.2f} at the end | |")
    print("\n| vertices | user CPU s | system CPU s | minor faults | major faults |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['vertices']:,} | {r['user']:.1f} | {r['sys']:.1f} | {r['minflt']:,} | "
              f"{r['majflt']:,} |")
    print(f"\nfit: epoch = {a:.3f} s + {b * 1e6:.4f} s per million edges")
    if args.plot:
        print(plot(rows, Path(args.plot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
