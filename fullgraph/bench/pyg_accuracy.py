"""Test accuracy of fullgraph and PyG side by side, on the identical split (a script).

For each dataset and model, seeds 0..S-1 train fullgraph (``fullgraph.train``) and a
PyG model of the same architecture (``SAGEConv`` / ``GINConv`` / ``GATConv``) from its own
initialisation: dropout on each layer's input (the features included, as fullgraph
does), ReLU between layers, Adam with the same learning rate and weight decay, full
batch, the test accuracy at the best validation epoch. fullgraph gets its features
laid out as ``fullgraph train`` lays them out (``--sparse-features auto``: CSR for
bag-of-words features such as Coauthor CS's), PyG gets them dense, as its examples.
``gin-bn`` is GIN with batch normalisation in its MLP (Linear, BatchNorm1d, ReLU,
Linear, as PyG's GIN example), fullgraph's ``batch_norm=True``. Prints a markdown
table for BENCHMARKS.md.

    python -m fullgraph.bench.pyg_accuracy --root DATASETS
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.bench import add_root, entry_point, names
from fullgraph.bench.accuracy import ROOT_HELP, SETTINGS, load
from fullgraph.config import Config, ModelConfig, TrainConfig
from fullgraph.extras import require
from fullgraph.graph.data import Dataset
from fullgraph.graph.sparse import choose_layout
from fullgraph.train import train

MODELS = ("sage", "gin", "gin-bn", "gat")


class PygNet(nn.Module):
    """``[dropout, conv] x L`` with ReLU between layers, as fullgraph's coupled models."""

    def __init__(self, model: str, in_dim: int, hidden: int, out_dim: int, dropout: float,
                 num_layers: int = 2, heads: int = 8) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv, GINConv, SAGEConv

        wide = heads * hidden if model == "gat" else hidden  # (GAT: heads concatenated)
        dims = [in_dim] + [wide] * (num_layers - 1) + [out_dim]
        convs: list[nn.Module] = []
        for k, (i, o) in enumerate(zip(dims[:-1], dims[1:])):
            if model == "sage":
                convs.append(SAGEConv(i, o))
                continue
            if model == "gat":  # (attention dropout as the features'; one averaged head last)
                last = k == num_layers - 1
                convs.append(GATConv(i, o if last else hidden, heads=1 if last else heads,
                                     concat=not last, dropout=dropout))
                continue
            norm = [nn.BatchNorm1d(hidden)] if model == "gin-bn" else []
            convs.append(GINConv(nn.Sequential(nn.Linear(i, hidden), *norm, nn.ReLU(),
                                               nn.Linear(hidden, o)), train_eps=False))
        self.convs, self.p = nn.ModuleList(convs), dropout

    def forward(self, x: Tensor, adj_t: Tensor) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(F.dropout(x, self.p, self.training), adj_t)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def adjacency(ds: Dataset, self_loops: bool = False) -> Tensor:
    """The transposed adjacency (row = destination) as torch CSR: without self-loops,
    or with ``self_loops`` one per vertex (A + I)."""
    graph = ds.graph.with_self_loops(self_loops)
    src, dst = graph.edges()
    n = ds.data.num_nodes
    values = torch.ones(src.numel())
    return torch.sparse_coo_tensor(torch.stack([dst, src]), values, (n, n),
                                   check_invariants=True).coalesce() \
        .to_sparse_csr()


def train_pyg(ds: Dataset, adj_t: Tensor, model: str, hidden: int, dropout: float, lr: float,
              weight_decay: float, epochs: int, seed: int) -> tuple[float, float]:
    """(best validation accuracy, test accuracy at that epoch) of one PyG run."""
    data = ds.data
    torch.manual_seed(seed)
    net = PygNet(model, data.num_features, hidden, data.num_classes, dropout)
    if model == "gat":  # (GATConv adds its self-loops to an edge list)
        src, dst = ds.graph.with_self_loops(False).edges()
        adj_t = torch.stack([src, dst])
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    x, y = data.features_as(torch.float32), data.labels
    masks = (data.train_mask, data.val_mask, data.test_mask)
    best = (-1.0, float("nan"))
    for _ in range(epochs):
        net.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x, adj_t)[masks[0]], y[masks[0]]).backward()
        opt.step()
        net.eval()
        with torch.no_grad():
            hit = net(x, adj_t).argmax(1) == y
        val, test = (float(hit[m].float().mean()) for m in masks[1:])
        if val > best[0]:
            best = (val, test)
    return best


def train_ours(ds: Dataset, model: str, options: dict, lr: float, epochs: int,
               seed: int) -> tuple[float, float]:
    """(best validation accuracy, test accuracy at that epoch) of one fullgraph run,
    on the features as ``fullgraph train`` holds them (``choose_layout`` auto)."""
    features = choose_layout(ds.data.features, "auto")
    if features is not ds.data.features:
        ds = dataclasses.replace(ds, data=dataclasses.replace(ds.data, features=features))
    name = "gin" if model == "gin-bn" else model
    if name == "gin":
        options = dict(options, batch_norm=model == "gin-bn")
    cfg = Config(model=ModelConfig(name=name, **options),
                 train=TrainConfig(epochs=epochs, lr=lr, seed=seed))
    result = train(ds, cfg)
    return result.best_val, result.test_at_best


def cell(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} +- {100 * std:.1f}"


def row(ds: Dataset, adj_t: Tensor, name: str, model: str, seeds: range, epochs: int,
        per_seed: bool) -> str:
    """One table row: both systems over ``seeds``."""
    options, lr = SETTINGS["gin" if model == "gin-bn" else model]
    ours, theirs, secs = [], [], [0.0, 0.0]
    for seed in seeds:
        t0 = time.perf_counter()
        ours.append(train_ours(ds, model, options, lr, epochs, seed))
        t1 = time.perf_counter()
        theirs.append(train_pyg(ds, adj_t, model, int(options["hidden"]), options["dropout"], lr,
                                5e-4, epochs, seed))
        secs[0] += t1 - t0
        secs[1] += time.perf_counter() - t1
        if per_seed:
            print(f"<!-- {name} {model} seed {seed}: fullgraph val/test {ours[-1][0]:.4f}/"
                  f"{ours[-1][1]:.4f}, PyG {theirs[-1][0]:.4f}/{theirs[-1][1]:.4f} -->",
                  flush=True)
    diff = statistics.mean(t for _, t in ours) - statistics.mean(t for _, t in theirs)
    return (f"| {name} | {model} | {cell([t for _, t in ours])} | "
            f"{cell([t for _, t in theirs])} | {100 * diff:+.1f} | "
            f"{cell([v for v, _ in ours])} | {cell([v for v, _ in theirs])} | "
            f"{seeds.start}-{seeds.stop - 1} | {secs[0]:.0f} / {secs[1]:.0f} |")


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_root(p, ROOT_HELP)
    p.add_argument("--datasets", default="amazon_photo,coauthor_cs")
    p.add_argument("--models", default="sage,gin-bn", help=f"some of {', '.join(MODELS)}")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds from this one on")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--per-seed", action="store_true", help="also print each seed's numbers")
    args = p.parse_args(argv)
    models = names(p, "--models", args.models, MODELS)
    require("torch_geometric", "the comparison with PyG")
    print("| dataset | model | fullgraph test | PyG test | difference | fullgraph val | "
          "PyG val | seeds | seconds (fullgraph / PyG) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.datasets.split(","):
        ds = load(Path(args.root), name)
        adj_t = adjacency(ds)
        for model in models:
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            print(row(ds, adj_t, name, model, seeds, args.epochs, args.per_seed),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
