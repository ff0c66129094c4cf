"""Changing the dependency plan between epochs, through ``train``'s epoch hook, stays
exact: half of every worker's remote dependencies switch between DepComm and DepCache
before epoch 3, and 6 epochs still equal single-process training (float64, dropout on).
"""
from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from fullgraph.config import Config, ModelConfig, RuntimeConfig, TrainConfig
from fullgraph.graph.synthetic import sbm
from fullgraph.parallel.data import DataParallel
from fullgraph.partition import PartitionOptions
from fullgraph.train import train

EPOCHS, SWITCH_AT = 6, 3


class SwitchHalf:
    """Runtime adapter: before epoch ``at``, flip every other remote dependency
    between DepComm and DepCache; records what it saw."""

    def __init__(self, strategy: DataParallel, at: int) -> None:
        self.strategy, self.at = strategy, at
        self.seen: list[tuple[int, int, int]] = []  # (epoch, profile epoch, redundant edges)
        self.switched = 0

    def between_epochs(self, model, plan, epoch, profile) -> None:
        self.seen.append((epoch, profile.epoch, profile.edges_redundant))
        if epoch == self.at - 1:
            flip = torch.zeros_like(plan.deps.cached)
            flip[::2] = True
            self.switched = int(flip.sum())
            self.strategy.replan(model, plan, plan.deps.cached ^ flip)


def config(name: str, strategy: str) -> Config:
    return Config(model=ModelConfig(name=name, hidden=5, dropout=0.3, heads=2),
                  train=TrainConfig(epochs=EPOCHS, lr=0.05, weight_decay=0.0,
                                    eval_every=EPOCHS),  # the kept model is the last one
                  runtime=RuntimeConfig(strategy=strategy))


def check_switch(comm, cases):
    dataset = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)
    for name, mode in cases:
        ref = train(dataset, config(name, "single"), dtype=torch.float64)
        strategy = DataParallel(DataParallel.Options(mode=mode), PartitionOptions(method="metis"))
        adapter = SwitchHalf(strategy, SWITCH_AT)
        got = train(dataset, config(name, "data"), comm=comm, strategy=strategy,
                    adapters=[adapter], dtype=torch.float64)
        where = f"{name} from {mode} rank {comm.rank}/{comm.world_size}"
        assert [e for e, _, _ in adapter.seen] == list(range(1, EPOCHS)), where
        assert all(e == p for e, p, _ in adapter.seen), where
        # the profile follows the plan: recomputed edges appear (depcomm) or shrink
        redundant = [r for _, _, r in adapter.seen]
        before, after = redundant[SWITCH_AT - 2], redundant[SWITCH_AT - 1]
        assert (after > before) if mode == "depcomm" else (after < before), (where, redundant)
        assert adapter.switched > 0, where
        torch.testing.assert_close(torch.tensor([r.loss for r in got.epochs]),
                                   torch.tensor([r.loss for r in ref.epochs]), msg=where)
        assert got.best_epoch == ref.best_epoch == EPOCHS
        assert got.test_at_best == ref.test_at_best, where
        for (k, p), (_, q) in zip(got.model.named_parameters(), ref.model.named_parameters()):
            assert p.dtype == torch.float64
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


CASES = [("gcn", "depcomm"), ("gat", "depcache"), ("gat", "depcomm"), ("gcn", "depcache")]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_switching_half_the_dependencies_mid_run_stays_exact(tmp_path, world_size):
    run_ranks(check_switch, world_size, tmp_path, CASES)
