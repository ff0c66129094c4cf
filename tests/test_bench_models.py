"""The models benchmark's profile table (``--profile``): where one epoch goes."""
from __future__ import annotations

import torch

from fullgraph.bench.models import WARMUPS, profile_table


def test_profile_table_names_the_operators_of_one_call():
    calls = []
    a = torch.randn(64, 64)

    def step() -> None:
        calls.append(1)
        torch.mm(a, a)

    table = profile_table(step, "cpu", 5)
    assert len(calls) == WARMUPS + 1  # the warm-ups, then the profiled call
    assert "aten::mm" in table and "Self CPU" in table
