"""NeutronCloud's Algorithms 2 and 3 as pure functions: grouping, order, prefix sums,
binary search boundaries, the budget split, ties, an empty owner list, a zero budget."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.blocks import in_edges
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.models.stages import propagation_inputs
from fullgraph.parallel import costmodel
from fullgraph.parallel.adjust import adjust, fit_prefix, positive_prefix, preprocess
from fullgraph.parallel.costmodel import DependencyWork, Rates


def work(vertex, edge, storage, comm_bytes=10.0):
    as_array = lambda v: np.asarray(v, dtype=np.float64)  # noqa: E731
    return DependencyWork(as_array(vertex), as_array(edge), as_array(storage), comm_bytes)


def test_preprocess_groups_by_owner_sorts_by_cache_cost_and_prefix_sums():
    w = work(vertex=[5, 1, 3, 2, 4], edge=[0, 0, 0, 0, 0], storage=[50, 10, 30, 20, 40])
    pre = preprocess(w, np.array([2, 0, 2, 0, 2]), Rates(1.0, 1.0, 1.0))
    assert pre.owners.tolist() == [0, 2]
    assert pre.bounds.tolist() == [0, 2, 5]
    assert pre.order.tolist() == [1, 3, 2, 4, 0]  # owner 0: costs 1, 2; owner 2: 3, 4, 5
    assert pre.prefix.tolist() == [10, 30, 30, 70, 120]  # restarts in every group


def test_preprocess_ties_keep_dependency_order_and_rejects_misaligned_owners():
    w = work([1, 1, 1], [0, 0, 0], [1, 1, 1])
    assert preprocess(w, np.zeros(3, dtype=np.int64), Rates(1, 1, 1)).order.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="2 owners for 3 dependencies"):
        preprocess(w, np.zeros(2, dtype=np.int64), Rates(1, 1, 1))


@pytest.mark.parametrize("comm, expected", [(0.5, 0), (1.0, 0), (1.5, 1), (3.0, 2), (3.5, 3),
                                            (100.0, 4)])
def test_positive_prefix_boundaries_and_ties(comm, expected):
    costs = np.array([1.0, 2.0, 3.0, 4.0])
    assert positive_prefix(costs, comm) == expected  # benefit exactly 0 is not positive
    assert positive_prefix(np.array([]), comm) == 0


def test_fit_prefix_takes_the_longest_prefix_within_the_share():
    prefix = np.array([10.0, 30.0, 60.0])
    assert fit_prefix(prefix, 3, 30.0) == 2  # equal to the share fits
    assert fit_prefix(prefix, 3, 29.9) == 1
    assert fit_prefix(prefix, 1, 1000.0) == 1  # never beyond the positive-benefit prefix
    assert fit_prefix(prefix, 3, 0.0) == 0


def test_adjust_without_budget_caches_every_positive_benefit_dependency():
    w = work(vertex=[1, 2, 3, 4], edge=[0, 0, 0, 0], storage=[1, 1, 1, 1], comm_bytes=1.0)
    pre = preprocess(w, np.array([1, 1, 2, 2]), Rates(1, 1, 1))
    got = adjust(pre, Rates(byte=2.5, edge=0.0, vertex=1.0), None)
    assert got.cached.tolist() == [True, True, False, False]
    assert (got.wanted, got.demand, got.budget_bound) == (2, 2.0, False)
    # per-owner communication costs: owner 2 is slow to reach, so its cheap one is cached
    got = adjust(pre, Rates(byte=1.5, edge=0.0, vertex=1.0), None, byte_per_owner={2: 3.5})
    assert got.cached.tolist() == [True, False, True, False]
    # every benefit negative: all fetched; cheaper recomputation: all cached
    assert not adjust(pre, Rates(byte=0.5, edge=0.0, vertex=1.0), None).cached.any()
    assert adjust(pre, Rates(byte=1.0, edge=0.0, vertex=0.0), None).cached.all()


def test_adjust_splits_the_budget_in_proportion_to_each_owners_demand():
    # owner 0 wants storage 10+10+10 = 30, owner 1 wants 20+20+50 = 90: S = 120
    w = work(vertex=[1, 2, 3, 1, 2, 3], edge=[0] * 6, storage=[10, 10, 10, 20, 20, 50])
    pre = preprocess(w, np.array([0, 0, 0, 1, 1, 1]), Rates(1, 1, 1))
    rates = Rates(byte=10.0, edge=0.0, vertex=1.0)  # every benefit positive
    assert adjust(pre, rates, budget=120.0).cached.all()  # S <= C: all of them
    got = adjust(pre, rates, budget=60.0)  # C_0 = 15, C_1 = 45
    assert got.cached.tolist() == [True, False, False, True, True, False]
    assert got.budget_bound and got.wanted == 6 and got.demand == 120.0
    assert not adjust(pre, rates, budget=0.0).cached.any()
    with pytest.raises(ValueError, match="cache budget"):
        adjust(pre, rates, budget=-1.0)


def test_adjust_with_no_dependencies():
    pre = preprocess(work([], [], []), np.zeros(0, dtype=np.int64), Rates(1, 1, 1))
    assert pre.owners.size == 0 and pre.bounds.tolist() == [0]
    got = adjust(pre, Rates(1, 1, 1), budget=0.0)
    assert got.cached.size == 0 and got.wanted == 0 and not got.budget_bound


def test_dependency_work_prices_as_dependency_costs_and_storage_follows_formula_12():
    ds = sbm(60, 3, avg_degree=4.0, num_features=6, seed=3)
    model = build_model("gcn", 6, 5, 3, num_layers=3)
    graph, _ = propagation_inputs(model, ds.graph, torch.float32)
    owned = torch.arange(20)
    _, src, _ = in_edges(graph, owned.numpy())
    direct = torch.from_numpy(np.unique(src[src >= 20]))
    rates = Rates(1e-6, 2e-9, 3e-9)
    w = costmodel.dependency_work(model, graph, owned, direct, 4)
    cache, comm = costmodel.dependency_costs(model, graph, owned, direct, rates, 4)
    np.testing.assert_allclose(w.cache_cost(rates), cache.numpy())
    np.testing.assert_allclose(np.full(direct.numel(), w.comm_cost(rates)), comm.numpy())
    np.testing.assert_allclose(w.storage, (w.vertex + w.edge) * 4)
    assert (w.storage > 0).all()


def test_adjuster_measures_unit_costs_from_stage_times_and_halo_transfer():
    from types import SimpleNamespace

    from fullgraph.adapt.adjuster import OnlineAdjuster
    from fullgraph.parallel.data import DataParallel
    from fullgraph.partition import PartitionOptions

    ds = sbm(40, 2, avg_degree=4.0, num_features=5, seed=1)
    model = build_model("gcn", 5, 4, 2, num_layers=2)
    strategy = DataParallel(DataParallel.Options(mode="depcomm", byte_cost=2e-9,
                                                 edge_cost=1e-9, vertex_cost=3e-9),
                            PartitionOptions(method="chunk"))
    plan = strategy.setup(ds, model, torch.device("cpu"))
    plan.deps.rates = Rates(2e-9, 1e-9, 3e-9)
    notes = []
    adj = OnlineAdjuster(strategy, model, plan, None, notes.append)
    assert notes[0]["kind"] == "preprocess" and plan.clock is not None
    plan.clock.add("T", 0.2, 1000)  # 0.2 s of transform over 1000 row x columns
    plan.clock.add("PE", 0.3, 3000)
    profile = SimpleNamespace(compute_s=1.0, bytes_sent={"halo": 400, "grad-sync": 99},
                              bytes_recv={"halo-grad": 400}, comm_by_phase={"halo": 0.004})
    rates = adj.measure(plan, profile)
    # the stages account for all 1.0 s of compute: x2 over their 0.5 s
    assert rates.vertex == pytest.approx(0.4 / 1000) and rates.edge == pytest.approx(0.6 / 3000)
    assert rates.byte == pytest.approx(0.004 / 400)
    # nothing fetched: the link is priced as at start; nothing timed: the start rates
    idle = SimpleNamespace(compute_s=1.0, bytes_sent={}, bytes_recv={}, comm_by_phase={})
    assert adj.measure(plan, idle) == Rates(2e-9, 1e-9, 3e-9, ("byte", "edge", "vertex"))
    # under partial reduce an unsplit halo time holds the waits for late peers: the last
    # cost measured without them stands (here the start's)
    adj.partial = True
    late = SimpleNamespace(compute_s=1.0, bytes_sent={"halo": 400}, bytes_recv={},
                           comm_by_phase={"halo": 0.4}, waiting_split=False)
    assert adj.measure(plan, late).byte == pytest.approx(2e-9)
    late.waiting_split = True
    assert adj.measure(plan, late).byte == pytest.approx(0.4 / 200)


def test_links_are_probed_at_the_first_adjustments_then_every_few(monkeypatch):
    """The probe is collective and cost 15-21 ms an adjustment on 3-5 workers of one
    host: after the first WINDOW it runs at every PROBE_EVERY-th, on a schedule every
    rank shares; the last probes' split stands in between."""
    from types import SimpleNamespace

    from fullgraph.adapt import adjuster

    calls = []

    def probe(comm, nbytes):
        calls.append(len(calls))
        return [0.0, 1.0, 3.0]  # rank 0's links: peer 2's is 3x peer 1's

    monkeypatch.setattr(adjuster, "probe_links", probe)
    monkeypatch.setattr(adjuster, "tagged_messages", lambda comm: True)  # (gloo's)
    adj = object.__new__(adjuster.OnlineAdjuster)
    adj.probes, adj.adjustments = [], 0
    plan = SimpleNamespace(comm=SimpleNamespace(world_size=3, rank=0))
    probed = []
    for _ in range(12):
        before = len(calls)
        split = adj.per_owner(plan, 2.0)
        probed.append(len(calls) > before)
        assert split == {1: 1.0, 2: 3.0}
    every = adjuster.PROBE_EVERY
    assert probed == [n <= adjuster.WINDOW or n % every == 0 for n in range(1, 13)]
    assert sum(probed) < 12
