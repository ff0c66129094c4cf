"""Checks of the primitives on one communicator, shared by the primitive and
sub-group tests: values and byte counts for the group's size.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fullgraph.comm import (
    ByteCounter,
    Comm,
    all_gather_object,
    all_gather_rows,
    all_reduce_,
    all_to_all_v,
    barrier,
    broadcast_,
)


def fresh_comm(comm: Comm, **changes) -> Comm:
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


def expected_counts(comm: Comm, phase: str, sent: int, recv: int, calls: int = 1) -> dict:
    if comm.world_size == 1:
        return {}
    return {phase: {"sent": sent, "recv": recv, "calls": calls}}


def phase_counts(comm: Comm) -> dict:
    snap = comm.counter.snapshot()
    return {k: {f: v[f] for f in ("sent", "recv", "calls")} for k, v in snap.items()}


def check_all_to_all_v(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    cases = [((3,), torch.float32), ((2, 2), torch.float64), ((), torch.int64), ((5,), torch.bool)]
    for salt, (trailing, dtype) in enumerate(cases):
        c = fresh_comm(comm)
        send = [_block(r, p, salt, trailing, dtype) for p in range(world)]
        out = all_to_all_v(send, [_rows(p, r, salt) for p in range(world)], c, "a2a")
        assert out[r] is send[r]
        for p in range(world):
            torch.testing.assert_close(out[p], _block(p, r, salt, trailing, dtype), rtol=0, atol=0)
        row_bytes = math.prod(trailing) * send[0].element_size()
        sent = sum(_rows(r, p, salt) for p in range(world) if p != r) * row_bytes
        recv = sum(_rows(p, r, salt) for p in range(world) if p != r) * row_bytes
        assert phase_counts(c) == expected_counts(c, "a2a", sent, recv), (salt, phase_counts(c))
    c = fresh_comm(comm)  # nothing to move anywhere
    out = all_to_all_v([torch.empty(0, 4)] * world, [0] * world, c, "empty")
    assert all(t.shape == (0, 4) for t in out)
    assert phase_counts(c) == expected_counts(c, "empty", 0, 0)
    if world > 1:  # refused locally, on every rank, before any communication
        bad = [torch.zeros(1, 2)] * world
        bad[(r + 1) % world] = torch.zeros(1, 3)
        with pytest.raises(ValueError, match="expected"):
            all_to_all_v(bad, [1] * world, fresh_comm(comm), "bad")
    with pytest.raises(ValueError, match="need world_size"):
        all_to_all_v([torch.zeros(1)] * (world + 1), [1] * (world + 1), fresh_comm(comm), "bad")


def check_reductions(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    for dtype in (torch.float64, torch.float32, torch.int64):
        for op, expect in (("sum", sum(range(1, world + 1))), ("max", world), ("min", 1),
                           ("product", math.factorial(world))):
            c = fresh_comm(comm)
            t = torch.full((5,), r + 1, dtype=dtype)
            assert all_reduce_(t, c, "ar", op=op) is t
            torch.testing.assert_close(t, torch.full((5,), expect, dtype=dtype))
            ring = 2 * (world - 1) * t.nbytes // world
            assert phase_counts(c) == expected_counts(c, "ar", ring, ring)
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce_(torch.zeros(1), fresh_comm(comm), "ar", op="mean")
    src = world - 1
    c = fresh_comm(comm)
    t = torch.full((2, 3), float(r))
    broadcast_(t, src, c, "bcast")
    torch.testing.assert_close(t, torch.full((2, 3), float(src)))
    sent, recv = ((world - 1) * t.nbytes, 0) if r == src else (0, t.nbytes)
    assert phase_counts(c) == expected_counts(c, "bcast", sent, recv)
    c = fresh_comm(comm)
    barrier(c, "sync")
    assert phase_counts(c) == expected_counts(c, "sync", 0, 0)


def check_gathers(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    rows = [(2 * p + 1) % 3 for p in range(world)]
    c = fresh_comm(comm)
    mine = torch.full((rows[r], 2), float(r))
    out = all_gather_rows(mine, rows, c, "gather")
    for p in range(world):
        torch.testing.assert_close(out[p], torch.full((rows[p], 2), float(p)))
    sent = (world - 1) * mine.nbytes
    recv = sum(rows[p] for p in range(world) if p != r) * 2 * 4
    assert phase_counts(c) == expected_counts(c, "gather", sent, recv)
    c = fresh_comm(comm)
    objs = all_gather_object({"rank": r, "items": list(range(r))}, c, "meta")
    assert objs == [{"rank": p, "items": list(range(p))} for p in range(world)]
    assert world == 1 or c.counter.snapshot()["meta"]["calls"] == 2
