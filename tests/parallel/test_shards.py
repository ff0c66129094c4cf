"""Per-part shards (``fullgraph partition --shards``): what each part holds, and
training on the parts (data parallel, p2p, tensor, task) equals the single-process run on
the whole dataset (float64, dropout on), each worker reading only its own part."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cases import MODELS, assert_same_run, make_dataset, make_model, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks
from test_data import EDGE_COST, VERTEX_COST, check_mixed, mixed_byte_cost

from fullgraph.checkpoint import dataset_fingerprint
from fullgraph.errors import ConfigError
from fullgraph.graph.sparse import to_sparse
from fullgraph.graph.store import load_shard as load_part
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.p2p import P2PParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel
from fullgraph.partition import PartitionBook, PartitionOptions, partition
from fullgraph.partition.shards import check_use, closure, write_shards


def _write(tmp_path, world: int, hops: int, method: str = "metis", dataset=None):
    dataset = dataset or make_dataset()
    book = partition(dataset.graph, world, method, seed=0)
    book.save(tmp_path / "book.npz")
    write_shards(dataset, book, tmp_path / "shards", hops, dataset_fingerprint(dataset), method)
    return dataset, book


@pytest.mark.parametrize("hops", [0, 1, 2])
def test_a_part_holds_its_rows_in_edges_and_replicated_halo(tmp_path, hops):
    dataset, book = _write(tmp_path, 3, hops, "random")
    graph = dataset.graph
    src, dst = graph.edges()
    held_rows = []
    for p in range(3):
        part = load_part(tmp_path / "shards", p)
        sh = part.shard
        owned = book.part_to_gids(p).numpy()
        levels = closure(graph, owned, hops)
        rows = part.data.row_ids.numpy()
        np.testing.assert_array_equal(rows, np.flatnonzero(levels[-1]))
        assert set(owned) <= set(rows)
        # the in-edges of exactly C_(h-1) (C_0 for h = 0), with global ids, CSR order
        edge_rows = np.flatnonzero(levels[max(hops - 1, 0)])
        np.testing.assert_array_equal(sh.edge_rows.numpy(), edge_rows)
        keep = torch.from_numpy(np.isin(dst.numpy(), edge_rows))
        psrc, pdst = part.graph.edges()
        torch.testing.assert_close(psrc, src[keep])
        torch.testing.assert_close(pdst, dst[keep])
        torch.testing.assert_close(part.data.features, dataset.data.features[rows])
        # the small per-vertex arrays of the whole graph
        torch.testing.assert_close(sh.part_of, book.part_of)
        torch.testing.assert_close(part.data.labels, dataset.data.labels)
        assert (sh.part, sh.parts, sh.hops, sh.num_edges) == (p, 3, hops, graph.num_edges)
        loops = torch.bincount(dst[src == dst], minlength=graph.num_nodes)
        torch.testing.assert_close(sh.in_degree, graph.in_degrees() - loops)
        held_rows.append(rows.size)
    if hops == 0:  # no replication: the parts hold each row once
        assert sum(held_rows) == graph.num_nodes
    else:  # replicated rows: some in more than one part
        assert sum(held_rows) > graph.num_nodes


def test_a_shard_refuses_rows_it_does_not_hold(tmp_path):
    _write(tmp_path, 2, 0)
    part = load_part(tmp_path / "shards", 0)
    other = torch.nonzero(part.shard.part_of == 1).flatten()[:3]
    with pytest.raises(ValueError, match="holds the feature rows of .* not those of 3"):
        part.data.take_features(other)
    with pytest.raises(ValueError, match="lacks the in-edges of 3 vertices.*--shard-hops"):
        part.shard.check_edge_rows(other, "here")


def test_row_normalisation_of_a_shard_equals_the_whole(tmp_path):
    """The shift by the least feature value is the whole dataset's, not the part's."""
    dataset = make_dataset()
    x = dataset.data.features.clone()
    x[5, 2] = -4.0  # the least value, in one row only
    dataset.data = dataclasses.replace(dataset.data, features=x)
    _, book = _write(tmp_path, 2, 0, "chunk", dataset)
    whole = dataset.data.row_normalized()
    for p in range(2):
        part = load_part(tmp_path / "shards", p)
        got = part.data.row_normalized(part.shard.feature_min)
        torch.testing.assert_close(got.features, whole.features[part.data.row_ids])


def test_sparse_features_are_sharded_as_csr(tmp_path):
    dataset = make_dataset()
    x = dataset.data.features * (dataset.data.features > 0.8)
    dataset.data = dataclasses.replace(dataset.data, features=to_sparse(x))
    _write(tmp_path, 2, 1, "chunk", dataset)
    part = load_part(tmp_path / "shards", 1)
    assert part.data.features.layout == torch.sparse_csr
    torch.testing.assert_close(part.data.features.to_dense(), x[part.data.row_ids])


def test_a_checkpoint_fingerprint_belongs_to_the_whole_dataset(tmp_path):
    """Every part of every shard set of one dataset has the same fingerprint (resume
    moves between part counts); it differs from the unsharded one's and notes row
    normalisation."""
    dataset = make_dataset()
    for parts in (2, 3):
        write_shards(dataset, partition(dataset.graph, parts, "chunk"), tmp_path / f"s{parts}",
                     parts - 2, dataset_fingerprint(dataset))
    prints = [dataset_fingerprint(load_part(tmp_path / f"s{n}", p))
              for n in (2, 3) for p in range(n)]
    assert all(f == prints[0] for f in prints)
    whole = dataset_fingerprint(dataset)
    assert prints[0] == {**whole, "sharded": True, "feature values":
                         f"{whole['feature values']} as written, held as float32"}
    part = load_part(tmp_path / "s2", 0)
    part.shard.normalized = True
    assert dataset_fingerprint(part)["feature values"].endswith("row-normalised")


def test_shards_are_refused_where_they_cannot_train(tmp_path):
    _write(tmp_path, 2, 0)
    part = load_part(tmp_path / "shards", 0)
    with pytest.raises(ConfigError, match="'single' cannot train on per-part shards"):
        check_use(part, "single", 2)
    with pytest.raises(ConfigError, match="use --workers 2"):
        check_use(part, "data", 3)
    check_use(part, "data", 2)
    check_use(part, "p2p", 2)
    check_use(part, "tensor", 2)
    check_use(part, "task", 2)
    with pytest.raises(ConfigError, match="has no part 2; train it with --workers 2"):
        load_part(tmp_path / "shards", 2)
    with pytest.raises(ConfigError, match="already a shard"):
        write_shards(part, None, tmp_path / "again", 0, {})  # type: ignore[arg-type]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    dataset = make_dataset()
    with pytest.raises(ConfigError, match="exists and is not a shard set"):
        write_shards(dataset, partition(dataset.graph, 2, "chunk"), tmp_path / "taken", 0, {})
    assert (tmp_path / "taken" / "x").read_text() == "mine"


def test_an_empty_part_and_a_split_seed_mismatch(tmp_path):
    """A part with no vertex of its own loads and gives no rows; shards are tied to the
    split they were written with."""
    dataset = make_dataset()
    part_of = torch.zeros(dataset.graph.num_nodes, dtype=torch.int64)
    part_of[::2] = 1  # part 2 of 3 gets nothing
    book = PartitionBook.from_assignment(part_of, 3)
    write_shards(dataset, book, tmp_path / "s", 0, dataset_fingerprint(dataset))
    empty = load_part(tmp_path / "s", 2)
    assert empty.data.features.shape[0] == 0 and empty.graph.num_edges == 0
    assert empty.data.take_features(torch.zeros(0, dtype=torch.int64)).shape == (0, 9)
    with pytest.raises(ConfigError, match="hold the split of seed 0"):
        load_part(tmp_path / "s", 0, split_seed=1)
    # a host copied other parts than its ranks read: named as such, not as a damaged part
    shutil.rmtree(tmp_path / "s" / "part-0")
    with pytest.raises(ConfigError, match="this host holds part-1, part-2, not part-0, "
                                          "which worker rank 0 reads"):
        load_part(tmp_path / "s", 0)


@pytest.mark.parametrize("flags", [["--dep-mode", "depcache"], ["--adapt", "adjust"]])
def test_too_few_hops_are_refused_before_training(tmp_path, flags):
    from fullgraph.cli import build_parser, config_from_args
    from fullgraph.train import build, check_shard_hops

    _write(tmp_path, 2, 1)
    part = load_part(tmp_path / "shards", 0)
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--strategy", "data", "--workers", "2", *flags]))
    with pytest.raises(ConfigError, match=r"written with 1 hops.*\(this model propagates 2 "
                       r"times: --shard-hops 2 holds every row a replicating plan reads\)"):
        check_shard_hops(cfg, part, build(part, cfg))
    cfg = config_from_args(build_parser().parse_args(["train", "--strategy", "data"]))
    check_shard_hops(cfg, part, build(part, cfg))  # DepComm needs no replicas


def test_tensor_with_adapt_is_refused_on_shards(tmp_path):
    from fullgraph.cli import build_parser, config_from_args
    from fullgraph.train import check_before_launch

    _write(tmp_path, 2, 0)
    part = load_part(tmp_path / "shards", 0)
    args = ["train", "--strategy", "tensor", "--workers", "2"]
    cfg = config_from_args(build_parser().parse_args(args + ["--adapt", "adjust"]))
    with pytest.raises(ConfigError, match="adapt.mode: --adapt adjust with --strategy tensor"):
        check_before_launch(cfg, part, 2)
    check_before_launch(config_from_args(build_parser().parse_args(args)), part, 2)
    with pytest.warns(UserWarning, match="--partitioner has no effect on per-part shards"):
        check_before_launch(config_from_args(build_parser().parse_args(
            args + ["--partitioner", "random"])), part, 2)


# ---------------------------------------------------------------- exactness
def _cases(world: int) -> list[tuple[str, bool, str]]:
    """Every model and mode on 3 workers (coupled), the decoupled forms on 2."""
    modes = ["depcomm", "depcache", "hybrid"]
    if world == 3:
        return [(m, False, modes[i % 3]) for i, m in enumerate(MODELS)] + \
            [("gcn", False, "depcache"), ("gat", False, "hybrid")]
    return [(m, True, modes[(i + 1) % 3]) for i, m in enumerate(MODELS)]


def own_part(comm, tmp: str):
    """Copy the manifest and this rank's part only to a directory of its own (a host
    without shared storage) and load the part from there."""
    import shutil

    host = Path(tmp) / f"host{comm.rank}"
    host.mkdir()
    shutil.copy(Path(tmp) / "shards" / "shards.json", host)
    shutil.copytree(Path(tmp) / "shards" / f"part-{comm.rank}", host / f"part-{comm.rank}")
    return load_part(host, comm.rank)


def check_exact_on_shards(comm, tmp: str):
    """Data parallelism, each rank holding only its own part (``own_part``)."""
    whole, mine = make_dataset(), own_part(comm, tmp)
    # only its part: the in-edges of its rows and their neighbours (on this small graph
    # the 2-hop halo of a part of two can hold every feature row)
    assert mine.graph.num_edges < whole.graph.num_edges
    for name, decoupled, mode in _cases(comm.world_size):
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), whole, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        opts = DataParallel.Options(mode=mode)
        if mode == "hybrid":  # a real mix, from the costs of the whole graph
            byte_cost = mixed_byte_cost(whole, model, comm, "metis")
            opts = DataParallel.Options(mode=mode, byte_cost=byte_cost, edge_cost=EDGE_COST,
                                        vertex_cost=VERTEX_COST)
        strategy = DataParallel(opts, PartitionOptions(method="metis"))
        losses, (out, gids), plan = run_epochs(strategy, mine, model, comm)
        where = f"{name} decoupled={decoupled} {mode} rank {comm.rank}/{comm.world_size}"
        if mode == "hybrid":
            check_mixed(plan, where)
        assert_same_run((losses, out, gids, model), (ref_losses, ref_out, ref_model), where)


def check_too_few_hops(comm, tmp: str):
    mine = load_part(f"{tmp}/shards", comm.rank)
    model = make_model("gcn", False, 9, 3)
    strategy = DataParallel(DataParallel.Options(mode="depcache"),
                            PartitionOptions(method="metis"))
    with pytest.raises(ValueError, match="written with 1 hops and lacks the in-edges"):
        strategy.setup(mine, model, TEST_DEVICE, comm, dtype=torch.float64)
    # DepComm needs no replicated rows: it trains on the same shards
    strategy = DataParallel(DataParallel.Options(mode="depcomm"),
                            PartitionOptions(method="metis"))
    strategy.setup(mine, model, TEST_DEVICE, comm, dtype=torch.float64)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_on_shards_equals_single_process(tmp_path, world):
    # the metis partition of the tests above: computed by rank 0 of a run is the same
    _write(tmp_path, world, 2)
    run_ranks(check_exact_on_shards, world, tmp_path, str(tmp_path))


def check_parts_of_two_partitions(comm, tmp: str):
    """Rank 1 holds its part of another partition of the same dataset (a stale copy on
    one host): the start-up check refuses it on every rank."""
    from fullgraph.train import check_same_data

    check_same_data(load_part(f"{tmp}/shards", comm.rank), comm)  # one partition passes
    mine = load_part(f"{tmp}/{'shards' if comm.rank == 0 else 'other'}", comm.rank)
    with pytest.raises(ConfigError, match=r"the workers loaded different data \(shard "
                                          r"partition: '\w+' on rank\(s\) 0, '\w+' on "
                                          r"rank\(s\) 1\)"):
        check_same_data(mine, comm)


@pytest.mark.dist
def test_parts_of_two_partitions_are_refused(tmp_path):
    dataset, _ = _write(tmp_path, 2, 2)
    other = partition(dataset.graph, 2, "random", seed=0)
    write_shards(dataset, other, tmp_path / "other", 2, dataset_fingerprint(dataset), "random")
    run_ranks(check_parts_of_two_partitions, 2, tmp_path, str(tmp_path))


@pytest.mark.dist
def test_depcache_needs_as_many_hops_as_layers(tmp_path):
    _write(tmp_path, 2, 1)
    run_ranks(check_too_few_hops, 2, tmp_path, str(tmp_path))


def check_partial_on_shards(comm, tmp: str, ref: list[float]):
    """``--adapt adjust+partial`` on shards, with a slack no deadline passes: its halo,
    its gradient reduce and its coverage counts (combined over the parts) as on the
    whole graph, so the run equals the single process."""
    from test_partial import _config, _losses

    from fullgraph.train import train

    cfg = _config("gcn", 8, slack=1e6, staleness=2)
    cfg = dataclasses.replace(cfg, options={**cfg.options,
                                            "partition": PartitionOptions(method="metis")})
    got = _losses(train(own_part(comm, tmp), cfg, comm=comm, dtype=torch.float64))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref))


@pytest.mark.dist
def test_partial_reduce_on_shards_equals_single_process(tmp_path):
    from test_partial import _config, _losses

    from fullgraph.train import train

    _write(tmp_path, 3, 2)
    ref = _losses(train(make_dataset(), _config("gcn", 8, mode="off", strategy="single"),
                        dtype=torch.float64))
    run_ranks(check_partial_on_shards, 3, tmp_path, str(tmp_path), ref)


def against_single(comm, whole, mine, runs) -> list:
    """Train each (label, model name, decoupled, strategy) of ``runs`` on ``mine`` and
    compare with the single process on ``whole``; the plans, in order."""
    plans = []
    for label, name, decoupled, strategy in runs:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), whole, ref_model, None)
        model = make_model(name, decoupled, 9, 3)
        losses, (out, gids), plan = run_epochs(strategy, mine, model, comm)
        where = f"{label} {name} decoupled={decoupled} rank {comm.rank}/{comm.world_size}"
        assert_same_run((losses, out, gids, model), (ref_losses, ref_out, ref_model), where)
        plans.append((plan, model))
    return plans


def check_p2p_on_shards(comm, tmp: str):
    """P2P (G3) on per-part shards without replicas: each rank holds its own part
    only, builds its bins from its own in-edges, and trains as the single process."""
    whole, mine = make_dataset(), own_part(comm, tmp)
    assert mine.graph.num_edges < whole.graph.num_edges
    cases = [(m, False, "multi-level", 4) for m in MODELS] + [("gat", True, "sequential", 1000)]
    runs = [(f"p2p {schedule} bins of {size}", name, decoupled,
             P2PParallel(P2PParallel.Options(schedule=schedule, bin_size=size)))
            for name, decoupled, schedule, size in cases]
    for (plan, _), (*_, size) in zip(against_single(comm, whole, mine, runs), cases):
        assert plan.phases[1].rounds > 1 or size == 1000


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_p2p_on_shards_equals_single_process(tmp_path, world):
    _write(tmp_path, world, 0, "random")
    run_ranks(check_p2p_on_shards, world, tmp_path, str(tmp_path))


def check_tensor_on_shards(comm, tmp: str):
    """Tensor parallelism on per-part shards: each rank gathers the whole graph from
    the parts' in-edges and its block of feature rows from the parts holding them, and
    trains as the single process (with and without row blocks)."""
    from fullgraph.parallel.assemble import whole_graph

    whole, mine = make_dataset(), own_part(comm, tmp)
    graph = whole_graph(mine, comm)
    torch.testing.assert_close(graph.indptr.to(torch.int64), whole.graph.indptr.to(torch.int64))
    torch.testing.assert_close(graph.indices.to(torch.int64),
                               whole.graph.indices.to(torch.int64))
    cases = [("gcn", False, None), ("gat", False, None), ("sage", True, 7), ("gin:bn", False, 5)]
    runs = [(f"tensor row_block={block}", name, decoupled,
             TensorParallel(TensorParallel.Options(row_block=block)))
            for name, decoupled, block in cases]
    plans = against_single(comm, whole, mine, runs)
    for plan, _ in plans:
        assert plan.source.row_ids is not None  # only its own block of rows
        assert plan.source.features.shape[0] == plan.gids.numel() < whole.graph.num_nodes
    plan, model = plans[-1]
    with pytest.raises(ValueError, match="keeps its row blocks"):
        runs[-1][3].replan(model, plan, [1.0] + [2.0] * (comm.world_size - 1))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_on_shards_equals_single_process(tmp_path, world):
    _write(tmp_path, world, 0, "random")
    run_ranks(check_tensor_on_shards, world, tmp_path, str(tmp_path))


def sparse_dataset():
    """``make_dataset`` with about 80 % of its feature entries zero, as CSR."""
    dataset = make_dataset()
    x = dataset.data.features * (dataset.data.features > 0.8)
    dataset.data = dataclasses.replace(dataset.data, features=to_sparse(x))
    return dataset


def check_tensor_on_sparse_shards(comm, tmp: str):
    mine = own_part(comm, tmp)
    assert mine.data.features.layout == torch.sparse_csr
    ((plan, _),) = against_single(comm, sparse_dataset(), mine,
                                  [("tensor, sparse", "gcn", False, TensorParallel())])
    assert plan.features.layout == torch.sparse_csr


@pytest.mark.dist
def test_tensor_on_sparse_shards_equals_single_process(tmp_path):
    _write(tmp_path, 2, 0, "random", sparse_dataset())
    run_ranks(check_tensor_on_sparse_shards, 2, tmp_path, str(tmp_path))


def check_task_on_shards(comm, tmp: str):
    """Task parallelism on per-part shards: the T workers gather their blocks of
    feature rows, every worker the whole graph, and the run is the single process's."""
    from fullgraph.parallel.task import TaskParallel

    whole, mine = make_dataset(), own_part(comm, tmp)
    runs = [("task", name, False, TaskParallel(TaskParallel.Options(**opts)))
            for name, opts in (("gcn", {}), ("gat", {"group_parallel": "data"}))]
    for plan, _ in against_single(comm, whole, mine, runs):  # its block of rows, or none
        assert plan.features.shape[0] == plan.gids.numel()


@pytest.mark.dist
def test_task_on_shards_equals_single_process(tmp_path):
    _write(tmp_path, 3, 0, "random")
    run_ranks(check_task_on_shards, 3, tmp_path, str(tmp_path))

