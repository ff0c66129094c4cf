"""Communicator sub-groups: ``Comm.split`` on 4 gloo workers, counters and errors.

One spawn of 4 ranks loops over splits 1+3, 2+2, an unsorted 2+2 and 3+none; on
each sub-group it reruns the value and byte checks of ``test_primitives`` and
``test_placement`` (both compare with hand-computed results for the group's size),
checks the world-counter prefixes, and hands tensors from one group to the other on
the world Comm, and checks that ranks passing different groups all get the same
ValueError. A one-rank group runs with torch.distributed removed from
``primitives``. A second spawn keeps one member of a sub-group away and checks the
timeout's CommError while the other sub-group carries on.
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
import time
from contextlib import contextmanager
from pathlib import Path

import placement_checks as tp
import primitive_checks as tprim
import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from fullgraph.comm import (
    ByteCounter,
    Comm,
    CommError,
    GroupCounter,
    all_reduce_,
    all_to_all_v,
    barrier,
    destroy_comm,
    single_comm,
)
from fullgraph.comm import primitives as prim
from fullgraph.comm.primitives import all_to_all_v_start
from fullgraph.comm.subgroup import _check_names

SPLITS = [([[0], [1, 2, 3]], ["T", "P"]),
          ([[0, 1], [2, 3]], None),
          ([[3, 1], [0, 2]], None),  # group rank = position in the list, not sorted
          ([[0, 1, 2]], None)]       # world rank 3 is in no group


class _NoDist:
    def __getattr__(self, name: str):
        if name == "ReduceOp":  # an enum of constants, no call
            return dist.ReduceOp
        raise AssertionError(f"torch.distributed.{name} called for a one-rank group")


@contextmanager
def _no_dist():
    """Any torch.distributed use by ``primitives`` inside fails the test."""
    saved, prim.dist = prim.dist, _NoDist()
    try:
        yield
    finally:
        prim.dist = saved


def _counts(counter) -> dict:
    return {k: (v["sent"], v["recv"], v["calls"]) for k, v in counter.snapshot().items()}


def _check_battery(sub: Comm) -> None:
    """Every primitive and placement pair, values and bytes, on ``sub``."""
    for p2p in (False, True):
        c = dataclasses.replace(sub, p2p_all_to_all=p2p, shm=None)
        tprim.check_all_to_all_v(c)
        tprim.check_reductions(c)
        tprim.check_gathers(c)
    tp.check_shared_columns(sub)
    tp.check_gather_rows(sub)
    tp.check_rows_cols(sub)
    tp.check_halo(sub)
    tp.check_all_reduce_grads(sub)


def _check_group_counter(world: Comm, sub: Comm) -> None:
    """The sub-group's phases land in the world's counter under "<name>/"."""
    r, size = sub.rank, sub.world_size
    sub.counter.reset()  # drops what the battery counted on ``sub`` itself, nothing else
    before = _counts(world.counter)
    assert not any(k.startswith(sub.name + "/") for k in before), before
    t = torch.full((6,), float(sub.global_rank), dtype=torch.float64, device=sub.device)
    all_reduce_(t, sub, "ar")
    torch.testing.assert_close(t, torch.full_like(t, float(sum(sub.global_ranks))))
    send = [torch.full((p + 1, 2), float(10 * r + p), device=sub.device) for p in range(size)]
    pending = all_to_all_v_start(send, [r + 1] * size, sub, "a2a")
    out = pending.wait()
    for p in range(size):
        torch.testing.assert_close(out[p], torch.full((r + 1, 2), float(10 * p + r)))
    ring = 2 * (size - 1) * t.nbytes // size
    a2a_sent = sum(p + 1 for p in range(size) if p != r) * 8
    want = {"ar": (ring, ring, 1), "a2a": (a2a_sent, (size - 1) * (r + 1) * 8, 1)}
    want = want if size > 1 else {}
    assert _counts(sub.counter) == want, _counts(sub.counter)
    prefixed = {f"{sub.name}/{k}": v for k, v in want.items()}
    assert _counts(world.counter) == {**before, **prefixed}
    assert sub.counter.total()["calls"] == len(want)
    sub.counter.reset()
    assert _counts(sub.counter) == {} and _counts(world.counter) == before


def _check_handoff(world: Comm, groups: list[list[int]]) -> None:
    """Rows from each member of groups[0] to each member of groups[1], on the world Comm."""
    src, dst = groups
    me = world.rank

    def block(s: int, d: int) -> torch.Tensor:
        rows = (s + 2 * d) % 3 + 1 if s in src and d in dst else 0
        return torch.full((rows, 3), float(100 * s + d), device=world.device)

    for p2p in (False, True):
        c = dataclasses.replace(world, counter=ByteCounter(), p2p_all_to_all=p2p,
                                shm=world.shm if not p2p else None)
        send = [block(me, d) for d in range(world.world_size)]
        out = all_to_all_v(send, [block(s, me).shape[0] for s in range(world.world_size)],
                           c, "handoff")
        for s in range(world.world_size):
            torch.testing.assert_close(out[s], block(s, me))
        sent = sum(t.nbytes for t in send)
        recv = sum(block(s, me).nbytes for s in range(world.world_size))
        assert _counts(c.counter) == {"handoff": (sent, recv, 1)}


def check_splits(world: Comm) -> None:
    assert world.global_ranks == (0, 1, 2, 3) and world.name == ""
    for groups, names in SPLITS:
        sub = world.split(groups, names)
        mine = [i for i, g in enumerate(groups) if world.rank in g]
        if not mine:
            assert sub is None
        else:
            ranks = groups[mine[0]]
            name = names[mine[0]] if names else "g" + "-".join(map(str, ranks))
            assert (sub.rank, sub.world_size, sub.global_ranks, sub.name, sub.global_rank) == \
                (ranks.index(world.rank), len(ranks), tuple(ranks), name, world.rank)
            assert sub.timeout == world.timeout and sub.device == world.device
            if len(ranks) == 1:
                assert sub.group is None
                with _no_dist():
                    _check_battery(sub)
                    _check_group_counter(world, sub)
            else:
                assert dist.get_process_group_ranks(sub.group) == ranks
                _check_battery(sub)
                _check_group_counter(world, sub)
        if len(groups) == 2:
            _check_handoff(world, groups)
        t = torch.ones(1)  # the world is unaffected
        all_reduce_(t, world, "world")
        assert t.item() == 4.0
        if sub is not None:
            destroy_comm(sub)
    odd = [[0, 1, 2], [3]] if world.rank == 3 else [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"same groups and names; .* \(differing ranks: \[3\]\)"):
        world.split(odd)  # refused on every rank, before any group is made
    assert set(world.counter.snapshot()) == {"comm-init", "world"}


@pytest.mark.dist
def test_split_four_ranks(tmp_path):
    run_ranks(check_splits, 4, tmp_path)


SHORT = datetime.timedelta(seconds=2)


def sub_member_hangs(world: Comm, tmp_path: Path) -> None:
    """World rank 3 never joins group B's all-reduce; rank 2 times out, group A goes on."""
    done = tmp_path / "rank2-done"
    sub = world.split([[0, 1], [2, 3]], ["A", "B"])
    if world.rank == 3:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    elif world.rank == 2:
        c = dataclasses.replace(sub, timeout=SHORT)
        start = time.perf_counter()
        try:
            with pytest.raises(CommError) as info:
                all_reduce_(torch.ones(3), c, "stuck")
        finally:
            done.touch()
        assert SHORT.total_seconds() - 0.5 < time.perf_counter() - start \
            < SHORT.total_seconds() + 5
        assert str(info.value).startswith(
            "rank 0 of 2 in group 'B' (global rank 2): "
            f"{'window(shm)' if c.shm is not None else 'all_reduce'} in phase 'stuck'")
        assert "timed out" in str(info.value).lower() and info.value.rank == 0
        assert sub.counter.snapshot() == {}
    else:
        for _ in range(3):  # group A works before, during and after B's failure
            t = torch.full((2,), float(world.rank + 1))
            all_reduce_(t, sub, "fine")
            assert t.tolist() == [3.0, 3.0]
            time.sleep(0.5)
        assert sub.counter.snapshot()["fine"]["calls"] == 3
    barrier(world, "end")


@pytest.mark.dist
def test_subgroup_timeout_names_rank(tmp_path):
    start = time.perf_counter()
    run_ranks(sub_member_hangs, 4, tmp_path, tmp_path)
    assert time.perf_counter() - start < 60


# ---------------------------------------------------------------- in process
def test_one_rank_world_splits_without_dist():
    assert not dist.is_initialized()
    world = single_comm()
    sub = world.subgroup([0], name="T")
    assert (sub.rank, sub.world_size, sub.group, sub.global_ranks, sub.name) == \
        (0, 1, None, (0,), "T")
    _check_battery(sub)
    _check_group_counter(world, sub)


@pytest.mark.parametrize("groups,names,match", [
    ([], None, "non-empty list"),
    ("01", None, "non-empty list"),
    ([[0, "a"]], None, "integer world ranks"),
    ([[]], None, "group 0 is empty"),
    ([[0, 0]], None, "rank 0 of group 0 = \\[0, 0\\] is twice"),
    ([[1]], None, "names rank 1, outside the world \\[0, 1\\)"),
    ([[0], [0]], None, "rank 0 of group 1 = \\[0\\] is also in group 0"),
    ([[0]], ["a", "b"], "one name per group \\(1\\)"),
    ([[0]], ["x/y"], "without '/'"),
    ([[0]], [""], "without '/'"),
])
def test_split_refuses_bad_groups(groups, names, match):
    with pytest.raises(ValueError, match=match):
        single_comm().split(groups, names)


def test_split_refuses_duplicate_names_and_nesting():
    with pytest.raises(ValueError, match="names must be unique"):
        _check_names(["a", "a"], [(0,), (1,)])
    sub = single_comm().subgroup([0])
    with pytest.raises(ValueError, match="called on sub-group 'g0'"):
        sub.split([[0]])


def test_comm_checks_global_ranks():
    with pytest.raises(ValueError, match="global_ranks \\[1, 1\\] must be world_size=2"):
        Comm(rank=0, world_size=2, group=object(), global_ranks=(1, 1))
    with pytest.raises(ValueError, match="global_ranks \\[3\\] must be world_size=2"):
        Comm(rank=0, world_size=2, group=object(), global_ranks=(3,))
    assert Comm(rank=1, world_size=2, group=object()).global_ranks == (0, 1)


def test_group_counter_views_the_world_counter():
    world = ByteCounter()
    world.add("halo", 1, 2, 0.5)
    a, b = GroupCounter(world, "A/"), GroupCounter(world, "B/")
    a.add("halo", 10, 20, 1.0)
    a.add("halo", 1, 1, 0.0)
    b.add("grad", 5, 5, 0.25)
    assert _counts(a) == {"halo": (11, 21, 2)} and _counts(b) == {"grad": (5, 5, 1)}
    assert _counts(world) == {"halo": (1, 2, 1), "A/halo": (11, 21, 2), "B/grad": (5, 5, 1)}
    assert a.total() == {"sent": 11, "recv": 21, "calls": 2, "seconds": 1.0}
    world.progress = "inside"  # anything else is the world counter's
    assert a.progress == "inside"
    with pytest.raises(AttributeError):
        a._phases
    a.reset()
    assert _counts(world) == {"halo": (1, 2, 1), "B/grad": (5, 5, 1)}


def test_comm_error_names_the_group():
    err = CommError(1, 3, "halo", "all_to_all_v", RuntimeError("Timed out"), 2.0, SHORT,
                    " in group 'P' (global rank 2)")
    assert str(err).startswith("rank 1 of 3 in group 'P' (global rank 2): all_to_all_v in "
                               "phase 'halo' failed after 2.0s (timeout 2s)")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
