"""Task parallelism's memory: recomputation holds less intermediate data, and
task-decoupled + recompute holds less per worker than data parallelism (its
exactness is in test_task.py's rotation).

Intermediate data is what autograd keeps between the forward and the backward pass
(``fullgraph.memory.SavedBytes``), counted on every worker; the comparison takes the
worker holding the most.
"""
from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.comm import primitives as prim
from fullgraph.graph.synthetic import sbm
from fullgraph.memory import SavedBytes
from fullgraph.models import build_model
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.task import TaskParallel


def _saved_max(strategy, dataset, model, comm) -> int:
    """Bytes autograd keeps for one training step's backward, on the worker with most."""
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    with SavedBytes(model.parameters()) as saved:
        loss = strategy.loss(strategy.forward(model, plan, training=True, seed=3), plan)
    loss.backward()
    value = torch.tensor([saved.bytes], dtype=torch.int64)
    prim.all_reduce_(value, comm, "test", op="max")
    return int(value)


def check_memory(comm):
    # a dense graph (degree ~24) with narrow features: replication is what costs
    dataset = sbm(400, 4, avg_degree=24.0, num_features=16, seed=5)
    out = {}
    for label, strategy in (("depcomm", DataParallel(DataParallel.Options(mode="depcomm"))),
                            ("depcache", DataParallel(DataParallel.Options(mode="depcache"))),
                            ("task", TaskParallel(TaskParallel.Options(split="1:1"))),
                            ("task+recompute", TaskParallel(TaskParallel.Options(
                                split="1:1", recompute=True)))):
        torch.manual_seed(0)
        model = build_model("gcn", 16, 64, 4, num_layers=2, decoupled=True, num_props=2,
                            dropout=0.5).to(TEST_DEVICE)
        out[label] = _saved_max(strategy, dataset, model, comm)
    assert out["task+recompute"] < out["task"], out
    assert out["task+recompute"] < out["depcomm"] and out["task+recompute"] < out["depcache"], out


@pytest.mark.dist
def test_task_decoupled_recompute_holds_less_than_data_parallelism(tmp_path):
    run_ranks(check_memory, 2, tmp_path)


def test_recompute_refuses_batch_norm():
    from cases import make_dataset

    from fullgraph.comm.group import single_comm

    model = build_model("gin", 9, 5, 3, batch_norm=True)
    with pytest.raises(ValueError, match="--recompute"):
        TaskParallel(TaskParallel.Options(recompute=True)).setup(
            make_dataset(), model, TEST_DEVICE, single_comm())


def test_saved_bytes_counts_each_tensor_once_and_skips_parameters():
    layer = torch.nn.Linear(10, 6)
    x = torch.randn(7, 10)
    with SavedBytes(layer.parameters()) as saved:
        y = torch.relu(layer(x))
        (y * y).sum()
    assert saved.bytes == (7 * 10 + 7 * 6) * 4  # x for the weight gradient, y once
    with SavedBytes(layer.parameters()) as saved:
        with torch.no_grad():
            torch.relu(layer(x))
    assert saved.bytes == 0
    adjacency = torch.eye(7).to_sparse_csr()  # kept by the sparse product: not counted
    with SavedBytes() as saved:
        (adjacency @ x.requires_grad_()).sum()
    assert saved.bytes == 0
