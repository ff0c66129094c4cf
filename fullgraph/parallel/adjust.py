"""NeutronCloud's online DepCache / DepComm adjustment as pure functions (§4.2).

``preprocess`` is Algorithm 2: once, before training, a worker groups its direct
remote dependencies by owner, orders each group by DepCache cost at the starting
unit costs (ascending), and keeps each group's prefix sums of storage cost s(v)
(formula 12). ``adjust`` is Algorithm 3: every epoch, with this epoch's measured
unit costs, a binary search per owner finds the prefix of dependencies whose
benefit ``gamma(v) = T'_comm,i,j - T'_cache,i,j(v)`` is positive (``T'_comm`` is
the same for every dependency of owner j, and the group is ordered by
``T'_cache``); when their storage exceeds the cache budget C_i, each owner's share
of the budget is ``C_i x s_ij / S_i`` and each group keeps the longest prefix that
fits its share. The result is a DepCache mask over the dependencies.

The order comes from the starting costs; later costs only move the prefix
boundaries (the paper: vertex and edge costs degrade in proportion, so the order is
stable). Ties (gamma = 0) stay DepComm. Everything is numpy over the arrays of one
worker; no processes, no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fullgraph.parallel.costmodel import DependencyWork, Rates


@dataclass(frozen=True)
class Preprocessed:
    """Algorithm 2's output for one worker.

    Attributes:
        order: (R,) positions into the dependency arrays, grouped by owner (ascending
            owner rank), each group ordered by DepCache cost at the starting rates.
        bounds: (m + 1,) offsets of each owner's group in ``order``.
        owners: (m,) owner rank of each group (only owners with dependencies).
        vertex, edge: (R,) the work arrays of ``DependencyWork``, in ``order``.
        prefix: (R,) prefix sums of storage cost within each group, in ``order``.
        comm_bytes: bytes DepComm moves per dependency per epoch.
    """

    order: np.ndarray
    bounds: np.ndarray
    owners: np.ndarray
    vertex: np.ndarray
    edge: np.ndarray
    prefix: np.ndarray
    comm_bytes: float

    @property
    def size(self) -> int:
        return int(self.order.size)


def preprocess(work: DependencyWork, owner: np.ndarray, rates: Rates) -> Preprocessed:
    """Algorithm 2: group by owner, sort by DepCache cost, prefix-sum the storage.

    Args:
        work: per-dependency work (``costmodel.dependency_work``).
        owner: (R,) owner rank of each dependency.
        rates: the unit costs known before training (the sort key's rates).
    """
    owner = np.asarray(owner, dtype=np.int64)
    if owner.shape != work.vertex.shape:
        raise ValueError(f"preprocess: {owner.size} owners for {work.vertex.size} dependencies")
    cost = work.cache_cost(rates)
    # owner first, then cost; position last so ties keep the dependency order
    order = np.lexsort((np.arange(owner.size), cost, owner))
    owners, starts = np.unique(owner[order], return_index=True)
    bounds = np.append(starts, owner.size).astype(np.int64)
    prefix = _group_cumsum(work.storage[order], bounds)
    return Preprocessed(order, bounds, owners.astype(np.int64), work.vertex[order],
                        work.edge[order], prefix, work.comm_bytes)


def _group_cumsum(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out[lo:hi] = np.cumsum(values[lo:hi])
    return out


def positive_prefix(cache_cost: np.ndarray, comm_cost: float) -> int:
    """Binary search (Algorithm 3, lines 2-6): the number k of leading dependencies
    with positive benefit ``comm_cost - cache_cost[t] > 0``, given ``cache_cost``
    ascending. 0 when none, ``len`` when all."""
    lo, hi = 0, int(cache_cost.size)
    while lo < hi:
        mid = (lo + hi) // 2
        if comm_cost - cache_cost[mid] > 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


def fit_prefix(prefix: np.ndarray, k: int, share: float) -> int:
    """Algorithm 3, line 18: the largest k' <= k with ``prefix[k' - 1] <= share``."""
    return int(np.searchsorted(prefix[:k], share, side="right"))


@dataclass(frozen=True)
class Decision:
    """Algorithm 3's output.

    Attributes:
        cached: (R,) bool DepCache mask in the dependency order of ``DependencyWork``.
        wanted: dependencies with positive benefit before the budget.
        demand: their storage (S_i, bytes).
        budget_bound: whether the budget cut the positive-benefit set.
    """

    cached: np.ndarray
    wanted: int
    demand: float
    budget_bound: bool


def adjust(pre: Preprocessed, rates: Rates, budget: float | None,
           byte_per_owner: dict[int, float] | None = None) -> Decision:
    """Algorithm 3: this epoch's DepCache set.

    Args:
        pre: ``preprocess``'s arrays.
        rates: this epoch's unit costs (``rates.byte`` for every owner unless
            ``byte_per_owner`` says otherwise).
        budget: C_i in bytes of storage cost (None: no limit).
        byte_per_owner: measured seconds per byte to each owner rank (T'_c,i,j).
    """
    if budget is not None and not budget >= 0:
        raise ValueError(f"adjust: cache budget must be >= 0 bytes or None, got {budget}")
    cost = pre.vertex * rates.vertex + pre.edge * rates.edge
    groups = list(zip(pre.bounds[:-1].tolist(), pre.bounds[1:].tolist()))
    wanted = []
    for (lo, hi), j in zip(groups, pre.owners.tolist()):
        byte = (byte_per_owner or {}).get(j, rates.byte)
        wanted.append(positive_prefix(cost[lo:hi], pre.comm_bytes * byte))
    demand = [float(pre.prefix[lo + k - 1]) if k else 0.0 for (lo, _), k in zip(groups, wanted)]
    total = sum(demand)
    keep = wanted
    bound = budget is not None and total > budget
    if bound:
        assert budget is not None
        keep = [fit_prefix(pre.prefix[lo:hi], k, budget * s / total)
                for (lo, hi), k, s in zip(groups, wanted, demand)]
    cached = np.zeros(pre.size, dtype=bool)
    for (lo, _), k in zip(groups, keep):
        cached[pre.order[lo:lo + k]] = True
    return Decision(cached, sum(wanted), total, bound)
