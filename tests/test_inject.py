"""Fluctuation injection: the spec, its seeded schedule, the sleeps and the CPU throttle."""
from __future__ import annotations

import os
import time

import pytest
import torch

from fullgraph.adapt.inject import (
    InjectSpec,
    Throttle,
    check_world,
    core_for,
    parse,
    schedule,
)
from fullgraph.adapt.injector import Injector
from fullgraph.config import AdaptConfig
from fullgraph.errors import ConfigError


def test_parse_reads_every_key_and_the_defaults():
    sleep, cpu = parse("sleep:p=0.2,s=1.5,n=3,ranks=1+2,at=4+7,seed=9; cpu:load=2")
    assert sleep == InjectSpec("sleep", p=0.2, seconds=1.5, epochs=3, ranks=(1, 2), at=(4, 7),
                               seed=9)
    assert cpu == InjectSpec("cpu", load=2)  # p 0.1, n 5, every rank, seed 0
    assert parse("sleep")[0].seconds is None  # auto: twice the mean clean epoch
    assert "rank 1,2" in sleep.describe() and "forced at epoch 4,7" in sleep.describe()


@pytest.mark.parametrize("text, message", [
    ("disk:rate=1mbit", "unknown kind 'disk'"),
    ("sleep:load=2", "bad key 'load=2'"),
    ("sleep:p", "bad key 'p'"),
    ("sleep:p=1.5", "p=1.5 is not a probability"),
    ("sleep:s=-1", "must be seconds >= 0"),
    ("cpu:n=0", "n=0 must be >= 1"),
    ("cpu:at=1", "start at epoch 2 or later"),
    ("sleep:p=often", "p='often' is not a number"),
    ("sleep:ranks=", "ranks='' is not integers joined by '\\+'"),
    ("sleep:at=1+x", "at='1\\+x' is not integers"),
    ("sleep:n=1.5", "n='1.5' is not an integer"),
    ("sleep:ranks=-1+2", "ranks=-1\\+2 must be >= 0"),
    (" ; ", "no item"),
    ("sleep:seed=-1", r"seed=-1 must be an integer in \[0, 2\*\*63\)"),
    ("sleep:s=0.1, s=0.2", "s given twice"),
    ("cpu:load=100000", "load=100000 would start that many busy processes; at most 64"),
])
def test_parse_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_partial_reduce_options_without_it_warn():
    with pytest.warns(UserWarning, match="--staleness, --slack have no effect without --adapt "
                                         "adjust\\+partial"):
        AdaptConfig(staleness=5, slack=0.7)


def test_config_refuses_a_bad_spec_and_check_world_a_missing_rank():
    with pytest.raises(ConfigError, match=r"^--inject 'cpu:n=0'"):
        AdaptConfig(inject="cpu:n=0")
    with pytest.raises(ValueError, match=r"ranks \[3\] do not exist with 3 worker"):
        check_world(parse("sleep:ranks=1+3"), 3)
    with pytest.raises(ValueError, match=r"at=9 is past the run's last epoch \(8\)"):
        check_world(parse("sleep:at=4+9"), 3, epochs=8)
    check_world(parse("sleep:at=4+8"), 3, epochs=8)


def test_a_sleep_as_long_as_the_timeout_is_refused():
    """The other workers would time out waiting and take the slowed one for hung."""
    from fullgraph.adapt import check_general
    from fullgraph.config import config_from_dict

    cfg = config_from_dict({"adapt": {"inject": "sleep:s=8,p=0,at=3,ranks=1"},
                            "launch": {"timeout_s": 5}})
    with pytest.raises(ConfigError, match=r"s=8 is at least --timeout \(5 s\)"):
        check_general(cfg, 2)
    check_general(config_from_dict({"adapt": {"inject": "sleep:s=8,p=0,at=3"},
                                    "launch": {"timeout_s": 5}}), 1)  # nobody waits
    check_general(config_from_dict({"adapt": {"inject": "sleep:s=4,p=0,at=3,ranks=1"},
                                    "launch": {"timeout_s": 5}}), 2)


def test_schedule_is_seeded_per_rank_and_does_not_overlap():
    spec = parse("sleep:p=0.3,n=3,seed=5")[0]
    runs = [schedule(spec, rank, 60) for rank in range(3)]
    assert runs == [schedule(spec, rank, 60) for rank in range(3)]  # identical across runs
    assert runs[0] != runs[1]  # each worker draws its own
    for events in runs:
        assert events and all(2 <= a <= b <= 60 and b - a <= 2 for a, b in events)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(events, events[1:]))
    # about p of the epochs without a slowdown start one
    starts = sum(len(e) for e in runs)
    assert 8 <= starts <= 40, runs
    assert schedule(parse("sleep:p=0,at=3+5,n=1,ranks=2")[0], 2, 6) == [(3, 3), (5, 5)]
    assert schedule(parse("sleep:p=0,at=3,ranks=2")[0], 1, 6) == []
    assert schedule(parse("cpu:p=1,n=4")[0], 0, 9) == [(2, 5), (6, 9)]


def test_at_alone_starts_only_the_slowdowns_it_names():
    """``at=`` names the epochs a slowdown starts for certain: it added random ones at
    the default p=0.1 besides (``at=2,n=2`` over 4 epochs injected 3, not 2)."""
    for seed in range(20):
        (only,) = parse(f"sleep:at=3+9,n=1,ranks=1,seed={seed}")
        assert only.p == 0 and schedule(only, 1, 60) == [(3, 3), (9, 9)], seed
    assert parse("sleep:at=3,p=0.2")[0].p == 0.2 and parse("sleep:n=2")[0].p == 0.1


def test_injector_sleeps_half_before_forward_half_in_backward_and_notes_it():
    notes = []
    inj = Injector(parse("sleep:p=0,s=0.2,at=2,n=1,ranks=0"), 0, 4, notes.append)
    inj.before_epoch(1)
    assert inj.sleep_s == 0 and not notes
    inj.between_epochs(None, None, 1, type("P", (), {"wall_s": 0.05})())
    inj.before_epoch(2)
    assert notes == [{"kind": "inject", "what": "sleep", "seconds": 0.2, "first": 2, "last": 2}]
    x = torch.ones(3, requires_grad=True)
    t0 = time.perf_counter()
    inj.before_forward()
    t1 = time.perf_counter()
    loss = inj.on_loss((x * 2).sum())
    assert loss.item() == 6.0
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    assert t1 - t0 >= 0.1 and t2 - t1 < 0.1 and t3 - t2 >= 0.1
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_auto_sleep_is_twice_the_mean_clean_epoch():
    """The first epoch run holds one-off costs (10x a later epoch on Cora): it counts
    only while no other clean epoch is known."""
    inj = Injector(parse("sleep:p=0,at=3,n=1"), 0, 5, lambda e: None)
    for epoch, wall in ((1, 2.0), (2, 0.3)):
        inj.before_epoch(epoch)
        inj.between_epochs(None, None, epoch, type("P", (), {"wall_s": wall})())
    inj.before_epoch(3)
    assert inj.sleep_s == pytest.approx(0.6)
    inj.between_epochs(None, None, 3, type("P", (), {"wall_s": 5.0})())  # injected: not clean
    assert inj.clean_walls == [0.3]
    early = Injector(parse("sleep:p=0,at=2,n=1"), 0, 5, lambda e: None)
    early.before_epoch(1)
    early.between_epochs(None, None, 1, type("P", (), {"wall_s": 0.25})())
    early.before_epoch(2)
    assert early.sleep_s == pytest.approx(0.5)


def test_auto_sleep_ignores_epochs_in_which_another_worker_is_slowed():
    """Rank 0's epoch 3 waits for rank 1's slowdown: it is not a clean epoch, or each
    worker's auto sleep would grow with the others' (before the fix, 10 s epochs)."""
    inj = Injector(parse("sleep:p=0,n=1,at=3,ranks=1;sleep:p=0,n=1,at=5,ranks=0"), 0, 6,
                   lambda e: None, world=2)
    for epoch, wall in ((1, 0.1), (2, 0.3), (3, 9.0), (4, 0.2)):
        inj.before_epoch(epoch)
        inj.between_epochs(None, None, epoch, type("P", (), {"wall_s": wall})())
    assert inj.clean_walls == [0.3, 0.2]
    inj.before_epoch(5)
    assert inj.sleep_s == pytest.approx(0.5)


def test_throttle_pins_busy_processes_to_the_core_and_removes_them():
    before = os.sched_getaffinity(0)
    throttle = Throttle(core_for(0))
    throttle.start(2)
    try:
        procs = list(throttle._procs)
        assert len(procs) == 2 and throttle.active
        assert all(os.sched_getaffinity(p.pid) == {throttle.core} for p in procs)
        assert os.sched_getaffinity(0) == {throttle.core}
        assert all(p.poll() is None for p in procs)
    finally:
        throttle.stop()
    assert all(p.poll() is not None for p in procs) and not throttle.active
    assert os.sched_getaffinity(0) == before


def test_net_spec_and_its_checks():
    (spec,) = parse("net:rate=50mbit,delay=10ms,ranks=1,p=0,at=3")
    assert (spec.rate, spec.delay, spec.ranks, spec.at) == ("50mbit", "10ms", (1,), (3,))
    assert "link at 50mbit, delay 10ms" in spec.describe()
    for text, message in (("net:p=0.1", "needs rate"), ("net:rate=fast", "not a tc rate"),
                          ("net:delay=5", "not a tc time")):
        with pytest.raises(ValueError, match=message):
            parse(text)


def test_net_injection_without_an_own_interface_is_refused(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME does not name"):
        Injector(parse("net:rate=1mbit,p=0,at=3"), 0, 5, lambda e: None)
    # a worker the item never slows needs no link of its own (nor a CPU throttle)
    inj = Injector(parse("net:rate=1mbit,p=0,at=3,ranks=1;cpu:p=0,at=2,ranks=1"), 0, 5,
                   lambda e: None, world=2)
    assert not inj.events and inj.shaper is None and inj.throttle is None


def test_auto_sleep_after_a_resume_uses_the_restored_clean_epochs():
    """Resumed after epoch 6: the slowdown at 7 is twice the mean of the restored
    epochs that no worker's slowdown touched (not 0 s for want of epochs run here)."""
    from fullgraph.report import EpochRecord

    inj = Injector(parse("sleep:p=0,n=3,at=7,ranks=0;sleep:p=0,n=1,at=4,ranks=1"), 0, 10,
                   lambda e: None, world=2)
    walls = {1: 0.2, 2: 0.4, 3: 0.3, 4: 9.0, 5: 0.1, 6: 0.5}
    inj.resumed([EpochRecord(e, 1.0, 0.0, 0.0, 0.0, w, 0.0, 0.0, 0.0)
                 for e, w in walls.items()])
    inj.before_epoch(7)
    assert inj.injected and inj.sleep_s == pytest.approx(2 * 1.5 / 5)


def test_a_resumed_run_says_its_adapters_start_again():
    """A resumed adapted run restarted from the starting plan, and partial reduce
    measured its deadlines again, without a word; with K=1 partial reduce's header
    described deadlines and stale rows that it never uses."""
    from types import SimpleNamespace

    from fullgraph.adapt.base import Adapter, resumed_line
    from fullgraph.adapt.partial import PartialReduce
    from fullgraph.report import EpochRecord

    adapter = Adapter()
    assert resumed_line(adapter, "the starting shares") == []
    adapter.resumed([EpochRecord(e, 1.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0) for e in (1, 2)])
    assert resumed_line(adapter, "the starting shares") == [
        "adapt    resumed after epoch 2: from the starting shares, not the plan adjusted by "
        "then (a checkpoint holds no plan)"]
    opts = SimpleNamespace(reuse=True, slack=0.5, warmup=3, resumed_after=6)
    (exact,) = PartialReduce.header(SimpleNamespace(**vars(opts), staleness=1))
    assert exact.startswith("partial  adjust+partial (exact with K=1): every worker "
                            "synchronised on every epoch") and "deadline" not in exact
    lines = PartialReduce.header(SimpleNamespace(**vars(opts), staleness=3))
    assert lines[0].startswith("partial  adjust+partial (approximate): halo rows up to K=3")
    assert lines[1].startswith("partial  resumed after epoch 6: the deadlines are measured "
                               "again over the first 3 epochs run here")


SHAPE = """
import subprocess, sys
from fullgraph.adapt.inject import LinkShaper
show = lambda: subprocess.run(["tc", "qdisc", "show", "dev", sys.argv[1]], text=True,
                              capture_output=True).stdout.strip()
shaper = LinkShaper(sys.argv[1])
print(show()); shaper.start("10mbit", None); print(show()); shaper.stop(); print(show())
"""


@pytest.mark.multihost
def test_link_shaper_swaps_the_queue_and_puts_it_back():
    from fullgraph.bench import netlink

    why = netlink.available()
    if why:
        pytest.skip(why)
    import subprocess
    import sys

    with netlink.two_hosts("100mbit") as link:
        host = link.hosts[0]
        done = subprocess.run(netlink.netns_cmd(host, [sys.executable, "-c", SHAPE, host.veth]),
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, during, after = done.stdout.splitlines()
    assert "tbf" in before and "100Mbit" in before, done.stdout
    assert "tbf" in during and "10Mbit" in during, done.stdout
    assert "tbf" in after and "100Mbit" in after, done.stdout
    # a fresh queue each time (a tbf changed in place with packets queued could stall)
    handles = [line.split()[2] for line in (before, during, after)]
    assert len(set(handles)) == 3, done.stdout
