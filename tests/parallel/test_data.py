"""Data parallelism reproduces the single-process executor (float64).

For every model (coupled and decoupled), partitioner and dependency mode, on world
sizes 1-4: the loss of each of 3 epochs, the output rows each worker owns, and the
parameters after the 3 Adam steps equal the single-process run, with dropout on
(masks are keyed by vertex / edge id, so every executor draws the same ones).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.partition import PartitionOptions
from fullgraph.train import step_seed

from harness import run_ranks

MODELS = ["gcn", "sage", "gat", "gin"]
MODES = ["depcomm", "depcache", "hybrid"]
PARTITIONERS = ["chunk", "random", "metis"]


def make_dataset():
    return sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)


def make_model(name: str, decoupled: bool, in_dim: int, out_dim: int, dtype=torch.float64):
    torch.manual_seed(0)
    opts = dict(num_layers=2, dropout=0.3, decoupled=decoupled, num_props=2)
    if name == "gat":
        opts.update(heads=2)
    return build_model(name, in_dim, 5, out_dim, **opts).to(dtype)


def run_epochs(strategy, dataset, model, comm, epochs=3, dtype=torch.float64):
    plan = strategy.setup(dataset, model, torch.device("cpu"), comm, dtype=dtype)
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


def check_all(comm, cases):
    dataset = make_dataset()
    for name, decoupled, part, mode in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        strategy = DataParallel(DataParallel.Options(mode=mode, byte_cost=1e-9, edge_cost=1e-9),
                                PartitionOptions(method=part))
        losses, (out, gids), _ = run_epochs(strategy, dataset, model, comm)
        where = f"{name} decoupled={decoupled} {part} {mode} rank {comm.rank}/{comm.world_size}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


ALL = list(itertools.product(MODELS, [False, True], PARTITIONERS, MODES))
# The full matrix on 3 workers (odd, uneven parts); on 1, 2 and 4 every model, form
# and mode with the partitioner rotating, to keep the suite's time in bounds.
ROTATED = [(m, d, PARTITIONERS[i % 3], mode)
           for i, (m, d, mode) in enumerate(itertools.product(MODELS, [False, True], MODES))]
CASES = {1: [c for c in ROTATED if c[3] == "depcomm"], 2: ROTATED, 3: ALL, 4: ROTATED}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_parallel_matches_single(tmp_path, world_size):
    run_ranks(check_all, world_size, tmp_path, CASES[world_size])


def check_float32(comm):
    """float32: same program, per-row sums in the same order; only GEMMs over other row
    subsets round differently, so 1e-5 relative (a few float32 ulps) is ample."""
    dataset = make_dataset()
    for name in MODELS:
        ref_model = make_model(name, False, 9, 3, torch.float32)
        ref, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None,
                                          dtype=torch.float32)
        model = make_model(name, False, 9, 3, torch.float32)
        strategy = DataParallel(DataParallel.Options(mode="depcomm"),
                                PartitionOptions(method="metis"))
        got, (out, gids), _ = run_epochs(strategy, dataset, model, comm, dtype=torch.float32)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref_out[gids], rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_data_parallel_float32(tmp_path):
    run_ranks(check_float32, 3, tmp_path)


def check_depcomm_bytes(comm):
    """DepComm moves sum over P stages of |V_i^remote| x dims x 4 bytes, each direction."""
    dataset = make_dataset()
    torch.manual_seed(0)
    hidden, classes = 6, 3
    model = build_model("gcn", 9, hidden, classes, aggregate_first=False, dropout=0.0)
    strategy = DataParallel(DataParallel.Options(mode="depcomm"), PartitionOptions(method="random"))
    plan = strategy.setup(dataset, model, torch.device("cpu"), comm)
    owned = plan.book.part_to_gids(comm.rank)
    src, dst = plan.graph.edges()
    mine = torch.zeros(plan.graph.num_dst, dtype=torch.bool)
    mine[owned] = True
    remote = torch.unique(src[mine[dst] & ~mine[src]])
    comm.counter.reset()
    result = strategy.forward(model, plan, training=True, seed=1)
    strategy.loss(result, plan).backward()
    snap = comm.counter.snapshot()
    expected = remote.numel() * (hidden + classes) * 4
    got_fwd = snap.get("halo", {}).get("recv", 0)
    got_bwd = snap.get("halo-grad", {}).get("sent", 0)
    assert got_fwd == expected, (comm.rank, got_fwd, expected)
    assert got_bwd == expected, (comm.rank, got_bwd, expected)
    # what this rank sends forward is what its peers receive from it
    totals = torch.tensor([snap["halo"]["sent"], snap["halo"]["recv"]], dtype=torch.int64)
    from fullgraph.comm.primitives import all_reduce_

    all_reduce_(totals, comm, "test")
    assert int(totals[0]) == int(totals[1])


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_depcomm_byte_counts(tmp_path, world_size):
    run_ranks(check_depcomm_bytes, world_size, tmp_path)
