"""Task parallelism reproduces the single-process executor (float64), moves the
hand-computed bytes between its groups, and refuses impossible splits.

The T group (ranks 0..N_t-1) runs T and E stages on row blocks, the P group the P
stages on column slices of every vertex. World sizes 2-5, the four models coupled and
decoupled, the split from the scheduling model or given, with and without the
subgraph pipeline, with and without recomputation: every value of every axis
appears (a rotation, not the product).
"""
from __future__ import annotations

import pytest
import torch
from cases import MODELS, make_dataset, make_model, run_epochs
from harness import run_ranks

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import single_comm
from fullgraph.models import build_model
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


# TAGCN on 2 and 3 workers: decoupled (pipelined, recomputed) and coupled
TAGCN = {2: [("tagcn", True, "1:1", 3, True)], 3: [("tagcn:agg_first", False, "auto", 1, False)]}


def cases_for(world: int) -> list[tuple[str, bool, str, int, bool]]:
    """Half of the model x coupled/decoupled combinations on each world size (2 and 3
    together run all eight, and so do 4 and 5); splits and subgraph counts rotate, so
    every split of every world size, S in {1, 3} and recomputation on and off appear.
    TAGCN once each on 2 and 3."""
    splits = SPLITS[world]
    combos = [(m, d) for m in MODELS for d in (False, True)]
    half = combos[world % 2::2]
    return [(name, decoupled, splits[i % len(splits)], 1 + 2 * ((i + world // 2) % 2),
             (i + world) % 2 == 1) for i, (name, decoupled) in enumerate(half)
            ] + TAGCN.get(world, [])


def check_task(comm, cases):
    dataset = make_dataset()
    refs = {}
    for name, decoupled, split, subgraphs, recompute in cases:
        if (name, decoupled) not in refs:
            model = make_model(name, decoupled, 9, 3)
            losses, (out, _), _ = run_epochs(SingleProcess(), dataset, model, None)
            refs[name, decoupled] = (losses, out, model)
        ref_losses, ref_out, ref_model = refs[name, decoupled]
        model = make_model(name, decoupled, 9, 3)
        strategy = TaskParallel(TaskParallel.Options(split=split, subgraphs=subgraphs,
                                                     recompute=recompute))
        losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
        where = (f"{name} decoupled={decoupled} split={split} S={subgraphs} "
                 f"recompute={recompute} rank {comm.rank}/{comm.world_size}")
        assert plan.recompute == recompute, where
        if split != "auto":
            assert f"{plan.split.num_t}:{plan.split.num_p}" == split, where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")
        # every vertex's output is on exactly one rank
        counts = torch.tensor([gids.numel()], dtype=torch.int64)
        prim.all_reduce_(counts, comm, "test")
        assert int(counts) == 67, where


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
        model = build_model("gcn", 9, 5, 3, decoupled=decoupled, num_props=2).to(torch.float64)
        strategy = TaskParallel(TaskParallel.Options(split=split))
        plan = strategy.setup(dataset, model, torch.device("cpu"), comm, dtype=torch.float64)
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


@pytest.mark.dist
@pytest.mark.parametrize("world_size,split", [(2, "1:1"), (3, "1:2")])
def test_handoff_bytes(tmp_path, world_size, split):
    run_ranks(check_handoff_bytes, world_size, tmp_path, split)


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
        TaskParallel().setup(make_dataset(), model, torch.device("cpu"), single_comm())


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
