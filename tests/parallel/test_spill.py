"""Tensor parallelism with the propagation's matrices in files (``--spill-dir``): the
same numbers as the single process, and no (N, C) matrix of the propagation in memory."""
from __future__ import annotations

import os

import pytest
import torch
from cases import assert_same_run, make_dataset, make_model, run_epochs
from devices import cpu_only
from harness import run_ranks

from fullgraph.graph.csr import Graph
from fullgraph.ops import spmm
from fullgraph.ops.loss import masked_cross_entropy
from fullgraph.ops.spill import Spill, spilled_spmm
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel

# models whose edge weights are fixed (attention is refused with a spill)
SPILL_CASES = [("gcn", True), ("gcn", False), ("sage", True), ("sage", False),
               ("gin", True), ("gin", False), ("tagcn", False)]


def in_file(t: torch.Tensor, directory) -> bool:
    """Whether ``t``'s memory is a mapping of a (deleted) file under ``directory``."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and fields[5].startswith(str(directory))
    return False


def _graph(n: int = 40, e: int = 200, seed: int = 0) -> tuple[Graph, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    graph = Graph.from_edges(src, dst, n)
    return graph, torch.rand(graph.num_edges, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("memory, strides", [(1 << 20, (7, 1)), (8000 * 3, (1, 1000))])
def test_spilled_matrices_are_file_backed_zeros(tmp_path, memory, strides):
    """Row-major when one chunk holds every column, column-major when it takes more
    (chunks of 3 columns here); in a file that is unlinked at once either way."""
    spill = Spill(tmp_path / "rows", memory=memory)
    m = spill.empty(1000, 7, torch.float32)
    assert m.shape == (1000, 7) and m.stride() == strides and not m.any()
    assert in_file(m, tmp_path / "rows")
    m[3] = torch.arange(7.0)
    assert m[3].tolist() == list(range(7)) and float(m.sum()) == 21
    assert os.listdir(tmp_path / "rows") == []  # nothing is left behind
    assert spill.made == 1 and spill.made_bytes == 28000


def test_a_full_disk_is_an_error_naming_the_directory(tmp_path, monkeypatch):
    """The disk space is claimed when the file is made: a mapping that finds no space at
    its first write would end the process by SIGBUS."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(OSError, match="no space left for 28000 bytes of spilled rows") as err:
        Spill(tmp_path / "rows", memory=1 << 20).empty(1000, 7, torch.float32)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "rows")
    assert os.listdir(tmp_path / "rows") == []


@pytest.mark.parametrize("memory", [1, 40 * 8 * 2 * 3, 1 << 20])
def test_spilled_spmm_equals_spmm_forward_and_backward(tmp_path, memory):
    """Column chunks of one, three and all columns give the SpMM's output and its
    gradient, bit for bit (each column goes through the same kernel)."""
    graph, weight = _graph()
    spill = Spill(tmp_path, memory)
    assert len(spill.column_ranges(40, 10, 8)) == {1: 10, 1920: 4, 1 << 20: 1}[memory]
    x = torch.randn(40, 10, dtype=torch.float64, requires_grad=True)
    y = torch.randn(40, 10, dtype=torch.float64)
    ref = spmm(graph, x, weight)
    (ref * y).sum().backward()
    ref_grad, x.grad = x.grad, None
    got = spilled_spmm(graph, x, weight, spill)
    assert in_file(got, tmp_path) and got.is_contiguous() == (memory == 1 << 20)
    (got * y).sum().backward()
    assert torch.equal(got, ref) and torch.equal(x.grad, ref_grad)


def test_spilled_spmm_refuses_learned_weights(tmp_path):
    graph, weight = _graph()
    with pytest.raises(ValueError, match="fixed"):
        spilled_spmm(graph, torch.randn(40, 3), weight.requires_grad_(), Spill(tmp_path, 99))


def test_loss_into_a_given_matrix_equals_the_loss(tmp_path, monkeypatch):
    """With ``grad_into`` the loss runs in row blocks (three here) and keeps its
    gradient in the matrix it was given: the same value and gradient."""
    import fullgraph.ops.loss as loss_mod

    monkeypatch.setattr(loss_mod, "ROWS_PER_BLOCK", 30)
    torch.manual_seed(0)
    logits = torch.randn(80, 5, dtype=torch.float64, requires_grad=True)
    labels, mask = torch.randint(0, 5, (80,)), torch.rand(80) < 0.5
    ref = masked_cross_entropy(logits, labels, mask)
    ref.backward()
    ref_grad, logits.grad = logits.grad, None
    made = []
    spill = Spill(tmp_path, 1 << 20)

    def into(rows, cols, dtype):
        made.append((rows, cols))
        return spill.empty(rows, cols, dtype)

    got = masked_cross_entropy(logits, labels, mask, grad_into=into)
    got.backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(logits.grad, ref_grad)
    assert made == [(80, 5)]


def check_spill(comm, cases, directory):
    """Row blocks of 10 or none, with a spill whose column chunks are a single column
    (column-major matrices) or every column (row-major): the single process's losses,
    outputs and parameters."""
    dataset = make_dataset()
    for name, decoupled in cases:
        ref_model = make_model(name, decoupled, 9, 3)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        one = str(2 * dataset.graph.num_dst * 8)  # one float64 column in, one out
        for row_block, memory in ((10, one), (None, one), (10, "1GB")):
            model = make_model(name, decoupled, 9, 3)
            opts = TensorParallel.Options(row_block=row_block, spill_dir=str(directory),
                                          spill_memory=memory)
            losses, (out, gids), plan = run_epochs(TensorParallel(opts), dataset, model, comm)
            where = (f"{name} decoupled={decoupled} row_block={row_block} memory={memory} "
                     f"rank {comm.rank}/{comm.world_size}")
            assert plan.spill is not None and plan.spill.made > 0, where
            assert_same_run((losses, out, gids, model), (ref_losses, ref_out, ref_model), where)


@pytest.mark.dist
@cpu_only("spilled matrices are host files")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_spill_matches_single(tmp_path, world_size):
    run_ranks(check_spill, world_size, tmp_path, SPILL_CASES, tmp_path / "spill")
    assert os.listdir(tmp_path / "spill") == []


@cpu_only("spilled matrices are host files")
def test_spill_holds_no_propagation_matrix_in_memory(tmp_path):
    """A blocked decoupled GCN with a spill: every (N, C) tensor autograd keeps (but
    the input features, read from the store) or the forward returns lives in a file
    (column-major), none in memory."""
    from fullgraph.models import build_model

    dataset = make_dataset()
    n = dataset.graph.num_dst
    torch.manual_seed(0)
    model = build_model("gcn", 9, 64, 3, decoupled=True, num_props=3)
    strategy = TensorParallel(TensorParallel.Options(row_block=16, spill_dir=str(tmp_path),
                                                     spill_memory=str(2 * n * 4)))
    plan = strategy.setup(dataset, model, torch.device("cpu"), None)  # (column chunks)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        result = strategy.forward(model, plan, training=True, seed=1)
        loss = strategy.loss(result, plan)
    assert in_file(result.logits, tmp_path)
    features = plan.features.untyped_storage().data_ptr()  # the input rows, mapped
    whole = [t for t in saved if t.dim() == 2 and t.shape[0] == n
             and t.untyped_storage().data_ptr() != features]
    assert whole and all(in_file(t, tmp_path) for t in whole), [t.shape for t in whole]
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert "in unlinked files under" in "\n".join(strategy.describe(model, plan))
    # the arrays setup built for the propagation are in files too; the forward CSR is
    # the dataset's own
    t = plan.graph.transpose()
    kept = [*plan.norms.values(), t.perm] + ([] if t.mirrors else [t.graph.indices,
                                                                     t.graph.indptr])
    assert all(in_file(a, tmp_path) for a in kept)


@pytest.mark.parametrize("opts, match", [
    (dict(spill_dir="d", num_chunks=2), "cannot be combined with num_chunks"),
    (dict(spill_dir="d", pipeline=True), "cannot be combined with pipeline"),
    (dict(spill_memory="1GB"), "without spill_dir"),
    (dict(spill_dir="d", spill_memory="lots"), "cannot read 'lots' as a size")])
def test_bad_spill_options_are_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        TensorParallel.Options(**opts)


def test_spill_refuses_attention_and_unwritable_directories(tmp_path):
    dataset = make_dataset()
    model = make_model("gat", True, 9, 3).cpu()
    strategy = TensorParallel(TensorParallel.Options(spill_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="learns edge weights"):
        strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = make_model("gcn", True, 9, 3).cpu()
    strategy = TensorParallel(TensorParallel.Options(spill_dir=str(blocker / "sub")))
    with pytest.raises(ValueError, match="cannot be written"):
        strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
    strategy = TensorParallel(TensorParallel.Options(spill_dir=str(blocker)))
    with pytest.raises(ValueError, match="is a file, not a directory"):  # (was: File exists)
        strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)


@cpu_only("spilled matrices are host files")
def test_a_spill_memory_below_one_column_is_refused(tmp_path):
    """1 byte was taken: the header said "column chunks of at most 1 B" while each held
    a whole column, and the transpose built into files took a pass per few edges (over
    120 s of setup on 2.1M edges)."""
    dataset = make_dataset()
    least = 2 * dataset.graph.num_dst * 8
    for memory, refused in (("1", True), (str(least - 1), True), (str(least), False)):
        model = make_model("gcn", False, 9, 3).cpu()
        strategy = TensorParallel(TensorParallel.Options(spill_dir=str(tmp_path),
                                                         spill_memory=memory))
        if refused:
            with pytest.raises(ValueError, match=f"holds less than one column .* give at "
                                                 f"least {least} B"):
                strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
        else:
            plan = strategy.setup(dataset, model, torch.device("cpu"), None, torch.float64)
            assert strategy.outcome(model, plan)[0].startswith("spill    ")


def test_spill_paths_expand_the_home_directory_and_a_size_limit_is_named(tmp_path,
                                                                        monkeypatch):
    """``spill_dir = "~/x"`` in a config file made a folder named ``~`` here; a file
    over ``ulimit -f`` ended with a bare "file too large"."""
    import errno

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    spill = Spill("~/rows", memory=1 << 20)
    assert spill.directory == tmp_path / "home" / "rows" and not (tmp_path / "~").exists()

    def too_big(fd, offset, length):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(os, "posix_fallocate", too_big, raising=False)
    with pytest.raises(OSError, match=r"file size limit \(ulimit -f; --spill-dir\)") as err:
        spill.empty(1000, 7, torch.float32)
    assert err.value.filename == str(tmp_path / "home" / "rows")


def test_kept_graph_arrays_are_in_files_and_give_the_same_gradients(tmp_path):
    """``keep_graph`` moves a transposed CSR built in memory, its permutation and the
    weights in the transpose's order (copied at the second backward) into files."""
    graph, weight = _graph()
    x = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    spmm(graph, x, weight).sum().backward()
    ref, x.grad = x.grad, None
    spill = Spill(tmp_path, 1 << 20)
    kept = spill.keep(weight)
    spill.keep_graph(graph)
    t = graph.transpose()
    assert not t.mirrors and torch.equal(kept, weight)
    assert all(in_file(a, tmp_path) for a in (kept, t.perm, t.graph.indices, t.graph.indptr))
    for _ in range(2):
        spmm(graph, x, kept).sum().backward()
        assert torch.equal(x.grad, ref)
        x.grad = None
    assert in_file(t.weights_in_order(kept), tmp_path)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("memory", [8, 100 * 8, 1 << 20])
def test_a_transpose_not_built_yet_is_built_into_files(tmp_path, symmetric, memory):
    """``keep_graph`` on a graph whose transpose was never built writes it straight
    into files, ``memory`` bytes of edges at a time (one edge, 100 edges, all): the
    same arrays as the in-memory build, and the same gradients. A symmetric graph
    shares the forward CSR's arrays and keeps only its permutation in a file."""
    graph, weight = _graph(seed=3)
    if symmetric:
        graph = Graph.from_edges(*graph.edges(), 40, symmetrize=True)
        weight = torch.rand(graph.num_edges, dtype=torch.float64)
    ref = Graph(graph.indptr, graph.indices, graph.num_src, validate=False).transpose()
    x = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    spmm(Graph(graph.indptr, graph.indices, graph.num_src), x, weight).sum().backward()
    grad, x.grad = x.grad, None
    spill = Spill(tmp_path, memory)
    kept = spill.keep(weight)
    spill.keep_graph(graph)
    t = graph.transpose()
    assert t.mirrors == symmetric == ref.mirrors
    for a, b in ((t.graph.indptr, ref.graph.indptr), (t.graph.indices, ref.graph.indices),
                 (t.perm, ref.perm)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    files = [t.perm] + ([] if symmetric else [t.graph.indices, t.graph.indptr])
    assert all(in_file(a, tmp_path) for a in files)
    if symmetric:
        assert t.graph.indices is graph.indices
    for _ in range(2):
        spmm(graph, x, kept).sum().backward()
        assert torch.equal(x.grad, grad)
        x.grad = None
    ordered = t.weights_in_order(kept)
    assert in_file(ordered, tmp_path) and torch.equal(ordered, weight[ref.perm])


def test_the_default_chunk_memory_is_shared_by_the_workers_on_a_host(tmp_path, monkeypatch):
    """Each of 4 workers took a quarter of the host's memory: all of it together."""
    import fullgraph.memory

    monkeypatch.setattr(fullgraph.memory, "available_ram", lambda: 64 << 30)
    model = make_model("gcn", True, 9, 3).cpu()
    strategy = TensorParallel(TensorParallel.Options(spill_dir=str(tmp_path)))
    cpu = torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert strategy._spill(model, cpu, cpu, world_size=8).memory == 4 << 30
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # (launched otherwise: all on this host)
    assert strategy._spill(model, cpu, cpu, world_size=2).memory == 8 << 30


def test_one_process_takes_the_hosts_memory_whatever_an_outer_job_says(monkeypatch):
    import fullgraph.memory

    monkeypatch.setattr(fullgraph.memory, "available_ram", lambda: 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # (a fit() inside a torchrun job's process)
    assert fullgraph.memory.ram_per_worker(1) == 64 << 30
    assert fullgraph.memory.ram_per_worker(2) == 32 << 30  # (at most its own workers)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert fullgraph.memory.ram_per_worker(4) == 16 << 30
