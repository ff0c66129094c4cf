"""Task parallelism reproduces the single-process executor (float64), moves the
hand-computed bytes between its groups, and refuses impossible splits.

The T group (ranks 0..N_t-1) runs T and E stages on row blocks, the P group the P
stages on column slices of every vertex (``--group-parallel tensor``) or on row
ranges (``data``). World sizes 2-5, the four models coupled and decoupled, the split
from the scheduling model or given, with and without the subgraph pipeline (S = 3 of
M = 3 or 6 chunks), with and without recomputation, both P-group forms: every value
of every axis appears (a rotation, not the product), and each model, coupled and
decoupled, in both P-group forms.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import MODELS, make_dataset, make_model, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import single_comm
from fullgraph.models import build_model
from fullgraph.models.stages import propagation_inputs
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.task import TaskParallel
from fullgraph.parallel.taskmodel import (
    Machine,
    TaskSplit,
    choose_split,
    parse_split,
    predict_times,
)

SPLITS = {2: ["auto", "1:1"], 3: ["auto", "1:2", "2:1"], 4: ["auto", "1:3", "3:1", "2:2"],
          5: ["auto", "2:3", "4:1"]}


# TAGCN on 2 and 3 workers: decoupled (pipelined, recomputed) and coupled; GAT with
# its coefficients handed to two P workers by rows, pipelined
EXTRA = {2: [("tagcn", True, "1:1", 3, True, "data", 0)],
         3: [("tagcn:agg_first", False, "auto", 1, False, "tensor", 0),
             ("gat", False, "1:2", 3, False, "data", 6)]}
FORMS = ("tensor", "data")


def cases_for(world: int) -> list[tuple[str, bool, str, int, bool, str, int]]:
    """Half of the model x coupled/decoupled combinations on each world size (2 and 3
    together run all eight, and so do 4 and 5); splits and subgraph counts rotate, so
    every split of every world size, S in {1, 3} and recomputation on and off appear.
    The P-group form alternates so that each combination runs in one form on 2 or 3
    workers and in the other on 4 or 5. Pipelined runs on 2 and 3 workers cut M = 6
    chunks (M > S), the others one chunk per subgraph (per P worker in the data
    form). TAGCN once each on 2 and 3, and GAT by rows on two P workers."""
    splits = SPLITS[world]
    combos = [(m, d) for m in MODELS for d in (False, True)]
    half = combos[world % 2::2]
    cases = []
    for i, (name, decoupled) in enumerate(half):
        subgraphs = 1 + 2 * ((i + world // 2) % 2)
        chunks = 6 if subgraphs > 1 and world <= 3 else 0
        cases.append((name, decoupled, splits[i % len(splits)], subgraphs,
                      (i + world) % 2 == 1, FORMS[(i // 2 + (world >= 4)) % 2], chunks))
    return cases + EXTRA.get(world, [])


def test_rotation_covers_every_axis():
    """Every model, coupled and decoupled, in both P-group forms; every split, S, M > S,
    recompute value and form on every world size."""
    cases = {w: cases_for(w) for w in SPLITS}
    seen = {(c[0], c[1], c[5]) for w in cases for c in cases[w]}
    assert all((m, d, f) in seen for m in MODELS for d in (False, True) for f in FORMS)
    for w, cs in cases.items():
        assert {c[2] for c in cs} == set(SPLITS[w]) and {c[5] for c in cs} == set(FORMS), w
        assert {c[3] for c in cs} == {1, 3} and {c[4] for c in cs} == {False, True}, w
    assert {c[5] for w in (2, 3) for c in cases[w] if c[6] > c[3] > 1} == set(FORMS)
    every = [c for w in cases for c in cases[w]]
    assert {(c[5], c[3], c[4]) for c in every} >= {(f, s, r) for f in FORMS for s in (1, 3)
                                                    for r in (False, True)}


def check_task(comm, cases):
    dataset = make_dataset()
    refs = {}
    for name, decoupled, split, subgraphs, recompute, form, chunks in cases:
        if (name, decoupled) not in refs:
            model = make_model(name, decoupled, 9, 3)
            losses, (out, _), _ = run_epochs(SingleProcess(), dataset, model, None)
            refs[name, decoupled] = (losses, out, model)
        ref_losses, ref_out, ref_model = refs[name, decoupled]
        model = make_model(name, decoupled, 9, 3)
        strategy = TaskParallel(TaskParallel.Options(
            split=split, subgraphs=subgraphs, recompute=recompute, group_parallel=form,
            chunks=chunks))
        losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
        where = (f"{name} decoupled={decoupled} split={split} S={subgraphs} M={chunks} "
                 f"recompute={recompute} {form} rank {comm.rank}/{comm.world_size}")
        assert plan.recompute == recompute and (plan.rows is not None) == (form == "data"), where
        header = strategy.describe(model, plan)
        assert {"data": "(P group, data: rows", "tensor": "(P group, tensor: columns"}[form] \
            in header[0], (where, header)
        if subgraphs > 1:
            assert f"{subgraphs} subgraphs of {chunks or ''}" in header[-1], (where, header)
        # the tensor form without a pipeline names the option that overlaps the groups
        hint = form == "tensor" and subgraphs == 1 and not recompute and not chunks \
            and name != "gat"  # (whose attention-weighted hand-offs cannot go in pieces)
        assert ("--task-pieces K" in header[-1]) == hint, (where, header)
        if form == "data":  # a P worker holds the in-edges of its rows only, each edge once
            held = torch.tensor([plan.graph.num_edges])
            prim.all_reduce_(held, comm, "test")
            assert int(held) == propagation_inputs(model, dataset.graph)[0].num_edges, where
            assert all(len(v) == plan.graph.num_edges for v in plan.norms.values()), where
        if split != "auto":
            assert f"{plan.split.num_t}:{plan.split.num_p}" == split, where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")
        # every vertex's output is on exactly one rank
        counts = torch.tensor([gids.numel()], dtype=torch.int64)
        prim.all_reduce_(counts, comm, "test")
        assert int(counts) == 67, where
    if comm.world_size == 2:
        check_regroup_forms_agree(comm, dataset)


def check_regroup_forms_agree(comm, dataset):
    """``--task-deps regroup`` in both P-group forms: on 1:1 the T block and the P
    range are all rows, so both cut the same chunks, draw the same groupings and skip
    the same blocks: equal losses and outputs (and not those of the exact mode)."""
    results = {}
    for form in FORMS:
        model = make_model("gat", False, 9, 3)
        strategy = TaskParallel(TaskParallel.Options(split="1:1", subgraphs=3, chunks=6,
                                                     deps="regroup", group_parallel=form))
        losses, (out, gids), _ = run_epochs(strategy, dataset, model, comm)
        full = out.new_zeros(67, out.shape[1])  # every rank's output rows, in place
        full[gids] = out
        results[form] = (torch.tensor(losses), prim.all_reduce_(full, comm, "test"))
    (l_t, out_t), (l_d, out_d) = results["tensor"], results["data"]
    torch.testing.assert_close(l_d, l_t)
    torch.testing.assert_close(out_d, out_t)
    ref, _, _ = run_epochs(SingleProcess(), dataset, make_model("gat", False, 9, 3), None)
    assert not torch.allclose(l_d, torch.tensor(ref)), (l_d, ref)


def check_budget(comm, _):
    """``--task-device-memory``: the fewest chunks a P worker's widest column slice fits,
    every chunk a subgraph; exact, and the streamed working set stays within the
    budget."""
    dataset = make_dataset()
    for name, decoupled in (("gcn", False), ("gat", True), ("sage", False)):
        model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, model, None)
        model = make_model(name, decoupled, 9, 3)
        strategy = TaskParallel(TaskParallel.Options(split="1:2", device_memory="3000"))
        losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
        where = f"{name} decoupled={decoupled} rank {comm.rank}"
        assert plan.grid is not None and plan.grid.num_chunks > 2, where
        assert plan.grid.num_subgraphs == plan.grid.num_chunks, where
        assert plan.account is not None and plan.account.peak <= 3000, (where, plan.account)
        assert "within a budget of 3000 B" in "\n".join(strategy.describe(model, plan)), where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)


@pytest.mark.dist
def test_device_memory_budget_sets_the_chunks_and_stays_exact(tmp_path):
    run_ranks(check_budget, 3, tmp_path, None)


def test_device_memory_budget_refuses_what_it_cannot_size():
    with pytest.raises(ValueError, match="group-parallel tensor"):
        TaskParallel.Options(device_memory="1MB", group_parallel="data")
    for extra in ({"chunks": 4}, {"subgraphs": 2}):
        with pytest.raises(ValueError, match="leave --chunks and --subgraphs unset"):
            TaskParallel.Options(device_memory="1MB", **extra)
    with pytest.raises(ValueError, match="regroup"):
        TaskParallel.Options(device_memory="1MB", deps="regroup")
    with pytest.raises(ValueError):
        TaskParallel.Options(device_memory="lots")


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_task_parallel_matches_single(tmp_path, world_size):
    run_ranks(check_task, world_size, tmp_path, cases_for(world_size))


def _sent(comm) -> dict[str, int]:
    return {k: int(v["sent"]) for k, v in comm.counter.snapshot().items()}


def check_handoff_bytes(comm, split):
    """Each split sends every row's every column from the T group to the P group, each
    gather every column back; the decoupled program hands off once each way."""
    dataset = make_dataset()
    n, s = 67, 8  # vertices, bytes per float64
    num_t = int(split.split(":")[0])
    t_rows = [n // num_t + (1 if r < n % num_t else 0) for r in range(num_t)]
    rank = comm.rank
    for decoupled in (False, True):
        torch.manual_seed(0)
        model = build_model("gcn", 9, 5, 3, decoupled=decoupled, num_props=2)
        model = model.to(TEST_DEVICE, torch.float64)
        strategy = TaskParallel(TaskParallel.Options(split=split))
        plan = strategy.setup(dataset, model, TEST_DEVICE, comm, dtype=torch.float64)
        comm.counter.reset()
        result = strategy.forward(model, plan, training=True, seed=1)
        strategy.loss(result, plan).backward()
        sent = _sent(comm)
        p_ranks = plan.split.p_ranks
        # coupled GCN: split and gather at 5 and at 3 columns; decoupled: one split at 3
        # columns, then the output gathered to rows inside the P group
        dims = [5, 3] if not decoupled else [3]
        if rank < num_t:
            fwd_split = t_rows[rank] * sum(dims)
            fwd_gather = 0
        else:
            cols = [plan.layout(d).col_counts[rank] for d in dims]
            fwd_split = 0
            fwd_gather = n * sum(cols) if not decoupled else 0
            if decoupled:  # columns of the other P ranks' output rows
                fwd_gather = cols[0] * (n - plan.out_rows[rank])
        assert sent.get("rows-to-cols", 0) == fwd_split * s, (decoupled, rank, sent)
        assert sent.get("cols-to-rows", 0) == fwd_gather * s, (decoupled, rank, sent)
        # backward: the same volumes in the other direction, summed over ranks
        totals = torch.tensor([sent.get(k, 0) for k in ("rows-to-cols", "rows-to-cols-grad",
                                                        "cols-to-rows", "cols-to-rows-grad")],
                              dtype=torch.int64)
        prim.all_reduce_(totals, comm, "test")
        assert int(totals[0]) == int(totals[1]) and int(totals[2]) == int(totals[3]), totals
        if decoupled:  # into the P group once, whatever the depth
            assert int(totals[0]) == n * 3 * s, totals
            assert int(totals[2]) == (0 if len(p_ranks) == 1 else
                                      sum(plan.layout(3).col_counts[p] * (n - plan.out_rows[p])
                                          for p in p_ranks) * s), totals
        else:  # every vertex over the boundary at each of the 4 hand-offs
            assert int(totals[0]) == int(totals[2]) == n * 8 * s, totals


def check_row_handoff_bytes(comm, split):
    """The data form: the T group sends every P worker the sources of its rows'
    in-edges once (its halo), later P stages exchange the halo inside the P group,
    and the rows go back to the T blocks once before a T stage; the gradients the
    same bytes the other way."""
    dataset, n, s = make_dataset(), 67, 8
    graph, _ = propagation_inputs(build_model("gcn", 9, 5, 3), dataset.graph)
    num_p = int(split.split(":")[1])
    lo = [0] + list(np.cumsum([n // num_p + (p < n % num_p) for p in range(num_p)]))
    ptr, idx = graph.indptr.numpy(), graph.indices.numpy()
    needs = [np.unique(idx[ptr[a]:ptr[b]]) for a, b in zip(lo[:-1], lo[1:])]
    halo = sum(int(((u < a) | (u >= b)).sum()) for u, a, b in zip(needs, lo[:-1], lo[1:]))
    fetched = sum(u.size for u in needs)
    for decoupled, dims, back in ((False, 8, 8), (True, 3, 0)):
        torch.manual_seed(0)
        model = build_model("gcn", 9, 5, 3, decoupled=decoupled, num_props=2)
        model = model.to(TEST_DEVICE, torch.float64)
        strategy = TaskParallel(TaskParallel.Options(split=split, group_parallel="data"))
        plan = strategy.setup(dataset, model, TEST_DEVICE, comm, dtype=torch.float64)
        comm.counter.reset()
        strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
        sent = _sent(comm)
        # the halo inside the P group goes over its own communicator ("P")
        names = ("t-to-p", "t-to-p-grad", "P/p-halo", "P/p-halo-grad", "p-to-t", "p-to-t-grad")
        totals = torch.tensor([sent.get(k, 0) for k in names], dtype=torch.int64)
        prim.all_reduce_(totals, comm, "test")
        # coupled: into the P group and back at 5 and at 3 columns (a T stage, the
        # bias, follows each P stage); decoupled: into the P group once at 3 columns,
        # the second P stage's halo inside the P group, the output left there
        want = [fetched * dims, fetched * dims, halo * 3 * decoupled, halo * 3 * decoupled,
                n * back, n * back]
        assert totals.tolist() == [w * s for w in want], (decoupled, totals, want)
    # GAT: each layer's coefficients go from the T worker of an edge's destination to
    # the P worker of it, each edge once (2 heads in the first layer, 1 in the last)
    model = make_model("gat", False, 9, 3)
    strategy = TaskParallel(TaskParallel.Options(split=split, group_parallel="data"))
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm, dtype=torch.float64)
    comm.counter.reset()
    strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
    sent = _sent(comm)
    totals = torch.tensor([sent.get(k, 0) for k in ("edge-to-p", "edge-to-p-grad")])
    prim.all_reduce_(totals, comm, "test")
    edges = propagation_inputs(model, dataset.graph)[0].num_edges
    assert totals.tolist() == [edges * (2 + 1) * s] * 2, totals


@pytest.mark.dist
@pytest.mark.parametrize("world_size,split", [(2, "1:1"), (3, "1:2")])
def test_handoff_bytes(tmp_path, world_size, split):
    run_ranks(check_both_handoffs, world_size, tmp_path, split)


def check_both_handoffs(comm, split):
    """Both P-group forms in one spawned run."""
    check_handoff_bytes(comm, split)
    check_row_handoff_bytes(comm, split)


# ---------------------------------------------------------------- no processes
def test_bad_splits_are_refused():
    for text, why in [("3:0", "at least one"), ("0:3", "at least one"), ("2-2", "T:P"),
                      ("x", "T:P")]:
        with pytest.raises(ValueError, match=why):
            TaskParallel.Options(split=text)
    with pytest.raises(ValueError, match="needs 4 workers, the run has 3"):
        parse_split("1:3", 3)
    with pytest.raises(ValueError, match="subgraphs"):
        TaskParallel.Options(subgraphs=0)
    with pytest.raises(ValueError, match="gamma"):
        TaskParallel.Options(gamma=1.5)
    model = make_model("gcn", False, 9, 3)
    with pytest.raises(ValueError, match="at least 2 workers"):
        TaskParallel().setup(make_dataset(), model, TEST_DEVICE, single_comm())


def test_scheduling_model_formulas():
    """Formulas 5-8 by hand on a decoupled GCN 9 -> 5 -> 3 with two propagations."""
    torch.manual_seed(0)
    model = build_model("gcn", 9, 5, 3, decoupled=True, num_props=2)
    machine = Machine(flops=1e9, bandwidth=1e9)
    v, e = 100, 400  # average degree 4
    t_time, p_time = predict_times(model, v, e, machine, gamma=0.25, itemsize=4)
    # the dense layers 9 -> 5 and 5 -> 3 (dropout and activation stages have no weights)
    assert t_time == pytest.approx(2 * v * (9 * 5 + 5 * 3) / 1e9)
    one_p = 0.25 * 2 * v * 4 * 3 / 1e9 + 0.75 * (v * 4 * (1 + 2 * 3) + v) * 4 / 1e9
    assert p_time == pytest.approx(2 * one_p)
    split = choose_split(4, t_time, p_time)
    assert (split.num_t, split.num_p, split.how) == (4 - split.num_p, split.num_p, "auto")
    assert split.num_p == min(3, max(1, round(4 * p_time / (p_time + t_time))))
    assert choose_split(5, 1.0, 0.0).num_p == 1 and choose_split(5, 0.0, 1.0).num_t == 1
    assert choose_split(4, 1.0, 3.0) == TaskSplit(1, 3, 1.0, 3.0, "auto")
    with pytest.raises(ValueError, match="at least 2 workers"):
        choose_split(1, 1.0, 1.0)


def test_the_automatic_split_takes_a_p_group_the_chunk_grid_fits():
    """--group-parallel data --chunks N shares N chunks equally over the P group: the
    automatic split takes the size nearest the model's share that divides N (one
    worker always does), where a worker's setup refused the formulas' size."""
    odd = TaskParallel.Options(group_parallel="data", chunks=7)
    assert choose_split(5, 2.0, 3.0).num_p == 3  # the formulas alone
    assert choose_split(5, 2.0, 3.0, TaskParallel(odd).p_group_fits).num_p == 1
    six = TaskParallel(TaskParallel.Options(group_parallel="data", chunks=6))
    assert choose_split(5, 2.0, 3.0, six.p_group_fits).num_p == 3
    assert choose_split(5, 1.0, 3.0, six.p_group_fits).num_p == 3  # 4 does not divide 6
    per_worker = TaskParallel(TaskParallel.Options(group_parallel="data", chunks=8,
                                                    subgraphs=3))
    assert choose_split(5, 1.0, 3.0, per_worker.p_group_fits).num_p == 2  # 4 x 2 < 3


def test_wider_features_move_work_to_the_t_group():
    """T time grows with the input width, P time with the degree (§5.2)."""
    machine = Machine(flops=1e10, bandwidth=1e10)
    narrow = build_model("gcn", 8, 64, 4, decoupled=True, num_props=2)
    wide = build_model("gcn", 4096, 64, 4, decoupled=True, num_props=2)
    t_n, p_n = predict_times(narrow, 10_000, 50_000, machine, 0.5)
    t_w, p_w = predict_times(wide, 10_000, 50_000, machine, 0.5)
    assert p_n == pytest.approx(p_w) and t_w > 100 * t_n
    _, p_dense = predict_times(narrow, 10_000, 5_000_000, machine, 0.5)
    assert p_dense > 50 * p_n
    assert choose_split(8, t_w, p_w).num_t > choose_split(8, t_n, p_dense).num_t


# ---------------------------------------------------------------- T/P hand-offs in pieces
PIECE_CASES = {2: [("gcn", False, "1:1", 2), ("sage", False, "1:1", 3), ("gin", False, "1:1", 2),
                   ("tagcn", True, "1:1", 3), ("gin:bn", False, "1:1", 2),
                   ("gcn", True, "1:1", 40)],
               3: [("gcn", False, "2:1", 3), ("sage", True, "1:2", 2), ("gin", False, "1:2", 3),
                   ("tagcn", False, "2:1", 2)]}


def check_pieces(comm, cases):
    """``--task-pieces K``: every model, coupled and decoupled, matches the single
    process in float64 (the sums of a P stage are taken per source piece, so equal up
    to float order); a run followed by a fixed-weight P stage hands off K times per
    hand-off, the others once; K may exceed a worker's rows (empty pieces)."""
    dataset = make_dataset()
    for name, decoupled, split, pieces in cases:
        model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), ref_model = (*run_epochs(SingleProcess(), dataset, model,
                                                           None)[:2], model)
        model = make_model(name, decoupled, 9, 3)
        strategy = TaskParallel(TaskParallel.Options(split=split, pieces=pieces))
        comm.counter.reset()
        losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
        where = f"{name} decoupled={decoupled} split={split} K={pieces} rank {comm.rank}"
        assert plan.pieces is not None and plan.pieces.count == pieces, where
        assert (plan.pieces.graphs is not None) == (comm.rank in plan.split.p_ranks), where
        assert f"in {pieces} row pieces" in "\n".join(strategy.describe(model, plan)), where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")
        calls = comm.counter.snapshot()["rows-to-cols"]["calls"]
        # GCN, SAGE, GIN: each of the 2 layers' T runs hands off in pieces, in each of
        # 3 training steps; batch norm's runs take the whole path (GAT, whose
        # attention-weighted P stages would all take it, is refused: the test below)
        if name in ("gcn", "sage", "gin") and not decoupled:
            assert calls == 3 * 2 * pieces, (where, calls)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_task_pieces_match_single(tmp_path, world_size):
    run_ranks(check_pieces, world_size, tmp_path, PIECE_CASES[world_size])


def test_task_pieces_refuse_what_they_do_not_combine_with():
    for extra, flag in (({"subgraphs": 2}, "--subgraphs"), ({"chunks": 2}, "--chunks"),
                        ({"device_memory": "1MB"}, "--task-device-memory"),
                        ({"recompute": True}, "--recompute"),
                        ({"group_parallel": "data"}, "--group-parallel data")):
        with pytest.raises(ValueError, match=flag):
            TaskParallel.Options(pieces=2, **extra)
    with pytest.raises(ValueError, match="task-pieces must be >= 1"):
        TaskParallel.Options(pieces=0)
    with pytest.raises(ValueError, match="--task-pieces 100 is more than"):
        TaskParallel(TaskParallel.Options(pieces=100)).check_sizes(67)


def test_pieces_are_refused_where_no_hand_off_could_go_in_pieces():
    """GAT's propagations weigh edges by attention, which needs every row first: its
    runs all went whole while the header said 'hand-offs in 3 row pieces' and the P
    workers built the pieces' graphs."""
    from fullgraph.parallel.taskpieces import piecewise_runs

    gcn, gat = make_model("gcn", False, 6, 3), make_model("gat", False, 6, 3)
    assert piecewise_runs(gcn) and not piecewise_runs(gat)
    assert not piecewise_runs(make_model("gat", True, 6, 3))  # decoupled too
    TaskParallel(TaskParallel.Options(pieces=3)).check_launch(gcn, 40, 3)
    with pytest.raises(ValueError, match="--task-pieces 3: no T stages of this model hand "
                       "off to a propagation that can start on a piece"):
        TaskParallel(TaskParallel.Options(pieces=3)).check_launch(gat, 40, 3)


def test_chunks_without_subgraphs_are_named_unused():
    assert "--chunks 4 has no effect without --subgraphs 2" in " ".join(
        TaskParallel(TaskParallel.Options(chunks=4)).unused_options())
    assert TaskParallel(TaskParallel.Options(chunks=4, subgraphs=2)).unused_options() == []
