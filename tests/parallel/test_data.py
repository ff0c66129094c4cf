"""Data parallelism reproduces the single-process executor (float64).

For every model (coupled and decoupled), partitioner and dependency mode, on world
sizes 1-4: the loss of each of 3 epochs, the output rows each worker owns, and the
parameters after the 3 Adam steps equal the single-process run, with dropout on
(masks are keyed by vertex / edge id, so every executor draws the same ones).
``hybrid`` cases are given unit costs that put the cost model's threshold at the
median dependency of each worker, so every worker really mixes DepCache and DepComm.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from adjust_checks import ADJUST_CASES, check_adjust, reference
from cases import MODELS, make_dataset, make_model, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.comm.primitives import all_gather_object
from fullgraph.models import build_model, propagation_inputs
from fullgraph.parallel import costmodel
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.rows import partition_book
from fullgraph.parallel.single import SingleProcess
from fullgraph.partition import PartitionOptions

MODES = ["depcomm", "depcache", "hybrid"]
PARTITIONERS = ["chunk", "random", "metis"]


EDGE_COST = VERTEX_COST = 1e-9


def mixed_byte_cost(dataset, model, comm, part: str) -> float:
    """A byte cost that makes this worker cache about half of its remote dependencies
    (the cheapest to recompute) and fetch the others."""
    graph, _ = propagation_inputs(model, dataset.graph, torch.float64)
    owned = partition_book(dataset, comm, PartitionOptions(method=part)).part_to_gids(comm.rank)
    src, dst = graph.edges()
    mine = torch.zeros(graph.num_dst, dtype=torch.bool)
    mine[owned] = True
    direct = torch.unique(src[mine[dst] & ~mine[src]])
    rates = costmodel.Rates(1.0, EDGE_COST, VERTEX_COST)
    cache, comm_per_byte = costmodel.dependency_costs(model, graph, owned, direct, rates, 8)
    c = torch.sort(cache).values
    # the split nearest the middle between two different costs
    splits = [k for k in range(1, c.numel()) if c[k - 1] < c[k]]
    assert splits, f"rank {comm.rank}: no two dependencies differ in cost: {c.tolist()}"
    k = min(splits, key=lambda k: abs(k - c.numel() / 2))
    return float(c[k - 1] + c[k]) / 2 / float(comm_per_byte[0])


def check_mixed(plan, where: str) -> None:
    """Both DepCache and DepComm, about half each, and both show in the row plan."""
    summary = plan.deps.summary()
    assert 0.25 <= summary["cached"] / summary["remote"] <= 0.75, (where, summary)
    assert plan.rows.edges_computed()[1] > 0, where  # cached rows are recomputed
    assert sum(f.numel() for f in plan.rows.fetched) > 0, where  # the others fetched


def strategy_for(dataset, model, comm, part: str, mode: str) -> DataParallel:
    opts = DataParallel.Options(mode=mode)
    if mode == "hybrid":
        byte_cost = mixed_byte_cost(dataset, model, comm, part)
        opts = DataParallel.Options(mode=mode, byte_cost=byte_cost, edge_cost=EDGE_COST,
                                    vertex_cost=VERTEX_COST)
    return DataParallel(opts, PartitionOptions(method=part))


def check_all(comm, cases):
    dataset = make_dataset()
    refs: dict[tuple, tuple] = {}  # one single-process run per (model, form)
    for name, decoupled, part, mode in cases:
        if (name, decoupled) not in refs:
            ref_model = make_model(name, decoupled, 9, 3)
            ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
            refs[name, decoupled] = ref_model, ref_losses, ref_out
        ref_model, ref_losses, ref_out = refs[name, decoupled]
        model = make_model(name, decoupled, 9, 3)
        strategy = strategy_for(dataset, model, comm, part, mode)
        losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
        where = f"{name} decoupled={decoupled} {part} {mode} rank {comm.rank}/{comm.world_size}"
        if mode == "hybrid" and comm.world_size > 1:
            check_mixed(plan, where)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


PAIRS = list(itertools.product(MODELS, [False, True]))
# On 3 workers (odd, uneven parts) every model and form with every partitioner, the
# mode shifted so that every (model/form, mode) and every (partitioner, mode) pair
# appears too (24 of the 72 combinations); on 1, 2 and 4 every model, form and mode
# with the partitioner rotating, to keep the suite's time in bounds.
PAIRWISE = [(m, d, part, MODES[(i + k) % 3]) for i, (m, d) in enumerate(PAIRS)
            for k, part in enumerate(PARTITIONERS)]
ROTATED = [(m, d, PARTITIONERS[i % 3], mode)
           for i, (m, d, mode) in enumerate(itertools.product(MODELS, [False, True], MODES))]
# TAGCN on 2 and 3 workers: both layer orders, both forms, every mode once
TAGCN = {2: [("tagcn", False, "metis", "depcomm"),
             ("tagcn:agg_first", False, "random", "depcache")],
         3: [("tagcn", True, "chunk", "depcache"), ("tagcn", False, "metis", "hybrid")]}
CASES = {1: [c for c in ROTATED if c[3] == "depcomm"], 2: ROTATED + TAGCN[2],
         3: PAIRWISE + TAGCN[3], 4: ROTATED}
assert all({(m, d, "hybrid") for m in MODELS for d in (False, True)} <=
           {(c[0], c[1], c[3]) for c in CASES[w]} for w in (2, 3, 4))


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


def check_depcomm_bytes(comm):
    """DepComm moves sum over P stages of |V_i^remote| x dims x 4 bytes, each direction."""
    dataset = make_dataset()
    torch.manual_seed(0)
    hidden, classes = 6, 3
    model = build_model("gcn", 9, hidden, classes, aggregate_first=False, dropout=0.0)
    model = model.to(TEST_DEVICE)
    strategy = DataParallel(DataParallel.Options(mode="depcomm"), PartitionOptions(method="random"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    owned = plan.book.part_to_gids(comm.rank).cpu()
    src, dst = (t.cpu() for t in plan.graph.edges())
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


def check_measured_costs(comm):
    """No unit cost given: all three are measured, the byte cost is the same on every
    worker, the run header says so, the split is checked by timing it against the pure
    modes, and the run is exact whatever the split."""
    dataset = make_dataset()
    ref_model = make_model("gat", False, 9, 3)
    ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
    model = make_model("gat", False, 9, 3)
    strategy = DataParallel(DataParallel.Options(mode="hybrid"), PartitionOptions(method="metis"))
    losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
    rates = plan.deps.rates
    assert rates.measured == ("byte", "edge", "vertex")
    assert all(0 < r < 1e-2 for r in (rates.byte, rates.edge, rates.vertex)), rates
    assert len(set(all_gather_object(rates.byte, comm, "test"))) == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    torch.testing.assert_close(out, ref_out[gids])
    # the header line: the totals over all workers and each worker's split
    (line,) = strategy.describe(model, plan)
    per_rank = all_gather_object(plan.deps.summary(), comm, "test")
    cached = sum(r["cached"] for r in per_rank)
    fetched = sum(r["fetched"] for r in per_rank)
    assert line.startswith("deps     hybrid, partitioner metis; remote dependencies "
                           f"{cached + fetched}: {cached} cached (DepCache), {fetched} fetched")
    assert "/".join(f"{r['cached']}:{r['fetched']}" for r in per_rank) in line
    assert "(measured byte, edge, vertex)" in line
    # measured rates: the split kept is the fastest of the model's and the pure modes,
    # timed once at setup without changing the parameters (the run above is exact)
    trial, kept = plan.deps.trial, plan.deps.kept
    assert sorted(trial) == ["depcache", "depcomm", "hybrid"] and all(t > 0 for t in
                                                                      trial.values())
    assert kept not in plan.deps.twins and trial[kept] == min(trial.values())
    for twin, same in plan.deps.twins.items():  # timed once, under the pure mode's name
        assert torch.equal(plan.deps.modes[twin], plan.deps.modes[same]) and same != "hybrid"
        assert trial[twin] == trial[same] and f"{twin} = {same}" in line
    assert all_gather_object((trial, kept), comm, "test") == [(trial, kept)] * comm.world_size
    if kept != "hybrid":
        assert bool(plan.deps.cached.all()) if kept == "depcache" else \
            not bool(plan.deps.cached.any())
    assert f"kept {kept}" in line


def check_online_choice(comm):
    """Hybrid with measured rates tries the plans close to the setup trial's fastest
    over the first training epochs (``DataParallel.between_epochs``): each plan runs
    one untimed epoch and then ``ONLINE_EPOCHS`` timed ones in a row, the slowest
    worker's epoch counts, the plan with the least median is kept, training stays
    exact across the switches, and a plan changed by someone else ends the trial."""
    from types import SimpleNamespace

    from cases import step_seed

    dataset = make_dataset()
    epochs = 10
    ref_losses, _, _ = run_epochs(SingleProcess(), dataset, make_model("gcn", False, 9, 3),
                                  None, epochs=epochs)
    model = make_model("gcn", False, 9, 3)
    strategy = DataParallel(DataParallel.Options(mode="hybrid"), PartitionOptions(method="metis"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm, dtype=torch.float64)
    deps = plan.deps
    # every plan in the running, whatever the setup trial timed
    deps.epochs = {n: [] for n in deps.modes}
    # epoch seconds per plan: depcomm is the fastest on rank 0 but the slowest worker
    # (rank 1) makes depcache the fastest overall, unless its first epoch after a
    # switch (10 s) were counted
    seconds = {"hybrid": [0.3, 0.3], "depcomm": [0.1, 0.5], "depcache": [0.2, 0.25]}
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses, used = [], []
    for epoch in range(1, epochs + 1):
        used.append(deps.kept)
        model.train()
        opt.zero_grad()
        loss = strategy.loss(strategy.forward(model, plan, training=True,
                                              seed=step_seed(0, epoch)), plan)
        loss.backward()
        strategy.sync_grads(model, plan)
        opt.step()
        losses.append(strategy.reduce_loss(loss, plan))
        switched = len(used) > 1 and used[-1] != used[-2]
        wall = 10.0 if switched and used[-1] == "depcache" else \
            seconds[used[-1]][min(comm.rank, 1)]
        strategy.between_epochs(model, plan, epoch, SimpleNamespace(wall_s=wall))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    # the setup trial's plan first (its first epoch warms up), then each other plan
    # for three epochs in a row; then the fastest
    assert used[0] == used[1] == used[2] and len(set(used[3:6])) == len(set(used[6:9])) == 1
    assert sorted(used[:9]) == sorted(list(seconds) * 3), used
    assert not deps.epochs and deps.kept == "depcache" and used[-1] == "depcache", used
    assert bool(deps.cached.all())
    assert deps.timed == {"hybrid": 0.3, "depcomm": 0.5, "depcache": 0.25}
    assert strategy.outcome(model, plan) == [
        "deps     kept depcache after 2 training epochs under each plan close at setup "
        "(median, slowest worker): hybrid 300.0 ms, depcomm 500.0 ms, depcache 250.0 ms"]
    # a replan elsewhere (an adjuster's) ends a trial in progress on every worker, even
    # where it left the worker's own plan as it was (rank 1 here)
    deps.epochs, deps.kept = {n: [] for n in deps.modes}, "depcache"
    strategy.replan(model, plan, deps.modes["depcomm"] if comm.rank == 0 else deps.cached)
    strategy.between_epochs(model, plan, 2, SimpleNamespace(wall_s=1.0))
    assert not deps.epochs


# the other checks share the spawned worlds of the exactness rotation (spawns are the
# slow part): float32 and byte counts, the measured-cost path and the plan tried over
# training epochs, online adjustment
EXTRA = {1: [], 2: ["depcomm_bytes", "measured_costs", "online_choice"],
         3: ["float32", "depcomm_bytes"], 4: []}


def check_world(comm, cases, refs):
    check_all(comm, cases)
    for name in EXTRA[comm.world_size]:
        globals()[f"check_{name}"](comm)
    if comm.world_size in ADJUST_CASES:
        check_adjust(comm, ADJUST_CASES[comm.world_size], refs)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_parallel_matches_single(tmp_path, world_size):
    """Exactness rotation (module docstring), plus on some worlds: float32, DepComm byte
    counts, the measured-cost path, and online adjustment with forced and measured
    switches (``adjust_checks``)."""
    cases = ADJUST_CASES.get(world_size, [])
    refs = {name: reference(name) for name in {c[0] for c in cases}}
    run_ranks(check_world, world_size, tmp_path, CASES[world_size], refs)


def test_bad_unit_cost_is_refused():
    with pytest.raises(ValueError, match="data parallel edge_cost must be a finite number"):
        DataParallel.Options(mode="hybrid", edge_cost=-1.0)


def test_a_split_equal_to_a_pure_mode_is_timed_once_under_its_name():
    """The hybrid trial times each distinct plan once: a cost-model split that caches
    nothing is DepComm's plan, one that caches everything DepCache's, and with no
    remote dependency all three are one plan."""
    from fullgraph.comm.group import single_comm
    from fullgraph.parallel.data import _twins

    comm = single_comm()
    none, some = torch.zeros(4, dtype=torch.bool), torch.tensor([True, False, True, False])
    pure = {"depcomm": none, "depcache": torch.ones(4, dtype=torch.bool)}
    assert _twins({"hybrid": none.clone(), **pure}, comm) == {"hybrid": "depcomm"}
    assert _twins({"hybrid": ~none, **pure}, comm) == {"hybrid": "depcache"}
    assert _twins({"hybrid": some, **pure}, comm) == {}
    empty = torch.zeros(0, dtype=torch.bool)
    assert _twins({"hybrid": empty, "depcomm": empty, "depcache": empty.clone()}, comm) == \
        {"depcache": "depcomm", "hybrid": "depcomm"}


def check_different_data_is_refused(comm, out: str):
    """Under torchrun each host reads its own copies: a partition file or a dataset
    that differs on one host is refused on every rank, naming the ranks."""
    from fullgraph.errors import ConfigError
    from fullgraph.partition import PartitionBook
    from fullgraph.train import check_same_data

    dataset = make_dataset()
    n = dataset.graph.num_nodes
    part_of = torch.arange(n) % 2
    if comm.rank == 1:
        part_of[0] = 1 - part_of[0]  # a stale copy on the second host
    path = f"{out}/book{comm.rank}.json"
    PartitionBook.from_assignment(part_of, 2).save(path)
    with pytest.raises(ValueError, match=r"partition file .*book\d\.json: its contents differ "
                                         r"between the workers \(\w+ on rank\(s\) 0; \w+ on "
                                         r"rank\(s\) 1\); give every host the same file"):
        partition_book(dataset, comm, PartitionOptions(file=path))
    check_same_data(dataset, comm)  # the same data passes
    if comm.rank == 1:
        dataset.data.train_mask[dataset.data.train_mask.nonzero()[0]] = False
    with pytest.raises(ConfigError, match=r"the workers loaded different data \(masks: .*; "
                                          r"train vertices: \d+ on rank\(s\) 0, \d+ on "
                                          r"rank\(s\) 1\)"):
        check_same_data(dataset, comm)
    # from the store (as every launched worker opens its data), what the files hold is
    # compared, by the checksums written with them: here features of the same shape
    from fullgraph.graph import store

    stored = make_dataset()
    if comm.rank == 1:
        stored.data.features.mul_(100)
    store.save_dataset(stored, f"{out}/copy{comm.rank}")
    opened = store.load_dataset(f"{out}/copy{comm.rank}")
    with pytest.raises(ConfigError, match=r"the workers loaded different data \(features.npy: "
                                          r"'\w+' on rank\(s\) 0, '\w+' on rank\(s\) 1\)"):
        check_same_data(opened, comm)


@pytest.mark.dist
def test_workers_with_different_data_are_refused(tmp_path):
    run_ranks(check_different_data_is_refused, 2, tmp_path, str(tmp_path))


def _budget_world(comm, ref_losses) -> None:
    import dataclasses

    from adjust_checks import config, dataset

    from fullgraph.config import AdaptConfig
    from fullgraph.train import train

    cfg = config("gcn", "data")
    cfg = dataclasses.replace(cfg, adapt=AdaptConfig(mode="adjust", cache_budget_mb=1e-4))
    cfg.options["data_parallel"] = DataParallel.Options(mode="depcache")
    result = train(dataset(), cfg, comm=comm, dtype=torch.float64)
    first = [e for e in result.extra["profiles"][comm.rank][0].events
             if e["kind"] == "adjust"]
    assert first and first[0]["at"].startswith("start") and first[0]["budget_bound"], first
    # exact whatever is cached
    torch.testing.assert_close(torch.tensor([r.loss for r in result.epochs]),
                               torch.tensor(ref_losses))


@pytest.mark.dist
def test_a_starting_plan_over_the_cache_budget_is_cut_before_the_first_epoch(tmp_path):
    """--dep-mode depcache with --cache-budget: the first epoch ran fully cached
    whatever the budget before (the budget bound only the first adjustment)."""
    run_ranks(_budget_world, 2, tmp_path, reference("gcn")[0])
