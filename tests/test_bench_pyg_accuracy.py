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


@pytest.mark.parametrize("masks", ["torch", "keyed"])
def test_the_plain_torch_gin_is_pygs_function(masks):
    """With PyG's weights and no dropout, the plain-torch GIN gives PyG's outputs (CSR
    features, weight first) in training and evaluation mode; it trains with either
    kind of dropout mask."""
    from fullgraph.bench.gin_reference import PlainGIN, self_loop_adjacency, train_plain

    ds = sbm(50, 3, avg_degree=5.0, num_features=12, seed=3)
    x = ds.data.features_as(torch.float64)
    torch.manual_seed(0)
    pyg = PygNet("gin-bn", 12, 16, 3, 0.0).double()
    plain = PlainGIN(12, 16, 3, 0.0, masks).double()
    for layer, conv in enumerate(pyg.convs):
        lin1, norm, _, lin2 = conv.nn
        plain.lin1[layer].load_state_dict(lin1.state_dict())
        plain.norm[layer].load_state_dict(norm.state_dict())
        plain.lin2[layer].load_state_dict(lin2.state_dict())
    adj, adj_t = self_loop_adjacency(ds).double(), adjacency(ds).double()
    for training in (True, False):
        pyg.train(training)
        plain.train(training)
        torch.testing.assert_close(plain(adj, x.to_sparse_csr(), 0), pyg(x, adj_t))
    val, test = train_plain(ds, self_loop_adjacency(ds), masks, 3, 0)
    assert 0.0 <= val <= 1.0 and 0.0 <= test <= 1.0
