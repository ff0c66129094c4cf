"""Test accuracy of every model on the real datasets (a script, not a test).

Mean and standard deviation over seeds of the test accuracy at the best validation
epoch, public split for the Planetoid graphs and the seeded 20/30-per-class split
for Amazon Photo and Coauthor CS. Prints a markdown table for BENCHMARKS.md.

    python -m fullgraph.bench.accuracy --root DATASETS
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from fullgraph.bench import add_root, entry_point, names
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
ALIASES = {"gin-bn": "gin"}
"""The labels the table prints that name a model of ``SETTINGS`` (GIN with batch norm)."""
CITATION = ("cora", "citeseer")
ROOT_HELP = ("the shared datasets folder: planetoid/raw/ind.<name>.* for cora and citeseer, "
             "<name>/<name>.npz for the others; or a fullgraph dataset root (<name>/processed "
             "or <name>/raw, as `fullgraph train --root` reads it)")


def load(shared: Path, name: str) -> Dataset:
    """Dataset ``name`` from the shared datasets folder ``shared``:
    ``planetoid/raw/ind.<name>.*`` for the citation graphs (features row-normalised),
    ``<name>/<name>.npz`` for the others (the split of seed 0). Where ``shared`` holds a
    folder ``<name>`` instead, it is read as a fullgraph dataset root, as ``fullgraph
    train --root`` reads it (``<name>/processed``, else ``<name>/raw``; nothing is
    downloaded).

    Raises:
        DatasetNotFoundError: neither layout holds ``name``; the message names both.
    """
    from fullgraph.errors import DatasetNotFoundError
    from fullgraph.graph import datasets
    from fullgraph.graph.formats.npz import load_npz
    from fullgraph.graph.formats.planetoid import load_planetoid

    citation = name in CITATION
    source = shared / "planetoid" / "raw" if citation else shared / name / f"{name}.npz"
    if source.exists():
        ds = load_planetoid(source, name) if citation else load_npz(source, name, seed=0)
    else:
        expected = (f"{source / f'ind.{name}.*' if citation else source} (the shared "
                    f"datasets layout), or a fullgraph dataset root holding {name}/processed "
                    f"or {name}/raw")
        if not (shared / name).is_dir():  # (nothing is written where neither layout is)
            raise DatasetNotFoundError(f"dataset {name!r} is not there", source=shared,
                                       expected=expected, hint="give --root the folder "
                                       "that holds it")
        try:
            ds = datasets.load(name, shared, download=False)
        except DatasetNotFoundError as exc:
            raise DatasetNotFoundError(f"dataset {name!r} is not there ({exc})",
                                       source=shared, expected=expected) from exc
    if citation:
        ds.data = ds.data.row_normalized()
    return ds


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_root(p, ROOT_HELP)
    p.add_argument("--datasets", default="cora,citeseer,amazon_photo,coauthor_cs")
    p.add_argument("--models", default="gcn,sage,gat,gin",
                   help=f"comma list of {', '.join([*SETTINGS, *ALIASES])}")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--decoupled", action="store_true", help="decoupled forms (K = 2)")
    args = p.parse_args(argv)
    models = names(p, "--models", args.models, tuple(SETTINGS), ALIASES)
    print("| dataset | model | test accuracy (mean +- std) | seeds | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.datasets.split(","):
        ds = load(Path(args.root), name)
        for model in models:
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
