"""Cases shared by the exactness tests of every strategy: a small graph whose vertex
count (67) and widths (9 features, 5 hidden, 3 classes) divide by no world size, the
four models, and a few epochs of training with any strategy.

TAGCN is not in ``MODELS`` (every rotation would grow by a quarter); each strategy's
test adds a few TAGCN cases of its own: ``"tagcn"`` (Horner on the projections, as
these widths choose) or ``"tagcn:agg_first"`` (the layer input propagated)."""
from __future__ import annotations

import torch
from devices import TEST_DEVICE

from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.train import step_seed

MODELS = ["gcn", "sage", "gat", "gin"]


def make_dataset():
    return sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)


def make_model(name: str, decoupled: bool, in_dim: int, out_dim: int, dtype=torch.float64):
    torch.manual_seed(0)
    name, _, variant = name.partition(":")
    opts = dict(num_layers=2, dropout=0.3, decoupled=decoupled, num_props=2)
    if name == "gat":
        opts.update(heads=2)
    if variant == "bn":  # GIN with global batch norm
        assert name == "gin", (name, variant)
        opts.update(batch_norm=True)
    elif variant:
        assert name == "tagcn" and variant == "agg_first", (name, variant)
        opts.update(aggregate_first=True)
    return build_model(name, in_dim, 5, out_dim, **opts).to(TEST_DEVICE, dtype)


def run_epochs(strategy, dataset, model, comm, epochs=3, dtype=torch.float64):
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses, outputs = [], None
    for epoch in range(1, epochs + 1):
        model.train()
        opt.zero_grad()
        result = strategy.forward(model, plan, training=True, seed=step_seed(0, epoch))
        loss = strategy.loss(result, plan)
        if outputs is None:
            outputs = (result.logits.detach().clone(), result.gids.clone())
        loss.backward()
        strategy.sync_grads(model, plan)
        opt.step()
        losses.append(strategy.reduce_loss(loss, plan))
    return losses, outputs, plan


def assert_same_run(got, ref, where: str) -> None:
    """``got`` and ``ref`` are (losses, output rows, their gids, model) of two runs: the
    same losses, rows, parameters and buffers (batch normalisation's running statistics,
    which evaluation reads), the reference's rows indexed by ``gids``; compared on the
    host (a run may keep its rows or parameters on another device)."""
    losses, out, gids, model = got
    ref_losses, ref_out, ref_model = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
    torch.testing.assert_close(out.cpu(), ref_out.cpu()[gids.cpu()], msg=where)
    state, ref_state = model.state_dict(), ref_model.state_dict()
    assert list(state) == list(ref_state), where
    for k, p in state.items():
        torch.testing.assert_close(p.cpu(), ref_state[k].cpu(), msg=f"{where} {k}")

