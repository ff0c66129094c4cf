"""ExchangeTable construction, validation and expected volumes (no processes)."""
from __future__ import annotations

import pytest
import torch

from fullgraph.comm import ExchangeTable


def test_from_needs_maps_gids_to_local_rows():
    # Rank 1 of 3 owns gids 10..14 at rows 0..4.
    needed_from = [torch.tensor([3, 1]), torch.tensor([], dtype=torch.int64), torch.tensor([20])]
    needed_by = [torch.tensor([14, 10, 12]), torch.tensor([], dtype=torch.int64),
                 torch.tensor([11])]
    table = ExchangeTable.from_needs(needed_from, needed_by, lambda gids: gids - 10)
    assert [t.tolist() for t in table.send_idx] == [[4, 0, 2], [], [1]]
    assert table.recv_rows == [2, 0, 1]
    assert table.send_rows() == [3, 0, 1]
    assert (table.world_size, table.num_halo) == (3, 3)
    assert table.volume_bytes(dim=5, itemsize=4) == (4 * 5 * 4, 3 * 5 * 4)


def test_volume_bytes_leaves_out_self():
    table = ExchangeTable([torch.tensor([0, 1]), torch.tensor([2])], [3, 1])
    assert table.volume_bytes(2, 8) == (3 * 16, 4 * 16)
    assert table.volume_bytes(2, 8, rank=0) == (1 * 16, 1 * 16)


def test_table_validation_and_to():
    with pytest.raises(ValueError, match="2 send lists but 1 receive counts"):
        ExchangeTable([torch.tensor([0]), torch.tensor([1])], [1])
    with pytest.raises(ValueError, match=r"send_idx\[0\] must be a 1-D int64"):
        ExchangeTable([torch.tensor([0], dtype=torch.int32)], [1])
    with pytest.raises(ValueError, match="recv_rows must be >= 0"):
        ExchangeTable([torch.tensor([0])], [-1])
    with pytest.raises(ValueError, match="needed_from lists"):
        ExchangeTable.from_needs([torch.tensor([1])], [], lambda g: g)
    table = ExchangeTable([torch.tensor([0])], [1]).to("cpu")
    assert table.send_idx[0].device == torch.device("cpu") and table.recv_rows == [1]


def test_receive_positions_as_runs():
    """``recv_runs``: each peer's positions as one block of the buffer, or None."""
    empty = torch.tensor([], dtype=torch.int64)
    idx = [torch.tensor([0]), torch.tensor([1, 2]), empty]
    runs = ExchangeTable(idx, [3, 2, 0],
                         recv_pos=[torch.tensor([4, 5, 6]), torch.tensor([0, 1]), empty])
    assert runs.recv_runs == [(4, 7), (0, 2), (0, 0)]
    gap = ExchangeTable(idx, [3, 2, 0],
                        recv_pos=[torch.tensor([4, 6, 5]), torch.tensor([0, 1]), empty])
    assert gap.recv_runs is None
    assert ExchangeTable(idx, [3, 2, 0]).recv_runs is None
