"""Sparse (CSR) input features train exactly as the same features held dense: the
kernels against dense references, then whole runs of every strategy (float64)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_ranks

from fullgraph.comm.group import Comm
from fullgraph.config import config_from_dict
from fullgraph.graph.data import Dataset, VertexData
from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.models.walk import reads_sparse
from fullgraph.ops import keyed_dropout
from fullgraph.ops.sparse import (
    density,
    is_sparse,
    nbytes,
    sparse_dropout,
    sparse_linear,
    take_rows,
    to_sparse,
)
from fullgraph.train import train


def bag_of_words(n: int = 50, k: int = 40, keep: float = 0.1, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, k, generator=gen, dtype=torch.float64)
    x[torch.rand(n, k, generator=gen) > keep] = 0.0
    x[3] = 0.0  # an empty row
    return x


def test_csr_rows_dropout_and_linear_match_the_dense_ops():
    x = bag_of_words()
    xs = to_sparse(x)
    assert is_sparse(xs) and torch.equal(xs.to_dense(), x)
    assert density(xs) == pytest.approx(density(x)) and nbytes(xs) < nbytes(x)
    rows = torch.tensor([7, 3, 3, 0, 49])
    assert torch.equal(take_rows(xs, rows).to_dense(), x[rows])
    mask = torch.arange(50) % 3 == 0
    assert torch.equal(take_rows(xs, mask).to_dense(), x[mask])
    keys = torch.arange(100, 150)
    dense = keyed_dropout(x, 0.4, keys, 1234, True)
    assert torch.equal(sparse_dropout(xs, 0.4, keys, 1234).to_dense(), dense)
    w = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(50, 6, dtype=torch.float64)
    (sparse_linear(xs, w, b) * g).sum().backward()
    got = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    ((x @ w.t() + b) * g).sum().backward()
    torch.testing.assert_close(got[0], w.grad)
    torch.testing.assert_close(got[1], b.grad)


def test_the_torch_fallbacks_match_the_numba_kernels(monkeypatch):
    from fullgraph.ops import kernels

    x = bag_of_words(seed=1)
    xs, keys = to_sparse(x), torch.arange(50)
    w = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    g = torch.randn(50, 5, dtype=torch.float64)
    (sparse_linear(xs, w) * g).sum().backward()
    want = sparse_dropout(xs, 0.3, keys, 9).to_dense(), w.grad.clone()
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    w.grad = None
    (sparse_linear(xs, w) * g).sum().backward()
    torch.testing.assert_close(w.grad, want[1])
    # the fallback's uniform is rounded to float32 before the comparison, as the dense
    # fallback's: the same entries but at a rounding boundary
    assert (sparse_dropout(xs, 0.3, keys, 9).to_dense() != want[0]).sum() <= 1


def test_which_models_read_csr_rows():
    def program(name, **opts):
        return build_model(name, 40, 8, 3, num_layers=2, **opts)

    assert reads_sparse(program("gcn")) and reads_sparse(program("sage"))
    assert reads_sparse(program("gat", heads=2)) and reads_sparse(program("gcn", decoupled=True))
    assert reads_sparse(program("gin"))  # 40 columns > 8 hidden: its weight comes first
    assert not reads_sparse(program("gin", eps=0.5))  # it sums the raw features first
    assert not reads_sparse(program("gin", aggregate_first=True))
    assert not reads_sparse(program("gcn", aggregate_first=True))



def test_the_header_names_why_features_are_made_dense():
    """It said 'propagates the raw features' of any model, also of one whose own stage
    reads the layer input (the README's GatedGCN propagates after its weight)."""
    from models.user_gnn import GatedGCN

    from fullgraph.models.walk import dense_reader

    assert dense_reader(build_model("gcn", 40, 8, 3)) is None
    assert dense_reader(build_model("gin", 40, 8, 3, eps=0.5)) == \
        "it propagates the raw features (stage 1)"
    gated = GatedGCN(40, 8, 3, num_layers=2)
    assert dense_reader(gated).startswith("stage 3 (Gate) reads the raw features and does "
                                          "not take CSR rows")


# ------------------------------------------------------------------- whole runs
def sparse_pair(seed: int = 2) -> tuple[Dataset, Dataset]:
    """An SBM whose features are 85 % zeros, held dense and as CSR."""
    dense = sbm(150, 3, num_features=48, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = dense.data.features.clone()
    x[torch.rand(x.shape, generator=gen) < 0.85] = 0.0
    d = dense.data
    dense = dataclasses.replace(dense, data=VertexData(x, d.labels, d.train_mask, d.val_mask,
                                                       d.test_mask, d.num_classes))
    sparse = dataclasses.replace(dense, data=dataclasses.replace(dense.data,
                                                                 features=to_sparse(x)))
    return dense, sparse


MODELS = {"gcn": {}, "sage": {}, "gat": {"heads": 2}, "gin": {}, "tagcn": {"hops": 2},
          "gcn-decoupled": {"decoupled": True}}


def cfg_for(model: str, strategy: str = "single", **sections):
    name = model.split("-")[0]
    return config_from_dict({
        "model": {"name": name, "hidden": 8, "dropout": 0.4, **MODELS[model]},
        "train": {"epochs": 4, "lr": 0.05, "seed": 3},
        "runtime": {"strategy": strategy}, **sections})


def losses(result) -> list[float]:
    return [r.loss for r in result.epochs]


def test_single_process_training_on_csr_features_equals_the_dense_run():
    dense, sparse = sparse_pair()
    for model in MODELS:
        want = train(dense, cfg_for(model), dtype=torch.float64)
        got = train(sparse, cfg_for(model), dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(losses(got)), torch.tensor(losses(want)))
        assert got.test_at_best == want.test_at_best, model


CASES = [("data", "gcn", {"data_parallel": {"mode": "depcomm"}}),
         ("data", "sage", {"data_parallel": {"mode": "depcache"}}),
         ("data", "gat", {"data_parallel": {"mode": "depcomm"}}),
         ("p2p", "gcn", {}),
         ("p2p", "gin", {}),
         ("p2p", "sage", {}),
         ("tensor", "sage", {"tensor_parallel": {"num_chunks": 2}}),
         ("tensor", "gcn-decoupled", {}),
         ("tensor", "gcn-decoupled", {"tensor_parallel": {"row_block": 16}}),
         # TAGCN's blocks read the layer input (CSR rows) again after the propagation
         ("tensor", "tagcn", {"tensor_parallel": {"row_block": 16}}),
         ("tensor", "gat", {"tensor_parallel": {"device_memory": "60KB", "pipeline": True}}),
         ("task", "gcn", {}),
         ("task", "gat", {"task_parallel": {"recompute": True, "subgraphs": 2}}),
         ("task", "sage", {"task_parallel": {"split": "1:2"}}),
         # hand-offs in pieces keep SAGE's layer input (CSR rows) piece by piece
         ("task", "sage", {"task_parallel": {"split": "1:2", "pieces": 2}})]


def _strategies_world(comm: Comm, refs: dict[str, list[float]]) -> None:
    _, sparse = sparse_pair()
    for strategy, model, sections in CASES:
        cfg = cfg_for(model, strategy, partition={"method": "chunk"}, **sections)
        got = losses(train(sparse, cfg, comm=comm, dtype=torch.float64))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(refs[model]),
                                   msg=lambda m, s=strategy, md=model: f"{s} {md}: {m}")


@pytest.mark.dist
def test_every_strategy_trains_csr_features_as_the_dense_single_process_run(tmp_path):
    dense, _ = sparse_pair()
    refs = {m: losses(train(dense, cfg_for(m), dtype=torch.float64))
            for m in {model for _, model, _ in CASES}}
    run_ranks(_strategies_world, 3, tmp_path, refs, timeout_s=300)


# ------------------------------------------------------------- data layer and CLI
def test_the_store_keeps_csr_features_and_maps_them(tmp_path):
    from fullgraph.graph.store import load_dataset, save_dataset

    _, sparse = sparse_pair()
    save_dataset(sparse, tmp_path / "ds")
    assert not (tmp_path / "ds" / "features.npy").exists()
    back = load_dataset(tmp_path / "ds")
    assert is_sparse(back.data.features)
    assert torch.equal(back.data.features.to_dense(), sparse.data.features.to_dense())


def test_non_finite_sparse_features_are_named():
    from fullgraph.errors import ValidationError

    _, sparse = sparse_pair()
    x = sparse.data.features
    values = x.values().clone()
    values[5] = float("nan")
    bad = torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), values, x.shape,
                                  check_invariants=False)
    row = int(torch.searchsorted(x.crow_indices(), torch.tensor(5), right=True)) - 1
    with pytest.raises(ValidationError, match=rf"features\[{row}, {int(x.col_indices()[5])}\]"):
        dataclasses.replace(sparse.data, features=bad).validate(150)


def test_layout_options_and_what_follows_from_them():
    from fullgraph.checkpoint import dataset_fingerprint
    from fullgraph.graph.sparse import choose_layout

    dense, sparse = sparse_pair()
    x = dense.data.features
    assert is_sparse(choose_layout(x, "on")) and not is_sparse(choose_layout(sparse.data.features,
                                                                              "off"))
    assert not is_sparse(choose_layout(x, "auto"))  # 15 % non-zero: left dense
    wide = torch.zeros(100, 80)
    wide[::7, ::5] = 1.0  # 2.9 %
    assert is_sparse(choose_layout(wide, "auto"))
    assert not is_sparse(choose_layout(wide[:, :40], "auto"))  # too few columns
    # a checkpoint belongs to the model: the same fingerprint either way
    assert dataset_fingerprint(dense) == dataset_fingerprint(sparse)
    norm_s = sparse.data.row_normalized().features.to_dense()
    torch.testing.assert_close(norm_s, dense.data.row_normalized().features)


def test_cora_is_held_sparse_by_default_and_dense_on_request(shared_datasets):
    from fullgraph.config import DataConfig
    from fullgraph.graph.datasets import load_for

    auto = load_for(DataConfig(dataset="cora", root=str(shared_datasets),
                               normalize_features=True))
    off = load_for(DataConfig(dataset="cora", root=str(shared_datasets),
                              normalize_features=True, sparse_features="off"))
    assert is_sparse(auto.data.features) and not is_sparse(off.data.features)
    torch.testing.assert_close(auto.data.features.to_dense(), off.data.features)


def test_convert_stores_bag_of_words_features_sparse(tmp_path, capsys):
    import numpy as np

    from fullgraph.cli import main
    from fullgraph.graph.store import load_dataset

    n = 60
    src = np.arange(n)
    (tmp_path / "e.txt").write_text("".join(f"{s} {(s + 1) % n}\n" for s in src))
    x = np.zeros((n, 100), dtype=np.float32)
    x[np.arange(n), np.arange(n) % 100] = 1.0
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(n) % 3)
    assert main(["convert", "edgelist", "--name", "bow", "--root", str(tmp_path / "root"),
                 "--edges", str(tmp_path / "e.txt"), "--features", str(tmp_path / "x.npy"),
                 "--labels", str(tmp_path / "y.npy"), "--symmetrize"]) == 0
    assert "(features stored sparse)" in capsys.readouterr().out
    ds = load_dataset(tmp_path / "root" / "bow" / "processed")
    assert is_sparse(ds.data.features)
    assert torch.equal(ds.data.features.to_dense(), torch.from_numpy(x))
