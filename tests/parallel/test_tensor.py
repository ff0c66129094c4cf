"""Tensor parallelism reproduces the single-process executor (float64).

Coupled programs run as naive tensor parallelism (split / gather around every P),
decoupled ones as decoupled tensor parallelism (one split, K propagations, one
gather); both must equal the single-process executor of the same program. The
vertex count (67) and the widths (9 features, 5 hidden, 3 classes) are not
divisible by the world sizes.
"""
from __future__ import annotations

import pytest
import torch

from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel

from harness import run_ranks
from test_data import MODELS, make_dataset, make_model, run_epochs


def check_tensor(comm, cases):
    dataset = make_dataset()
    for name, decoupled in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        losses, (out, gids), _ = run_epochs(TensorParallel(), dataset, model, comm)
        where = f"{name} decoupled={decoupled} rank {comm.rank}/{comm.world_size}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


CASES = [(m, d) for m in MODELS for d in (False, True)]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_tensor_parallel_matches_single(tmp_path, world_size):
    run_ranks(check_tensor, world_size, tmp_path, CASES)


def check_rounds(comm):
    """Decoupled, no E stage: 4 collective rounds of vertex data per epoch, any L and K."""
    dataset = make_dataset()
    for layers, props in ((1, 1), (2, 2), (3, 5)):
        torch.manual_seed(0)
        from fullgraph.models import build_model

        model = build_model("gcn", 9, 5, 3, num_layers=layers, decoupled=True,
                            num_props=props)
        strategy = TensorParallel()
        plan = strategy.setup(dataset, model, torch.device("cpu"), comm)
        comm.counter.reset()
        result = strategy.forward(model, plan, training=True, seed=1)
        strategy.loss(result, plan).backward()
        snap = comm.counter.snapshot()
        rounds = {k: v["calls"] for k, v in snap.items()}
        assert rounds == {"rows-to-cols": 1, "cols-to-rows": 1, "rows-to-cols-grad": 1,
                          "cols-to-rows-grad": 1}, (layers, props, rounds)
    # GAT's attention adds, once: the halo of source rows for the coefficients of
    # owned destinations and the all-gather that shares them, each with its backward
    torch.manual_seed(0)
    from fullgraph.models import build_model

    model = build_model("gat", 9, 5, 3, num_layers=2, decoupled=True, num_props=3)
    strategy = TensorParallel()
    plan = strategy.setup(dataset, model, torch.device("cpu"), comm)
    comm.counter.reset()
    strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
    rounds = {k: v["calls"] for k, v in comm.counter.snapshot().items()}
    assert rounds == {"rows-to-cols": 1, "cols-to-rows": 1, "rows-to-cols-grad": 1,
                      "cols-to-rows-grad": 1, "edge-halo": 1, "edge-halo-grad": 1,
                      "edge-share": 1, "edge-share-grad": 1}, rounds


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_decoupled_uses_four_rounds(tmp_path, world_size):
    run_ranks(check_rounds, world_size, tmp_path)


def check_chunked(comm, cases):
    """Chunked propagation (a chunk count, or a budget far below the graph's footprint)
    gives the same numbers, and the accounted device peak stays under the budget."""
    dataset = make_dataset()
    budget = 3000  # bytes: the whole graph at 5 columns needs several times more
    for name, decoupled in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        for opts in (TensorParallel.Options(num_chunks=4),
                     TensorParallel.Options(device_memory=str(budget)),
                     TensorParallel.Options(column_split="even"),
                     TensorParallel.Options(pipeline=True),
                     TensorParallel.Options(pipeline=True, device_memory=str(budget)),
                     TensorParallel.Options(pipeline=True, column_split="even")):
            model = make_model(name, decoupled, 9, 3)
            losses, (out, gids), plan = run_epochs(TensorParallel(opts), dataset, model, comm)
            where = f"{name} decoupled={decoupled} {opts} rank {comm.rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
            torch.testing.assert_close(out, ref_out[gids], msg=where)
            if opts.device_memory:
                assert len(plan.chunks) > 1, where
                assert 0 < plan.account.peak <= budget, (where, plan.account.peak)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 3])
def test_chunked_tensor_parallel(tmp_path, world_size):
    run_ranks(check_chunked, world_size, tmp_path, CASES)


def check_pipeline_bytes(comm):
    """Pipelined pieces move exactly the bytes of the whole split and gather: every
    vertex is split once (first-read de-duplication), every row gathered once."""
    dataset = make_dataset()
    from fullgraph.models import build_model

    totals = []
    for opts in (TensorParallel.Options(), TensorParallel.Options(pipeline=True, num_chunks=5)):
        torch.manual_seed(0)
        model = build_model("gcn", 9, 5, 3, decoupled=True, num_props=2)
        strategy = TensorParallel(opts)
        plan = strategy.setup(dataset, model, torch.device("cpu"), comm)
        comm.counter.reset()
        strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
        snap = comm.counter.snapshot()
        totals.append({k: (v["sent"], v["recv"]) for k, v in snap.items()})
        calls = {k: v["calls"] for k, v in snap.items()}
        if opts.pipeline:  # one piece per chunk in each direction
            assert all(calls[k] == 5 for k in ("rows-to-cols", "cols-to-rows",
                                               "rows-to-cols-grad", "cols-to-rows-grad")), calls
    assert totals[0] == totals[1], totals


@pytest.mark.dist
def test_pipeline_moves_the_same_bytes(tmp_path):
    run_ranks(check_pipeline_bytes, 3, tmp_path)
