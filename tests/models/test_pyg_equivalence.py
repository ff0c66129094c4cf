"""Every coupled model equals its PyTorch Geometric counterpart: outputs and gradients.

For GCN, GraphSAGE, GAT, GIN and TAGCN we build a 2-layer fullgraph stage program and
the equivalent PyG stack (``GCNConv`` / ``SAGEConv`` / ``GATConv`` / ``GINConv`` /
``TAGConv``, ReLU
between layers, no dropout), copy our parameters into PyG's modules and compare, in
float64, the logits and the gradients of every parameter and of the input features
for a fixed random linear loss. The graph is a random symmetric graph without
self-loops (PyG adds its own for GCN and GAT; ours come from ``propagation_inputs``)
with an isolated vertex; the features are Cora-like sparse binary bag-of-words rows.
Both sides run on the test device (``FULLGRAPH_TEST_DEVICE``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from devices import TEST_DEVICE, cpu_only

pyg_nn = pytest.importorskip("torch_geometric.nn")

from fullgraph.graph.csr import Graph  # noqa: E402
from fullgraph.models import StageContext, build_model, propagation_inputs  # noqa: E402
from fullgraph.models.gat import GATAttention, GATOutput  # noqa: E402
from fullgraph.models.gin import GINUpdate  # noqa: E402
from fullgraph.models.layers import Dense  # noqa: E402
from fullgraph.ops import kernels  # noqa: E402
from fullgraph.ops.spmm import set_backend  # noqa: E402

N, IN_DIM, HIDDEN, OUT_DIM = 60, 24, 16, 5
F64 = dict(rtol=1e-10, atol=1e-10)
# float32: sums over ~10 neighbours of O(1) values and two layers; the two libraries
# sum in different orders, so agreement is to a few ulps of the result scale.
F32 = dict(rtol=1e-4, atol=1e-5)
# numba's kernels are CPU only: on a GPU every backend resolves to torch
NUMBA = pytest.param("numba", marks=cpu_only("numba's kernels"))
BACKENDS = ["torch"] + ([NUMBA] if kernels.HAVE_NUMBA else [])


# ------------------------------------------------------------------- fixtures
@pytest.fixture(params=BACKENDS)
def backend(request):
    set_backend(request.param)
    yield request.param
    set_backend("auto")


def random_graph(seed: int = 0) -> Graph:
    """~300 directed edges (150 random pairs, symmetrised), no self-loops; the last
    vertex is isolated (no in- or out-edges)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, N - 1, (160,), generator=g)
    dst = torch.randint(0, N - 1, (160,), generator=g)
    graph = Graph.from_edges(src, dst, N, symmetrize=True, self_loops="remove")
    assert not graph.has_self_loops() and 250 <= graph.num_edges <= 320
    assert int(graph.in_degrees()[N - 1]) == 0
    return graph


def cora_like_features(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Sparse binary bag-of-words rows (~10% ones), row-normalised like Cora's."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(N, IN_DIM, generator=g) < 0.1).to(dtype)
    x[torch.arange(N), torch.randint(0, IN_DIM, (N,), generator=g)] = 1.0  # no empty row
    return x / x.sum(1, keepdim=True)


def edge_index_of(graph: Graph) -> torch.Tensor:
    src, dst = graph.edges()
    return torch.stack([src, dst])


# ----------------------------------------------- PyG models and weight copies
class PygStack(torch.nn.Module):
    """``conv -> relu -> conv`` like PyG's BasicGNN without dropout or norms."""

    def __init__(self, convs: list[torch.nn.Module]) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


def layer_stages(model, layer: int) -> list:
    return [s for s, lay in zip(model.stages, model.layer_of) if lay == layer]


def one(stages, pred):
    found = [s for s in stages if pred(s)]
    assert len(found) == 1, found
    return found[0]


def pair(ours: torch.nn.Parameter, theirs: torch.nn.Parameter, pairs: list) -> None:
    """Copy ``ours`` into ``theirs`` (reshaped) and remember the pair for gradients."""
    assert ours.numel() == theirs.numel(), (ours.shape, theirs.shape)
    with torch.no_grad():
        theirs.copy_(ours.detach().reshape(theirs.shape))
    pairs.append((ours, theirs))


def gcn_like_pairs(model, pyg: PygStack, kind: str) -> list:
    pairs: list = []
    for layer, conv in enumerate(pyg.convs):
        stages = layer_stages(model, layer)
        dense = [s for s in stages if isinstance(s, Dense)]
        lin = one(dense, lambda s: s.lin is not None)
        bias = one(dense, lambda s: s.bias is not None)
        if kind == "gcn":
            pair(lin.lin.weight, conv.lin.weight, pairs)
            pair(bias.bias, conv.bias, pairs)
        else:
            root = one(dense, lambda s: s.root is not None)
            pair(lin.lin.weight, conv.lin_l.weight, pairs)
            pair(bias.bias, conv.lin_l.bias, pairs)
            pair(root.root.weight, conv.lin_r.weight, pairs)
    assert len(pairs) == len(list(pyg.parameters()))
    return pairs


def gat_pairs(model, pyg: PygStack) -> list:
    pairs: list = []
    for layer, conv in enumerate(pyg.convs):
        stages = layer_stages(model, layer)
        lin = one(stages, lambda s: isinstance(s, Dense))
        att = one(stages, lambda s: isinstance(s, GATAttention))
        out = one(stages, lambda s: isinstance(s, GATOutput))
        lin_w = conv.lin.weight if getattr(conv, "lin", None) is not None else conv.lin_src.weight
        pair(lin.lin.weight, lin_w, pairs)
        pair(att.att_src, conv.att_src, pairs)
        pair(att.att_dst, conv.att_dst, pairs)
        pair(out.bias, conv.bias, pairs)
    assert len(pairs) == len(list(pyg.parameters()))
    return pairs


def gin_first_linear(model, layer: int) -> tuple:
    """(weight, bias) of GIN layer ``layer``'s first MLP layer: the update's own, or,
    where the layer applies the weight before the sum, the Dense stage's weight and the
    update's ``bias1``."""
    stages = layer_stages(model, layer)
    upd = one(stages, lambda s: isinstance(s, GINUpdate))
    if upd.lin1 is not None:
        return upd.lin1.weight, upd.lin1.bias
    return one(stages, lambda s: isinstance(s, Dense)).lin.weight, upd.bias1


def gin_pairs(model, pyg: PygStack) -> list:
    pairs: list = []
    for layer, conv in enumerate(pyg.convs):
        upd = one(layer_stages(model, layer), lambda s: isinstance(s, GINUpdate))
        w1, b1 = gin_first_linear(model, layer)
        pair(w1, conv.nn[0].weight, pairs)
        pair(b1, conv.nn[0].bias, pairs)
        if upd.norm is not None:  # Linear, BatchNorm1d, ReLU, Linear
            pair(upd.norm.weight, conv.nn[1].weight, pairs)
            pair(upd.norm.bias, conv.nn[1].bias, pairs)
        pair(upd.lin2.weight, conv.nn[-1].weight, pairs)
        pair(upd.lin2.bias, conv.nn[-1].bias, pairs)
    assert len(pairs) == len(list(pyg.parameters()))
    return pairs


class Cat:
    """PyG parameters that one of ours holds side by side (TAGCN's hop weights when it
    aggregates first): ``grad`` is theirs concatenated along the input columns."""

    def __init__(self, params: list) -> None:
        self.params = params

    @property
    def grad(self) -> torch.Tensor:
        return torch.cat([p.grad for p in self.params], dim=1)


def tagcn_pairs(model, pyg: PygStack) -> list:
    """Projection first: ``X W_K``, then roots ``W_{K-1} .. W_0``; aggregate first: one
    weight ``[W_K .. W_1]`` on ``[A^K X .. A X]`` and the root ``W_0``."""
    pairs: list = []
    for layer, conv in enumerate(pyg.convs):
        dense = [s for s in layer_stages(model, layer) if isinstance(s, Dense)]
        lins = list(conv.lins)
        if len(dense) == 1:
            (d,) = dense
            blocks = lins[:0:-1]  # W_K .. W_1
            with torch.no_grad():
                for block, w in zip(blocks, d.lin.weight.split(conv.in_channels, dim=1)):
                    block.weight.copy_(w)
            pairs.append((d.lin.weight, Cat([b.weight for b in blocks])))
            pair(d.root.weight, lins[0].weight, pairs)
        else:
            pair(dense[0].lin.weight, lins[-1].weight, pairs)
            for d, lin in zip(dense[1:], lins[-2::-1]):
                pair(d.root.weight, lin.weight, pairs)
        pair(one(dense, lambda s: s.bias is not None).bias, conv.bias, pairs)
    return pairs


def build_pair(case: str, dtype: torch.dtype, seed: int = 0):
    """(our model, PyG model, parameter pairs) for ``case``, weights copied."""
    torch.manual_seed(seed)
    name, _, variant = case.partition(":")
    if name in ("gcn", "sage"):
        first = {"agg_first": True, "agg_last": False}[variant]
        ours = build_model(name, IN_DIM, HIDDEN, OUT_DIM, num_layers=2, dropout=0.0,
                           aggregate_first=first)
        Conv = pyg_nn.GCNConv if name == "gcn" else pyg_nn.SAGEConv
        pyg = PygStack([Conv(IN_DIM, HIDDEN), Conv(HIDDEN, OUT_DIM)])
        ours, pyg = ours.to(TEST_DEVICE, dtype), pyg.to(TEST_DEVICE, dtype)
        pairs = gcn_like_pairs(ours, pyg, name)
    elif name == "gat":
        heads, out_heads = {"concat_1": (4, 1), "concat_avg3": (3, 3)}[variant]
        ours = build_model("gat", IN_DIM, HIDDEN, OUT_DIM, num_layers=2, dropout=0.0,
                           heads=heads, out_heads=out_heads, attn_dropout=0.0)
        pyg = PygStack([
            pyg_nn.GATConv(IN_DIM, HIDDEN, heads=heads, concat=True, dropout=0.0),
            pyg_nn.GATConv(heads * HIDDEN, OUT_DIM, heads=out_heads, concat=False, dropout=0.0),
        ])
        ours, pyg = ours.to(TEST_DEVICE, dtype), pyg.to(TEST_DEVICE, dtype)
        pairs = gat_pairs(ours, pyg)
    elif name in ("gin", "gin_bn"):
        eps, bn = float(variant), name == "gin_bn"
        ours = build_model("gin", IN_DIM, HIDDEN, OUT_DIM, num_layers=2, dropout=0.0, eps=eps,
                           batch_norm=bn)

        def mlp(i, o):
            norm = [torch.nn.BatchNorm1d(HIDDEN)] if bn else []
            return torch.nn.Sequential(torch.nn.Linear(i, HIDDEN), *norm, torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, o))

        pyg = PygStack([pyg_nn.GINConv(mlp(IN_DIM, HIDDEN), eps=eps, train_eps=False),
                        pyg_nn.GINConv(mlp(HIDDEN, OUT_DIM), eps=eps, train_eps=False)])
        ours, pyg = ours.to(TEST_DEVICE, dtype), pyg.to(TEST_DEVICE, dtype)
        with torch.no_grad():  # PyG stores a fixed eps as a float32 buffer: 0.3 + 1.2e-8
            for conv in pyg.convs:
                conv.eps.fill_(eps)
        pairs = gin_pairs(ours, pyg)
    elif name == "tagcn":
        ours = build_model("tagcn", IN_DIM, HIDDEN, OUT_DIM, num_layers=2, dropout=0.0,
                           aggregate_first={"agg_first": True, "agg_last": False}[variant])
        pyg = PygStack([pyg_nn.TAGConv(IN_DIM, HIDDEN), pyg_nn.TAGConv(HIDDEN, OUT_DIM)])
        ours, pyg = ours.to(TEST_DEVICE, dtype), pyg.to(TEST_DEVICE, dtype)
        pairs = tagcn_pairs(ours, pyg)
    else:  # pragma: no cover
        raise AssertionError(case)
    # a zero bias would hide a bias that is added at the wrong place: randomise all
    with torch.no_grad():
        for p, q in pairs:
            if p.dim() == 1:
                p.normal_(0.0, 0.1)
                q.copy_(p.reshape(q.shape))
    assert len(pairs) == len(list(ours.parameters())), "some parameter of ours has no PyG peer"
    return ours, pyg, pairs


def run_both(case: str, dtype: torch.dtype):
    graph = random_graph().to(TEST_DEVICE)
    ours, pyg, pairs = build_pair(case, dtype)
    x = cora_like_features(dtype).to(TEST_DEVICE)
    proj = torch.randn(N, OUT_DIM, generator=torch.Generator().manual_seed(7), dtype=dtype)
    proj = proj.to(TEST_DEVICE)

    pg, norms = propagation_inputs(ours, graph.to(TEST_DEVICE), dtype=dtype)
    ctx = StageContext(gids=torch.arange(N, device=TEST_DEVICE), seed=0, training=True,
                       eids=torch.arange(pg.num_edges, device=TEST_DEVICE))
    x_ours = x.clone().requires_grad_(True)
    out_ours = ours(pg, norms, x_ours, ctx)
    (out_ours * proj).sum().backward()

    x_pyg = x.clone().requires_grad_(True)
    out_pyg = pyg(x_pyg, edge_index_of(graph))
    (out_pyg * proj).sum().backward()
    return out_ours, out_pyg, x_ours.grad, x_pyg.grad, pairs


CASES = ["gcn:agg_first", "gcn:agg_last", "sage:agg_first", "sage:agg_last",
         "gat:concat_1", "gat:concat_avg3", "gin:0.0", "gin:0.3", "gin_bn:0.0",
         "gin_bn:0.3",
         "tagcn:agg_first", "tagcn:agg_last"]


@pytest.mark.parametrize("case", CASES)
def test_float64_outputs_and_gradients_match_pyg(case, backend):
    out, ref, gx, gx_ref, pairs = run_both(case, torch.float64)
    assert out.dtype == torch.float64 and out.shape == (N, OUT_DIM)
    assert out.abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(gx, gx_ref, **F64)
    for ours, theirs in pairs:
        assert ours.grad is not None and theirs.grad is not None
        torch.testing.assert_close(ours.grad, theirs.grad.reshape(ours.shape), **F64)


@pytest.mark.parametrize("case", ["gcn:agg_last", "gat:concat_1"])
def test_float32_matches_pyg_with_looser_tolerance(case):
    out, ref, gx, gx_ref, pairs = run_both(case, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **F32)
    torch.testing.assert_close(gx, gx_ref, **F32)
    for ours, theirs in pairs:
        torch.testing.assert_close(ours.grad, theirs.grad.reshape(ours.shape), **F32)


def test_gcn_and_sage_aggregation_orders_agree_with_each_other():
    """aggregate_first=True/False/None are one function: same weights, same logits."""
    graph = random_graph().to(TEST_DEVICE)
    x = cora_like_features(torch.float64).to(TEST_DEVICE)
    for name in ("gcn", "sage"):
        outs = []
        for first in (True, False, None):
            torch.manual_seed(3)
            m = build_model(name, IN_DIM, HIDDEN, OUT_DIM, dropout=0.0,
                            aggregate_first=first).to(TEST_DEVICE, torch.float64)
            if outs:  # copy parameters by role from the first model
                ref = outs[0][0]
                for layer in range(2):
                    a = [s for s in layer_stages(ref, layer) if isinstance(s, Dense)]
                    b = [s for s in layer_stages(m, layer) if isinstance(s, Dense)]
                    for attr in ("lin", "root") if name == "sage" else ("lin",):
                        sa = one(a, lambda s: getattr(s, attr) is not None)
                        sb = one(b, lambda s: getattr(s, attr) is not None)
                        getattr(sb, attr).weight.data.copy_(getattr(sa, attr).weight)
                    sa = one(a, lambda s: s.bias is not None)
                    sb = one(b, lambda s: s.bias is not None)
                    sb.bias.data.copy_(sa.bias)
            pg, norms = propagation_inputs(m, graph.to(TEST_DEVICE), dtype=torch.float64)
            ctx = StageContext(torch.arange(N, device=TEST_DEVICE), 0, False,
                               torch.arange(pg.num_edges, device=TEST_DEVICE))
            outs.append((m, m(pg, norms, x, ctx)))
        for _, o in outs[1:]:
            torch.testing.assert_close(o, outs[0][1], **F64)


# ------------------------------------------------------------ initialisation
# Amazon Photo's shapes: the bounds differ most where fan-in and fan-out differ.
INIT_IN, INIT_HIDDEN, INIT_OUT = 745, 64, 8


def init_pairs(name: str, first: bool | None = None) -> list:
    """(ours, PyG's) parameter pairs of freshly initialised 2-layer models (no copy)."""
    torch.manual_seed(11)
    dims = [(INIT_IN, INIT_HIDDEN), (INIT_HIDDEN, INIT_OUT)]
    if name == "gin":
        ours = build_model("gin", INIT_IN, INIT_HIDDEN, INIT_OUT, dropout=0.0)
        pyg = PygStack([pyg_nn.GINConv(torch.nn.Sequential(
            torch.nn.Linear(i, INIT_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(INIT_HIDDEN, o)))
            for i, o in dims])
        pairs: list = []
        for layer, conv in enumerate(pyg.convs):
            upd = one(layer_stages(ours, layer), lambda s: isinstance(s, GINUpdate))
            w1, b1 = gin_first_linear(ours, layer)
            pairs += [(w1, conv.nn[0].weight), (b1, conv.nn[0].bias),
                      (upd.lin2.weight, conv.nn[2].weight), (upd.lin2.bias, conv.nn[2].bias)]
        return pairs
    ours = build_model(name, INIT_IN, INIT_HIDDEN, INIT_OUT, dropout=0.0, aggregate_first=first)
    if name == "tagcn":
        convs = [pyg_nn.TAGConv(i, o) for i, o in dims]
        pairs = []
        for layer, conv in enumerate(convs):
            dense = [s for s in layer_stages(ours, layer) if isinstance(s, Dense)]
            weights = [w for s in dense for m in (s.lin, s.root) if m is not None
                       for w in m.weight.split(conv.in_channels, dim=1)]
            # ours in hop order K .. 0 in both aggregation orders
            pairs += list(zip(weights, [lin.weight for lin in conv.lins][::-1]))
            pairs.append((one(dense, lambda s: s.bias is not None).bias, conv.bias))
        return pairs
    Conv = pyg_nn.GCNConv if name == "gcn" else pyg_nn.SAGEConv
    pyg = PygStack([Conv(i, o) for i, o in dims])
    pairs = []
    for layer, conv in enumerate(pyg.convs):
        dense = [s for s in layer_stages(ours, layer) if isinstance(s, Dense)]
        lin = one(dense, lambda s: s.lin is not None).lin.weight
        bias = one(dense, lambda s: s.bias is not None).bias
        if name == "gcn":
            pairs += [(lin, conv.lin.weight), (bias, conv.bias)]
        else:
            root = one(dense, lambda s: s.root is not None).root.weight
            pairs += [(lin, conv.lin_l.weight), (bias, conv.lin_l.bias),
                      (root, conv.lin_r.weight)]
    return pairs


@pytest.mark.parametrize("case", ["gcn:True", "gcn:False", "sage:True", "sage:False", "gin",
                                  "tagcn:True", "tagcn:False"])
def test_initialisation_matches_pyg_layers(case):
    """Each parameter is drawn from the distribution of its PyG peer: same support
    (max |w| within 2% of the largest entry of PyG's for weights), same spread (std within
    5% for weights, 30% for the 64- or 8-entry biases), zero where PyG's is zero."""
    name, _, first = case.partition(":")
    for ours, theirs in init_pairs(name, {"True": True, "False": False}.get(first)):
        ours, theirs = ours.detach(), theirs.detach()
        assert ours.shape == theirs.reshape(ours.shape).shape
        bound = float(theirs.abs().max())
        if bound == 0.0:  # GCNConv's bias
            assert float(ours.abs().max()) == 0.0, case
            continue
        fan_in = theirs.shape[-1] if theirs.dim() == 2 else None
        big = theirs.numel() > 200
        assert float(ours.abs().max()) <= bound * (1.02 if big else 2.0), (case, fan_in)
        assert float(ours.abs().max()) >= bound * (0.9 if big else 0.5), (case, fan_in)
        rel = float(ours.std()) / float(theirs.std())
        assert abs(rel - 1.0) <= (0.05 if big else 0.3), (case, ours.shape, rel)


# ------------------------------------------------------------ whole training runs
@pytest.mark.parametrize("case", ["sage:agg_last", "gin_bn:0.0", "gin_bn:0.3"])
def test_training_run_matches_pyg_loop(case, monkeypatch):
    """``fullgraph.train`` from PyG's weights equals a plain PyG loop epoch by epoch.

    Without dropout, in float64: the same losses, validation and test accuracies and
    best epoch over 25 epochs of Adam with weight decay, evaluating in eval mode after
    each step. This covers what the one-step checks above do not: the optimiser and
    its weight decay, batch normalisation's running statistics and evaluation mode, and
    the choice of the best-validation epoch.
    """
    from fullgraph import train as fg_train
    from fullgraph.bench.pyg_accuracy import PygNet, adjacency
    from fullgraph.config import Config, ModelConfig, TrainConfig
    from fullgraph.graph.synthetic import sbm

    name, _, variant = case.partition(":")
    ds = sbm(240, 4, avg_degree=6.0, num_features=40, homophily=0.6, feature_noise=3.0,
             seed=5)
    hidden, epochs = 16, 25
    bn = name == "gin_bn"
    cfg = Config(model=ModelConfig(name="gin" if bn else name, hidden=hidden, dropout=0.0,
                                   batch_norm=bn),
                 train=TrainConfig(epochs=epochs, lr=0.02, seed=3, device=str(TEST_DEVICE)))
    pyg = PygNet("gin-bn" if bn else name, ds.data.num_features, hidden,
                 ds.data.num_classes, 0.0).to(TEST_DEVICE, torch.float64)
    if bn:
        eps = float(variant)  # not a config option: the model is built here with it
        ours = build_model("gin", ds.data.num_features, hidden, ds.data.num_classes,
                           dropout=0.0, batch_norm=True, eps=eps).to(TEST_DEVICE, torch.float64)
        assert any(isinstance(s, Dense) for s in ours.stages) == (eps == 0.0)
        with torch.no_grad():
            for conv in pyg.convs:
                conv.eps.fill_(eps)
        gin_pairs(ours, pyg)
    else:
        ours = fg_train.build(ds, cfg).to(TEST_DEVICE, torch.float64)
        gcn_like_pairs(ours, pyg, name)
    start = copy.deepcopy(ours)
    monkeypatch.setattr(fg_train, "build", lambda *_: copy.deepcopy(start))
    result = fg_train.train(ds, cfg, dtype=torch.float64)

    opt = torch.optim.Adam(pyg.parameters(), lr=cfg.train.lr,
                           weight_decay=cfg.train.weight_decay)
    x, y, adj_t = ds.data.features_as(torch.float64), ds.data.labels, adjacency(ds)
    x, y, adj_t = x.to(TEST_DEVICE), y.to(TEST_DEVICE), adj_t.to(TEST_DEVICE, torch.float64)
    masks = tuple(m.to(TEST_DEVICE) for m in (ds.data.train_mask, ds.data.val_mask,
                                                ds.data.test_mask))
    best = (-1.0, 0, float("nan"))
    for epoch, rec in enumerate(result.epochs, start=1):
        pyg.train()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(pyg(x, adj_t)[masks[0]], y[masks[0]])
        loss.backward()
        opt.step()
        pyg.eval()
        with torch.no_grad():
            hit = pyg(x, adj_t).argmax(1) == y
        val, test = (float(hit[m].double().mean()) for m in masks[1:])
        assert rec.loss == pytest.approx(loss.item(), rel=1e-9), (case, epoch)
        # the same hits; the two means may differ in the last bit (GPU reductions)
        assert (rec.val_acc, rec.test_acc) == pytest.approx((val, test), abs=1e-12), \
            (case, epoch)
        if val > best[0]:
            best = (val, epoch, test)
    assert len(result.epochs) == epochs
    assert result.best_epoch == best[1]
    assert (result.best_val, result.test_at_best) == pytest.approx((best[0], best[2]), abs=1e-12)
    assert best[1] > 1, "the run should improve on its first epoch"


@pytest.mark.parametrize("heads,channels", [(8, 8), (8, 64), (1, 7)])
def test_attention_vectors_are_drawn_as_pygs(heads, channels):
    """PyG's glorot on a (1, H, C) vector takes fans H and C; torch's xavier_uniform_ on
    that view took H * C and C, a 2-3x narrower range than the README's claim."""
    from fullgraph.models.gat import GATAttention

    torch.manual_seed(3)
    ours = torch.cat([GATAttention(heads, channels).att_src.detach().flatten()
                      for _ in range(20)])
    theirs = torch.cat([pyg_nn.GATConv(4, channels, heads=heads).att_src.detach().flatten()
                        for _ in range(20)])
    bound = (6.0 / (heads + channels)) ** 0.5
    assert float(ours.abs().max()) <= bound and float(ours.abs().max()) >= 0.9 * bound
    assert abs(float(ours.std()) / float(theirs.std()) - 1.0) <= 0.15
