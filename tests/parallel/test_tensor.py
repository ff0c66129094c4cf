"""Tensor parallelism reproduces the single-process executor (float64).

Coupled programs run as naive tensor parallelism (split / gather around every P),
decoupled ones as decoupled tensor parallelism (one split, K propagations, one
gather); both must equal the single-process executor of the same program. The
vertex count (67) and the widths (9 features, 5 hidden, 3 classes) are not
divisible by the world sizes.
"""
from __future__ import annotations

import pytest
import torch
from adjust_checks import SHARE_CASES, check_shares, reference
from cases import MODELS, assert_same_run, make_dataset, make_model, run_epochs
from devices import TEST_DEVICE, cpu_only
from harness import run_ranks

from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel


def check_tensor(comm, cases):
    dataset = make_dataset()
    for name, decoupled in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        losses, (out, gids), _ = run_epochs(TensorParallel(), dataset, model, comm)
        where = f"{name} decoupled={decoupled} rank {comm.rank}/{comm.world_size}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        for (k, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


CASES = [(m, d) for m in MODELS for d in (False, True)]
# TAGCN (a split and a gather around each of its K hops), both layer orders
TAGCN = {2: [("tagcn", False)], 3: [("tagcn:agg_first", False)]}


def check_world(comm, cases, share_cases, share_refs):
    check_tensor(comm, cases)
    if share_cases:
        check_shares(comm, share_cases, share_refs)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_tensor_parallel_matches_single(tmp_path, world_size):
    """Exactness for every model and form; on 2 and 3 workers also speed-proportional
    shares switched between epochs (``adjust_checks.check_shares``)."""
    share_cases = SHARE_CASES.get(world_size, [])
    share_refs = {(n, d): reference(n, d) for n, d, _, _ in share_cases}
    run_ranks(check_world, world_size, tmp_path, CASES + TAGCN.get(world_size, []),
              share_cases, share_refs)


def check_rounds(comm):
    """Decoupled, no E stage: 4 collective rounds of vertex data per epoch, any L and K."""
    dataset = make_dataset()
    for layers, props in ((1, 1), (2, 2), (3, 5)):
        torch.manual_seed(0)
        from fullgraph.models import build_model

        model = build_model("gcn", 9, 5, 3, num_layers=layers, decoupled=True,
                            num_props=props).to(TEST_DEVICE)
        strategy = TensorParallel()
        plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
        comm.counter.reset()
        result = strategy.forward(model, plan, training=True, seed=1)
        strategy.loss(result, plan).backward()
        snap = comm.counter.snapshot()
        rounds = {k: v["calls"] for k, v in snap.items()}
        assert rounds == {"rows-to-cols": 1, "cols-to-rows": 1, "rows-to-cols-grad": 1,
                          "cols-to-rows-grad": 1}, (layers, props, rounds)
    # GAT's attention adds, once: the halo of source rows for the coefficients of
    # owned destinations and the all-gather that shares them, each with its backward
    torch.manual_seed(0)
    from fullgraph.models import build_model

    model = build_model("gat", 9, 5, 3, num_layers=2, decoupled=True, num_props=3)
    model = model.to(TEST_DEVICE)
    strategy = TensorParallel()
    plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
    comm.counter.reset()
    strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
    rounds = {k: v["calls"] for k, v in comm.counter.snapshot().items()}
    assert rounds == {"rows-to-cols": 1, "cols-to-rows": 1, "rows-to-cols-grad": 1,
                      "cols-to-rows-grad": 1, "edge-halo": 1, "edge-halo-grad": 1,
                      "edge-share": 1, "edge-share-grad": 1}, rounds


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_decoupled_uses_four_rounds(tmp_path, world_size):
    run_ranks(check_rounds, world_size, tmp_path)


BUDGET = 3000  # bytes: the whole graph at 5 columns needs several times more
ALL_OPTIONS = [TensorParallel.Options(num_chunks=4),
               TensorParallel.Options(device_memory=str(BUDGET)),
               TensorParallel.Options(column_split="even"),
               TensorParallel.Options(pipeline=True),
               TensorParallel.Options(pipeline=True, device_memory=str(BUDGET)),
               TensorParallel.Options(pipeline=True, column_split="even")]
# on 1 and 3 workers each case with two variants, so
# every variant meets coupled and decoupled models; chunks with a budget and
# pipelining on 2, and alternately with and without a budget on 4
OPTIONS = {1: lambda i: [ALL_OPTIONS[i % 6], ALL_OPTIONS[(i + 1) % 6]],
           2: lambda i: ALL_OPTIONS[4:5],
           3: lambda i: [ALL_OPTIONS[i % 6], ALL_OPTIONS[(i + 3) % 6]],
           4: lambda i: [ALL_OPTIONS[4 + i % 2]]}


def check_chunked(comm, cases):
    """Chunked propagation (a chunk count, or a budget far below the graph's footprint),
    with and without pipelining, gives the same numbers, and the accounted device peak
    stays under the budget."""
    dataset = make_dataset()
    budget = BUDGET
    for i, (name, decoupled) in enumerate(cases):
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        for opts in OPTIONS[comm.world_size](i):
            model = make_model(name, decoupled, 9, 3)
            losses, (out, gids), plan = run_epochs(TensorParallel(opts), dataset, model, comm)
            where = f"{name} decoupled={decoupled} {opts} rank {comm.rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
            torch.testing.assert_close(out, ref_out[gids], msg=where)
            if opts.device_memory:
                assert len(plan.chunks) > 1, where
                assert 0 < plan.account.peak <= budget, (where, plan.account.peak)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chunked_tensor_parallel(tmp_path, world_size):
    run_ranks(check_chunked, world_size, tmp_path, CASES)


def check_pipeline_bytes(comm):
    """Pipelined pieces move exactly the bytes of the whole split and gather: every
    vertex is split once (first-read de-duplication), every row gathered once."""
    dataset = make_dataset()
    from fullgraph.models import build_model

    totals = []
    for opts in (TensorParallel.Options(), TensorParallel.Options(pipeline=True, num_chunks=5)):
        torch.manual_seed(0)
        model = build_model("gcn", 9, 5, 3, decoupled=True, num_props=2).to(TEST_DEVICE)
        strategy = TensorParallel(opts)
        plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
        comm.counter.reset()
        strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
        snap = comm.counter.snapshot()
        totals.append({k: (v["sent"], v["recv"]) for k, v in snap.items()})
        calls = {k: v["calls"] for k, v in snap.items()}
        if opts.pipeline:  # one piece per chunk in each direction
            assert all(calls[k] == 5 for k in ("rows-to-cols", "cols-to-rows",
                                               "rows-to-cols-grad", "cols-to-rows-grad")), calls
    assert totals[0] == totals[1], totals


@pytest.mark.dist
def test_pipeline_moves_the_same_bytes(tmp_path):
    run_ranks(check_pipeline_bytes, 3, tmp_path)


def check_balance(comm):
    """NeutronTP Fig. 10 in small: on an R-MAT graph tensor parallelism's per-rank work
    (edges x columns) and bytes are within 2%, where data parallelism over contiguous
    chunks is far off (measured here, both with the same program)."""
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.graph.synthetic import rmat
    from fullgraph.models import build_model
    from fullgraph.parallel.data import DataParallel
    from fullgraph.partition import PartitionOptions

    dataset = rmat(3001, 40_000, num_features=60, num_classes=11, symmetrize=True, seed=3)
    results = {}
    for label, strategy, decoupled in (
            ("dp-chunk", DataParallel(partition=PartitionOptions(method="chunk")), False),
            ("tp", TensorParallel(), False), ("tp-decoupled", TensorParallel(), True)):
        torch.manual_seed(0)
        model = build_model("gcn", 60, 32, 11, decoupled=decoupled).to(TEST_DEVICE)
        plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
        comm.counter.reset()
        opt = torch.optim.Adam(model.parameters())
        strategy.train_step(model, plan, opt, seed=1)
        snap = comm.counter.snapshot()
        moved = sum(v["sent"] + v["recv"] for k, v in snap.items()
                    if k not in ("metrics", "setup", "wait"))
        gathered = all_gather_object((strategy.work(model, plan).edge_dims, moved), comm, "test")
        work = [w for w, _ in gathered]
        nbytes = [b for _, b in gathered]
        results[label] = (max(work) / min(work), max(nbytes) / min(nbytes))
    for label in ("tp", "tp-decoupled"):
        assert results[label][0] <= 1.02 and results[label][1] <= 1.02, results
    assert results["dp-chunk"][0] > 1.5, results  # the imbalance TP removes


@pytest.mark.dist
def test_tensor_parallel_balances_work_and_bytes(tmp_path):
    run_ranks(check_balance, 4, tmp_path)


def check_chunk_exchange_balance(comm):
    """NeutronTP Algorithm 1 line 2: every chunk spreads its rows over all workers, so
    each per-chunk gather (and its backward) is a balanced all-to-all: every rank
    receives near-equal rows in every call, never one rank all of a chunk."""
    import fullgraph.comm.halo as halo
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.graph.synthetic import rmat
    from fullgraph.models import build_model

    dataset = rmat(1003, 12_000, num_features=12, num_classes=5, symmetrize=True, seed=4)
    calls: list[tuple[str, int]] = []
    start = halo.all_to_all_v_start  # what the pipeline's block exchanges call

    def recording(send, recv_numel, comm_, phase):
        calls.append((phase, sum(recv_numel)))
        return start(send, recv_numel, comm_, phase)

    halo.all_to_all_v_start = recording
    try:
        for opts in (TensorParallel.Options(pipeline=True, num_chunks=4),
                     TensorParallel.Options(pipeline=True, device_memory="60KB")):
            calls.clear()
            torch.manual_seed(0)
            model = build_model("gcn", 12, 8, 5, decoupled=True, num_props=2).to(TEST_DEVICE)
            strategy = TensorParallel(opts)
            plan = strategy.setup(dataset, model, TEST_DEVICE, comm)
            strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
            everyone = all_gather_object(list(calls), comm, "test")
            for phase in ("cols-to-rows", "cols-to-rows-grad"):
                per_call = [[n for p, n in rank_calls if p == phase] for rank_calls in everyone]
                assert len(per_call[0]) == len(plan.chunks) > 1, (opts, per_call)
                for received in zip(*per_call):  # one collective, every rank's share
                    assert min(received) > 0, (opts, phase, per_call)
                    assert max(received) / min(received) <= 1.1, (opts, phase, per_call)
    finally:
        halo.all_to_all_v_start = start


@pytest.mark.dist
def test_chunk_exchanges_are_balanced(tmp_path):
    run_ranks(check_chunk_exchange_balance, 4, tmp_path)


def test_device_memory_states_what_stays_resident():
    """With --device-memory the topology and edge weights stay in host memory and only
    chunks stream through the device; what else the device holds (the transform
    stages' rows when they run there) is counted by name, the graph never."""
    from fullgraph.comm.group import single_comm
    from fullgraph.models import build_model

    dataset = make_dataset()
    torch.manual_seed(0)
    model = build_model("gat", 9, 5, 3, decoupled=True, num_props=2)
    model = model.to(TEST_DEVICE, torch.float64)
    strategy = TensorParallel(TensorParallel.Options(device_memory=str(BUDGET)))
    plan = strategy.setup(dataset, model, TEST_DEVICE, single_comm(), torch.float64)
    account = plan.account
    assert plan.graph.indptr.device.type == "cpu"
    assert set(account.resident) == {"feature rows", "parameters and gradients",
                                     "activations (estimate)", "edge block"}
    assert account.resident["feature rows"] == 67 * 9 * 8
    params = sum(p.numel() for p in model.parameters()) * 8
    assert account.resident["parameters and gradients"] == 2 * params
    strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan).backward()
    assert 0 < account.peak <= BUDGET  # the streamed working set keeps to the budget
    assert account.device_peak == account.peak + sum(account.resident.values())
    line = "\n".join(strategy.describe(model, plan))
    assert "streamed from host memory" in line and "feature rows 4824 B" in line


def check_row_blocks(comm, cases):
    """Dense stages run 10 rows at a time and recomputed in the backward give the
    single-process numbers; the features stay the dataset's own rows (a view in their
    stored float32, converted to float64 block by block)."""
    dataset = make_dataset()
    for name, decoupled in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        opts = TensorParallel.Options(row_block=10)
        losses, (out, gids), plan = run_epochs(TensorParallel(opts), dataset, model, comm)
        where = f"{name} decoupled={decoupled} rank {comm.rank}/{comm.world_size}"
        assert plan.features.dtype == torch.float32 and plan.row_dtype == torch.float64
        assert plan.features.untyped_storage().data_ptr() == \
            dataset.data.features.untyped_storage().data_ptr(), where
        assert_same_run((losses, out, gids, model), (ref_losses, ref_out, ref_model), where)


@pytest.mark.dist
@cpu_only("row blocks read host (memory-mapped) features; on a GPU the rows live there")
@pytest.mark.parametrize("world_size", [1, 3])
def test_row_blocks_match_single(tmp_path, world_size):
    run_ranks(check_row_blocks, world_size, tmp_path, CASES + [("gin:bn", False)])


@cpu_only("row blocks read host (memory-mapped) features; on a GPU the rows live there")
@pytest.mark.parametrize("name", ["sage", "gcn"])
def test_a_run_in_one_row_block_is_recomputed_as_it_ran(name):
    """Rows that fit one block are recomputed whole (``recomputed_transform_run``):
    SAGE's root weight reads the dropout output made before the run, whose record the
    recomputation's copy of it must carry too (it crashed in the backward)."""
    from adjust_checks import config, dataset

    from fullgraph.comm.group import single_comm
    from fullgraph.train import train

    ref_losses, ref_params = reference(name)
    got = train(dataset(), config(name, "tensor"), comm=single_comm(), dtype=torch.float64,
                strategy=TensorParallel(TensorParallel.Options(row_block=1000)))
    torch.testing.assert_close(torch.tensor([r.loss for r in got.epochs]),
                               torch.tensor(ref_losses))
    for k, p in got.model.named_parameters():
        torch.testing.assert_close(p, ref_params[k], msg=k)


def test_row_blocks_hold_no_hidden_rows():
    """A blocked decoupled MLP keeps no (N, hidden) tensor for its backward: what
    autograd saves is the input rows and the parameters, however wide the hidden layer."""
    from fullgraph.models import build_model

    dataset = make_dataset()
    torch.manual_seed(0)
    model = build_model("gcn", 9, 64, 3, decoupled=True, num_props=2).to(TEST_DEVICE)
    strategy = TensorParallel(TensorParallel.Options(row_block=16))
    plan = strategy.setup(dataset, model, TEST_DEVICE, None)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t,
                                                  lambda t: t):
        loss = strategy.loss(strategy.forward(model, plan, training=True, seed=1), plan)
    loss.backward()
    assert not [s for s in saved if len(s) == 2 and s[1] == 64 and s[0] > 16], saved
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("opts, why", [
    (dict(num_chunks=3), "on cpu"),
    (dict(), "without chunks"),
    (dict(pipeline=True, num_chunks=3), "with --pipeline")])
def test_prefetch_where_it_cannot_apply_warns_and_is_off(opts, why):
    """``prefetch`` copies chunks to a GPU: on the CPU, without chunks or with the
    pipeline it says it has no effect, and the plan does not prefetch."""
    dataset = make_dataset()
    model = make_model("gcn", False, 9, 3).cpu()
    strategy = TensorParallel(TensorParallel.Options(prefetch=True, **opts))
    with pytest.warns(UserWarning, match=f"prefetch has no effect {why}"):
        plan = strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
    assert plan.prefetch is False


def test_backward_reads_the_plans_edge_weights_in_the_transposes_order():
    """The SpMM gets the plan's own weight tensor, so from the second backward pass on
    ``Transposed.weights_in_order`` finds it and reads a copy in the transpose's order
    (a reshaped view, new every pass, was never found)."""
    dataset = make_dataset()
    model = make_model("gcn", True, 9, 3).cpu()
    strategy = TensorParallel(TensorParallel.Options())
    plan = strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
    for seed in (1, 2):
        strategy.loss(strategy.forward(model, plan, training=True, seed=seed), plan).backward()
    ordered = [entry[2] for entry in plan.graph.transpose()._ordered]
    assert ordered and ordered[0] is not None


def check_more_chunks_than_rows(comm):
    dataset = make_dataset()  # 67 vertices
    model = make_model("gcn", True, 9, 3)
    with pytest.warns(UserWarning, match="num_chunks 1000: a chunk holds at least one row"):
        _, _, plan = run_epochs(TensorParallel(TensorParallel.Options(num_chunks=1000)),
                                dataset, model, comm)
    assert len(plan.chunks) == 67


@pytest.mark.dist
def test_more_chunks_than_rows_warn_with_the_count_cut(tmp_path):
    run_ranks(check_more_chunks_than_rows, 1, tmp_path)


def test_a_chunk_count_and_a_budget_are_not_both_taken():
    with pytest.raises(ValueError, match="give device_memory or num_chunks, not both"):
        TensorParallel.Options(device_memory="1MB", num_chunks=4)
