"""Task parallelism's approximate dependency mode (``--task-deps regroup``): accuracy on
Cora against the exact mode, and the chunk grid's bad input (the regroup schedule
itself is checked without processes in tests/schedule/test_regroup.py)."""
from __future__ import annotations

import re

import pytest
import torch
from cases import make_dataset, make_model
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.cli import main
from fullgraph.comm.group import Comm
from fullgraph.config import Config, RuntimeConfig
from fullgraph.graph.datasets import BUILTIN
from fullgraph.graph.formats.planetoid import load_planetoid
from fullgraph.models import build_model
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.task import TaskParallel
from fullgraph.train import check_before_launch, step_seed

SEEDS, EPOCHS, LR = (0, 1, 2), 60, 0.03


def cora():
    dataset = load_planetoid(BUILTIN / "cora", "cora")
    dataset.data = dataset.data.row_normalized()
    return dataset


def trained_accuracy(strategy, dataset, seed: int, comm: Comm | None) -> tuple[float, float]:
    """Test accuracy of a GCN trained for ``EPOCHS`` at ``LR``, and the share of the
    edges that the last training pass aggregated."""
    torch.manual_seed(seed)
    model = build_model("gcn", dataset.data.num_features, 16, dataset.data.num_classes,
                        num_layers=2, dropout=0.5).to(TEST_DEVICE)
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=5e-4)
    for epoch in range(1, EPOCHS + 1):
        strategy.train_step(model, plan, optimizer, seed=step_seed(seed, epoch))
    keep = getattr(plan, "edge_keep", None)
    used = 1.0 if keep is None else keep[0].numel() / plan.graph.num_edges
    return strategy.reduce_counts(strategy.evaluate(model, plan), plan)["test"], used




def check_cora_accuracy(comm: Comm, exact: float) -> None:
    dataset = cora()
    strategy = TaskParallel(TaskParallel.Options(split="1:1", subgraphs=4, chunks=12,
                                                 deps="regroup"))
    model = build_model("gcn", dataset.data.num_features, 16, dataset.data.num_classes)
    model = model.to(TEST_DEVICE)
    header = strategy.describe(model, strategy.setup(dataset, model, TEST_DEVICE, comm))
    assert "task     4 subgraphs of 12 chunks, pipelined" in header[-2], header
    assert "regroup (APPROXIMATE)" in header[-1], header
    accs = []
    for seed in SEEDS:
        acc, used = trained_accuracy(strategy, dataset, seed, comm)
        accs.append(acc)
        # the last training pass really skipped blocks: at S = 4 about 3/8 of the edges
        # between chunks
        assert 0.5 < used < 0.9, used
    regroup = sum(accs) / len(accs)
    if comm.rank == 0:
        print(f"cora test accuracy, mean of {len(SEEDS)} seeds: exact {exact:.4f}, "
              f"regroup {regroup:.4f} {accs}")
    assert regroup >= exact - 0.015, (exact, regroup, accs)


@pytest.mark.dist
def test_regroup_on_cora_keeps_the_exact_accuracy(tmp_path):
    """S = 4 subgraphs of 12 chunks on 2 workers, mean of 3 seeds, against the exact
    mode's accuracy, taken from the single-process executor (which the exact mode
    equals, test_task.py) to spare a second spawned run."""
    dataset = cora()
    exact = sum(trained_accuracy(SingleProcess(), dataset, s, None)[0]
                for s in SEEDS) / len(SEEDS)
    run_ranks(check_cora_accuracy, 2, tmp_path, exact)


def test_bad_chunk_grids_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--strategy", "task", "--task-deps", "approx"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--task-deps: invalid choice: 'approx'" in err, err
    assert "'exact', 'regroup'" in err, err
    with pytest.raises(ValueError, match="--subgraphs 4 is more than --chunks 3"):
        TaskParallel.Options(subgraphs=4, chunks=3)
    with pytest.raises(ValueError, match="--chunks must be >= 1"):
        TaskParallel.Options(chunks=-1)
    with pytest.raises(ValueError, match="--task-deps must be one of exact, regroup, got 'x'"):
        TaskParallel.Options(deps="x")
    model = make_model("gcn", False, 9, 3)
    strategy = TaskParallel(TaskParallel.Options(subgraphs=2, chunks=68))
    with pytest.raises(ValueError, match="--chunks 68 is more than the graph's 67 vertices"):
        strategy.setup(make_dataset(), model, TEST_DEVICE, _FakeComm())


def test_bad_row_groups_are_refused_before_launch(capsys):
    """M larger than the vertex count, and (data form, given split) a chunk count the
    P group cannot share equally, are refused before any worker starts."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--strategy", "task", "--group-parallel", "rows"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--group-parallel: invalid choice: 'rows'" in err, err
    with pytest.raises(ValueError, match="--group-parallel must be one of tensor, data"):
        TaskParallel.Options(group_parallel="x")
    dataset = make_dataset()
    for opts, workers, why in [
            (dict(subgraphs=2, chunks=68), 2, "--chunks 68 is more than the graph's 67 vertices"),
            (dict(subgraphs=68), 2, "--subgraphs 68 is more than the graph's 67 vertices"),
            (dict(split="1:2", group_parallel="data", subgraphs=2, chunks=5), 3,
             "--chunks 5 with --group-parallel data: the chunk count must be a multiple of "
             "the P group's 2 workers"),
            (dict(split="1:2", group_parallel="data", subgraphs=3, chunks=4), 3,
             "--subgraphs 3 with --group-parallel data needs at least 3 chunks per P worker; "
             "--chunks 4 over 2 P workers gives 2")]:
        cfg = Config(runtime=RuntimeConfig(strategy="task"),
                     options={"task_parallel": TaskParallel.Options(**opts)})
        with pytest.raises(ValueError, match=re.escape(why)):
            check_before_launch(cfg, dataset, workers)
    # the same grids pass in the tensor form, and with an automatic split the data
    # form's check waits for setup (where the split is known)
    for opts in (dict(split="1:2", subgraphs=2, chunks=5),
                 dict(group_parallel="data", subgraphs=2, chunks=5)):
        check_before_launch(Config(runtime=RuntimeConfig(strategy="task"),
                                   options={"task_parallel": TaskParallel.Options(**opts)}),
                            dataset, 3)


class _FakeComm:
    """Two workers, for the checks that run before any communication."""

    rank, world_size = 0, 2
