"""What per-part shards hold against the whole dataset (a script, not a test).

On one cached R-MAT graph (``--vertices``, ``--edges``, ``--features``) and a METIS
partition into ``--parts`` parts, ``fullgraph.partition.shards.write_shards`` writes
the shards for each ``--hops``; the table gives, per hop count, the time to write
them and each part's bytes on disk against the whole dataset's (the largest part and
the mean), with its feature rows and edges against the whole graph's.

    python -m fullgraph.bench.shards
    python -m fullgraph.bench.shards --vertices 100000 --edges 2000000   # quick
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from fullgraph.bench import entry_point
from fullgraph.bench.rmat import cached_rmat
from fullgraph.runlog import MIB, fmt_bytes


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=1_000_000)
    p.add_argument("--edges", type=int, default=20_000_000, help="after symmetrisation")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--hops", default="0,1,2")
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    args = p.parse_args(argv)
    from fullgraph.checkpoint import dataset_fingerprint
    from fullgraph.graph import store
    from fullgraph.partition import partition
    from fullgraph.partition.shards import write_shards

    data = cached_rmat(args.cache, args.vertices, args.edges, args.features, 16, 0)
    dataset = store.load_dataset(data, verify=False)
    whole = du(data)
    fingerprint = dataset_fingerprint(dataset)
    n, e = dataset.graph.num_nodes, dataset.graph.num_edges
    t0 = time.perf_counter()
    book = partition(dataset.graph, args.parts, "metis", seed=0)
    metis_s = time.perf_counter() - t0
    print(f"python -m fullgraph.bench.shards {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores; R-MAT "
          f"{n} vertices, {e} edges, {args.features} float32 features: {fmt_bytes(whole)} "
          f"on disk; METIS into {args.parts} parts in {metis_s:.1f} s\n")
    print("| hops | write s | largest part, MiB (of whole) | mean part, MiB (of whole) | "
          "feature rows, largest part (of N) | edges, largest part (of E) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-shards-", dir=args.cache) as tmp:
        for hops in (int(h) for h in args.hops.split(",")):
            out = Path(tmp) / f"h{hops}"
            t0 = time.perf_counter()
            sizes = write_shards(dataset, book, out, hops, fingerprint, "metis")
            took = time.perf_counter() - t0
            nbytes = [du(out / f"part-{k}") for k in range(args.parts)]
            big, mean = max(nbytes), sum(nbytes) / len(nbytes)
            rows = max(s["rows"] for s in sizes)
            edges = max(s["edges"] for s in sizes)
            print(f"| {hops} | {took:.1f} | {big / MIB:.1f} ({big / whole:.0%}) | "
                  f"{mean / MIB:.1f} ({mean / whole:.0%}) | {rows} ({rows / n:.0%}) | "
                  f"{edges} ({edges / e:.0%}) |", flush=True)
            shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
