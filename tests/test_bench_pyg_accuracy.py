"""The side-by-side accuracy script: both systems run the model asked for."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from fullgraph.bench.pyg_accuracy import PygNet, adjacency, train_ours, train_pyg  # noqa: E402
from fullgraph.graph.synthetic import sbm  # noqa: E402


def test_adjacency_sums_in_neighbours():
    ds = sbm(40, 2, avg_degree=4.0, num_features=3, seed=1)
    x = torch.randn(40, 3)
    src, dst = ds.graph.edges()
    ref = torch.zeros(40, 3).index_add_(0, dst, x[src])
    torch.testing.assert_close(adjacency(ds) @ x, ref)


@pytest.mark.parametrize("model", ["sage", "gin", "gin-bn"])
def test_both_systems_train(model):
    ds = sbm(60, 3, avg_degree=5.0, num_features=8, seed=2)
    net = PygNet(model, 8, 16, 3, 0.5)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in net.modules()) == (model == "gin-bn")
    opts = dict(hidden=16, dropout=0.5)
    for val, test in (train_pyg(ds, adjacency(ds), model, 16, 0.5, 0.01, 5e-4, 3, 0),
                      train_ours(ds, model, opts, 0.01, 3, 0)):
        assert 0.0 <= val <= 1.0 and 0.0 <= test <= 1.0
