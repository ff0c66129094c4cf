"""Partition quality and time: chunk, random, METIS and G3 (a script, not a test).

For each graph and partitioner: seconds to partition, per-part max/min of vertices,
in-edges and remote vertices (G3 §4.1's cost factors), total remote vertices, the
busiest part's work over the mean (in-edges plus the mean in-degree per vertex, as
``metis``'s ``"work"`` weights count it), edge cut and replication factor. Prints a
markdown table for BENCHMARKS.md. A method ``metis:CONSTRAINTS`` runs METIS with
those vertex weights (``metis:vertices+degree`` is G3's first stage).

    python -m fullgraph.bench.partition --parts 4 --rmat 1000000:20000000 \
        --npz DATASETS/coauthor_cs/coauthor_cs.npz
"""
from __future__ import annotations

import argparse
import time

from fullgraph.bench import entry_point
from fullgraph.graph.data import Dataset
from fullgraph.partition import partition
from fullgraph.partition.metis import work_imbalance
from fullgraph.partition.metrics import quality

METHODS = ("chunk", "random", "metis", "g3")


def graphs(args: argparse.Namespace) -> list[Dataset]:
    from fullgraph.graph.formats.npz import load_npz
    from fullgraph.graph.synthetic import rmat

    out = []
    for spec in args.rmat:
        n, e = (int(v) for v in spec.split(":"))
        out.append(rmat(n, e, num_features=4, seed=args.seed))
    for path in args.npz:
        out.append(load_npz(path))
    return out


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", type=int, nargs="+", default=[4])
    p.add_argument("--rmat", nargs="*", default=["1000000:20000000"], help="VERTICES:EDGES")
    p.add_argument("--npz", nargs="*", default=[], help="gnn-benchmark .npz files")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print("| graph | parts | method | seconds | remote max/min | remote total "
          "| vertices max/min | in-edges max/min | work max/mean | edge cut | replication |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ds in graphs(args):
        g = ds.graph
        name = f"{ds.name} ({g.num_nodes} v, {g.num_edges} e)"
        degree = g.in_degrees().numpy()
        for parts in args.parts:
            for method in args.methods.split(","):
                base, _, constraints = method.partition(":")
                opts = {"constraints": constraints} if constraints else {}
                t0 = time.perf_counter()
                book = partition(g, parts, base, seed=args.seed, **opts)
                seconds = time.perf_counter() - t0
                q = quality(g, book)
                work = work_imbalance(book.part_of.numpy(), degree, parts)
                print(f"| {name} | {parts} | {method} | {seconds:.1f} | "
                      f"{q.ratio('remote'):.3f} | {sum(q.remote)} | "
                      f"{q.ratio('vertices'):.3f} | {q.ratio('edges'):.3f} | {work:.3f} | "
                      f"{q.edge_cut} | {q.replication_factor:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
