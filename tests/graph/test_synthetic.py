"""Tests of the seeded R-MAT and stochastic-block-model generators (small sizes only)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fullgraph.errors import ValidationError
from fullgraph.graph import synthetic
from fullgraph.graph.synthetic import rmat, rmat_edges, sbm

GRAPH500 = dict(a=0.57, b=0.19, c=0.19, d=0.05)


# ----------------------------------------------------------------------- R-MAT
def test_rmat_edges_deterministic_and_seed_dependent() -> None:
    first = rmat_edges(1000, 5000, seed=3)
    again = rmat_edges(1000, 5000, seed=3)
    other = rmat_edges(1000, 5000, seed=4)
    assert all(x.dtype == np.int64 and x.shape == (5000,) for x in first)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])


@pytest.mark.parametrize("num_nodes", [1, 2, 3, 1000, 1024, 1025])
def test_rmat_edges_ids_in_range(num_nodes: int) -> None:
    src, dst = rmat_edges(num_nodes, 3000, seed=0)
    assert src.shape == dst.shape == (3000,)
    assert src.min() >= 0 and dst.min() >= 0
    assert src.max() < num_nodes and dst.max() < num_nodes
    if num_nodes >= 1000:  # rejection does not starve the top of the range
        assert max(src.max(), dst.max()) >= num_nodes // 2


def test_rmat_quadrant_frequencies() -> None:
    src, dst = rmat_edges(2, 200_000, **GRAPH500, seed=1)
    freq = [np.mean((src == s) & (dst == t)) for s in (0, 1) for t in (0, 1)]
    np.testing.assert_allclose(freq, list(GRAPH500.values()), atol=0.005)


def test_in_range_probability_matches_rejection_rate() -> None:
    probs = tuple(GRAPH500.values())
    cuts = tuple(np.uint64(round(p * 2**32)) for p in np.cumsum(probs)[:3])
    for num_nodes in (700, 1025, 3000):
        scale = (num_nodes - 1).bit_length()
        s, t = synthetic._rmat_block(0, 200_000, scale, np.uint64(9), cuts)
        rate = np.mean((s < num_nodes) & (t < num_nodes))
        expected = synthetic._in_range_probability(num_nodes - 1, scale, probs)
        assert abs(rate - expected) < 0.005, (num_nodes, rate, expected)


@pytest.mark.skipif(synthetic.numba is None, reason="numba not installed")
def test_numba_and_numpy_give_identical_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    cuts = (np.uint64(1 << 30), np.uint64(2 << 30), np.uint64(3 << 30))
    for scale in (0, 1, 4, 7):
        fast = synthetic._rmat_block(5, 4000, scale, np.uint64(77), cuts, use_numba=True)
        slow = synthetic._rmat_block(5, 4000, scale, np.uint64(77), cuts, use_numba=False)
        assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])
    with_numba = rmat_edges(1000, 3000, seed=2)
    monkeypatch.setattr(synthetic, "_rmat_kernel", None)
    without = rmat_edges(1000, 3000, seed=2)
    assert np.array_equal(with_numba[0], without[0]) and np.array_equal(with_numba[1], without[1])


def test_rmat_degree_skew() -> None:
    skewed = rmat(4096, 40_000, **GRAPH500, num_features=4).graph.in_degrees().float()
    uniform = rmat(4096, 40_000, a=0.25, b=0.25, c=0.25, d=0.25,
                   num_features=4).graph.in_degrees().float()
    assert skewed.max() > 20 * skewed.mean()
    assert uniform.max() < 4 * uniform.mean()


@pytest.mark.parametrize("probs", [(0.5, 0.2, 0.2, 0.2), (0.6, 0.3, 0.2, -0.1),
                                   (1.2, -0.1, -0.05, -0.05)])
def test_bad_probabilities_raise(probs: tuple[float, ...]) -> None:
    a, b, c, d = probs
    with pytest.raises(ValidationError, match="a, b, c, d"):
        rmat_edges(100, 10, a=a, b=b, c=c, d=d)
    with pytest.raises(ValidationError):
        rmat(100, 10, a=a, b=b, c=c, d=d)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValidationError, match="no edge inside"):  # d = 1 only hits id 2**k - 1
        rmat_edges(100, 10, a=0.0, b=0.0, c=0.0, d=1.0)
    with pytest.raises(ValidationError, match="num_nodes"):
        rmat_edges(0, 10)
    with pytest.raises(ValidationError, match="num_edges"):
        rmat_edges(10, -1)
    with pytest.raises(ValidationError, match="feature_dtype"):
        rmat(10, 10, feature_dtype="int8")
    with pytest.raises(ValidationError, match="homophily"):
        sbm(100, 4, homophily=1.5)
    with pytest.raises(ValidationError, match="num_nodes"):
        sbm(3, 4)


def test_rmat_dataset() -> None:
    ds = rmat(1000, 8000, seed=5, num_features=16, num_classes=7, train=0.1, val=0.3)
    ds.validate()
    again = rmat(1000, 8000, seed=5, num_features=16, num_classes=7, train=0.1, val=0.3)
    assert torch.equal(ds.graph.indices, again.graph.indices)
    assert torch.equal(ds.data.features, again.data.features)
    assert torch.equal(ds.data.labels, again.data.labels)
    assert ds.name == "rmat-1000-8000"
    assert 0.5 * 8000 < ds.graph.num_edges <= 8000  # duplicates and self-loops removed
    assert not ds.graph.has_self_loops()
    assert ds.data.features.shape == (1000, 16) and ds.data.features.dtype == torch.float32
    assert int(ds.data.train_mask.sum()) == 100 and int(ds.data.val_mask.sum()) == 300
    src, dst = ds.graph.edges()
    keys = dst * 1000 + src
    assert keys.unique().numel() == keys.numel()


def test_rmat_options() -> None:
    sym = rmat(500, 3000, seed=1, num_features=2, symmetrize=True, self_loops="add",
               feature_dtype="bfloat16", labels="degree", num_classes=5)
    sym.validate()
    src, dst = sym.graph.edges()
    forward = set(zip(src.tolist(), dst.tolist()))
    assert forward == {(t, s) for s, t in forward}
    assert sum(s == t for s, t in forward) == 500
    assert sym.graph.num_edges <= 2 * 3000 + 500
    assert sym.data.features.dtype == torch.bfloat16
    y, deg = sym.data.labels, sym.graph.in_degrees()
    assert torch.bincount(y).tolist() == [100] * 5  # equal-size degree bands
    assert deg[y == 4].float().mean() > deg[y == 0].float().mean()


def test_sbm_structure() -> None:
    ds = sbm(3000, 5, avg_degree=12.0, homophily=0.7, seed=3)
    ds.validate()
    assert ds.name == "sbm-3000-5"
    y = ds.data.labels
    assert torch.bincount(y).tolist() == [600] * 5
    src, dst = ds.graph.edges()
    same = (y[src] == y[dst]).float().mean().item()
    assert abs(same - 0.7) < 0.03, same
    assert abs(ds.graph.num_edges / 3000 - 12.0) < 1.0
    assert not ds.graph.has_self_loops()
    keys = set(zip(src.tolist(), dst.tolist()))
    assert keys == {(t, s) for s, t in keys}
    again = sbm(3000, 5, avg_degree=12.0, homophily=0.7, seed=3)
    assert torch.equal(ds.graph.indices, again.graph.indices)
    assert torch.equal(ds.data.features, again.data.features)
    assert not torch.equal(ds.graph.indices[:100],
                           sbm(3000, 5, avg_degree=12.0, homophily=0.7,
                               seed=4).graph.indices[:100])


def _class_mean_accuracy(x: torch.Tensor, ds: "synthetic.Dataset") -> float:
    d = ds.data
    y = d.labels
    means = torch.stack([x[d.train_mask & (y == c)].mean(0) for c in range(d.num_classes)])
    pred = torch.cdist(x[d.test_mask], means).argmin(1)
    return (pred == y[d.test_mask]).float().mean().item()


def test_sbm_features_carry_the_class() -> None:
    ds = sbm(3000, 4, avg_degree=10.0, homophily=0.9, feature_noise=1.0, seed=1)
    x = ds.data.features
    alone = _class_mean_accuracy(x, ds)
    src, dst = ds.graph.edges()
    agg = torch.zeros_like(x).index_add_(0, dst, x[src])
    mean_nbr = agg / ds.graph.in_degrees().clamp(min=1).unsqueeze(1).float()
    with_graph = _class_mean_accuracy(x + mean_nbr, ds)
    assert alone > 0.25 + 0.15, alone  # chance is 0.25
    assert with_graph > alone + 0.1, (alone, with_graph)


def test_sbm_edge_cases() -> None:
    one = sbm(50, 1, avg_degree=4.0, homophily=0.3, seed=0)
    one.validate()
    assert one.data.num_classes == 1 and one.graph.num_edges > 0
    empty = sbm(20, 2, avg_degree=0.0, feature_dtype="float16")
    assert empty.graph.num_edges == 0 and empty.data.features.dtype == torch.float16


# ------------------------------------------------------------- streamed R-MAT
STREAM_CASES = [
    dict(num_nodes=1000, num_edges=20000),
    dict(num_nodes=1000, num_edges=20000, symmetrize=True, self_loops="add", labels="degree",
         feature_dtype="bfloat16"),
    dict(num_nodes=777, num_edges=9000, self_loops="keep", feature_dtype="float16",
         num_features=5, seed=3),
]


def assert_same_files(a, b) -> None:
    """Directories ``a`` and ``b`` hold the same file names with the same bytes."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("case", range(len(STREAM_CASES)))
@pytest.mark.parametrize("memory", [1 << 30, 8 * 3000, 8])
def test_write_rmat_equals_saving_rmat_byte_for_byte(tmp_path, case: int, memory: int) -> None:
    """One range, a few ranges and one range per destination give the same files."""
    from fullgraph.graph.store import save_dataset

    kwargs = STREAM_CASES[case]
    save_dataset(rmat(**kwargs), tmp_path / "whole")
    out = synthetic.write_rmat(tmp_path / "streamed", **kwargs, memory_bytes=memory)
    assert_same_files(tmp_path / "whole", tmp_path / "streamed")
    assert (out["ranges"] == 1) == (memory == 1 << 30)
    assert out["ranges"] > 1 or memory == 1 << 30


def test_write_rmat_holds_one_range_of_keys(tmp_path, monkeypatch) -> None:
    """No key array is larger than the budget (a destination of its own aside)."""
    sizes: list[int] = []
    real = synthetic._append_rows

    def spy(keys, *args):
        sizes.append(keys.size)
        return real(keys, *args)

    monkeypatch.setattr(synthetic, "_append_rows", spy)
    out = synthetic.write_rmat(tmp_path / "d", 4096, 40000, memory_bytes=8 * 5000)
    graph = rmat(4096, 40000).graph
    biggest_row = int(graph.in_degrees().max())
    assert len(sizes) == out["ranges"] > 1 and sum(sizes) >= graph.num_edges
    assert max(sizes) <= max(5000, biggest_row * 2)


def test_write_rmat_crash_leaves_nothing(tmp_path, monkeypatch) -> None:
    from fullgraph.graph import store

    def boom(tensor):
        raise RuntimeError("disk full")

    monkeypatch.setattr(store, "stored_array", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        synthetic.write_rmat(tmp_path / "d", 100, 1000)
    assert list(tmp_path.iterdir()) == []


def test_write_rmat_checks_arguments_before_writing(tmp_path) -> None:
    with pytest.raises(ValidationError, match="num_edges"):
        synthetic.write_rmat(tmp_path / "d", 100, -1)
    with pytest.raises(ValidationError, match="self_loops"):
        synthetic.write_rmat(tmp_path / "d", 100, 10, self_loops="drop")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


SBM_CASES = [dict(num_nodes=3000, num_classes=5, avg_degree=8.0, homophily=0.7, seed=3),
             dict(num_nodes=70_000, num_classes=3, avg_degree=3.0, num_features=5, seed=1,
                  self_loops="add", feature_dtype="float16"),  # two vertex blocks
             dict(num_nodes=40, num_classes=2, avg_degree=6.0, num_features=3,
                  self_loops="keep")]


@pytest.mark.parametrize("case", range(len(SBM_CASES)))
@pytest.mark.parametrize("memory", [1 << 30, 8 * 2000])
def test_write_sbm_equals_saving_sbm_byte_for_byte(tmp_path, case: int, memory: int) -> None:
    """The streamed block model is the in-memory one, in one key range or in several."""
    from fullgraph.graph.store import save_dataset

    kwargs = SBM_CASES[case]
    save_dataset(sbm(**kwargs), tmp_path / "whole")
    out = synthetic.write_sbm(tmp_path / "streamed", **kwargs, memory_bytes=memory)
    assert_same_files(tmp_path / "whole", tmp_path / "streamed")
    assert (out["ranges"] > 1) == (memory < 1 << 30 and case != 2)


def test_write_sbm_checks_arguments_before_writing(tmp_path) -> None:
    with pytest.raises(ValidationError, match="homophily"):
        synthetic.write_sbm(tmp_path / "d", 100, 4, homophily=1.5)
    with pytest.raises(ValidationError, match="self_loops"):
        synthetic.write_sbm(tmp_path / "d", 100, 4, self_loops="drop")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
