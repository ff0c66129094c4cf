"""Stage-program properties: signatures, propagation graphs, decoupled forms against
dense references, keyed dropout, residual connections and option validation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from devices import TEST_DEVICE

from fullgraph.config import ModelConfig
from fullgraph.errors import ConfigError
from fullgraph.graph.csr import Graph
from fullgraph.models import (
    EdgeTransform,
    LayerInput,
    Propagate,
    StageContext,
    StageKind,
    StageProgram,
    Transform,
    build_model,
    propagation_inputs,
)
from fullgraph.models.gat import GATAttention, GATOutput
from fullgraph.models.layers import Dense

N, IN_DIM, HIDDEN, OUT_DIM = 30, 10, 16, 3
F64 = dict(rtol=1e-10, atol=1e-10)


def random_graph(seed: int = 0, loops: int = 0) -> Graph:
    """Random symmetric graph on the test device; with ``loops`` > 0, that many
    self-loops are kept."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, N, (80,), generator=g)
    dst = torch.randint(0, N, (80,), generator=g)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if loops:
        v = torch.arange(loops) * 2  # vertices 0, 2, 4, ... get a self-loop
        src, dst = torch.cat([src, v]), torch.cat([dst, v])
    return Graph.from_edges(src, dst, N, symmetrize=True, self_loops="keep").to(TEST_DEVICE)


def dense_adjacency(graph: Graph, with_loops: bool) -> torch.Tensor:
    """A[i, j] = 1 for an edge j -> i, input self-loops dropped, then I added if asked."""
    a = torch.zeros(N, N, dtype=torch.float64, device=graph.device)
    src, dst = graph.edges()
    a[dst, src] = 1.0
    a.fill_diagonal_(1.0 if with_loops else 0.0)
    return a


def features(seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, IN_DIM, generator=gen, dtype=dtype).to(TEST_DEVICE)


def full_ctx(pg: Graph, seed: int = 0, training: bool = False) -> StageContext:
    return StageContext(gids=torch.arange(N, device=pg.device), seed=seed, training=training,
                        eids=torch.arange(pg.num_edges, device=pg.device))


def run(model, graph: Graph, x: torch.Tensor, seed: int = 0, training: bool = False):
    pg, norms = propagation_inputs(model, graph.to(x.device), dtype=x.dtype)
    return model(pg, norms, x, full_ctx(pg, seed, training))


def mlp_reference(model, x: torch.Tensor) -> torch.Tensor:
    """The decoupled MLP computed from the Dense weights, without the stage machinery."""
    h = x
    for s in model.stages:
        if isinstance(s, Dense):
            assert not s.residual and s.root is None
            h = F.linear(h, s.lin.weight, s.bias)
            h = torch.relu(h) if s.act_name == "relu" else h
            assert s.act_name in ("relu", None)
    return h


# ------------------------------------------------------------------ signatures
@pytest.mark.parametrize("name, options, expected", [
    ("gcn", {}, "TPT TTPT"),  # widens then narrows: aggregate on the narrower side
    ("gcn", {"aggregate_first": True}, "TPT TPT"),
    ("gcn", {"aggregate_first": False}, "TTPT TTPT"),
    ("sage", {}, "TPT TTPT"),
    ("sage", {"aggregate_first": False}, "TTPT TTPT"),
    ("gat", {"heads": 2}, "TTEPT TTEPT"),
    ("gin", {}, "TPT TPT"),
    ("gcn", {"num_layers": 3}, "TPT TPT TTPT"),
    ("gcn", {"num_layers": 1}, "TTPT"),
    ("gcn", {"decoupled": True, "num_props": 3}, "TT TTPPP"),
    ("sage", {"decoupled": True, "num_props": 2}, "TT TTPP"),
    ("gin", {"decoupled": True, "num_props": 4}, "TT TTPPPP"),
    ("gat", {"decoupled": True, "num_props": 3}, "TT TTEPPP"),
    ("gat", {"decoupled": True, "num_props": 1, "num_layers": 3}, "TT TT TTEP"),
    # TAGCN, K = 3: Horner on the projections unless the input is much narrower
    ("tagcn", {}, "TTPTPTPT TTPTPTPT"),
    ("tagcn", {"aggregate_first": True}, "TPTPTPT TPTPTPT"),
    ("tagcn", {"hops": 1}, "TPT TTPT"),  # K = 1: the narrower side, as GCN
    ("tagcn", {"decoupled": True, "num_props": 2}, "TT TT TPTPT"),
])
def test_signatures(name, options, expected):
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, **options)
    assert m.signature() == expected
    assert m.in_dim == IN_DIM and m.out_dim == OUT_DIM
    assert isinstance(m.stages[0], LayerInput)
    assert m.layer_of == [int(i) for i, part in enumerate(expected.split()) for _ in part]
    assert [s.index for s in m.stages] == list(range(len(m.stages)))
    kinds = {Transform: StageKind.TRANSFORM, EdgeTransform: StageKind.EDGE,
             Propagate: StageKind.PROPAGATE}
    for s in m.stages:
        assert any(isinstance(s, cls) and s.kind == k for cls, k in kinds.items())


@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin"])
def test_decoupled_program_shape(name):
    K = 3
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=2, decoupled=True, num_props=K)
    kinds = [s.kind for s in m.stages]
    assert all(k == StageKind.PROPAGATE for k in kinds[-K:])
    assert StageKind.PROPAGATE not in kinds[:-K]
    edges = [i for i, k in enumerate(kinds) if k == StageKind.EDGE]
    assert edges == ([len(kinds) - K - 1] if name == "gat" else [])
    assert all(p.in_dim == OUT_DIM for p in m.stages[-K:])
    assert m.self_loops is True
    assert m.name == f"{name}-decoupled"


def test_stage_dims_chain():
    for name in ("gcn", "sage", "gat", "gin"):
        for decoupled in (False, True):
            m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=3, decoupled=decoupled)
            width = IN_DIM
            for s in m.stages:
                assert s.in_dim == width, (name, decoupled, s)
                if not isinstance(s, EdgeTransform):
                    width = s.out_dim
            assert width == OUT_DIM


# ---------------------------------------------------------- propagation graphs
@pytest.mark.parametrize("name, coupled_loops, norms", [
    ("gcn", True, {"gcn"}), ("sage", False, {"mean"}), ("gat", True, set()),
    ("gin", True, {"sum"}),
])
@pytest.mark.parametrize("input_loops", [0, 5, N // 2])
def test_propagation_graph_self_loops(name, coupled_loops, norms, input_loops):
    graph = random_graph(loops=input_loops)
    assert graph.has_self_loops() == bool(input_loops)
    src, dst = graph.edges()
    non_loop = int((src != dst).sum())
    for decoupled in (False, True):
        m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, decoupled=decoupled)
        pg, got_norms = propagation_inputs(m, graph)
        want_loops = True if decoupled else coupled_loops
        assert m.self_loops is want_loops
        psrc, pdst = pg.edges()
        loops = torch.bincount(pdst[psrc == pdst], minlength=N)
        if want_loops:
            assert torch.equal(loops, torch.ones(N, dtype=torch.int64, device=loops.device))
            assert pg.num_edges == non_loop + N
        else:
            assert int(loops.sum()) == 0 and pg.num_edges == non_loop
        # the non-loop edges are those of the input, unchanged
        key = lambda s, d: set((d * N + s)[s != d].tolist())  # noqa: E731
        assert key(psrc, pdst) == key(src, dst)
        expected_norms = norms if not decoupled else {
            "gcn": {"gcn"}, "sage": {"mean"}, "gat": set(), "gin": {"sum"}}[name]
        assert set(got_norms) == expected_norms == m.norms
        for w in got_norms.values():
            assert w.shape == (pg.num_edges,)


# ---------------------------------------------- decoupled forms, dense references
@pytest.mark.parametrize("K", [1, 3])
def test_decoupled_gcn_is_mlp_then_k_dense_gcn_steps(K):
    graph = random_graph(loops=4)  # input loops must not count twice
    torch.manual_seed(0)
    m = build_model("gcn", IN_DIM, HIDDEN, OUT_DIM, decoupled=True, num_props=K,
                    dropout=0.0).to(TEST_DEVICE, torch.float64)
    x = features()
    a = dense_adjacency(graph, with_loops=True)
    d_inv_sqrt = a.sum(1).rsqrt()
    a_hat = d_inv_sqrt[:, None] * a * d_inv_sqrt[None, :]
    ref = mlp_reference(m, x)
    for _ in range(K):
        ref = a_hat @ ref
    torch.testing.assert_close(run(m, graph, x), ref, **F64)


@pytest.mark.parametrize("name", ["sage", "gin"])
def test_decoupled_mean_and_sum_against_dense(name):
    graph, K = random_graph(loops=3), 2
    torch.manual_seed(0)
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, decoupled=True, num_props=K,
                    dropout=0.0).to(TEST_DEVICE, torch.float64)
    x = features()
    a = dense_adjacency(graph, with_loops=True)
    prop = a / a.sum(1, keepdim=True) if name == "sage" else a
    ref = mlp_reference(m, x)
    for _ in range(K):
        ref = prop @ ref
    torch.testing.assert_close(run(m, graph, x), ref, **F64)


def test_tagcn_propagates_without_self_loops_and_picks_the_narrow_order():
    graph = random_graph(loops=4)
    for decoupled in (False, True):
        m = build_model("tagcn", IN_DIM, HIDDEN, OUT_DIM, decoupled=decoupled)
        pg, norms = propagation_inputs(m, graph)
        assert m.self_loops is False and not pg.has_self_loops() and set(norms) == {"gcn"}
    # K = 3 propagates 6 x in (aggregate first) or 3 x out columns per layer
    wide = build_model("tagcn", 4, 16, 9, num_layers=1)
    assert wide.signature() == "TPTPTPT"
    assert [s.in_dim for s in wide.stages if isinstance(s, Propagate)] == [4, 8, 12]
    assert build_model("tagcn", 4, 16, 8, num_layers=1).signature() == "TTPTPTPT"


@pytest.mark.parametrize("K", [1, 3])
def test_tagcn_decoupled_is_mlp_then_sum_of_hops(K):
    graph = random_graph(loops=4)  # input loops are dropped
    torch.manual_seed(0)
    m = build_model("tagcn", IN_DIM, HIDDEN, OUT_DIM, decoupled=True, num_props=K,
                    dropout=0.0).to(TEST_DEVICE, torch.float64)
    x = features()
    a = dense_adjacency(graph, with_loops=False)
    deg = a.sum(1)
    d_inv_sqrt = torch.where(deg > 0, deg.rsqrt(), torch.zeros_like(deg))
    a_hat = d_inv_sqrt[:, None] * a * d_inv_sqrt[None, :]
    h = x
    for s in m.stages:
        if isinstance(s, Dense) and s.lin is not None:
            h = F.linear(h, s.lin.weight, s.bias)
            h = torch.relu(h) if s.act_name == "relu" else h
    ref, hop = h.clone(), h
    for _ in range(K):
        hop = a_hat @ hop
        ref = ref + hop
    torch.testing.assert_close(run(m, graph, x), ref, **F64)


def test_decoupled_gat_computes_attention_once_and_reuses_it():
    graph, K = random_graph(), 3
    torch.manual_seed(0)
    m = build_model("gat", IN_DIM, HIDDEN, OUT_DIM, decoupled=True, num_props=K,
                    dropout=0.0, attn_dropout=0.0).to(TEST_DEVICE, torch.float64)
    x = features()
    h = mlp_reference(m, x)
    att = [s for s in m.stages if isinstance(s, GATAttention)][0]
    assert att.heads == 1 and att.channels == OUT_DIM
    a = dense_adjacency(graph, with_loops=True)
    scores = (h @ att.att_dst[0])[:, None] + (h @ att.att_src[0])[None, :]  # [dst, src]
    scores = F.leaky_relu(scores, 0.2).masked_fill(a == 0, float("-inf"))
    alpha = torch.softmax(scores, dim=1)
    ref = h
    for _ in range(K):
        ref = alpha @ ref
    torch.testing.assert_close(run(m, graph, x), ref, **F64)


# ---------------------------------------------------------------- keyed dropout
@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin"])
def test_dropout_depends_on_seed_only(name):
    graph, x = random_graph(), features(dtype=torch.float32)
    torch.manual_seed(0)
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, dropout=0.5).to(TEST_DEVICE)
    a = run(m, graph, x, seed=1, training=True)
    torch.manual_seed(123)  # the global RNG plays no part
    b = run(m, graph, x, seed=1, training=True)
    c = run(m, graph, x, seed=2, training=True)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    # eval: no dropout, and the seed does not matter
    e1, e2 = run(m, graph, x, seed=1), run(m, graph, x, seed=2)
    assert torch.equal(e1, e2) and not torch.allclose(a, e1)


def test_attention_dropout_keyed_by_edge_ids():
    graph, x = random_graph(), features(dtype=torch.float32)
    torch.manual_seed(0)
    m = build_model("gat", IN_DIM, 4, OUT_DIM, heads=2, dropout=0.0, attn_dropout=0.5)
    m = m.to(TEST_DEVICE)
    a = run(m, graph, x, seed=5, training=True)
    assert torch.equal(a, run(m, graph, x, seed=5, training=True))
    assert not torch.allclose(a, run(m, graph, x, seed=6, training=True))
    assert not torch.allclose(a, run(m, graph, x, seed=5, training=False))
    pg, norms = propagation_inputs(m, graph.to(TEST_DEVICE))
    with pytest.raises(ValueError, match="eids"):
        m(pg, norms, x, StageContext(torch.arange(N, device=pg.device), 5, True, eids=None))


def test_stages_get_distinct_masks():
    """Two LayerInput stages with the same shape drop different entries."""
    m = build_model("gcn", HIDDEN, HIDDEN, HIDDEN, num_layers=2, dropout=0.5,
                    aggregate_first=True).to(TEST_DEVICE)
    inputs = [s for s in m.stages if isinstance(s, LayerInput)]
    ones = torch.ones(N, HIDDEN, device=TEST_DEVICE)
    ctx = StageContext(torch.arange(N, device=TEST_DEVICE), seed=9, training=True)
    m0, m1 = (s(ones, ctx) for s in inputs)
    assert not torch.equal(m0, m1)


def test_keyed_dropout_on_a_subset_of_rows():
    m = build_model("gcn", IN_DIM, HIDDEN, OUT_DIM, decoupled=True, dropout=0.5)
    m = m.to(TEST_DEVICE)
    x = features(dtype=torch.float32)
    ctx = StageContext(torch.arange(N, device=TEST_DEVICE), seed=17, training=True)
    rows = torch.tensor([3, 7, 9], device=TEST_DEVICE)
    layer_input = m.stages[0]
    full = layer_input(x, ctx)
    assert (full == 0).any() and (full != 0).any()
    torch.testing.assert_close(layer_input(x[rows], ctx.rows(rows)), full[rows], rtol=0, atol=0)
    # in any order, and through the whole (row-wise) MLP of the decoupled model
    perm = torch.tensor([9, 3, 7], device=TEST_DEVICE)

    def mlp(h, c):
        li = None
        for s in m.stages:
            if not isinstance(s, Transform):
                break
            h = s(h, c, li)
            li = h if isinstance(s, LayerInput) else li
        return h

    full_mlp = mlp(x, ctx)
    # (matmuls over 3 rows and over N rows may round differently: not bitwise)
    torch.testing.assert_close(mlp(x[perm], ctx.rows(perm)), full_mlp[perm])


# ------------------------------------------------------------------- residual
def test_residual_flags_on_width_preserving_layers():
    for name, opts, hidden_width in [("gcn", {}, HIDDEN), ("sage", {}, HIDDEN),
                                     ("gat", {"heads": 2}, 2 * HIDDEN),
                                     ("gcn", {"decoupled": True}, HIDDEN)]:
        m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=3, residual=True, **opts)
        for layer in range(3):
            stages = [s for s, lay in zip(m.stages, m.layer_of) if lay == layer]
            flags = [s.residual for s in stages if isinstance(s, (Dense, GATOutput))]
            assert any(flags) == (layer == 1), (name, opts, layer, flags)
            if layer == 1:
                assert stages[0].in_dim == stages[-1].out_dim == hidden_width
                assert stages[-1].uses_layer_input


@pytest.mark.parametrize("aggregate_first", [True, False])
def test_residual_gcn_against_dense(aggregate_first):
    graph = random_graph()
    torch.manual_seed(0)
    m = build_model("gcn", IN_DIM, HIDDEN, OUT_DIM, num_layers=3, residual=True, dropout=0.0,
                    aggregate_first=aggregate_first).to(TEST_DEVICE, torch.float64)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.1)
    a = dense_adjacency(graph, with_loops=True)
    d = a.sum(1).rsqrt()
    a_hat = d[:, None] * a * d[None, :]
    weights = [[s for s, lay in zip(m.stages, m.layer_of) if lay == k] for k in range(3)]
    lin = [next(s.lin.weight for s in st if isinstance(s, Dense) and s.lin is not None)
           for st in weights]
    bias = [next(s.bias for s in st if isinstance(s, Dense) and s.bias is not None)
            for st in weights]
    x = features()
    h0 = torch.relu(a_hat @ x @ lin[0].T + bias[0])
    h1 = torch.relu(a_hat @ h0 @ lin[1].T + bias[1] + h0)  # residual before activation
    ref = a_hat @ h1 @ lin[2].T + bias[2]
    torch.testing.assert_close(run(m, graph, x), ref, **F64)
    # and the residual is really there: without it the output changes
    for s in m.stages:
        if isinstance(s, Dense):
            s.residual = False
    assert not torch.allclose(run(m, graph, x), ref)


# ----------------------------------------------------------- invalid options
@pytest.mark.parametrize("call, match", [
    (lambda: build_model("gcnn", 4, 4, 2), "unknown model"),
    (lambda: build_model("gcn", 4, 4, 2, num_layers=0), "num_layers"),
    (lambda: build_model("gat", 4, 4, 2, num_layers=-1), "num_layers"),
    (lambda: build_model("gin", 4, 4, 2, residual=True), "residual"),
    (lambda: build_model("gcn", 4, 4, 2, decoupled=True, num_props=0), "num_props"),
    (lambda: build_model("tagcn", 4, 4, 2, hops=0), "hops"),
    (lambda: build_model("sage", 4, 4, 2, activation="swish"), "activation"),
    (lambda: Propagate(4, "max"), "norm"),
    (lambda: StageProgram([Dense(4, 4)], self_loops=True, name="x"), "LayerInput"),
    (lambda: StageProgram([LayerInput(4, 0.0), Propagate(4, "edge")], self_loops=True,
                          name="x"), "EdgeTransform"),
    (lambda: Dense(4, 5, linear=False), "width"),
])
def test_invalid_options_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("field, value", [("dropout", 1.0), ("dropout", -0.1),
                                          ("attn_dropout", 1.5), ("input_dropout", 1.0),
                                          ("layers", 0), ("name", "mlp"), ("num_props", 0),
                                          ("hops", 0)])
def test_model_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field if field != "attn_dropout" else "attn"):
        ModelConfig(**{field: value})
    assert issubclass(ConfigError, ValueError)


def test_model_config_options_build_the_model():
    cfg = ModelConfig(name="gat", hidden=4, layers=3, dropout=0.2, heads=2, decoupled=False)
    m = build_model(cfg.name, IN_DIM, cfg.hidden, OUT_DIM, **cfg.build_options())
    assert m.signature() == "TTEPT TTEPT TTEPT"
    assert [s.p for s in m.stages if isinstance(s, LayerInput)] == [0.2, 0.2, 0.2]


@pytest.mark.parametrize("options", [dict(dropout=1.0), dict(dropout=-0.5),
                                     dict(input_dropout=1.5)])
def test_bad_dropout_is_refused_when_building(options):
    """A model built directly (not through ModelConfig) refuses p outside [0, 1)."""
    with pytest.raises(ValueError, match="dropout"):
        build_model("gcn", IN_DIM, HIDDEN, OUT_DIM, **options)
    with pytest.raises(ValueError, match="dropout"):
        build_model("gat", IN_DIM, HIDDEN, OUT_DIM, attn_dropout=options.get("dropout", 1.0))


def test_model_config_hops_reach_tagcn_and_warn_elsewhere():
    cfg = ModelConfig(name="tagcn", hops=2, layers=1)
    m = build_model(cfg.name, IN_DIM, cfg.hidden, OUT_DIM, **cfg.build_options())
    assert m.signature() == "TTPTPT"
    for other in (dict(name="gcn"), dict(name="tagcn", decoupled=True)):
        with pytest.warns(UserWarning, match="hops has no effect"):
            ModelConfig(hops=2, **other)


@pytest.mark.parametrize("name", ["gcn", "sage", "gat", "gin"])
def test_the_walk_lets_go_of_what_no_later_stage_reads(name):
    """Layer inputs and attention weights leave the carry after their last reader, so
    the forward does not hold every layer's dropped input to its end."""
    from fullgraph.models.walk import Carry, GraphRunner, describe, walk

    graph, x = random_graph(), features(dtype=torch.float32)
    torch.manual_seed(0)
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=3, dropout=0.5).to(TEST_DEVICE)
    pg, norms = propagation_inputs(m, graph.to(TEST_DEVICE))
    ctx = full_ctx(pg, 3, True)
    seen: list[int] = []
    carry = Carry()

    class Watched(GraphRunner):
        def transform(self, s, stage, h, layer_input):
            seen.append(len(carry.layer_inputs) + len(carry.edge_weights))
            return super().transform(s, stage, h, layer_input)

    out = walk(m, Watched(pg, norms, ctx), x, carry=carry)
    torch.testing.assert_close(out, m(pg, norms, x, ctx))
    assert carry.layer_inputs == {} and carry.edge_weights == {}
    assert max(seen) <= 2  # never more than one layer's values at once
    assert sum(i.opens_layer for i in describe(m)) == 3


@pytest.mark.parametrize("name, folds", [("gcn", 1), ("sage", 0), ("gin", 0)])
def test_the_walk_lets_a_product_write_over_a_relu_output_only_it_reads(name, folds,
                                                                         monkeypatch):
    """GCN's last layer (its width shrinks: the product comes before the propagation):
    the dropout's output is read by the next product alone and
    its input by the dropout alone, so the walker marks it (``mark_sole``) and the
    product's backward writes the ReLU input's gradient over the ReLU's output; the
    dropped rows are never made either (the product rebuilds them, a block at a time).
    The gradients are the same bits as the walk's without either. GraphSAGE's root weight reads its
    layer input too: no mark there."""
    if TEST_DEVICE.type != "cpu":
        pytest.skip("the fold is a CPU path")
    from fullgraph.models import walk as walk_mod
    from fullgraph.ops import dropout as kd
    from fullgraph.ops import kernels

    if not kernels.HAVE_NUMBA:
        pytest.skip("the fold is numba's kernel")
    graph, x = random_graph(), features(dtype=torch.float64)
    torch.manual_seed(0)
    m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=3, dropout=0.5)
    pg, norms = propagation_inputs(m, graph, dtype=torch.float64)
    m = m.double()
    up = torch.randn(N, OUT_DIM, dtype=torch.float64)

    def grads():
        out = m(pg, norms, x, full_ctx(pg, 3, True))
        return torch.autograd.grad((out * up).sum(), list(m.parameters()))

    seen, made = [], []
    real, real_apply = kd._can_fold, kd._KeyedDropout.apply

    def spy(*a):  # records the backwards that write over their input
        folded = real(*a)
        if folded:
            seen.append(1)
        return folded

    monkeypatch.setattr(kd, "_can_fold", spy)
    monkeypatch.setattr(kd._KeyedDropout, "apply",
                        lambda *a: made.append(1) or real_apply(*a))
    folded = grads()
    assert len(seen) == folds
    assert len(made) == 3 - folds  # that layer's dropped input was never made
    monkeypatch.setattr(walk_mod, "mark_sole", lambda t: None)
    monkeypatch.setattr(walk_mod.GraphRunner, "passes_rows_through", False)
    seen.clear()
    made.clear()
    for a, b in zip(grads(), folded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not seen and len(made) == 3


def test_gins_bias_before_batch_norm_gets_its_exact_gradient_zero():
    """The norm cancels the bias before it, so its gradient is 0; autograd's was 0 up
    to rounding, which Adam turned into full steps that differed by strategy and fed
    the norm's running mean: saved models of data and tensor runs differed by 1e-3."""
    labels = torch.arange(N, device=TEST_DEVICE) % OUT_DIM
    for aggregate_first in (False, True):  # the bias of lin1, or bias1 after the sum
        torch.manual_seed(0)
        model = build_model("gin", IN_DIM, HIDDEN, OUT_DIM, batch_norm=True, dropout=0.0,
                            aggregate_first=aggregate_first).to(TEST_DEVICE, torch.float64)
        out = run(model, random_graph(), features(), training=True)
        F.cross_entropy(out, labels).backward()
        update = next(s for s in model.stages if type(s).__name__ == "GINUpdate")
        pre = update.bias1 if update.lin1 is None else update.lin1.bias
        assert pre.grad is not None and bool((pre.grad == 0).all()), pre.grad
        assert float(update.lin2.bias.grad.abs().max()) > 1e-6  # the others are not
