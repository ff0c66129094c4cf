"""PyG ``Data`` <-> Dataset conversion."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fullgraph.graph
from fullgraph.errors import FormatError, ValidationError
from fullgraph.graph.formats.planetoid import load_planetoid
from fullgraph.graph.formats.pyg import from_pyg, to_pyg
from fullgraph.graph.sparse import is_sparse

pyg_data = pytest.importorskip("torch_geometric.data")
BUILTIN_CORA = Path(fullgraph.graph.__file__).resolve().parent / "builtin" / "cora"


def _tiny(**overrides: object):
    g = torch.Generator().manual_seed(0)
    n = 10
    fields = {"x": torch.randn(n, 3, generator=g), "y": torch.arange(n) % 2,
              "edge_index": torch.tensor([[0, 1, 2, 3, 3, 9], [1, 2, 3, 4, 3, 0]]),
              "train_mask": torch.arange(n) < 4,
              "val_mask": (torch.arange(n) >= 4) & (torch.arange(n) < 7),
              "test_mask": torch.arange(n) >= 7}
    fields.update(overrides)
    return pyg_data.Data(**{k: v for k, v in fields.items() if v is not None})


def _edge_set(src: torch.Tensor, dst: torch.Tensor) -> set[tuple[int, int]]:
    return set(zip(src.tolist(), dst.tolist()))


def test_from_pyg_keeps_everything() -> None:
    data = _tiny()
    ds = from_pyg(data, name="tiny")
    assert ds.name == "tiny"
    assert torch.equal(ds.data.features, data.x)
    assert torch.equal(ds.data.labels, data.y)
    assert torch.equal(ds.data.train_mask, data.train_mask)
    assert _edge_set(*ds.graph.edges()) == _edge_set(*data.edge_index)
    assert ds.graph.has_self_loops()  # (3, 3) is kept


def test_round_trip_cora() -> None:
    ds = load_planetoid(BUILTIN_CORA, "cora")
    data = to_pyg(ds)
    assert data.num_nodes == 2708 and data.num_edges == 10556
    back = from_pyg(data, name="cora")
    for name in ("features", "labels", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(back.data, name), getattr(ds.data, name))
    assert torch.equal(back.graph.indptr, ds.graph.indptr)
    assert torch.equal(back.graph.indices, ds.graph.indices)


def test_without_masks_draws_a_seeded_split() -> None:
    data = _tiny(train_mask=None, val_mask=None, test_mask=None)
    a, b = from_pyg(data, seed=5), from_pyg(data, seed=5)
    assert torch.equal(a.data.train_mask, b.data.train_mask)
    assert int(a.data.train_mask.sum()) == 6


def test_two_dimensional_masks_pick_a_column() -> None:
    train = torch.stack([torch.arange(10) < 4, torch.arange(10) >= 8], dim=1)
    ds = from_pyg(_tiny(train_mask=train, test_mask=(torch.arange(10) >= 4) &
                        (torch.arange(10) < 8), val_mask=None), split_index=1)
    assert ds.data.train_mask.tolist() == (torch.arange(10) >= 8).tolist()


def test_edge_index_out_of_range() -> None:
    with pytest.raises(ValidationError, match="out of range") as err:
        from_pyg(_tiny(edge_index=torch.tensor([[0, 1], [1, 10]])), name="bad")
    assert (err.value.source, err.value.field, err.value.found) == ("bad", "edge_index[1, 1]",
                                                                   10)


def test_nan_features() -> None:
    x = torch.zeros(10, 3)
    x[2, 1] = float("nan")
    with pytest.raises(ValidationError, match="not finite"):
        from_pyg(_tiny(x=x))


class _SparseTensorLike:
    """What fullgraph reads of a ``torch_sparse.SparseTensor`` (not installed here)."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.dense = dense

    def to_torch_sparse_csr_tensor(self) -> torch.Tensor:
        return self.dense.to_sparse_csr()


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "int64 coo", "SparseTensor",
                                    "scipy csr", "scipy coo float64"])
def test_sparse_x_is_kept_sparse(layout) -> None:
    """A sparse ``x`` (torch COO, CSR or CSC, a ``SparseTensor``, a scipy matrix)
    becomes CSR features, its non-zeros only, equal to the dense matrix (integers and
    float64 as float32)."""
    import scipy.sparse as sp

    x = torch.zeros(10, 6)
    x[0, 1], x[3, 5], x[3, 0], x[9, 2] = 1.0, 2.0, 3.0, 4.0
    given = {"coo": x.to_sparse(), "csr": x.to_sparse_csr(), "csc": x.to_sparse_csc(),
             "int64 coo": x.to(torch.int64).to_sparse(),
             "SparseTensor": _SparseTensorLike(x),
             "scipy csr": sp.csr_matrix(x.numpy()),
             "scipy coo float64": sp.coo_matrix(x.numpy().astype("float64"))}[layout]
    before = given.copy() if layout.startswith("scipy") else None
    ds = from_pyg(_tiny(x=given))
    if before is not None:  # the caller's matrix is left as it was
        assert (given != before).nnz == 0 and given.format == before.format
    assert is_sparse(ds.data.features) and ds.data.features.values().dtype == torch.float32
    assert ds.data.features.values().numel() == 4
    assert torch.equal(ds.data.features.to_dense(), x)


def test_sparse_x_with_nan_names_the_entry() -> None:
    x = torch.zeros(10, 3)
    x[0, 0], x[7, 2] = 1.0, float("nan")
    with pytest.raises(ValidationError, match="not finite") as err:
        from_pyg(_tiny(x=x.to_sparse_csr()), name="bad")
    assert err.value.field == "x[7, 2]"


def test_masks_given_as_vertex_ids() -> None:
    """Integer masks are vertex ids (OGB's split indices); out-of-range ids and a 0/1
    vector that may be a mask are refused."""
    ds = from_pyg(_tiny(train_mask=torch.tensor([0, 2, 2]), val_mask=torch.tensor([5]),
                        test_mask=torch.arange(7, 10)))
    assert ds.data.train_mask.nonzero().flatten().tolist() == [0, 2]
    assert ds.data.val_mask.nonzero().flatten().tolist() == [5]
    assert ds.data.test_mask.nonzero().flatten().tolist() == [7, 8, 9]
    with pytest.raises(ValidationError, match="out of range") as err:
        from_pyg(_tiny(train_mask=torch.tensor([0, 10])), name="bad")
    assert err.value.field == "train_mask[1]"
    with pytest.raises(FormatError, match="ambiguous"):
        from_pyg(_tiny(train_mask=(torch.arange(10) < 4).long()))
    byte = from_pyg(_tiny(train_mask=(torch.arange(10) < 4).to(torch.uint8)))
    assert byte.data.train_mask.tolist() == (torch.arange(10) < 4).tolist()
    with pytest.raises(FormatError, match="sparse in both"):
        from_pyg(_tiny(x=torch.eye(10, 3).to_sparse(1)))


def test_missing_labels() -> None:
    with pytest.raises(FormatError, match="lacks") as err:
        from_pyg(_tiny(y=None))
    assert err.value.field == "y"


def test_overlapping_masks() -> None:
    with pytest.raises(ValidationError, match="overlap"):
        from_pyg(_tiny(val_mask=torch.arange(10) < 2))


def test_negative_edge_id() -> None:
    with pytest.raises(ValidationError, match="negative") as err:
        from_pyg(_tiny(edge_index=torch.tensor([[0, -1], [1, 2]])))
    assert err.value.field == "edge_index[0, 1]"


def test_labels_not_one_per_vertex() -> None:
    with pytest.raises(FormatError, match="one label per vertex") as err:
        from_pyg(_tiny(y=torch.zeros(9, dtype=torch.long)))
    assert (err.value.found, err.value.expected) == (9, 10)


def test_label_out_of_range() -> None:
    with pytest.raises(ValidationError, match="label out of range") as err:
        from_pyg(_tiny(), num_classes=1)
    assert err.value.field == "y[1]"


def test_empty_train_mask() -> None:
    ds = from_pyg(_tiny(train_mask=torch.zeros(10, dtype=torch.bool)))
    with pytest.raises(ValidationError, match="train mask is empty"):  # data to predict on
        ds.data.require_training(ds.name)


def test_empty_graph() -> None:
    with pytest.raises(ValidationError, match="no edges"):
        from_pyg(_tiny(edge_index=torch.zeros(2, 0, dtype=torch.long)))


@pytest.mark.parametrize("layout", ["dense", "csr"])
def test_features_without_columns_are_refused(layout) -> None:
    """(N, 0) features were taken, and training failed later with a reshape error."""
    x = torch.zeros(5, 0)
    x = x.to_sparse_csr() if layout == "csr" else x
    with pytest.raises(FormatError, match="features have no columns.*column of ones"):
        from_pyg(_tiny(x=x))
