"""The asynchronous halo exchanges: start_fetch / start_return against one process.

Each rank rebuilds the whole problem from seeds: a random partition, the rows every
rank needs from every other one (in a random order) and random receive positions in
a halo buffer larger than the rows received. Checked: the fetched values, the
scatter-added returns (several peers adding into the same owner row), the bytes of
each direction, two exchanges in flight at once, and world size 1 without any
process group.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_ranks

from fullgraph.comm import (
    ByteCounter,
    Comm,
    ExchangeTable,
    halo_fetch,
    single_comm,
    start_fetch,
    start_return,
)

N, EXTRA = 17, 3  # vertices; unused rows in each positioned halo buffer


def _problem(world: int, seed: int):
    """part_of, and needs[q][p]: gids q reads from p (with repeats across readers)."""
    gen = torch.Generator().manual_seed(seed)
    part_of = torch.randint(0, world, (N,), generator=gen)
    needs = [[torch.empty(0, dtype=torch.int64)] * world for _ in range(world)]
    for q in range(world):
        for p in range(world):
            if p != q:
                owned = torch.nonzero(part_of == p).flatten()
                picked = owned[torch.rand(owned.numel(), generator=gen) < 0.6]
                needs[q][p] = picked[torch.randperm(picked.numel(), generator=gen)]
    return part_of, needs


def _positions(needs, q: int, seed: int) -> list[torch.Tensor]:
    """Where rank q puts the rows from each peer in its buffer (random, disjoint)."""
    counts = [t.numel() for t in needs[q]]
    perm = torch.randperm(sum(counts) + EXTRA, generator=torch.Generator().manual_seed(seed + q))
    return list(torch.split(perm[:sum(counts)], counts))


def _table(part_of, needs, r: int, seed: int, positioned: bool) -> ExchangeTable:
    lid = torch.zeros(N, dtype=torch.int64)
    for p in range(len(needs)):
        gids = torch.nonzero(part_of == p).flatten()
        lid[gids] = torch.arange(gids.numel())
    table = ExchangeTable.from_needs(needs[r], [needs[q][r] for q in range(len(needs))],
                                     lambda g: lid[g])
    if positioned:
        table = ExchangeTable(table.send_idx, table.recv_rows, _positions(needs, r, seed))
    return table


def _fresh(comm: Comm) -> Comm:
    return dataclasses.replace(comm, counter=ByteCounter())


def _check_case(comm: Comm, seed: int, positioned: bool) -> None:
    r, world = comm.rank, comm.world_size
    part_of, needs = _problem(world, seed)
    table = _table(part_of, needs, r, seed, positioned)
    x_full = torch.randn(N, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    owned = torch.nonzero(part_of == r).flatten()
    size = table.num_halo + (EXTRA if positioned else 0)
    c = _fresh(comm)
    pending = start_fetch(x_full[owned], table, c, "fetch")
    if positioned:
        halo = pending.wait(torch.full((size, 3), -1.0, dtype=torch.float64))
        expect = torch.full((size, 3), -1.0, dtype=torch.float64)
        for p, pos in enumerate(table.recv_pos):
            expect[pos] = x_full[needs[r][p]]
    else:
        halo, expect = pending.wait(), x_full[torch.cat(needs[r])]
    torch.testing.assert_close(halo, expect, rtol=0, atol=0)
    # Return: every rank sends back its buffer rows; owners add them in peer order.
    bufs = [torch.randn(sum(t.numel() for t in needs[q]) + (EXTRA if positioned else 0), 3,
                        dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed + 100 + q))
            for q in range(world)]
    back = start_return(bufs[r], table, c, "back").wait(torch.ones(owned.numel(), 3,
                                                                   dtype=torch.float64))
    ref = torch.ones(N, 3, dtype=torch.float64)
    for q in range(world):
        rows = torch.cat([bufs[q][pos] for pos in _positions(needs, q, seed)]) if positioned \
            else bufs[q]
        ref.index_add_(0, torch.cat(needs[q]), rows)
    torch.testing.assert_close(back, ref[owned])
    row = 3 * 8
    sent = sum(needs[q][r].numel() for q in range(world) if q != r) * row
    recv = sum(needs[r][p].numel() for p in range(world) if p != r) * row
    counts = {k: (v["sent"], v["recv"]) for k, v in c.counter.snapshot().items()}
    assert counts == ({"fetch": (sent, recv), "back": (recv, sent)} if world > 1 else {})
    assert table.volume_bytes(3, 8, rank=r) == (sent, recv)


def _check_overlapped(comm: Comm) -> None:
    """Two fetches in flight, waited for in order, give each its own rows."""
    part_of, needs = _problem(comm.world_size, 5)
    table = _table(part_of, needs, comm.rank, 5, positioned=False)
    owned = torch.nonzero(part_of == comm.rank).flatten()
    x = torch.arange(N, dtype=torch.float32).unsqueeze(1)
    first = start_fetch(x[owned], table, comm, "a")
    second = start_fetch(-x[owned], table, comm, "b")
    gids = torch.cat(needs[comm.rank]).float().unsqueeze(1)
    torch.testing.assert_close(first.wait(), gids)
    torch.testing.assert_close(second.wait(), -gids)
    torch.testing.assert_close(halo_fetch(x[owned], table, comm), gids)


def check_halo(comm: Comm) -> None:
    for seed in (0, 1, 2):
        for positioned in (False, True):
            _check_case(comm, seed, positioned)
    _check_overlapped(comm)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_halo_exchanges_gloo(tmp_path, world_size):
    run_ranks(check_halo, world_size, tmp_path)


def test_halo_exchanges_world_1_in_process():
    check_halo(single_comm())


def test_world_1_positions_and_scatter_add():
    comm = single_comm()
    table = ExchangeTable([torch.tensor([2, 0, 2])], [3], [torch.tensor([4, 1, 0])])
    x = torch.tensor([[1.0], [2.0], [3.0]])
    halo = start_fetch(x, table, comm, "f").wait(torch.zeros(5, 1))
    assert halo.flatten().tolist() == [3.0, 1.0, 0.0, 0.0, 3.0]
    grads = start_return(torch.tensor([[1.0], [10.0], [0.0], [0.0], [100.0]]), table, comm,
                         "r").wait(torch.zeros(3, 1))
    assert grads.flatten().tolist() == [10.0, 0.0, 101.0]  # row 2 sent twice: summed
    assert comm.counter.snapshot() == {}


def test_positioned_table_validation():
    with pytest.raises(ValueError, match=r"recv_pos\[0\] must be a 1-D int64 tensor of "
                                         r"recv_rows\[0\]=2"):
        ExchangeTable([torch.tensor([0])], [2], [torch.tensor([0])])
    with pytest.raises(ValueError, match="1 receive position lists but 2 receive counts"):
        ExchangeTable([torch.tensor([0])] * 2, [1, 1], [torch.tensor([0])])
    table = ExchangeTable([torch.tensor([0])], [1], [torch.tensor([3])]).to("cpu")
    assert table.recv_pos[0].tolist() == [3]
    pending = start_fetch(torch.zeros(1, 2), table, single_comm(), "f")
    with pytest.raises(ValueError, match="pass the halo buffer"):
        pending.wait()
    with pytest.raises(ValueError, match="expected 2 halo rows"):
        start_return(torch.zeros(3, 2), ExchangeTable([torch.tensor([0, 0])], [2]),
                     single_comm(), "r")
