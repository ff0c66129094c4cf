"""Checks run inside ``test_data``'s spawned worlds: changing the dependency plan
between epochs, through ``train``'s epoch hook, stays exact.

NeutronCloud's online adjuster (Algorithm 3 and ``replan``) runs after every epoch,
with unit costs forced so that a different DepCache set is chosen each time (all,
none, half, ...), or measured with one worker slowed down by injected sleep; 6
epochs equal single-process training (float64, dropout on) for the four models and
TAGCN on 2, 3 and 4 workers, and the profile follows the plan (recomputed edges
appear and vanish with the DepCache set).

Tensor parallelism's speed-proportional shares (``ShareBalancer``, ``replan``) run in
``test_tensor``'s spawns on 2 and 3 workers: shares forced to change after every epoch
(very unequal ones leave a worker without columns), given row and column counts, and
the measured balancer with one worker slowed down; coupled and decoupled models,
whole, chunked and pipelined propagation.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fullgraph.adapt.adjuster import OnlineAdjuster
from fullgraph.adapt.shares import ShareBalancer
from fullgraph.config import AdaptConfig, Config, ModelConfig, RuntimeConfig, TrainConfig
from fullgraph.graph.synthetic import sbm
from fullgraph.parallel.costmodel import Rates
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.tensor import TensorParallel
from fullgraph.partition import PartitionOptions
from fullgraph.train import train

EPOCHS = 6


def config(name: str, strategy: str, decoupled: bool = False) -> Config:
    return Config(model=ModelConfig(name=name, hidden=5, dropout=0.3, heads=2,
                                    decoupled=decoupled),
                  train=TrainConfig(epochs=EPOCHS, lr=0.05, weight_decay=0.0,
                                    eval_every=EPOCHS),  # the kept model is the last one
                  runtime=RuntimeConfig(strategy=strategy))


# ------------------------------------------------ the online adjuster (NeutronCloud)
# after epoch e, the share of each worker's dependencies the forced unit costs make
# worth caching (1: all DepCache, 0: all DepComm)
FORCED = {1: 1.0, 2: 0.0, 3: 0.5, 4: 1.0, 5: 0.3}


class ForcedAdjuster:
    """The real ``OnlineAdjuster`` (Algorithm 3, ``replan``) with unit costs that force a
    different DepCache set after every epoch; records each epoch's set."""

    def __init__(self, strategy: DataParallel) -> None:
        self.strategy, self.inner, self.sets, self.redundant = strategy, None, [], []

    def rates(self, epoch, profile):
        pre, start = self.inner.pre, self.inner.start_rates
        cost = pre.vertex * start.vertex + pre.edge * start.edge  # ascending within owners
        share = FORCED[epoch]
        bar = 0.0 if cost.size == 0 or share == 0.0 else \
            float(np.quantile(cost, share)) * (2.0 if share == 1.0 else 1.0)
        return Rates(bar / pre.comm_bytes, start.edge, start.vertex)

    def between_epochs(self, model, plan, epoch, profile) -> None:
        if self.inner is None:  # collective: every rank builds it after epoch 1
            self.inner = OnlineAdjuster(self.strategy, model, plan, None, lambda e: None,
                                        rates_for=self.rates)
        self.redundant.append(profile.edges_redundant)
        self.inner.between_epochs(model, plan, epoch, profile)
        self.sets.append(plan.deps.cached.clone())


class Events:
    """Records the profile events every rank sees, and the row counts of each epoch."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()
        self.rows: list[list[int]] = []

    def between_epochs(self, model, plan, epoch, profile) -> None:
        self.kinds |= {e["kind"] for e in profile.events}
        self.rows.append(list(getattr(plan, "row_counts", [])))


def dataset():
    return sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)


def reference(name, decoupled=False):
    """Single-process losses and parameters (computed once, before the spawn)."""
    ref = train(dataset(), config(name, "single", decoupled), dtype=torch.float64)
    return [r.loss for r in ref.epochs], {k: p.detach() for k, p in ref.model.named_parameters()}


def check_adjust(comm, cases, refs):
    for name, mode, inject in cases:
        where = f"{name} from {mode} rank {comm.rank}/{comm.world_size}, inject {inject}"
        ref_losses, ref_params = refs[name]
        strategy = DataParallel(DataParallel.Options(mode=mode), PartitionOptions(method="metis"))
        cfg = config(name, "data")
        if inject:  # the measured, cost-driven adjuster, with rank 1 slowed down
            cfg = dataclasses.replace(cfg, adapt=AdaptConfig(
                mode="adjust", inject="sleep:s=0.02,p=0,at=2+4,n=1,ranks=1"))
            adapter = Events()
        else:
            adapter = ForcedAdjuster(strategy)
        got = train(dataset(), cfg, comm=comm, strategy=strategy, adapters=[adapter],
                    dtype=torch.float64)
        if inject:
            assert "adjust" in adapter.kinds, where
            assert ("inject" in adapter.kinds) == (comm.rank == 1), (where, adapter.kinds)
        else:
            sets = {tuple(c.tolist()) for c in adapter.sets}
            assert len(sets) >= 3 or plan_is_trivial(adapter), (where, sets)
            # all cached for epoch 2, all fetched for epoch 3: the profile follows
            all_cached, none_cached = adapter.sets[0].all(), not adapter.sets[1].any()
            assert all_cached and none_cached, where
            if adapter.inner.pre.size and adapter.inner.pre.prefix.max() > 0:
                assert adapter.redundant[1] > 0 == adapter.redundant[2], (where,
                                                                           adapter.redundant)
        torch.testing.assert_close(torch.tensor([r.loss for r in got.epochs]),
                                   torch.tensor(ref_losses), msg=where)
        for k, p in got.model.named_parameters():
            torch.testing.assert_close(p, ref_params[k], msg=f"{where} parameter {k}")


def plan_is_trivial(adapter: ForcedAdjuster) -> bool:
    return adapter.inner is not None and adapter.inner.pre.size < 2


# every model on every world size; starting modes and the injected run rotate
ADJUST_CASES = {
    2: [("gcn", "depcomm", False), ("sage", "hybrid", False), ("gat", "depcache", False),
        ("gin", "depcomm", False), ("sage", "depcomm", True)],
    3: [("gcn", "depcache", False), ("sage", "depcomm", False), ("gat", "hybrid", False),
        ("gin", "depcache", False), ("tagcn", "hybrid", True)],
    4: [("gcn", "hybrid", False), ("sage", "depcache", False), ("gat", "depcomm", False),
        ("gin", "hybrid", False), ("gin", "depcomm", True)],
}


# ------------------------------------------ tensor parallelism's shares (beyond it)
# after epoch e, every worker's forced speed (the shares follow; 20:1 and 1:30 leave
# the slow worker one row in twenty and no column of the 5- and 3-wide propagations)
FORCED_SPEEDS = {2: {1: (3, 1), 2: (1, 5), 3: (1, 1), 4: (20, 1), 5: (1, 30)},
                 3: {1: (3, 1, 1), 2: (1, 5, 2), 3: (1, 1, 1), 4: (20, 1, 1), 5: (1, 1, 30)}}
# given counts after epoch e (rows of the 67 vertices; columns of the 5-wide hidden)
COUNTS = {2: ([60, 7], [0, 5]), 3: ([1, 40, 26], [5, 0, 0])}


class ForcedCounts:
    """``replan`` with given row and column counts after epoch 2, back to setup's split
    (shares None) after epoch 3, shares otherwise."""

    def __init__(self, strategy: TensorParallel) -> None:
        self.strategy, self.first = strategy, None

    def between_epochs(self, model, plan, epoch, profile) -> None:
        world = plan.comm.world_size
        rows, cols = COUNTS[world]
        if self.first is None:  # setup's split, before any replan
            self.first = (list(plan.row_counts), plan.layout(5).col_counts)
        if epoch == 2:
            self.strategy.replan(model, plan, [1.0] * world, row_counts=rows,
                                 col_counts={5: cols})
            assert plan.layout(5).col_counts == tuple(cols) and plan.row_counts == rows
        elif epoch == 3:
            self.strategy.replan(model, plan, None)
            assert (list(plan.row_counts), plan.layout(5).col_counts) == self.first
        else:
            self.strategy.replan(model, plan, FORCED_SPEEDS[world][epoch])


def check_shares(comm, cases, refs):
    world = comm.world_size
    for name, decoupled, how, opts in cases:
        where = f"tensor {name} decoupled={decoupled} {how} {opts} rank {comm.rank}/{world}"
        ref_losses, ref_params = refs[name, decoupled]
        strategy = TensorParallel(opts)
        cfg = config(name, "tensor", decoupled)
        seen = Events()
        if how == "inject":  # the measured balancer, built by --adapt adjust
            cfg = dataclasses.replace(cfg, adapt=AdaptConfig(
                mode="adjust", inject="sleep:s=0.05,p=0,at=2,n=5,ranks=1"))
            hooks = [seen]
        elif how == "forced":
            forced = FORCED_SPEEDS[world]
            hooks = [seen, Built(strategy, lambda e, measured: forced[e])]
        else:
            hooks = [ForcedCounts(strategy)]
        got = train(dataset(), cfg, comm=comm, strategy=strategy, adapters=hooks,
                    dtype=torch.float64)
        if how == "inject":  # rank 1 sleeps 50 ms an epoch: the measured balancer tries
            # fewer rows for it (a sleep is a fixed cost: the trial may be undone)
            assert "shares" in seen.kinds, (where, seen.kinds)
            assert min(r[1] for r in seen.rows) < seen.rows[0][1], (where, seen.rows)
        elif how == "forced":
            assert len({tuple(r) for r in seen.rows}) >= 4, (where, seen.rows)
        torch.testing.assert_close(torch.tensor([r.loss for r in got.epochs]),
                                   torch.tensor(ref_losses), msg=where)
        for k, p in got.model.named_parameters():
            torch.testing.assert_close(p, ref_params[k], msg=f"{where} parameter {k}")


class Built:
    """A ``ShareBalancer`` built after epoch 1 (the plan exists) with forced speeds."""

    def __init__(self, strategy, speeds_for) -> None:
        self.strategy, self.speeds_for, self.inner = strategy, speeds_for, None

    def between_epochs(self, model, plan, epoch, profile) -> None:
        if self.inner is None:
            self.inner = ShareBalancer(self.strategy, plan, lambda e: None, self.speeds_for)
        self.inner.between_epochs(model, plan, epoch, profile)


CHUNKS, PIPELINE, PLAIN = (TensorParallel.Options(num_chunks=3),
                           TensorParallel.Options(pipeline=True), TensorParallel.Options())
# a budget cuts chunks for the widest worker's slice, the same chunks on every worker
# whatever the shares; row blocks read the features in their stored dtype (float32 in a
# float64 run) and a switch keeps the run's
BUDGET_PIPELINE = TensorParallel.Options(pipeline=True, device_memory="3000")
ROW_BLOCKS = TensorParallel.Options(row_block=10)
SHARE_CASES = {  # chunked and pipelined propagation re-cut with the rows too
    2: [("gcn", False, "forced", CHUNKS), ("gat", True, "forced", PLAIN),
        ("sage", False, "counts", PLAIN), ("gin", True, "inject", PLAIN),
        ("gcn", True, "forced", BUDGET_PIPELINE), ("sage", False, "forced", ROW_BLOCKS)],
    3: [("gat", False, "forced", PLAIN), ("gcn", True, "forced", PIPELINE),
        ("gin", False, "counts", CHUNKS), ("sage", True, "inject", PLAIN)],
}
