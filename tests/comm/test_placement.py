"""The conjugate placement pairs: values, gradients and bytes against one process.

Each rank rebuilds the whole problem from seeds, computes the single-process
reference itself and checks its own slice. Cases cover N and D
not divisible by the world size, ranks with 0 rows or 0 columns, empty halos and
the isend/irecv fallback. ``Fn.backward(stub_ctx, g)`` is checked against the
conjugate's forward on every world size, and without any process group for 1.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from placement_checks import (
    check_all_reduce_grads,
    check_gather_rows,
    check_halo,
    check_rows_cols,
    check_shared_columns,
)

from fullgraph.comm import (
    Comm,
    ExchangeTable,
    RowColLayout,
    cols_to_rows,
    halo_fetch,
    halo_scatter_add,
    rows_to_cols,
    single_comm,
)
from fullgraph.comm.halo import _HaloFetch
from fullgraph.comm.placement import _ColsToRows, _RowsToCols


def check_placement(comm: Comm) -> None:
    assert comm.world_size > 1 or not dist.is_initialized()
    check_shared_columns(comm)
    check_gather_rows(comm)
    check_rows_cols(comm)
    check_halo(comm)
    check_all_reduce_grads(comm)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_placement_gloo(tmp_path, world_size):
    run_ranks(check_placement, world_size, tmp_path)


# ---------------------------------------------------------------- world size 1, in process
def test_world_1_in_process_matches_reference():
    check_placement(single_comm())


def test_world_1_returns_input_and_stub_backward():
    comm = single_comm()
    layout = RowColLayout.even(5, 3, 1)
    x = torch.randn(5, 3)
    assert rows_to_cols(x, layout, comm) is x and cols_to_rows(x, layout, comm) is x
    ctx = SimpleNamespace(layout=layout, comm=comm, phase="p")
    g = torch.randn(5, 3)
    assert _RowsToCols.backward(ctx, g)[0] is g and _ColsToRows.backward(ctx, g)[1:] == (None,) * 3
    # A local "halo" at world size 1: rows 4, 0, 4 of x; backward scatter-adds.
    table = ExchangeTable([torch.tensor([4, 0, 4])], [3])
    ctx = SimpleNamespace(table=table, comm=comm, phase="p", num_rows=5)
    grad = _HaloFetch.backward(ctx, torch.ones(3, 3))
    torch.testing.assert_close(grad[0], torch.tensor([[1.0] * 3, [0] * 3, [0] * 3, [0] * 3,
                                                      [2] * 3]))
    assert grad[1:] == (None, None, None)
    assert comm.counter.snapshot() == {}


def test_world_1_gradcheck():
    comm = single_comm()
    table = ExchangeTable([torch.tensor([2, 0, 2, 1])], [4])
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    h = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: halo_fetch(t, table, comm), (x,))
    assert torch.autograd.gradcheck(lambda t: halo_scatter_add(t, table, 3, comm), (h,))


def test_row_col_layout():
    layout = RowColLayout.even(10, 7, 3)
    assert layout.row_counts == (4, 3, 3) and layout.col_counts == (3, 2, 2)
    assert (layout.num_rows, layout.num_cols, layout.world_size) == (10, 7, 3)
    assert layout.row_slice(1) == slice(4, 7) and layout.col_slice(2) == slice(5, 7)
    assert RowColLayout.even(2, 1, 3).col_counts == (1, 0, 0)
    assert RowColLayout.for_rows([0, 5], 3) == RowColLayout((0, 5), (2, 1))
    with pytest.raises(ValueError, match="one non-negative row and column count per rank"):
        RowColLayout([1, 2], [3])
    with pytest.raises(ValueError, match="layout is for 2 ranks"):
        rows_to_cols(torch.zeros(3, 3), RowColLayout.even(3, 3, 2), single_comm())
    with pytest.raises(ValueError, match=r"expected shape \(3, 3\)"):
        cols_to_rows(torch.zeros(3, 2), RowColLayout.even(3, 3, 1), single_comm())


def test_halo_shape_errors():
    table = ExchangeTable([torch.tensor([0])], [1])
    with pytest.raises(ValueError, match="expected 1 halo rows"):
        halo_scatter_add(torch.zeros(2, 3), table, 4, single_comm())
    with pytest.raises(ValueError, match="table is for 2 ranks"):
        halo_fetch(torch.zeros(2, 3), ExchangeTable([torch.tensor([0])] * 2, [1, 1]),
                   single_comm())
