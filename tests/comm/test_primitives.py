"""Smoke and accounting tests of every primitive, on gloo and without it.

One spawn per world size runs every case twice: with the backend's all-to-all and
with the isend/irecv fallback (forced through ``Comm.p2p_all_to_all``). World size 1
runs in this process with no process group, so a bypass that forgot to skip
torch.distributed fails. The CommError tests keep a peer away from a collective and
check that the waiting rank fails within its timeout, naming its rank and the phase.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.multiprocessing import ProcessRaisedException

from fullgraph.comm import (
    ByteCounter,
    Comm,
    CommError,
    all_gather_object,
    all_gather_rows,
    all_reduce_,
    all_to_all_v,
    barrier,
    broadcast_,
    single_comm,
)


def _with(comm: Comm, **changes) -> Comm:
    """The same group with a fresh counter (and any other field changed)."""
    return dataclasses.replace(comm, counter=ByteCounter(), **changes)


def _rows(src: int, dst: int, salt: int) -> int:
    """Uneven block sizes, some 0, known to every rank."""
    return (3 * src + 5 * dst + salt) % 4


def _block(src: int, dst: int, salt: int, trailing: tuple[int, ...], dtype) -> torch.Tensor:
    n = _rows(src, dst, salt)
    base = torch.arange(n * math.prod(trailing), dtype=torch.float64).reshape(n, *trailing)
    values = base + 1000 * src + 100 * dst + salt
    if dtype == torch.bool:
        return (values.long() % 3 == 0)
    return values.to(dtype)


def _expected(comm: Comm, phase: str, sent: int, recv: int, calls: int = 1) -> dict:
    if comm.world_size == 1:
        return {}
    return {phase: {"sent": sent, "recv": recv, "calls": calls}}


def _counts(comm: Comm) -> dict:
    snap = comm.counter.snapshot()
    return {k: {f: v[f] for f in ("sent", "recv", "calls")} for k, v in snap.items()}


def _check_all_to_all_v(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    cases = [((3,), torch.float32), ((2, 2), torch.float64), ((), torch.int64), ((5,), torch.bool)]
    for salt, (trailing, dtype) in enumerate(cases):
        c = _with(comm)
        send = [_block(r, p, salt, trailing, dtype) for p in range(world)]
        out = all_to_all_v(send, [_rows(p, r, salt) for p in range(world)], c, "a2a")
        assert out[r] is send[r]
        for p in range(world):
            torch.testing.assert_close(out[p], _block(p, r, salt, trailing, dtype), rtol=0, atol=0)
        row_bytes = math.prod(trailing) * send[0].element_size()
        sent = sum(_rows(r, p, salt) for p in range(world) if p != r) * row_bytes
        recv = sum(_rows(p, r, salt) for p in range(world) if p != r) * row_bytes
        assert _counts(c) == _expected(c, "a2a", sent, recv), (salt, _counts(c))
    c = _with(comm)  # nothing to move anywhere
    out = all_to_all_v([torch.empty(0, 4)] * world, [0] * world, c, "empty")
    assert all(t.shape == (0, 4) for t in out)
    assert _counts(c) == _expected(c, "empty", 0, 0)
    if world > 1:  # refused locally, on every rank, before any communication
        bad = [torch.zeros(1, 2)] * world
        bad[(r + 1) % world] = torch.zeros(1, 3)
        with pytest.raises(ValueError, match="expected"):
            all_to_all_v(bad, [1] * world, _with(comm), "bad")
    with pytest.raises(ValueError, match="need world_size"):
        all_to_all_v([torch.zeros(1)] * (world + 1), [1] * (world + 1), _with(comm), "bad")


def _check_reductions(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    for dtype in (torch.float64, torch.float32, torch.int64):
        for op, expect in (("sum", sum(range(1, world + 1))), ("max", world), ("min", 1),
                           ("product", math.factorial(world))):
            c = _with(comm)
            t = torch.full((5,), r + 1, dtype=dtype)
            assert all_reduce_(t, c, "ar", op=op) is t
            torch.testing.assert_close(t, torch.full((5,), expect, dtype=dtype))
            ring = 2 * (world - 1) * t.nbytes // world
            assert _counts(c) == _expected(c, "ar", ring, ring)
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce_(torch.zeros(1), _with(comm), "ar", op="mean")
    src = world - 1
    c = _with(comm)
    t = torch.full((2, 3), float(r))
    broadcast_(t, src, c, "bcast")
    torch.testing.assert_close(t, torch.full((2, 3), float(src)))
    sent, recv = ((world - 1) * t.nbytes, 0) if r == src else (0, t.nbytes)
    assert _counts(c) == _expected(c, "bcast", sent, recv)
    c = _with(comm)
    barrier(c, "sync")
    assert _counts(c) == _expected(c, "sync", 0, 0)


def _check_gathers(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    rows = [(2 * p + 1) % 3 for p in range(world)]
    c = _with(comm)
    mine = torch.full((rows[r], 2), float(r))
    out = all_gather_rows(mine, rows, c, "gather")
    for p in range(world):
        torch.testing.assert_close(out[p], torch.full((rows[p], 2), float(p)))
    sent = (world - 1) * mine.nbytes
    recv = sum(rows[p] for p in range(world) if p != r) * 2 * 4
    assert _counts(c) == _expected(c, "gather", sent, recv)
    c = _with(comm)
    objs = all_gather_object({"rank": r, "items": list(range(r))}, c, "meta")
    assert objs == [{"rank": p, "items": list(range(p))} for p in range(world)]
    assert world == 1 or c.counter.snapshot()["meta"]["calls"] == 2


def check_primitives(comm: Comm) -> None:
    if comm.world_size > 1:  # gloo in torch 2.13 runs all_to_all_single: no fallback chosen
        assert comm.p2p_all_to_all is False
        assert comm.counter.snapshot()["comm-init"]["calls"] == 1
        assert comm.timeout == datetime.timedelta(seconds=120)
    assert comm.device == torch.device("cpu")
    for p2p in (False, True):
        c = dataclasses.replace(comm, p2p_all_to_all=p2p)
        _check_all_to_all_v(c)
        _check_reductions(c)
        _check_gathers(c)


def test_primitives_world_1_make_no_dist_calls():
    assert not dist.is_initialized()
    check_primitives(single_comm())


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_primitives_gloo(tmp_path, world_size):
    run_ranks(check_primitives, world_size, tmp_path)


# ---------------------------------------------------------------- failures
SHORT = datetime.timedelta(seconds=2)


def peer_leaves(comm: Comm, tmp_path: Path) -> None:
    """Rank 1 returns (its group is destroyed, the process exits); rank 0 collects."""
    if comm.rank == 1:
        return
    c = _with(comm, timeout=SHORT)
    calls = [("all_reduce", lambda: all_reduce_(torch.ones(3), c, "doomed")),
             ("all_to_all_v(p2p)", lambda: all_to_all_v(
                 [torch.ones(2, 2)] * 2, [2, 2], dataclasses.replace(c, p2p_all_to_all=True),
                 "doomed")),
             ("barrier", lambda: barrier(c, "doomed"))]
    for name, call in calls:
        start = time.perf_counter()
        with pytest.raises(CommError) as info:
            call()
        assert time.perf_counter() - start < SHORT.total_seconds() + 5
        msg = str(info.value)
        assert msg.startswith("rank 0 of 2:") and "'doomed'" in msg and name in msg, msg
        assert info.value.rank == 0 and info.value.phase == "doomed"
        assert isinstance(info.value.cause, RuntimeError)


def peer_hangs(comm: Comm, tmp_path: Path) -> None:
    """Rank 1 stays away until rank 0 has timed out; rank 0 must give up in time."""
    done = tmp_path / "rank0-done"
    if comm.rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    c = _with(comm, timeout=SHORT)
    start = time.perf_counter()
    try:
        with pytest.raises(CommError, match=r"rank 0 of 2: all_reduce in phase 'stuck'") as info:
            all_reduce_(torch.ones(3), c, "stuck")
    finally:
        done.touch()
    elapsed = time.perf_counter() - start
    assert SHORT.total_seconds() - 0.5 < elapsed < SHORT.total_seconds() + 5, elapsed
    assert "timed out" in str(info.value).lower()
    assert c.counter.snapshot() == {}  # a failed call is not counted


@pytest.mark.dist
@pytest.mark.parametrize("scenario", [peer_leaves, peer_hangs], ids=["leaves", "hangs"])
def test_comm_error_names_rank_and_phase(tmp_path, scenario):
    start = time.perf_counter()
    run_ranks(scenario, 2, tmp_path, tmp_path)
    assert time.perf_counter() - start < 20


def raises_on_rank_1(comm: Comm) -> None:
    if comm.rank == 1:
        raise ValueError("boom on rank 1")
    barrier(_with(comm, timeout=datetime.timedelta(seconds=30)), "wait")


@pytest.mark.dist
def test_harness_reports_failing_rank(tmp_path):
    with pytest.raises(ProcessRaisedException, match="boom on rank 1"):
        run_ranks(raises_on_rank_1, 2, tmp_path)


def test_comm_error_message_and_pickling():
    import pickle

    err = CommError(2, 3, "halo", "all_to_all_v", RuntimeError("Connection closed by peer"),
                    0.25, datetime.timedelta(seconds=5))
    assert str(err) == ("rank 2 of 3: all_to_all_v in phase 'halo' failed after 0.2s "
                        "(timeout 5s): RuntimeError: Connection closed by peer")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, RuntimeError) and str(again) == str(err) and again.rank == 2
