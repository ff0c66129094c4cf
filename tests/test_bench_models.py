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


def test_roofline_line_divides_the_epoch_by_the_bound_at_the_mean_rates():
    import argparse

    from fullgraph.bench.kernels import roofline
    from fullgraph.bench.models import CLASSES, roofline_line
    from fullgraph.graph import synthetic

    graph = synthetic.rmat(500, 4000, seed=0, num_features=8, num_classes=3).graph
    args = argparse.Namespace(features=128, hidden=256)
    before = {"read_GBps": 30.0, "gemm_GFLOPs": 100.0}
    after = {"read_GBps": 50.0, "gemm_GFLOPs": 300.0}
    looped = graph.with_self_loops(True)  # (GCN aggregates a self-loop per vertex)
    assert looped.num_edges > graph.num_edges
    bound = roofline({"read_GBps": 40.0, "gemm_GFLOPs": 200.0}, looped.num_dst,
                     looped.num_edges, argparse.Namespace(features=128, hidden=256,
                                                          classes=CLASSES))["roofline_s"]
    line = roofline_line(3 * bound, graph, args, before, after)
    assert line.startswith("GCN epoch ") and ", 3.00x its roofline" in line
    assert "at 40.0 GB/s read and 200.0 GFLOP/s" in line
    assert roofline_line(None, graph, args, before, after).startswith("GCN epoch: out of memory")
