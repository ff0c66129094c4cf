"""Partial reduce (``--adapt adjust+partial``, NeutronCloud §5).

- the pieces as pure functions: BFS counts, coverage factors, parameter hops, which
  epochs synchronise everyone;
- the stale halo on two ranks: a late peer's rows replaced by its last ones, the late
  message refreshing them when it completes, the staleness bound forcing a wait, the
  drain leaving nothing in flight;
- with a slack no deadline can pass, the whole machinery (tagged halo, store
  agreement, reduce at the lowest ready rank) equals single-process training;
- with one straggler, the fast workers do not wait for it (their blocking stays
  within the slack), it is left out of the partial updates and brought back every K
  epochs, and every worker ends with the same parameters;
- accuracy on Cora with the paper's compute injection, against the exact run.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from harness import run_ranks

from fullgraph.adapt.partial import bfs_counts, coverage_factors, parameter_hops
from fullgraph.comm.exchange import ExchangeTable
from fullgraph.comm.group import Comm
from fullgraph.comm.stale import StaleHalo, point_tag
from fullgraph.config import AdaptConfig, Config, ModelConfig, RuntimeConfig, TrainConfig
from fullgraph.graph.csr import Graph
from fullgraph.graph.datasets import BUILTIN
from fullgraph.graph.formats.planetoid import load_planetoid
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.train import train


# ------------------------------------------------------------------ pure pieces
def test_bfs_counts_per_owner_and_hop():
    # in-edges (CSR by destination): 0 <- 1, 1 <- 2, 2 <- 3, 3 <- (none), 4 <- 3
    graph = Graph(torch.tensor([0, 1, 2, 3, 3, 4]), torch.tensor([1, 2, 3, 3]))
    train_mask = torch.tensor([True, False, False, False, True])
    part_of = torch.tensor([0, 0, 1, 1, 1])
    counts = bfs_counts(graph, train_mask, part_of, 2, 3)
    # hop 0: {0, 4}; hop 1: + {1, 3}; hop 2: + {2}; hop 3: nothing new
    assert counts.tolist() == [[1, 2, 2, 2], [1, 2, 3, 3]]


def _shard_counts_world(comm: Comm, want: np.ndarray) -> None:
    from fullgraph.checkpoint import dataset_fingerprint
    from fullgraph.models.stages import propagation_inputs
    from fullgraph.partition import partition
    from fullgraph.partition.shards import loop_free_in_degree, part_dataset

    ds = sbm(200, 3, avg_degree=4.0, num_features=5, seed=1)
    book = partition(ds.graph, comm.world_size, "random", seed=0)
    model = build_model("gcn", 5, 4, 3, num_layers=2)
    part = part_dataset(ds, book, comm.rank, 2, loop_free_in_degree(ds.graph), 0.0,
                        dataset_fingerprint(ds))
    graph, _ = propagation_inputs(model, part.graph, torch.float32, part.shard.in_degree)
    alone = bfs_counts(graph, part.data.train_mask, book.part_of, comm.world_size, 2)
    assert not np.array_equal(alone, want)  # the shard alone misses other parts' in-edges
    got = bfs_counts(graph, part.data.train_mask, book.part_of, comm.world_size, 2, comm)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {comm.rank}")


@pytest.mark.dist
def test_bfs_counts_on_shards_equal_the_whole_graphs(tmp_path):
    """On per-part shards the workers follow the in-edges of the vertices they own and
    combine what they reach (formula 13's counts, the same on every worker)."""
    from fullgraph.models.stages import propagation_inputs
    from fullgraph.partition import partition

    ds = sbm(200, 3, avg_degree=4.0, num_features=5, seed=1)
    book = partition(ds.graph, 3, "random", seed=0)
    whole, _ = propagation_inputs(build_model("gcn", 5, 4, 3, num_layers=2), ds.graph)
    run_ranks(_shard_counts_world, 3, tmp_path,
              bfs_counts(whole, ds.data.train_mask, book.part_of, 3, 2))


def test_coverage_factors_scale_the_ready_sum_to_every_worker():
    counts = np.array([[10, 20], [30, 60], [0, 20]])
    assert coverage_factors(counts, [0, 1, 2]) == [1.0, 1.0]
    assert coverage_factors(counts, [0, 1]) == pytest.approx([1.0, 100 / 80])
    assert coverage_factors(counts, [2]) == [1.0, 5.0]  # no training vertex among them


def test_parameter_hops_count_the_propagations_a_stage_feeds():
    model = build_model("gcn", 6, 4, 3, num_layers=2)
    params = list(model.parameters())
    # T (W1), P, bias, T (W2), P, bias: W1 feeds two propagations, W2 one, biases after
    # the P of their layer: the first one feeds the second layer's P
    hops = dict(zip([n for n, _ in model.named_parameters()], parameter_hops(model, params)))
    assert hops == {"stages.1.lin.weight": 2, "stages.3.bias": 1,
                    "stages.5.lin.weight": 1, "stages.7.bias": 0}


def test_point_tags_are_distinct_per_epoch_stage_and_direction():
    tags = {point_tag(e, (s, d)) for e in range(4) for s in range(10) for d in ("fwd", "bwd")}
    assert len(tags) == 80


# ------------------------------------------------------------- the stale halo
def _halo_world(comm: Comm) -> None:
    """Rank 1 owns rows [10, 11, 12]; rank 0 fetches the first two every epoch."""
    deadline = {"at": float("inf")}
    halo = StaleHalo(comm, staleness=1, deadline=lambda point: deadline["at"],
                     reached=lambda point: None)
    if comm.rank == 0:
        table = ExchangeTable([torch.empty(0, dtype=torch.int64)] * 2, [0, 2])
    else:
        table = ExchangeTable([torch.tensor([0, 1]), torch.empty(0, dtype=torch.int64)], [0, 0])
    rows = lambda epoch: torch.tensor([[10.0], [11.0], [12.0]]) * epoch  # noqa: E731

    def epoch(e: int, sync: bool, late: float = 0.0) -> torch.Tensor:
        halo.begin_epoch(e, sync)
        if comm.rank == 1:
            time.sleep(late)
            return halo.fetch(rows(e), table, 0)
        deadline["at"] = time.perf_counter() + 0.3
        return halo.fetch(torch.zeros(0, 1), table, 0)

    got1 = epoch(1, sync=True)
    got2 = epoch(2, sync=False, late=1.0)  # rank 1 sends 1 s late: rank 0 uses epoch 1's
    got3 = epoch(3, sync=False, late=0.0)
    stats3 = halo.begin_epoch(4, False)
    if comm.rank == 0:
        assert got1.flatten().tolist() == [10.0, 11.0]
        assert got2.flatten().tolist() == [10.0, 11.0]  # historical
        assert got3.flatten().tolist() == [30.0, 33.0]  # current
        assert stats3.late_refreshes == 1  # epoch 2's message arrived and was kept
    # K = 1: rows two epochs old are too old, rank 0 waits for the current ones
    got4 = epoch(4, sync=False, late=0.0)
    halo.begin_epoch(5, False)
    got5 = epoch(5, sync=False, late=0.8)
    stats5 = halo.begin_epoch(6, True)
    if comm.rank == 0:
        assert got4.flatten().tolist() == [40.0, 44.0]
        assert got5.flatten().tolist() == [40.0, 44.0] and stats5.oldest == 1
    halo.close()
    assert all(not queue for queue in halo.pending.values()) and not halo.outbox.pending


@pytest.mark.dist
def test_stale_halo_uses_history_refreshes_it_late_and_bounds_its_age(tmp_path):
    run_ranks(_halo_world, 2, tmp_path)


def _forced_wait_world(comm: Comm) -> None:
    halo = StaleHalo(comm, staleness=1, deadline=lambda point: time.perf_counter() + 0.05,
                     reached=lambda point: None)
    if comm.rank == 0:
        table = ExchangeTable([torch.empty(0, dtype=torch.int64)] * 2, [0, 1])
    else:
        table = ExchangeTable([torch.tensor([0]), torch.empty(0, dtype=torch.int64)], [0, 0])
    for e in (1, 2, 3):
        halo.begin_epoch(e, sync=False)
        if comm.rank == 1:
            time.sleep(0.4 if e != 2 else 0.0)
        got = halo.fetch(torch.full((1, 1), float(e)) if comm.rank else torch.zeros(0, 1),
                         table, 0)
        if comm.rank == 0:
            # epoch 1: nothing kept, waits; 2: on time; 3: late but epoch 2's is 1 old
            assert got.item() == (2.0 if e == 3 else float(e)), (e, got)
    stats = halo.begin_epoch(4, True)
    halo.close()
    if comm.rank == 0:
        assert stats.stale_peers == 1 and stats.forced_waits == 0


@pytest.mark.dist
def test_stale_halo_waits_when_nothing_recent_is_kept(tmp_path):
    run_ranks(_forced_wait_world, 2, tmp_path)


# ------------------------------------------------- whole runs in spawned worlds
def _config(model: str, epochs: int, *, mode: str = "adjust+partial", slack: float = 0.5,
            staleness: int = 3, inject: str | None = None, lr: float = 0.05,
            seed: int = 0, strategy: str = "data", late: str = "reuse") -> Config:
    return Config(model=ModelConfig(name=model, hidden=6, dropout=0.3,
                                    **({"heads": 2} if model == "gat" else {})),
                  train=TrainConfig(epochs=epochs, lr=lr, weight_decay=0.0, seed=seed),
                  runtime=RuntimeConfig(strategy=strategy),
                  adapt=AdaptConfig(mode=mode, slack=slack, staleness=staleness,
                                    inject=inject, late_gradients=late))


def _losses(result) -> list[float]:
    return [r.loss for r in result.epochs]


def _exact_world(comm: Comm, refs: dict[str, list[float]]) -> None:
    from fullgraph.adapt.adjuster import OnlineAdjuster

    measured: list[tuple[int, dict[str, float], tuple[int, ...]]] = []
    original = OnlineAdjuster.measure

    def measure(self, plan, profile):
        cached = tuple(plan.deps.cached.nonzero()[:, 0].tolist())  # the plan measured
        measured.append((profile.epoch, dict(plan.clock.units), cached))
        return original(self, plan, profile)

    OnlineAdjuster.measure = measure  # (this rank's process only)
    dataset = sbm(240, 3, seed=2)
    for model, expected in refs.items():
        measured.clear()
        cfg = _config(model, 8, slack=1e6, staleness=2)
        got = _losses(train(dataset, cfg, comm=comm, dtype=torch.float64))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
        # every adjustment measures one epoch's stages, the deferred ones (of the
        # partial epochs 4 and 6, run at the start of 5 and 7) too
        assert [e for e, _, _ in measured] == [1, 2, 4, 6, 7], measured
        per_plan: dict[tuple[int, ...], dict[str, float]] = {}
        assert all(units.get("T") and per_plan.setdefault(cached, units) == units
                   for _, units, cached in measured), measured


@pytest.mark.dist
def test_partial_reduce_without_deadlines_equals_single_process(tmp_path):
    """A slack no deadline passes: every halo row is current and every worker is in
    every update, so the tagged exchanges, the store agreement and the reduce at the
    lowest rank must reproduce single-process training (float64, 3 workers, partial
    epochs 4 and 6 between full ones)."""
    dataset = sbm(240, 3, seed=2)
    refs = {m: _losses(train(dataset, _config(m, 8, mode="off", strategy="single"),
                             dtype=torch.float64)) for m in ("gcn", "gat")}
    run_ranks(_exact_world, 3, tmp_path, refs)


STRAGGLER, K, EPOCHS = 2, 3, 12


def _straggler_world(comm: Comm, late: str) -> None:
    from fullgraph.comm.tagged import probe_links

    times = probe_links(comm, 4096)  # T_c,i,j of the online adjustment: one per peer
    assert times[comm.rank] == 0.0 and all(t > 0 for r, t in enumerate(times) if r != comm.rank)
    dataset = sbm(300, 3, seed=1)
    inject = f"sleep:p=0,s=0.6,n=100,at=4,ranks={STRAGGLER}"
    result = train(dataset, _config("gcn", EPOCHS, inject=inject, staleness=K, late=late),
                   comm=comm)
    per_rank = result.extra["profiles"]  # [rank][epoch]
    events = [[next(e for e in per_rank[r][i].events if e["kind"] == "partial")
               for r in range(comm.world_size)] for i in range(EPOCHS)]  # [epoch][rank]
    left_out, stale, beyond, reused = [], 0, [], []
    for epoch, per_rank in enumerate(events, start=1):
        sync = per_rank[0]["sync"]
        assert all(e["sync"] == sync for e in per_rank), (epoch, per_rank)
        assert sync == (epoch <= 3 or epoch == EPOCHS or (epoch - 3) % K == 0), epoch
        if sync:
            assert per_rank[0]["ready"] == [0, 1, 2]
            left_out.append(False)
            continue
        assert all(e["ready"] == [0, 1] for e in per_rank), (epoch, per_rank)
        left_out.append(True)
        lead = per_rank[0]  # rank 0 sums the gradients
        assert lead["reused"] in ([], [STRAGGLER]) and lead["reused_age"] <= K, (epoch, lead)
        reused.append(epoch if lead["reused"] else None)
        for rank in (0, 1):  # the fast ones did not wait for rank 2: old rows instead
            e = per_rank[rank]
            assert e["oldest"] <= K, (epoch, rank, e)
            assert e["blocked_s"] < 0.3, (epoch, e)  # half of rank 2's delay, whatever the load
            stale += e["stale_peers"]
            beyond.append(e["blocked_s"] - e["baseline_wait_s"] - e["slack_s"])
    assert stale > 0  # (a plan that caches all of rank 2's rows on a worker needs none)
    # the fast ones block about as long as they did without a straggler plus the slack:
    # a few ms over it on a quiet machine, up to ~0.1 s with 3 ranks on 2 loaded cores;
    # waiting for rank 2 would put the median near its 0.6 s delay
    assert sorted(beyond)[len(beyond) // 2] < 0.15, beyond
    runs = "".join("x" if x else "." for x in left_out)
    assert "x" * K not in runs and "x" in runs, runs  # brought back within K epochs
    if late == "rescale":
        assert not any(reused), reused
    else:  # its gradient of epoch 5 (8), drained at the sync of 6 (9), stands in at 7, 8
        # (10, 11); at 4 there is none yet, at 5 that of 4 is still on its way
        assert {7, 8, 10, 11} <= set(reused), reused
    flat = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(comm.world_size)]
    torch.distributed.all_gather(gathered, flat)
    for other in gathered[1:]:  # the straggler applied the group's updates too
        assert torch.equal(other, gathered[0])


@pytest.mark.dist
@pytest.mark.parametrize("late", ["reuse", "rescale"])
def test_fast_workers_go_on_without_a_straggler_for_at_most_k_epochs(tmp_path, late):
    """Rank 2 sleeps 0.6 s per epoch from epoch 4. ``reuse``: its late gradient
    stands in for it, at most K epochs old; ``rescale``: never."""
    run_ranks(_straggler_world, 3, tmp_path, late)


def test_the_usual_time_is_the_smallest_then_the_lower_quartile():
    """A slowed worker's full synchronisations raise it only when they are all of the
    first three or three quarters of more (a sleep of 10 x the step)."""
    from fullgraph.adapt.partial import usual

    assert usual([10.0, 1.0]) == usual([10.0, 10.0, 1.0]) == usual([10, 1, 10, 1, 10]) == 1.0
    assert usual([10.0, 10.0]) == 10.0 and usual([1.0, 10, 10, 10, 10]) == 10.0


def _warmup_straggler_world(comm: Comm) -> None:
    # rank 2 sleeps in epochs 2-3 (the warm-up) and again from epoch 10; K = 3: full
    # synchronisations at 1-3, 6, 9, 12 and 15
    inject = "sleep:p=0,s=0.6,n=2,at=2,ranks=2;sleep:p=0,s=0.6,n=100,at=10,ranks=2"
    result = train(sbm(300, 3, seed=1), _config("gcn", 15, inject=inject, staleness=3),
                   comm=comm)
    events = [next(e for e in p.events if e["kind"] == "partial")
              for p in result.extra["profiles"][comm.rank]]
    left_out = [epoch for epoch, e in enumerate(events, 1) if e["skipped"]]
    # before the fix the warm-up's median kept the deadline above the sleep all run
    assert {10, 11, 13, 14} <= set(left_out), (left_out, events)


@pytest.mark.dist
def test_a_slowdown_in_the_warm_up_does_not_switch_partial_update_off(tmp_path):
    run_ranks(_warmup_straggler_world, 3, tmp_path)


def _diverging_world(comm: Comm) -> None:
    with pytest.warns(UserWarning, match="the training diverged"):
        result = train(sbm(240, 3, seed=2), _config("gcn", 12, lr=1e37, staleness=3),
                       comm=comm)
    assert len(result.epochs) < 12 and not np.isfinite(result.epochs[-1].loss)


@pytest.mark.dist
def test_a_diverged_run_stops_under_partial_reduce_too(tmp_path):
    """At a full synchronisation (every rank's loss, nothing in flight); it trained on
    NaN to the end before."""
    run_ranks(_diverging_world, 3, tmp_path)


def _resume_world(comm: Comm, ckpt: str) -> None:
    dataset = sbm(200, 3, seed=3)
    first = _config("gcn", 6, staleness=2)
    first = dataclasses.replace(first, train=dataclasses.replace(
        first.train, checkpoint_dir=ckpt, checkpoint_every=6))
    train(dataset, first, comm=comm)
    again = dataclasses.replace(first, train=dataclasses.replace(first.train, epochs=12,
                                                                 resume=ckpt))
    result = train(dataset, again, comm=comm)
    events = [next(e for e in p.events if e["kind"] == "partial")
              for p in result.extra["profiles"][comm.rank]]
    # epochs 7-9 warm up again, then 11 is a full sync (K = 2) and 12 the last
    assert [e["sync"] for e in events] == [True, True, True, False, True, True], events
    assert events[3]["slack_s"] is not None  # deadlines measured after the resume


@pytest.mark.dist
def test_partial_reduce_warms_up_again_after_a_resume(tmp_path):
    run_ranks(_resume_world, 2, tmp_path, str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ accuracy
SEEDS, ACC_EPOCHS, ACC_LR = (0, 1, 2), 60, 0.03


def _cora():
    dataset = load_planetoid(BUILTIN / "cora", "cora")
    dataset.data = dataset.data.row_normalized()
    return dataset


def _cora_config(mode: str, seed: int, strategy: str = "data") -> Config:
    cfg = _config("gcn", ACC_EPOCHS, mode=mode, lr=ACC_LR, seed=seed, strategy=strategy,
                  inject="sleep:p=0.1,n=5" if mode != "off" else None)
    return dataclasses.replace(cfg, model=ModelConfig(name="gcn", hidden=16, dropout=0.5),
                               train=dataclasses.replace(cfg.train, weight_decay=5e-4))


def _accuracy_world(comm: Comm, exact: float) -> None:
    dataset = _cora()
    accs = [train(dataset, _cora_config("adjust+partial", s), comm=comm).test_at_best
            for s in SEEDS]
    partial = sum(accs) / len(accs)
    if comm.rank == 0:
        print(f"cora test accuracy, mean of {len(SEEDS)} seeds: exact {exact:.4f}, "
              f"adjust+partial {partial:.4f} {accs}")
    assert partial >= exact - 0.01, (exact, partial, accs)


@pytest.mark.dist
def test_partial_reduce_keeps_the_exact_accuracy_on_cora(tmp_path):
    """4 workers, each slowed with probability 0.1 per epoch for 5 epochs by twice its
    clean epoch (the paper's injection), K = 3; the exact mode's accuracy is the
    single-process executor's (which it equals)."""
    dataset = _cora()
    exact = [train(dataset, _cora_config("off", s, strategy="single")).test_at_best
             for s in SEEDS]
    run_ranks(_accuracy_world, 4, tmp_path, sum(exact) / len(exact), timeout_s=300)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("change, message", [
    (dict(strategy="tensor"), "works on --strategy data; the run uses 'tensor'"),
    (dict(batch_norm=True), "batch normalisation sums over every worker's rows"),
    (dict(backend="nccl"), "needs the gloo backend"),
])
def test_partial_reduce_refuses_what_it_cannot_run(change, message):
    from fullgraph.adapt import check_options
    from fullgraph.config import LaunchConfig
    from fullgraph.errors import ConfigError

    cfg = _config("gin" if change.get("batch_norm") else "gcn", 5,
                  strategy=change.get("strategy", "data"))
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, batch_norm=change.get("batch_norm", False)),
        launch=LaunchConfig(backend=change.get("backend", "auto")))
    with pytest.raises(ConfigError, match=message):
        check_options(cfg, 2)


def test_staleness_and_slack_are_checked():
    from fullgraph.errors import ConfigError

    with pytest.raises(ConfigError, match="staleness"):
        AdaptConfig(mode="adjust+partial", staleness=0)
    with pytest.raises(ConfigError, match="slack"):
        AdaptConfig(mode="adjust+partial", slack=-1.0)
    with pytest.raises(ConfigError, match="late_gradients"):
        AdaptConfig(mode="adjust+partial", late_gradients="average")



@pytest.mark.parametrize("world,warns", [(2, True), (3, False)])
def test_two_workers_are_told_that_no_one_is_left_out(monkeypatch, world, warns):
    """A majority of 2 is both workers: the run says that only the partial computation
    takes effect there."""
    import warnings

    from fullgraph import adapt
    from fullgraph.adapt import partial

    monkeypatch.setattr(partial, "PartialReduce", lambda *a, **k: "partial")
    monkeypatch.setattr(adapt, "_adjuster", lambda *a, **k: "adjuster")
    cfg = Config(runtime=RuntimeConfig(strategy="data"), adapt=AdaptConfig(mode="adjust+partial"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adapt.build_adapters(cfg, None, None, None, 0, world, None) == \
            ["partial", "adjuster"]
    said = [str(w.message) for w in caught if "no worker is left out" in str(w.message)]
    assert bool(said) == warns
