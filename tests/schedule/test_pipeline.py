"""Pipeline schedules as data: step order and the once-per-vertex split sets."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.graph.csr import Graph
from fullgraph.ops.chunked import build_chunks
from fullgraph.schedule.chunks import even_ranges
from fullgraph.schedule.pipeline import Step, backward_steps, first_reads, forward_steps


def test_forward_overlaps_next_split_and_previous_gather():
    steps = forward_steps(num_props=1, num_chunks=3)
    assert steps == [
        Step("split", 0), Step("wait-split", 0), Step("split", 1), Step("aggregate", 0, 0),
        Step("gather", 0),
        Step("wait-split", 1), Step("split", 2), Step("aggregate", 1, 0), Step("gather", 1),
        Step("wait-gather", 0),
        Step("wait-split", 2), Step("aggregate", 2, 0), Step("gather", 2),
        Step("wait-gather", 1), Step("wait-gather", 2)]


@pytest.mark.parametrize("props,chunks", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_every_exchange_is_started_once_and_waited_after(props, chunks):
    for steps in (forward_steps(props, chunks), backward_steps(props, chunks)):
        for kind in ("split", "gather"):
            started = [s.chunk for s in steps if s.op == kind]
            assert sorted(started) == list(range(chunks))
            for k in range(chunks):
                assert steps.index(Step(kind, k)) < steps.index(Step(f"wait-{kind}", k))
        aggregations = [(s.stage, s.chunk) for s in steps if s.op == "aggregate"]
        assert sorted(aggregations) == [(p, k) for p in range(props) for k in range(chunks)]


def test_forward_splits_before_reading_and_backward_gathers_after_last_reader():
    props, chunks = 2, 4
    fwd = forward_steps(props, chunks)
    for k in range(chunks):  # P_1 of chunk k only after chunk k's split arrived
        assert fwd.index(Step("wait-split", k)) < fwd.index(Step("aggregate", k, 0))
    bwd = backward_steps(props, chunks)
    for k in range(chunks):  # a row first read by chunk k is done once chunks >= k ran
        gather = bwd.index(Step("gather", k))
        assert all(bwd.index(Step("aggregate", j, 0)) < gather for j in range(k, chunks))


def test_first_reads_partition_the_sources():
    rng = np.random.default_rng(0)
    g = Graph.from_edges(rng.integers(0, 40, 200), rng.integers(0, 40, 200), 40)
    chunks = build_chunks(g, even_ranges(40, 5))
    fresh = first_reads(chunks)
    seen: set[int] = set()
    for c, new in zip(chunks, fresh):
        assert set(new.tolist()).isdisjoint(seen)
        seen |= set(new.tolist())
        assert set(c.src.tolist()) <= seen  # everything a chunk reads was split by then
        assert torch.equal(new, torch.sort(new).values)
