"""Sparse input features: fullgraph's CSR first layer against dense, and against PyG.

Bag-of-words features (thousands of columns, under 1 % non-zero) trained as a
2-layer GCN, single process, one training step (forward, loss, backward, Adam) timed
after a warm-up, median of ``--epochs``; four runs side by side in one process:
fullgraph with ``--sparse-features off`` and ``on``, and PyG's ``GCNConv`` with the
features dense and as a torch CSR tensor (its ``Linear`` takes either). Dropout
0.5 everywhere except on PyG's sparse input (``F.dropout`` does not take a CSR
tensor), which favours PyG. Datasets: ``bow`` (a stochastic block model with
``--features`` columns of random word counts, ``--words`` per vertex) and
``coauthor_cs`` (6,805 columns, read from ``--root``).

    python -m fullgraph.bench.sparse_features --root DATASETS
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fullgraph.bench import NO_PYG, add_root, entry_point, have_pyg
from fullgraph.bench.kernels import _median_time


def bow_dataset(n: int, features: int, words: int, seed: int = 0) -> Any:
    """An SBM graph whose features are ``words`` random word counts per vertex, the
    class visible in which words are drawn (a third from a class-specific block)."""
    from fullgraph.graph.sparse import csr
    from fullgraph.graph.synthetic import sbm

    ds = sbm(n, 8, num_features=4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    labels = ds.data.labels
    block = features // 8
    cols = torch.randint(0, features, (n, words), generator=gen)
    own = torch.randint(0, block, (n, words // 3), generator=gen) + labels[:, None] * block
    cols = torch.sort(torch.cat([cols, own], dim=1), dim=1).values
    keep = torch.ones_like(cols, dtype=torch.bool)
    keep[:, 1:] = cols[:, 1:] != cols[:, :-1]  # one entry per (row, column)
    counts = keep.sum(dim=1)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    x = csr(indptr, cols[keep], torch.ones(int(counts.sum())), (n, features))
    return dataclasses.replace(ds, name="bow", data=dataclasses.replace(ds.data, features=x))


def load(name: str, args: argparse.Namespace, scratch: Path) -> Any:
    """Dataset ``name``, features row-normalised and as CSR. A ``.npz`` of ``--root`` is
    processed in ``scratch`` (a dataset root the caller removes), as ``fullgraph train``
    processes it, leaving the shared folder as it is; any other name is read as
    ``bench.accuracy`` reads it."""
    from fullgraph.bench.accuracy import load as load_shared
    from fullgraph.graph.datasets import load as load_dataset
    from fullgraph.graph.sparse import is_sparse, to_sparse

    if name == "bow":
        return bow_dataset(args.vertices, args.features, args.words)
    npz = Path(args.root) / name / f"{name}.npz"
    if npz.is_file():
        (scratch / name / "raw").mkdir(parents=True)
        shutil.copy(npz, scratch / name / "raw")
        ds = load_dataset(name, scratch)
    else:
        ds = load_shared(Path(args.root), name)
    data = ds.data.row_normalized()
    # (the loaders hold bag-of-words features as CSR already, as `--sparse-features auto`)
    features = data.features if is_sparse(data.features) else to_sparse(data.features)
    ds.data = dataclasses.replace(data, features=features)
    return ds


def epoch_ours(ds: Any, sparse: bool, args: argparse.Namespace) -> float:
    from fullgraph.config import Config, ModelConfig, TrainConfig
    from fullgraph.graph.sparse import densify
    from fullgraph.parallel.single import SingleProcess
    from fullgraph.train import build, step_seed

    data = ds.data if sparse else dataclasses.replace(ds.data,
                                                       features=densify(ds.data.features))
    ds = dataclasses.replace(ds, data=data)
    cfg = Config(model=ModelConfig(name="gcn", hidden=args.hidden, dropout=0.5),
                 train=TrainConfig(epochs=1))
    model = build(ds, cfg)
    strategy = SingleProcess()
    plan = strategy.setup(ds, model, torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    seeds = iter(range(10**6))
    return _median_time(lambda: strategy.train_step(model, plan, opt,
                                                    seed=step_seed(0, next(seeds))),
                        args.epochs)


def epoch_pyg(ds: Any, sparse: bool, args: argparse.Namespace) -> float | None:
    try:
        from torch_geometric.nn import GCNConv
    except ImportError:
        return None
    import torch.nn.functional as F

    from fullgraph.graph.sparse import densify

    g = ds.graph
    adj_t = torch.sparse_csr_tensor(g.indptr, g.indices.to(torch.int64),
                                    torch.ones(g.num_edges), size=(g.num_dst, g.num_src),
                                    check_invariants=False)
    x = ds.data.features if sparse else densify(ds.data.features)
    y, mask = ds.data.labels, ds.data.train_mask
    torch.manual_seed(0)
    conv1 = GCNConv(ds.data.num_features, args.hidden, cached=True)
    conv2 = GCNConv(args.hidden, ds.data.num_classes, cached=True)
    opt = torch.optim.Adam([*conv1.parameters(), *conv2.parameters()], lr=0.01)

    def step() -> None:
        opt.zero_grad()
        h = x if sparse else F.dropout(x, 0.5, True)
        h = F.dropout(F.relu(conv1(h, adj_t)), 0.5, True)
        F.cross_entropy(conv2(h, adj_t)[mask], y[mask]).backward()
        opt.step()

    return _median_time(step, args.epochs)


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_root(p, "holds <name>/<name>.npz (coauthor_cs); other names are read as "
                "bench.accuracy reads them; bow needs none")
    p.add_argument("--datasets", default="bow,coauthor_cs")
    p.add_argument("--vertices", type=int, default=20_000, help="bow: vertices")
    p.add_argument("--features", type=int, default=8192, help="bow: columns")
    p.add_argument("--words", type=int, default=48, help="bow: random words per vertex")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fullgraph.ops import kernels
    kernels.set_threads(args.threads)
    print(f"<!-- {datetime.date.today()} {platform.node()} torch {torch.__version__}, "
          f"{args.threads} thread(s), GCN hidden {args.hidden}, median of {args.epochs} "
          f"steps -->")
    if not have_pyg():
        print(f"\n{NO_PYG}. Its columns read -.\n")
    print("| dataset | vertices x columns, non-zero | fullgraph dense | fullgraph CSR | "
          "PyG dense | PyG CSR | CSR / dense (fullgraph) | fullgraph CSR / PyG CSR |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-sparse-") as scratch:
        for name in args.datasets.split(","):
            print(row(name, load(name, args, Path(scratch)), args), flush=True)
    return 0


def row(name: str, ds: Any, args: argparse.Namespace) -> str:
    """The table row of ``ds``: the four systems' steps ("-" for PyG's where it is not
    installed)."""
    from fullgraph.graph.sparse import density

    dense, csr = epoch_ours(ds, False, args), epoch_ours(ds, True, args)
    pyg_dense, pyg_csr = epoch_pyg(ds, False, args), epoch_pyg(ds, True, args)
    x = ds.data.features

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.1f} ms"

    vs_pyg = "-" if pyg_csr is None else f"{csr / pyg_csr:.2f}"
    return (f"| {name} | {x.shape[0]} x {x.shape[1]}, {100 * density(x):.2f}% | "
            f"{cell(dense)} | {cell(csr)} | {cell(pyg_dense)} | {cell(pyg_csr)} | "
            f"{csr / dense:.2f} | {vs_pyg} |")


if __name__ == "__main__":
    raise SystemExit(main())
