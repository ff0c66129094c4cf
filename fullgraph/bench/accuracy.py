"""Test accuracy of every model on the real datasets (a script, not a test).

Mean and standard deviation over seeds of the test accuracy at the best validation
epoch, public split for the Planetoid graphs and the seeded 20/30-per-class split
for Amazon Photo and Coauthor CS. Prints a markdown table for BENCHMARKS.md.

    python -m fullgraph.bench.accuracy --root ../shared/datasets
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from fullgraph.config import Config, ModelConfig, TrainConfig
from fullgraph.graph.data import Dataset
from fullgraph.train import train

# The papers' settings: GCN and GAT as Kipf & Welling and Velickovic et al. on the
# citation graphs (row-normalised features), GCN with 64 hidden units as Shchur et
# al. on Amazon / Coauthor (raw features); SAGE and GIN use 64 hidden units, GIN
# with batch normalisation in its MLP as PyG's GIN example (coupled form only).
SETTINGS: dict[str, tuple[dict[str, Any], float]] = {
    "gcn": (dict(hidden=16, dropout=0.5), 0.01),
    "sage": (dict(hidden=64, dropout=0.5), 0.01),
    "gat": (dict(hidden=8, heads=8, dropout=0.6), 0.005),
    "gin": (dict(hidden=64, dropout=0.5, batch_norm=True), 0.01),
}
CITATION = ("cora", "citeseer")


def load(shared: Path, name: str) -> Dataset:
    from fullgraph.graph.formats.npz import load_npz
    from fullgraph.graph.formats.planetoid import load_planetoid

    if name in CITATION:
        ds = load_planetoid(shared / "planetoid" / "raw", name)
        ds.data = ds.data.row_normalized()
        return ds
    return load_npz(shared / name / f"{name}.npz", name, seed=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="../shared/datasets", help="the shared datasets folder")
    p.add_argument("--datasets", default="cora,citeseer,amazon_photo,coauthor_cs")
    p.add_argument("--models", default="gcn,sage,gat,gin")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--decoupled", action="store_true", help="decoupled forms (K = 2)")
    args = p.parse_args(argv)
    print("| dataset | model | test accuracy (mean +- std) | seeds | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.datasets.split(","):
        ds = load(Path(args.root), name)
        for model in args.models.split(","):
            options, lr = SETTINGS[model]
            if model == "gcn" and name not in CITATION:
                options = dict(options, hidden=64)
            if args.decoupled:
                options = {k: v for k, v in options.items() if k != "batch_norm"}
            accs, t0 = [], time.perf_counter()
            for seed in range(args.seeds):
                cfg = Config(model=ModelConfig(name=model, decoupled=args.decoupled, **options),
                             train=TrainConfig(epochs=args.epochs, lr=lr, seed=seed))
                accs.append(train(ds, cfg).test_at_best)
            std = statistics.stdev(accs) if len(accs) > 1 else 0.0
            label = model + ("-decoupled" if args.decoupled else
                             "-bn" if options.get("batch_norm") else "")
            print(f"| {name} | {label} | {100 * statistics.mean(accs):.1f} +- {100 * std:.1f} | "
                  f"{args.seeds} | {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
