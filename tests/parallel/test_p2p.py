"""P2P (G3) execution reproduces the single-process executor and moves each row once.

Exactness (float64, dropout on): the loss of 3 epochs, the owned output rows and the
parameters after 3 Adam steps equal the single-process run for GCN, GraphSAGE, GAT
and GIN, coupled and decoupled, every partitioner and every schedule, on 1-4 workers,
with bins small enough that every phase has several rounds.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from cases import make_dataset, make_model, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.models import build_model
from fullgraph.parallel.p2p import P2PParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.partition import PartitionOptions
from fullgraph.schedule.bins import SCHEDULES, bin_limit, build_schedule, priority_order
from fullgraph.schedule.links import CrossReads, LinkRounds, RowIndex, link_tables

MODELS = ["gcn", "sage", "gat", "gin"]
PARTITIONERS = ["chunk", "random", "metis", "g3"]
SCHEDULE_NAMES = list(SCHEDULES)
BIN_SIZES = [2, 5, 1000]  # 1000: one bin per phase


def check_all(comm, cases):
    dataset = make_dataset()
    refs = {}
    for name, decoupled, part, schedule, bin_size in cases:
        if (name, decoupled) not in refs:
            ref_model = make_model(name, decoupled, 9, 3)
            refs[name, decoupled] = ref_model, run_epochs(SingleProcess(), dataset, ref_model, None)
        ref_model, (ref_losses, (ref_out, _), _) = refs[name, decoupled]
        model = make_model(name, decoupled, 9, 3)
        strategy = P2PParallel(P2PParallel.Options(schedule=schedule, bin_size=bin_size),
                               PartitionOptions(method=part))
        losses, (out, gids), _ = run_epochs(strategy, dataset, model, comm)
        where = (f"{name} decoupled={decoupled} {part} {schedule} bins of {bin_size} "
                 f"rank {comm.rank}/{comm.world_size}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


# On 3 workers (odd, uneven parts) every pair of axes in full: each model and form
# with each partitioner, the schedule shifted so that every (model/form, schedule)
# and every (partitioner, schedule) pair also appears (32 of the 128 combinations);
# on 1, 2 and 4 every model and form with the partitioner, schedule and bin size
# rotating so that each world size sees all four of each, keeping the suite's time
# in bounds.
PAIRS = list(itertools.product(MODELS, [False, True]))
FULL = [(m, d, part, SCHEDULE_NAMES[(i + k) % 4], BIN_SIZES[(i + k) % 3])
        for i, (m, d) in enumerate(PAIRS) for k, part in enumerate(PARTITIONERS)]


def rotated(shift: int) -> list[tuple]:
    return [(m, d, PARTITIONERS[(i + shift) % 4], SCHEDULE_NAMES[(i // 2 + shift) % 4],
             BIN_SIZES[i % 3]) for i, (m, d) in enumerate(PAIRS)]


# one worker (nothing pushed) and four (the most processes on 2 cores) run half of
# their rotation: the four models coupled on one, decoupled on four, each under all
# four schedules
# and TAGCN once (its K hops, each reading the layer input, in bins)
CASES = {1: rotated(0)[::2], 2: rotated(1) + [("tagcn", False, "g3", "multi-level", 5)],
         3: FULL, 4: rotated(3)[1::2]}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_p2p_matches_single(tmp_path, world_size):
    run_ranks(check_all, world_size, tmp_path, CASES[world_size])


def check_band(comm):
    """A path graph in bins of 4: an inner bin reads one run of local rows and no pushed
    row, a view of the buffer the next rounds land in; the eager schedules run it
    before they arrive, and GAT's attention saves its input for the backward."""
    import dataclasses

    from fullgraph.graph.csr import Graph

    ds = make_dataset()
    n = ds.graph.num_nodes
    path = Graph.from_edges(np.arange(n - 1), np.arange(1, n), n, symmetrize=True)
    dataset = dataclasses.replace(ds, graph=path)
    ref_model = make_model("gat", False, 9, 3)
    ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
    for schedule in ("multi-level", "inter-layer"):
        model = make_model("gat", False, 9, 3)
        strategy = P2PParallel(P2PParallel.Options(schedule=schedule, bin_size=4),
                               PartitionOptions(method="chunk"))
        losses, (out, gids), _ = run_epochs(strategy, dataset, model, comm)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=schedule)
        torch.testing.assert_close(out, ref_out[gids], msg=schedule)


@pytest.mark.dist
def test_eager_bins_reading_a_buffer_still_being_filled(tmp_path):
    run_ranks(check_band, 2, tmp_path)


def check_bytes(comm, schedule):
    """Each link moves |V_i^remote| x dims x itemsize bytes per direction, no more."""
    dataset = make_dataset()
    torch.manual_seed(0)
    hidden, classes = 6, 3
    model = build_model("gcn", 9, hidden, classes, aggregate_first=False, dropout=0.0)
    model = model.to(TEST_DEVICE)
    strategy = P2PParallel(P2PParallel.Options(schedule=schedule, bin_size=5),
                           PartitionOptions(method="random"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    assert max(ph.rounds for ph in plan.phases) > 1 or schedule == "sequential"
    owned = plan.book.part_to_gids(comm.rank).cpu()
    src, dst = (t.cpu() for t in plan.graph.edges())
    mine = torch.zeros(plan.graph.num_dst, dtype=torch.bool)
    mine[owned] = True
    remote = torch.unique(src[mine[dst] & ~mine[src]])
    needed_by_peers = torch.unique(src[~mine[dst] & mine[src]])  # a row may go to 2 peers
    comm.counter.reset()
    result = strategy.forward(model, plan, training=True, seed=1)
    strategy.loss(result, plan).backward()
    snap = comm.counter.snapshot()
    # GCN, weight before propagation: the links carry hidden and classes columns
    expected = remote.numel() * (hidden + classes) * 4
    assert snap["push"]["recv"] == expected, (comm.rank, snap["push"], expected)
    assert snap["push-grad"]["sent"] == expected, (comm.rank, snap["push-grad"], expected)
    assert snap["push"]["sent"] == snap["push-grad"]["recv"] >= needed_by_peers.numel() * 36
    from fullgraph.comm.primitives import all_reduce_

    totals = torch.tensor([snap["push"]["sent"], snap["push"]["recv"]], dtype=torch.int64)
    all_reduce_(totals, comm, "test")
    assert int(totals[0]) == int(totals[1])


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["sequential", "multi-level"])
def test_p2p_moves_each_remote_row_once_per_link(tmp_path, schedule):
    run_ranks(check_bytes, 3, tmp_path, schedule)


def test_link_tables_agree_between_ranks():
    """What rank p sends to q in round j is, in order, what q expects from p then."""
    dataset = make_dataset()
    graph = dataset.graph.with_self_loops(True)
    world = 3
    part_of = torch.from_numpy(np.random.default_rng(0).integers(0, world, graph.num_dst))
    part = part_of.numpy()
    phases = build_schedule(graph, part_of, world, [4, 6], SCHEDULES["multi-level"])
    owned = [np.flatnonzero(part == p) for p in range(world)]
    lid = np.zeros(graph.num_dst, dtype=np.int64)
    for p in range(world):
        lid[owned[p]] = np.arange(owned[p].size)
    src, dst = (t.numpy() for t in graph.edges())
    cross = CrossReads.build(graph, part)
    links = []
    for r in range(world):
        reads = np.unique(src[(part[dst] == r) & (part[src] != r)])
        halo = reads[np.lexsort((reads, part[reads]))]
        rounds = LinkRounds(phases[0].round_of, phases[1].step_of, phases[0].rounds,
                            phases[1].rounds)
        links.append((halo, link_tables(cross, RowIndex(part, lid, world), rounds, r, halo)))
    for p, q in itertools.permutations(range(world), 2):
        halo_q, link_q = links[q]
        _, link_p = links[p]
        for j in range(phases[0].rounds):
            sent = owned[p][link_p.fwd_send[j][q].numpy()]
            expected = halo_q[link_q.fwd_recv[j][p].numpy()]
            assert sent.tolist() == expected.tolist()
            assert (phases[0].round_of[sent] == j).all()
        for t in range(phases[1].rounds):
            back = halo_q[link_q.bwd_send[t][p].numpy()]
            got = owned[p][link_p.bwd_recv[t][q].numpy()]
            assert back.tolist() == got.tolist()
    for r in range(world):  # every halo row arrives exactly once, and goes back once
        halo, link = links[r]
        fwd = np.concatenate([t.numpy() for rnd in link.fwd_recv for t in rnd])
        bwd = np.concatenate([t.numpy() for rnd in link.bwd_send for t in rnd])
        assert sorted(fwd.tolist()) == list(range(halo.size)) == sorted(bwd.tolist())


def check_pieces(comm, name):
    """Each rank, holding only its own vertices' in-edges, builds its part of the
    schedule and its link tables: the same as from the whole graph."""
    from fullgraph.graph.csr import Graph
    from fullgraph.parallel.p2p_plan import reads_exchange, reduce_max

    graph = make_dataset().graph.with_self_loops(True)
    world, rank = comm.world_size, comm.rank
    part_of = torch.from_numpy(np.random.default_rng(1).integers(0, world, graph.num_dst))
    part = part_of.numpy()
    src, dst = (t.numpy() for t in graph.edges())
    keep = part[dst] == rank
    mine = Graph.from_edges(src[keep], dst[keep], graph.num_dst)
    mode = SCHEDULES[name]
    whole = build_schedule(graph, part_of, world, [4, 3, 6], mode)
    piece = build_schedule(mine, part_of, world, [4, 3, 6], mode, parts=[rank],
                           reduce_max=reduce_max(comm))
    owned = torch.from_numpy(np.flatnonzero(part == rank))
    first = priority_order(graph, owned, part_of) if mode.priority else owned
    assert np.concatenate(piece[0].bins[rank]).tolist() == first.tolist()  # G3 step 1
    for k, (w, p) in enumerate(zip(whole, piece)):
        where = f"{name} phase {k} rank {rank}/{world}"
        assert [b.tolist() for b in w.bins[rank]] == [b.tolist() for b in p.bins[rank]], where
        for field in ("fwd_wait", "bwd_order", "bwd_wait"):
            assert getattr(w, field)[rank].tolist() == getattr(p, field)[rank].tolist(), where
        assert all(not p.bins[q] for q in range(world) if q != rank), where
        assert w.rounds == p.rounds, where
        np.testing.assert_array_equal(w.round_of, p.round_of, err_msg=where)
        np.testing.assert_array_equal(w.step_of, p.step_of, err_msg=where)
    lid = np.zeros(graph.num_dst, dtype=np.int64)
    for q in range(world):
        lid[part == q] = np.arange(int((part == q).sum()))
    index = RowIndex(part, lid, world)
    reads = np.unique(src[keep & (part[src] != rank)])
    halo = reads[np.lexsort((reads, part[reads]))]
    for k in (1, 2):
        rounds = LinkRounds(whole[k - 1].round_of, whole[k].step_of, whole[k - 1].rounds,
                            whole[k].rounds)
        a = link_tables(CrossReads.build(graph, part), index, rounds, rank, halo)
        b = link_tables(CrossReads.build(mine, part, reader=rank), index, rounds, rank, halo,
                        reads_exchange(comm))
        for x, y in ((a.fwd_send, b.fwd_send), (a.fwd_recv, b.fwd_recv),
                     (a.bwd_send, b.bwd_send), (a.bwd_recv, b.bwd_recv)):
            assert [[t.tolist() for t in r] for r in x] == [[t.tolist() for t in r] for r in y]


@pytest.mark.dist
@pytest.mark.parametrize("world,schedule", [(2, "multi-level"), (3, "sequential"),
                                            (3, "multi-level"), (4, "inter-layer")])
def test_each_worker_builds_its_part_of_the_schedule(tmp_path, world, schedule):
    run_ranks(check_pieces, world, tmp_path, schedule)


def test_bin_memory_sets_each_phase_limit():
    dataset = make_dataset()
    model = make_model("sage", False, 9, 3)
    strategy = P2PParallel(P2PParallel.Options(bin_memory="2KB"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, dtype=torch.float64)
    dims = [(ph.start, model.stages[ph.start].in_dim, ph.out_dim) for ph in plan.phases]
    assert plan.limits == [bin_limit(2048, i, o, 8) for _, i, o in dims]
    assert len(set(plan.limits)) > 1  # recomputed per phase: the widths differ
    for ph, limit in zip(plan.phases, plan.limits):
        assert all(b.rows.numel() <= limit for b in ph.bins)


@pytest.mark.parametrize("bad, match", [
    ({"schedule": "pipelined"}, "p2p schedule 'pipelined'"),
    ({"bin_size": 0}, "bin_size must be >= 1"),
    ({"bin_memory": "lots"}, "lots"),
    ({"bin_memory": "1MB", "bin_size": 100}, "give bin_memory or bin_size, not both"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        P2PParallel.Options(**bad)


def test_positions_that_form_a_run_become_slices():
    from fullgraph.parallel.p2p_plan import add_at, as_run, pos_len, take, whole

    assert as_run(torch.arange(3, 7)) == slice(3, 7)
    assert as_run(torch.tensor([], dtype=torch.int64)) == slice(0, 0)
    for t in ([0, 2, 3], [1, 0], [0, 1, 3, 3]):  # gaps, order, repeats: kept as indices
        idx = torch.tensor(t)
        assert isinstance(as_run(idx), torch.Tensor)
        assert pos_len(as_run(idx)) == len(t)
    x = torch.arange(12.0).view(6, 2)
    assert take(x, slice(0, 6)) is x and whole(slice(0, 6), 6) and not whole(slice(1, 6), 6)
    assert take(x, slice(2, 4)).data_ptr() == x[2].data_ptr()  # a view
    torch.testing.assert_close(take(x, torch.tensor([4, 1])), x[[4, 1]])
    a, b = torch.zeros(6, 2), torch.zeros(6, 2)
    add_at(a, slice(1, 3), torch.ones(2, 2))
    add_at(b, torch.tensor([1, 2]), torch.ones(2, 2))
    torch.testing.assert_close(a, b)


def check_one_bin_runs(comm):
    """One bin per phase: every position is a slice (whole buffers, nothing gathered)."""
    dataset = make_dataset()
    model = make_model("gat", False, 9, 3).to(TEST_DEVICE)
    strategy = P2PParallel(P2PParallel.Options(bin_size=1000), PartitionOptions(method="metis"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    for k, ph in enumerate(plan.phases):
        assert len(ph.bins) == 1
        blk = ph.bins[0]
        names = ["rows"] + (["src_local", "src_halo", "dst_pos", "edge_pos"] if k else [])
        for name in names:
            assert isinstance(getattr(blk, name), slice), (comm.rank, k, name)


@pytest.mark.dist
def test_one_bin_per_phase_reads_whole_buffers(tmp_path):
    run_ranks(check_one_bin_runs, 2, tmp_path)


def test_the_header_names_bins_by_the_largest_part_and_shards_as_the_source():
    """A bin limit between two parts' sizes was printed 'all' (one bin) from rank 0's
    part; on shards the header named --partitioner's value, which they do not use."""
    from types import SimpleNamespace

    from fullgraph.partition import PartitionBook

    book = PartitionBook.from_assignment(np.repeat([0, 1, 2], [902, 903, 903]), 3)
    phases = [SimpleNamespace(start=0, stop=3, rounds=2)]
    plan = SimpleNamespace(phases=phases, limits=[902], book=book, shard=None,
                           schedule="multi-level")
    line, = P2PParallel(partition=PartitionOptions(method="random")).describe(None, plan)
    assert "partitioner random;" in line and "vertices per bin at most 902;" in line
    plan.limits, plan.shard = [903], object()
    line, = P2PParallel(partition=PartitionOptions(method="random")).describe(None, plan)
    assert "per-part shards;" in line and "vertices per bin at most all;" in line
