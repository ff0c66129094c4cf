"""Checks of the placement pairs on one communicator, shared by the placement and
sub-group tests: each compares with a hand-computed result for the group's size.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fullgraph.comm import (
    ByteCounter,
    Comm,
    ExchangeTable,
    RowColLayout,
    all_reduce_,
    all_reduce_grads,
    cols_to_rows,
    gather_rows,
    halo_fetch,
    halo_join,
    halo_scatter_add,
    rows_to_cols,
)
from fullgraph.comm.halo import _HaloFetch, _HaloScatterAdd, windowed
from fullgraph.comm.placement import _ColsToRows, _RowsToCols, even_counts
from fullgraph.graph.csr import Graph
from fullgraph.ops.spmm import spmm
from fullgraph.parallel.halo_spmm import halo_spmm


def fresh_counter(comm: Comm, **changes) -> Comm:
    return dataclasses.replace(comm, counter=ByteCounter(), **changes)


def phase_bytes(comm: Comm) -> dict:
    return {k: (v["sent"], v["recv"]) for k, v in comm.counter.snapshot().items()}


def rnd(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------- rows <-> cols
def _layouts(world: int) -> list[RowColLayout]:
    uneven = [(3 * p) % 5 for p in range(world)]  # partition-like blocks, rank 0 empty
    return [RowColLayout.even(10, 7, world), RowColLayout.even(4, 2, world),
            RowColLayout.for_rows(uneven, 5), RowColLayout.even(1, 9, world)]


def _check_rows_cols_case(comm: Comm, layout: RowColLayout, dtype, seed: int) -> None:
    r, n, d = comm.rank, layout.num_rows, layout.num_cols
    rows, cols = layout.row_slice(r), layout.col_slice(r)
    n_r, d_r, s = layout.row_counts[r], layout.col_counts[r], dtype.itemsize
    x_full, w_full = rnd(seed, n, d, dtype=dtype), rnd(seed + 1, n, d, dtype=dtype)
    # Reference: the loss sum(x * w) over the whole tensor has gradient w.
    c = fresh_counter(comm)
    x_rows = x_full[rows].clone().requires_grad_()
    x_cols = rows_to_cols(x_rows, layout, c)
    torch.testing.assert_close(x_cols, x_full[:, cols], rtol=0, atol=0)
    (x_cols * w_full[:, cols]).sum().backward()
    torch.testing.assert_close(x_rows.grad, w_full[rows])
    forward, backward = (n_r * d - n_r * d_r) * s, (n - n_r) * d_r * s
    expect = {"rows-to-cols": (forward, backward), "rows-to-cols-grad": (backward, forward)}
    assert phase_bytes(c) == (expect if comm.world_size > 1 else {}), (layout, phase_bytes(c))

    c = fresh_counter(comm)
    x_cols = x_full[:, cols].clone().requires_grad_()
    back = cols_to_rows(x_cols, layout, c)
    torch.testing.assert_close(back, x_full[rows], rtol=0, atol=0)
    (back * w_full[rows]).sum().backward()
    torch.testing.assert_close(x_cols.grad, w_full[:, cols])
    expect = {"cols-to-rows": (backward, forward), "cols-to-rows-grad": (forward, backward)}
    assert phase_bytes(c) == (expect if comm.world_size > 1 else {}), (layout, phase_bytes(c))
    torch.testing.assert_close(cols_to_rows(rows_to_cols(x_full[rows], layout, c), layout, c),
                               x_full[rows], rtol=0, atol=0)

    # Each one's backward is the other's forward.
    g_cols, g_rows = rnd(seed + 2, n, d, dtype=dtype)[:, cols], rnd(seed + 3, n, d)[rows]
    g_rows = g_rows.to(dtype)
    ctx = SimpleNamespace(layout=layout, comm=comm, phase="stub")
    torch.testing.assert_close(_RowsToCols.backward(ctx, g_cols)[0],
                               cols_to_rows(g_cols, layout, comm), rtol=0, atol=0)
    torch.testing.assert_close(_ColsToRows.backward(ctx, g_rows)[0],
                               rows_to_cols(g_rows, layout, comm), rtol=0, atol=0)


def check_rows_cols(comm: Comm) -> None:
    for i, layout in enumerate(_layouts(comm.world_size)):
        for dtype in (torch.float64, torch.float32):
            _check_rows_cols_case(comm, layout, dtype, seed=10 * i)
    _check_rows_cols_case(fresh_counter(comm, p2p_all_to_all=True, shm=None),
                          _layouts(comm.world_size)[0], torch.float64, seed=99)


# ---------------------------------------------------------------- halo
def _halo_problem(world: int, seed: int, num_vertices: int, density: float):
    """A random owner per vertex and, per rank q, an ordered list of remote gids it needs."""
    gen = torch.Generator().manual_seed(seed)
    part_of = torch.randint(world, (num_vertices,), generator=gen)
    needs = []
    for q in range(world):
        remote = torch.nonzero(part_of != q).flatten()
        keep = torch.rand(remote.numel(), generator=gen) < density
        picked = remote[keep]
        needs.append(picked[torch.randperm(picked.numel(), generator=gen)])  # halo order
    return part_of, needs


def halo_table(rank: int, world: int, part_of: torch.Tensor, needs: list[torch.Tensor]):
    owned = torch.nonzero(part_of == rank).flatten()
    gid_to_lid = torch.full((part_of.numel(),), -1, dtype=torch.int64)
    gid_to_lid[owned] = torch.arange(owned.numel())
    needed_from = [needs[rank][part_of[needs[rank]] == p] for p in range(world)]
    needed_by = [needs[p][part_of[needs[p]] == rank] for p in range(world)]
    table = ExchangeTable.from_needs(needed_from, needed_by, lambda g: gid_to_lid[g])
    return owned, table, torch.cat(needed_from)


def _check_halo_case(comm: Comm, seed: int, density: float, feat: tuple[int, ...],
                     dtype) -> None:
    r, world = comm.rank, comm.world_size
    part_of, needs = _halo_problem(world, seed, 23, density)
    tables = [halo_table(q, world, part_of, needs) for q in range(world)]
    owned, table, halo_gids = tables[r]
    x_full = rnd(seed, part_of.numel(), *feat, dtype=dtype)
    weights = [rnd(seed + 1 + q, tables[q][2].numel(), *feat, dtype=dtype)
               for q in range(world)]
    # Reference gradient of sum_q (halo_q * w_q).sum() + 2 * x.sum() with respect to x.
    grad_ref = torch.full_like(x_full, 2.0)
    for q in range(world):
        grad_ref.index_add_(0, tables[q][2], weights[q])

    c = fresh_counter(comm)
    x_rows = x_full[owned].clone().requires_grad_()
    halo = halo_fetch(x_rows, table, c, "halo")
    torch.testing.assert_close(halo, x_full[halo_gids], rtol=0, atol=0)
    ((halo * weights[r]).sum() + 2 * x_rows.sum()).backward()
    torch.testing.assert_close(x_rows.grad, grad_ref[owned])
    row_bytes = math.prod(feat) * dtype.itemsize
    sent = sum(int((part_of[needs[q]] == r).sum()) for q in range(world) if q != r) * row_bytes
    recv = halo_gids.numel() * row_bytes
    assert table.volume_bytes(math.prod(feat), dtype.itemsize, rank=r) == (sent, recv)
    expect = {"halo": (sent, recv), "halo-grad": (recv, sent)} if world > 1 else {}
    assert phase_bytes(c) == expect, (seed, phase_bytes(c))

    # halo_join: the own rows then the halo, one tensor, the same gradient and bytes
    c = fresh_counter(comm)
    x_rows = x_full[owned].clone().requires_grad_()
    joined = halo_join(x_rows, table, c, "halo")
    torch.testing.assert_close(joined, torch.cat([x_full[owned], x_full[halo_gids]]),
                               rtol=0, atol=0)
    ((joined[owned.numel():] * weights[r]).sum() + 2 * joined[:owned.numel()].sum()).backward()
    torch.testing.assert_close(x_rows.grad, grad_ref[owned])
    assert phase_bytes(c) == expect, (seed, phase_bytes(c))

    if len(feat) == 1:
        _check_halo_spmm(comm, table, x_full[owned], x_full[halo_gids], seed, expect)

    # halo_scatter_add: partial sums pushed to owners; its gradient is a halo fetch.
    c = fresh_counter(comm)
    x_halo = weights[r].clone().requires_grad_()
    pushed = halo_scatter_add(x_halo, table, owned.numel(), c, "push")
    push_ref = torch.zeros_like(x_full)
    for q in range(world):
        push_ref.index_add_(0, tables[q][2], weights[q])
    torch.testing.assert_close(pushed, push_ref[owned])
    (pushed * x_full[owned]).sum().backward()
    torch.testing.assert_close(x_halo.grad, x_full[halo_gids], rtol=0, atol=0)
    expect = {"push": (recv, sent), "push-grad": (sent, recv)} if world > 1 else {}
    assert phase_bytes(c) == expect, (seed, phase_bytes(c))

    ctx = SimpleNamespace(table=table, comm=comm, phase="stub", num_rows=owned.numel())
    torch.testing.assert_close(_HaloFetch.backward(ctx, weights[r])[0], pushed.detach())
    torch.testing.assert_close(_HaloScatterAdd.backward(ctx, x_full[owned])[0], x_full[halo_gids],
                               rtol=0, atol=0)


def _check_halo_spmm(comm: Comm, table, x_own, x_halo, seed: int, expect: dict) -> None:
    """halo_spmm equals spmm over halo_join, forward and backward, to the bit, with the
    same bytes; weighted and unweighted."""
    n, h = x_own.shape[0], x_halo.shape[0]
    gen = torch.Generator().manual_seed(100 + seed)
    num_dst = n + 2
    degrees = torch.randint(0, 6, (num_dst,), generator=gen)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), degrees.cumsum(0)])
    indices = torch.randint(0, max(n + h, 1), (int(indptr[-1]),), generator=gen)
    if n + h == 0:
        indptr, indices = torch.zeros(num_dst + 1, dtype=torch.int64), indices[:0]
    graph = Graph(indptr, indices, num_src=n + h)
    # the same edges, each row's own sources first: the kernel reads the own rows and
    # the halo from two buffers (ops.spmm.split_aggregate) where numba runs
    rows_of = torch.repeat_interleave(torch.arange(num_dst), degrees)
    order = torch.from_numpy(np.lexsort(((indices >= n).numpy(), rows_of.numpy())))
    grouped = Graph(indptr, indices[order], num_src=n + h)
    assert grouped.source_split(n) is not None
    assert (graph.source_split(n) is None) == bool((order != torch.arange(order.numel())).any())
    grad_out = rnd(200 + seed, num_dst, x_own.shape[1], dtype=x_own.dtype)
    # through shared memory the rows go through the peers' windows (comm.halo.windowed),
    # unless some rank's table sends rows to itself (here rank 0's): then no rank's do
    assert (windowed(table, comm, x_own) is None) == (comm.shm is None or comm.world_size == 1)
    own = [i.clone() for i in table.send_idx]
    recv_rows = list(table.recv_rows)
    selfish = torch.tensor([int(comm.rank == 0 and n > 0)])
    if selfish:
        own[0], recv_rows[0] = torch.zeros(1, dtype=torch.int64), 1
    all_reduce_(selfish, fresh_counter(comm), "test", op="max")
    got = windowed(ExchangeTable(send_idx=own, recv_rows=recv_rows), comm, x_own)
    assert (got is None) == (comm.shm is None or comm.world_size == 1 or bool(selfish))
    for g in (graph, grouped):
        for weight in (None, torch.rand(g.num_edges, generator=gen, dtype=x_own.dtype)):
            ref_rows = x_own.clone().requires_grad_()
            ref = spmm(g, halo_join(ref_rows, table, fresh_counter(comm)), weight)
            ref.backward(grad_out)
            c = fresh_counter(comm)
            rows = x_own.clone().requires_grad_()
            out = halo_spmm(g, rows, weight, table, c)
            torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
            out.backward(grad_out)
            torch.testing.assert_close(rows.grad, ref_rows.grad, rtol=0, atol=0)
            # (shared memory: the first call opens the table's windows, "comm-init")
            got = {k: v for k, v in phase_bytes(c).items() if k != "comm-init"}
            assert got == expect, (seed, phase_bytes(c))
    with pytest.raises(ValueError, match="sources"):
        halo_spmm(Graph(indptr, indices.clamp(max=0), num_src=n + h + 1), x_own, None,
                  table, comm)


def check_halo(comm: Comm) -> None:
    cases = [(0.4, (3,), torch.float64), (0.15, (2, 2), torch.float64), (0.0, (4,), torch.float64),
             (0.6, (5,), torch.float32)]
    for seed, (density, feat, dtype) in enumerate(cases):
        _check_halo_case(comm, seed, density, feat, dtype)
    _check_halo_case(fresh_counter(comm, p2p_all_to_all=True, shm=None), 7, 0.3, (3,),
                     torch.float64)


# ---------------------------------------------------------------- gradient sync
def check_all_reduce_grads(comm: Comm) -> None:
    r, world = comm.rank, comm.world_size
    shapes = [((3, 2), torch.float64), ((4,), torch.float32), ((2, 2), torch.float64),
              ((5,), torch.float64), ((1,), torch.float64)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=t)) for s, t in shapes]
    params[4].requires_grad_(False)
    grads = {q: [rnd(100 * q + i, *s).to(t) for i, (s, t) in enumerate(shapes)]
             for q in range(world)}

    def present(q: int, i: int) -> bool:  # param 2 has no grad on rank 0; param 3 on none
        return i not in (3, 4) and not (i == 2 and q == 0)

    for i, p in enumerate(params):
        p.grad = grads[r][i].clone() if present(r, i) else None
    c = fresh_counter(comm)
    all_reduce_grads(params, c)
    for i, p in enumerate(params):
        owners = [q for q in range(world) if present(q, i)]
        if not owners:  # stays None only when no rank had a gradient
            assert p.grad is None, i
            continue
        torch.testing.assert_close(p.grad, sum(grads[q][i] for q in owners))
    if world == 1:
        assert phase_bytes(c) == {}
        return
    f64 = (6 + 4 + 5 + 3) * 8  # grads of params 0, 2, 3 + one flag each
    f32 = (4 + 1) * 4
    ring = sum(2 * (world - 1) * b // world for b in (f64, f32))
    assert phase_bytes(c) == {"grad-sync": (ring, ring)}
    assert c.counter.snapshot()["grad-sync"]["calls"] == 2  # one per dtype


def check_gather_rows(comm: Comm) -> None:
    """gather_rows replicates row blocks; its backward sums gradients to the owners."""
    world, r = comm.world_size, comm.rank
    counts = [3 + p for p in range(world)]  # uneven blocks
    full = rnd(5, sum(counts), 2)
    mine = full[sum(counts[:r]):sum(counts[:r + 1])].clone().requires_grad_(True)
    c = fresh_counter(comm)
    out = gather_rows(mine, counts, c, "share")
    torch.testing.assert_close(out, full)
    # every rank weighs the replicated rows by its own factor; the owner's gradient
    # is the sum of all ranks' factors
    (out * (r + 1)).sum().backward()
    total = sum(p + 1 for p in range(world))
    torch.testing.assert_close(mine.grad, torch.full_like(mine, float(total)))
    itemsize, n_r, n = 8 * 2, counts[r], sum(counts)
    if world > 1:
        assert phase_bytes(c) == {"share": ((world - 1) * n_r * itemsize, (n - n_r) * itemsize),
                              "share-grad": ((n - n_r) * itemsize, (world - 1) * n_r * itemsize)}


def check_shared_columns(comm: Comm) -> None:
    """Balanced layout: D // R columns each plus D % R replicated ones; values, gradients."""
    world, r = comm.world_size, comm.rank
    n, d = 10, 7
    layout = RowColLayout.balanced(even_counts(n, world), d)
    full = rnd(11, n, d)
    mine = full[layout.row_slice(r)].clone().requires_grad_(True)
    cols = rows_to_cols(mine, layout, comm)
    idx = [c for a, b in layout.col_ranges(r) for c in range(a, b)]
    torch.testing.assert_close(cols, full[:, idx])
    torch.testing.assert_close(cols_to_rows(cols, layout, comm), mine)
    weights = [rnd(20 + q, n, layout.local_cols(q)) for q in range(world)]
    (cols * weights[r]).sum().backward()
    expected = torch.zeros(n, d, dtype=torch.float64)
    for q in range(world):
        for j, c in enumerate(c for a, b in layout.col_ranges(q) for c in range(a, b)):
            expected[:, c] += weights[q][:, j]
    torch.testing.assert_close(mine.grad, expected[layout.row_slice(r)])
    # gather back: the shared columns' gradient stays on the owner's own rows
    x_cols = full[:, idx].clone().requires_grad_(True)
    rows = cols_to_rows(x_cols, layout, comm)
    rows.sum().backward()
    want = torch.zeros_like(x_cols)
    own_cols = layout.col_counts[r]
    want[:, :own_cols] = 1.0
    want[layout.row_slice(r), own_cols:] = 1.0
    torch.testing.assert_close(x_cols.grad, want)
