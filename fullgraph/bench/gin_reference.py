"""GIN with batch normalisation written in plain torch: a third system beside fullgraph
and PyG, for the Coauthor CS comparison of ``bench.pyg_accuracy`` (a script).

The model of ``pyg_accuracy``'s ``gin-bn`` (two layers; MLP Linear, BatchNorm1d,
ReLU, Linear; dropout on each layer's input; Adam with weight decay 5e-4; the test
accuracy at the best validation epoch) from ``torch.nn`` modules and ``torch.sparse``
products only: no fullgraph model code and no PyG. Like fullgraph, the first layer
applies its first weight to the CSR features before summing over the graph
(``(A + I)(x W)``); PyG sums the dense features first (``((A + I) x) W``), which is
the same function. ``--masks torch`` draws dropout from torch's generator,
``--masks keyed`` uses fullgraph's keyed masks (``ops.dropout``) with fullgraph's
seeds, so that the masks can be told apart from the rest of the implementation.

    python -m fullgraph.bench.gin_reference --root DATASETS --seeds 20
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.bench import add_root, entry_point
from fullgraph.bench.accuracy import ROOT_HELP, SETTINGS, load
from fullgraph.bench.pyg_accuracy import adjacency
from fullgraph.graph.data import Dataset

MASKS = ("torch", "keyed")


class PlainGIN(nn.Module):
    """Two GIN layers with batch normalisation over ``adj`` = A + I (torch CSR)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, dropout: float,
                 masks: str) -> None:
        super().__init__()
        self.lin1 = nn.ModuleList([nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)])
        self.norm = nn.ModuleList([nn.BatchNorm1d(hidden), nn.BatchNorm1d(hidden)])
        self.lin2 = nn.ModuleList([nn.Linear(hidden, hidden), nn.Linear(hidden, out_dim)])
        self.p, self.masks = dropout, masks

    def drop(self, x: Tensor, stage: int, step_seed: int) -> Tensor:
        """Dropout of a layer's input (``stage``: fullgraph's LayerInput index)."""
        if not self.training or self.p == 0.0:
            return x
        sparse = x.layout == torch.sparse_csr
        if self.masks == "torch":
            if sparse:
                return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(),
                                               F.dropout(x.values(), self.p, True), x.shape,
                                               check_invariants=False)
            return F.dropout(x, self.p, True)
        from fullgraph.models.stages import stage_seed
        from fullgraph.ops.dropout import keyed_dropout
        from fullgraph.ops.sparse import sparse_dropout

        keys, seed = torch.arange(x.shape[0]), stage_seed(step_seed, stage)
        return sparse_dropout(x, self.p, keys, seed) if sparse else \
            keyed_dropout(x, self.p, keys, seed, True)

    def forward(self, adj: Tensor, x: Tensor, step_seed: int) -> Tensor:
        x = self.drop(x, 0, step_seed)
        first: nn.Linear = self.lin1[0]  # type: ignore[assignment]
        if x.layout == torch.sparse_csr:
            h = adj @ torch.sparse.mm(x, first.weight.t()) + first.bias
        else:
            h = first(adj @ x)
        x = F.relu(self.lin2[0](F.relu(self.norm[0](h))))
        x = self.drop(x, 4, step_seed)
        h = self.lin1[1](adj @ x)
        return self.lin2[1](F.relu(self.norm[1](h)))


def self_loop_adjacency(ds: Dataset) -> Tensor:
    """A + I as torch CSR (row = destination), one self-loop per vertex."""
    return adjacency(ds, self_loops=True)


def train_plain(ds: Dataset, adj: Tensor, masks: str, epochs: int, seed: int
                ) -> tuple[float, float]:
    """(best validation accuracy, test accuracy at that epoch) of one run."""
    from fullgraph.train import step_seed

    options, lr = SETTINGS["gin"]
    data = ds.data
    x = data.features_as(torch.float32)
    x = x.to_sparse_csr() if x.layout == torch.strided else x
    torch.manual_seed(seed)
    net = PlainGIN(x.shape[1], int(options["hidden"]), data.num_classes,
                   float(options["dropout"]), masks)
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=5e-4)
    y, train_m, val_m, test_m = data.labels, data.train_mask, data.val_mask, data.test_mask
    best = (-1.0, float("nan"))
    for epoch in range(epochs):
        net.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(adj, x, step_seed(seed, epoch))[train_m], y[train_m]).backward()
        opt.step()
        net.eval()
        with torch.no_grad():
            hit = net(adj, x, 0).argmax(1) == y
        val, test = (float(hit[m].float().mean()) for m in (val_m, test_m))
        if val > best[0]:
            best = (val, test)
    return best


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_root(p, ROOT_HELP)
    p.add_argument("--dataset", default="coauthor_cs")
    p.add_argument("--masks", default="torch", choices=MASKS)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=200)
    args = p.parse_args(argv)
    ds = load(Path(args.root), args.dataset)
    adj = self_loop_adjacency(ds)
    tests, vals = [], []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        t0 = time.perf_counter()
        val, test = train_plain(ds, adj, args.masks, args.epochs, seed)
        vals.append(val)
        tests.append(test)
        print(f"<!-- plain torch {args.dataset} gin-bn masks {args.masks} seed {seed}: "
              f"val/test {val:.4f}/{test:.4f} ({time.perf_counter() - t0:.0f} s) -->",
              flush=True)
    sd = statistics.stdev(tests) if len(tests) > 1 else 0.0
    print(f"| plain torch ({args.masks} masks) | {args.dataset} | gin-bn | "
          f"{100 * statistics.mean(tests):.2f} +- {100 * sd:.2f} | "
          f"{100 * statistics.mean(vals):.2f} | {len(tests)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
