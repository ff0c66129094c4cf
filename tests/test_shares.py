"""Speed-proportional shares of tensor parallelism, without spawning workers: the
count split (``share_counts``, ``check_counts``), the share computation and its
hysteresis (``target_shares``, ``changed``, ``ShareBalancer.decide``), the
``shares`` option and ``replan``'s argument checks, and ``--adapt adjust`` building
the balancer for ``--strategy tensor``. Exactness on 2 and 3 workers is tested in
``tests/parallel/test_replan.py``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fullgraph.adapt import build_adapters
from fullgraph.adapt.shares import (
    MIN_SHARE,
    WINDOW,
    ShareBalancer,
    changed,
    floor_share,
    target_shares,
)
from fullgraph.comm.placement import check_counts, even_counts, share_counts
from fullgraph.config import AdaptConfig, Config, RuntimeConfig
from fullgraph.errors import ConfigError
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel
from fullgraph.train import check_before_launch


def test_share_counts_are_proportional_and_sum_exactly():
    assert share_counts(90, [2, 1]) == [60, 30]
    assert share_counts(10, [1, 1, 1]) == [4, 3, 3]  # ties to the lower part
    assert share_counts(7, [0.5, 0.3, 0.2]) == [4, 2, 1]  # 3.5, 2.1, 1.4: largest remainders
    for total in range(0, 40):
        for shares in ([1, 1], [3, 1, 1], [0.1, 7, 2.5, 1], [1, 0, 0]):
            counts = share_counts(total, shares)
            assert sum(counts) == total and min(counts) >= 0, (total, shares, counts)
            assert all(abs(c - total * w / sum(shares)) < 1 for c, w in zip(counts, shares))
        for parts in (1, 2, 3, 4):  # equal shares are the even split
            assert share_counts(total, [1.0] * parts) == even_counts(total, parts)


def test_share_counts_minimum_and_bad_shares():
    assert share_counts(67, [20, 1]) == [64, 3]
    assert share_counts(5, [20, 1]) == [5, 0]  # a worker may get no columns
    assert share_counts(5, [20, 1], minimum=1) == [4, 1]  # but at least one row
    assert share_counts(1, [1, 1], minimum=1) == [1, 0]  # too few for the minimum
    for bad in ([], [1, -1], [0, 0], [float("nan"), 1], [float("inf"), 1]):
        with pytest.raises(ValueError, match="shares must be finite"):
            share_counts(10, bad)


def test_check_counts_names_what_is_wrong():
    assert check_counts([3, 0, 4], 7, 3, "rows") == [3, 0, 4]
    for bad in ([3, 4], [3, 5, 0], [8, -1, 0]):
        with pytest.raises(ValueError, match="rows: need 3 non-negative counts summing to 7"):
            check_counts(bad, 7, 3, "rows")


def test_target_shares_proportional_with_a_minimum():
    assert target_shares([2.0, 1.0, 1.0]) == pytest.approx([0.5, 0.25, 0.25])
    assert target_shares([1.0, 1.0]) == pytest.approx([0.5, 0.5])
    low = target_shares([100.0, 1.0, 1.0])  # both slow ones held at the minimum
    assert low == pytest.approx([1 - 2 * MIN_SHARE, MIN_SHARE, MIN_SHARE])
    mixed = target_shares([100.0, 50.0, 1.0], 0.1)
    assert mixed == pytest.approx([0.6, 0.3, 0.1]) and sum(mixed) == pytest.approx(1.0)
    for speeds, floor in (([1.0, 0.0], 0.05), ([1.0, 1.0], 0.6), ([], 0.0)):
        with pytest.raises(ValueError, match="target_shares"):
            target_shares(speeds, floor)


class Recorder:
    """A strategy stand-in for ``ShareBalancer.decide`` (which never calls it)."""


class FakePlan:
    shares = None
    comm = type("C", (), {"world_size": 2})()


def test_no_thrash_when_speeds_are_equal_or_drift_a_little():
    assert not changed([0.5, 0.5], [0.52, 0.48])
    assert changed([0.5, 0.5], [0.6, 0.4])
    assert changed([0.95, 0.05], [0.94, 0.06])  # a small share moving by a fifth
    balancer = ShareBalancer(Recorder(), FakePlan(), lambda e: None)
    assert balancer.decide([1.0, 0.1], 1) is None  # warm-up: not measured
    noisy = [[1.0, 1.08], [0.93, 1.0], [1.1, 1.0], [1.0, 0.9], [1.0, 1.0], [1.07, 0.96]]
    assert all(balancer.decide(s, e) is None for e, s in enumerate(noisy, 2))
    assert [0.1] not in [h[1:] for h in balancer.history]
    # rank 1 at half speed: one switch once the median sees it, then none
    epochs = range(8, 8 + WINDOW + 3)
    decisions = [balancer.decide([1.0, 0.5 + 0.02 * (e % 2)], e) for e in epochs]
    switches = [d for d in decisions if d is not None]
    assert len(switches) == 1 and switches[0] == pytest.approx([2 / 3, 1 / 3], abs=0.01)
    assert decisions.index(switches[0]) == WINDOW // 2  # the median's delay
    assert balancer.shares == switches[0]


def test_many_workers_get_a_floor_their_number_allows():
    """21 workers at 5 % each would exceed the whole: the floor is half an equal share."""
    assert floor_share(2) == MIN_SHARE and floor_share(24) == pytest.approx(1 / 48)

    class Plan:
        shares = None
        comm = type("C", (), {"world_size": 24})()

    balancer = ShareBalancer(Recorder(), Plan(), lambda e: None)
    assert balancer.decide([1.0] * 23 + [0.01], 5) is None  # resumed after 4: warm-up
    shares = balancer.decide([1.0] * 23 + [0.01], 6)  # one worker nearly stopped
    assert shares is not None and sum(shares) == pytest.approx(1.0)
    assert shares[23] == pytest.approx(1 / 48) and shares[0] == pytest.approx((1 - 1 / 48) / 23)
    assert "share >= 2.1%" in balancer.header()[0]


def dataset():
    return sbm(30, 3, avg_degree=4.0, num_features=6, seed=3)


def test_shares_option_and_replan_reject_bad_counts():
    torch.manual_seed(0)
    model = build_model("gcn", 6, 4, 3, num_layers=2)
    for bad in ("", "2,x", "1,-1", "0,0"):
        with pytest.raises(ValueError, match="expected comma-separated non-negative"):
            TensorParallel.Options(shares=bad)
    with pytest.raises(ValueError, match="gives 2 shares for 1 workers"):
        TensorParallel(TensorParallel.Options(shares="2,1")).setup(dataset(), model,
                                                                   torch.device("cpu"))
    strategy = TensorParallel(TensorParallel.Options(shares="3"))
    plan = strategy.setup(dataset(), model, torch.device("cpu"))
    assert plan.shares == (3.0,) and plan.row_counts == [30] and plan.layout(4).col_counts == (4,)
    assert strategy.describe(model, plan) == ["tensor   shares 3: rows 30, columns split in "
                                              "the same proportion"]
    with pytest.raises(ValueError, match="replan: 2 shares for 1 workers"):
        strategy.replan(model, plan, [1.0, 1.0])
    with pytest.raises(ValueError, match="replan row_counts: need 1 non-negative counts "
                                         "summing to 30, got \\[29\\]"):
        strategy.replan(model, plan, [1.0], row_counts=[29])
    with pytest.raises(ValueError, match="replan col_counts\\[4\\]: .* got \\[-1\\]"):
        strategy.replan(model, plan, [1.0], col_counts={4: [-1]})


def test_adapt_adjust_builds_the_balancer_for_tensor_only():
    torch.manual_seed(0)
    model = build_model("gcn", 6, 4, 3, num_layers=2)
    strategy = TensorParallel()
    plan = strategy.setup(dataset(), model, torch.device("cpu"))
    cfg = Config(runtime=RuntimeConfig(strategy="tensor"), adapt=AdaptConfig(mode="adjust"))
    (balancer,) = build_adapters(cfg, strategy, model, plan, 0, 2, lambda e: None)
    assert isinstance(balancer, ShareBalancer)
    with pytest.warns(UserWarning, match="--adapt adjust has no effect with one worker"):
        assert build_adapters(cfg, strategy, model, plan, 0, 1, lambda e: None) == []
    assert "in proportion to each worker's measured compute speed" in balancer.header()[0]
    budget = dataclasses.replace(cfg, adapt=AdaptConfig(mode="adjust", cache_budget_mb=1.0))
    with pytest.raises(ConfigError, match="--cache-budget bounds DepCache under --adapt "
                                          "adjust with --strategy data"):
        build_adapters(budget, strategy, model, plan, 0, 1, lambda e: None)
    with pytest.raises(ConfigError, match="--cache-budget bounds DepCache"):  # before launch
        check_before_launch(budget, dataset(), 2)
    single = dataclasses.replace(cfg, runtime=RuntimeConfig(strategy="single"))
    with pytest.raises(ConfigError, match="works on --strategy data .* or tensor .* "
                                          "the run uses 'single'"):
        build_adapters(single, SingleProcess(), model, plan, 0, 1, lambda e: None)
    injected = dataclasses.replace(cfg, adapt=AdaptConfig(inject="sleep:ranks=2"))
    with pytest.raises(ConfigError, match=r"ranks \[2\] do not exist with 2 worker"):
        check_before_launch(injected, dataset(), 2)


def test_even_times_do_not_switch_and_probes_give_work_back():
    """Compute that does not shrink with a share (a fixed cost, as on small graphs): the
    speeds follow the shares, the times stay even. The shares do not walk with the
    speeds' noise, and a worker left at a small share is probed with twice its share:
    kept where its time stays, undone (and the next probe waits twice as long) where
    its time grows in proportion."""
    balancer = ShareBalancer(Recorder(), FakePlan(), lambda e: None)
    balancer.shares = [0.9, 0.1]  # left by a slowdown that is over
    fixed = [0.01, 0.01]
    assert balancer.decide([1.0, 1.0], 1, fixed) is None  # warm-up
    decisions = [balancer.decide([0.9 / 0.01, 0.1 / 0.01 * (1.3 if e % 2 else 1.0)], e, fixed)
                 for e in range(2, 2 + WINDOW - 1)]
    assert decisions == [None] * (WINDOW - 1)  # even times: no switch, whatever the speeds
    probe = balancer.decide([90.0, 10.0], 2 + WINDOW - 1, fixed)  # the WINDOW-th quiet epoch
    assert probe == pytest.approx([0.8, 0.2]) and balancer.trial is not None
    assert balancer.decide([80.0, 20.0], 10, fixed) is None  # its time stayed: kept
    assert balancer.shares == pytest.approx([0.8, 0.2]) and balancer.trial is None
    # a worker still slow: its time doubles with its share, the probe is undone
    slow = ShareBalancer(Recorder(), FakePlan(), lambda e: None)
    slow.shares = [0.9, 0.1]
    slow.decide([1.0, 1.0], 1, fixed)
    for e in range(2, 2 + WINDOW):
        out = slow.decide([90.0, 10.0], e, fixed)
    assert out == pytest.approx([0.8, 0.2])
    assert slow.decide([80.0, 10.0], 20, [0.01, 0.02]) == pytest.approx([0.9, 0.1])
    assert slow.probe_wait == 2 * WINDOW
    assert all(slow.decide([90.0, 10.0], e, fixed) is None for e in range(21, 21 + WINDOW))


def _on_balancing_trial() -> ShareBalancer:
    """A balancer of 2 workers, rank 1 taking twice rank 0's time, on the balancing
    trial that gives it a third of the work."""
    balancer = ShareBalancer(Recorder(), FakePlan(), lambda e: None)
    balancer.decide([1.0, 1.0], 1, [0.01, 0.01])  # warm-up
    out = None
    for e in range(2, 2 + WINDOW):
        out = balancer.decide([0.5 / 0.01, 0.5 / 0.02], e, [0.01, 0.02])
        if out is not None:
            break
    assert out == pytest.approx([2 / 3, 1 / 3], abs=0.01) and balancer.trial is not None
    return balancer


def test_a_balancing_switch_that_does_not_shorten_the_slowest_time_is_undone():
    """Rank 1 slowest by a fixed cost of its own: shares in proportion to the speeds
    predict a shorter epoch, the epoch after shows none, and the shares go back (the
    next try waits twice as long). Where the slowest time falls, the switch stays."""
    def run(after: list[float]) -> ShareBalancer:
        balancer = _on_balancing_trial()
        balancer.decide([0.67 / after[0], 0.33 / after[1]], 10, after)
        return balancer

    stuck = run([0.0135, 0.02])  # rank 1's time did not fall: undone
    assert stuck.shares == pytest.approx([0.5, 0.5])
    assert stuck.balance_wait == WINDOW
    assert all(stuck.decide([50.0, 25.0], e, [0.01, 0.02]) is None for e in range(11, 16))
    helped = run([0.0135, 0.0135])  # as predicted: kept
    assert helped.shares == pytest.approx([2 / 3, 1 / 3], abs=0.01) and helped.balance_wait == 0


def test_an_undone_trial_restores_the_first_split_itself():
    """Without --shares the first split is setup's (even rows, --column-split's
    columns), not equal shares' proportional one: going back to the first shares
    replans with None, which splits as setup does."""
    calls = []

    class Strategy:
        def replan(self, model, plan, shares):
            calls.append(shares)

    balancer = ShareBalancer(Strategy(), FakePlan(), lambda e: None)
    plan = type("P", (), {"comm": FakePlan.comm, "row_counts": [5, 5]})()
    for target in ([0.7, 0.3], [0.5, 0.5]):
        balancer.measure = lambda *a: (None, None)
        balancer.decide = lambda *a, t=target: balancer._switch(t)
        balancer.between_epochs(None, plan, 3, None)
    assert calls == [[0.7, 0.3], None]
    given = type("G", (FakePlan,), {"shares": (1.0, 1.0)})()  # --shares 1,1: kept as such
    again = ShareBalancer(Strategy(), given, lambda e: None)
    again.measure = lambda *a: (None, None)
    again.decide = lambda *a: again._switch([0.5, 0.5])
    again.between_epochs(None, plan, 3, None)
    assert calls[-1] == [0.5, 0.5]


def test_a_balancing_switch_kept_by_a_slowdown_that_ended_is_undone():
    """Rank 1 was slow (speeds 2:1); its slowdown ends in the epoch the switch takes
    work from it: the slowest time falls, but rank 1 took far less than its smaller
    share predicts, so the fall is not the switch's and the shares go back."""
    balancer = _on_balancing_trial()
    # predicted for rank 1: 0.02 x (1/3) / (1/2) = 0.0133; it took 0.004 (recovered)
    assert balancer.decide([0.67 / 0.0135, 0.33 / 0.004], 10, [0.0135, 0.004]) == \
        pytest.approx([0.5, 0.5])
