"""G3 link tables as per-round ExchangeTables: the all-to-all-v contract of every round."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from fullgraph.graph.synthetic import sbm
from fullgraph.schedule.bins import SCHEDULES, build_schedule
from fullgraph.schedule.links import CrossReads, LinkRounds, RowIndex, link_tables


def _links(world: int, seed: int):
    graph = sbm(67, 3, avg_degree=5.0, num_features=9, seed=11).graph.with_self_loops(True)
    part = np.random.default_rng(seed).integers(0, world, graph.num_dst)
    phases = build_schedule(graph, torch.from_numpy(part), world, [3, 5],
                            SCHEDULES["multi-level"])
    lid = np.zeros(graph.num_dst, dtype=np.int64)
    for p in range(world):
        owned = np.flatnonzero(part == p)
        lid[owned] = np.arange(owned.size)
    src, dst = (t.numpy() for t in graph.edges())
    cross, index = CrossReads.build(graph, part), RowIndex(part, lid, world)
    rounds = LinkRounds(phases[0].round_of, phases[1].step_of, phases[0].rounds,
                        phases[1].rounds)
    links = []
    for r in range(world):
        reads = np.unique(src[(part[dst] == r) & (part[src] != r)])
        links.append(link_tables(cross, index, rounds, r, reads[np.lexsort((reads, part[reads]))]))
    return links, phases


def test_every_round_is_a_matching_exchange():
    """Per round, what p sends q is what q's table expects from p, both ways."""
    world = 3
    links, phases = _links(world, 1)
    for link in links:
        assert len(link.fwd) == phases[0].rounds and len(link.bwd) == phases[1].rounds
        for table in link.fwd + link.bwd:
            assert table.world_size == world and table.recv_pos is not None
    for p, q in itertools.permutations(range(world), 2):
        for j in range(phases[0].rounds):  # forward: fetch direction
            assert links[p].fwd[j].send_rows()[q] == links[q].fwd[j].recv_rows[p]
        for t in range(phases[1].rounds):  # backward: return direction
            assert links[q].bwd[t].recv_rows[p] == links[p].bwd[t].send_rows()[q]
    sent = sum(link.rows_moved(r)[0] for r, link in enumerate(links))
    recv = sum(link.rows_moved(r)[1] for r, link in enumerate(links))
    assert sent == recv == sum(link.num_halo for link in links) > 0


def test_link_to_device_keeps_tables():
    links, _ = _links(2, 0)
    moved = links[0].to("cpu")
    assert moved.num_halo == links[0].num_halo
    for a, b in zip(moved.fwd_recv + moved.bwd_recv, links[0].fwd_recv + links[0].bwd_recv):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
