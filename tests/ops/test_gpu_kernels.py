"""The Triton kernels of ``ops.gpu_kernels`` against the torch ops they replace.

On a GPU (``--device cuda``) they run compiled; elsewhere through Triton's
interpreter on CPU tensors, where Triton is installed (it comes with torch's CUDA
builds, not with the CPU build, so these tests skip on a CPU-only install).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from devices import ON_CUDA, TEST_DEVICE

from fullgraph.graph.csr import Graph
from fullgraph.ops import dropout as kd
from fullgraph.ops import gpu_kernels, kernels

es = importlib.import_module("fullgraph.ops.edge_softmax")
spmm = importlib.import_module("fullgraph.ops.spmm")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (torch's CPU build)")


@pytest.fixture(autouse=True)
def triton_on(monkeypatch, request):
    """The kernels on: compiled on CUDA, interpreted on the CPU."""
    if not ON_CUDA:
        if os.environ.get("TRITON_INTERPRET") != "1":  # (conftest sets it on the CPU)
            pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported")
        monkeypatch.setenv("FULLGRAPH_TRITON", "interpret")
        monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
        monkeypatch.setattr(spmm, "_AUTO", [None])  # (auto's choice without numba: not kept)
        _scalar_bounds(monkeypatch)
    monkeypatch.setattr(gpu_kernels, "_FAILED", [])
    assert gpu_kernels.available(TEST_DEVICE)
    yield
    assert request.node.name.startswith("test_a_failing") or not gpu_kernels._FAILED, \
        "a kernel failed and the torch ops ran instead"


def _scalar_bounds(monkeypatch) -> None:
    """The interpreter holds a loaded scalar as a one-entry array, which numpy 2 no
    longer turns into an int: a loop bounded by CSR offsets read in the kernel failed
    there (not on a GPU)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def random_graph(n_dst=40, n_src=50, edges=300, seed=0, empty_rows=True) -> Graph:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n_src, (edges,), generator=g)
    dst = torch.randint(0, n_dst, (edges,), generator=g)
    # row 3 a hub of 100 more in-edges: its loops take several steps of EDGES
    src = torch.cat([src, torch.randint(0, n_src, (100,), generator=g)])
    dst = torch.cat([dst, torch.full((100,), 3)])
    if empty_rows:  # rows 0 and 7 without in-edges
        keep = (dst != 0) & (dst != 7)
        src, dst = src[keep], dst[keep]
    order = torch.argsort(dst * n_src + src)
    src, dst = src[order], dst[order]
    indptr = torch.zeros(n_dst + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n_dst), 0)
    return Graph(indptr, src, num_src=n_src).to(TEST_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,p", [((300, 17), 0.4), ((41, 3), 0.5), ((1000, 200), 0.1)])
def test_dropout_kernel_is_the_torch_mask(monkeypatch, dtype, shape, p):
    """The same entries kept, with the same values, as the int32 torch ops; keys past
    2**32, new, into ``out``, in place, and rows at a stride (padded rows)."""
    rows, cols = shape
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols + 5, generator=gen, dtype=dtype).to(TEST_DEVICE)[:, :cols]
    keys = (torch.arange(rows) * 7 + 2**33).to(TEST_DEVICE)
    mode = os.environ.get("FULLGRAPH_TRITON", "auto")
    for seed in (12345, 1, 0xDEADBEEF):  # (1: no constant; past 2**31: all 32 bits)
        monkeypatch.setenv("FULLGRAPH_TRITON", mode)
        got_new = kd._apply_mask(x, keys, seed, p)
        got_out = torch.full((rows, cols), float("nan"), dtype=dtype, device=TEST_DEVICE)
        kd._apply_mask(x, keys, seed, p, out=got_out)
        inplace = x.contiguous().clone()
        kd._apply_mask(inplace, keys, seed, p, inplace=True)
        monkeypatch.setenv("FULLGRAPH_TRITON", "0")
        want = kd._apply_mask(x, keys, seed, p)
        for got in (got_new, got_out, inplace):
            assert torch.equal(got, want)


def test_dropout_kernel_at_a_hash_exactly():
    """An entry whose hash equals the threshold is kept, one below is dropped."""
    keys = (torch.arange(64) * 3 + 11).to(TEST_DEVICE)
    h = kd.entry_hashes(kd.row_hashes(keys, 99)[:, None],
                        torch.arange(9, device=TEST_DEVICE)[None, :])
    x = torch.ones(64, 9, device=TEST_DEVICE)
    for offset in (0, 1):
        p = (h[10, 4].item() + offset) * 2.0**-32
        want = h >= kd.keep_threshold(p)
        assert bool(want[10, 4]) == (offset == 0)
        assert torch.equal(kd._apply_mask(x, keys, 99, p) != 0, want)


@pytest.mark.parametrize("heads", [1, 3, 8])
def test_attention_is_the_torch_one(monkeypatch, heads):
    """Weights and both half-scores' gradients as the torch ops', rows without in-edges
    included; the same bits on a second run (no atomics)."""
    graph = random_graph()
    gen = torch.Generator().manual_seed(heads)
    s_src = torch.randn(graph.num_src, heads, generator=gen, dtype=torch.float64)
    s_dst = torch.randn(graph.num_dst, heads, generator=gen, dtype=torch.float64)
    grad = torch.randn(graph.num_edges, heads, generator=gen, dtype=torch.float64)

    def run():
        a = s_src.to(TEST_DEVICE).requires_grad_()
        b = s_dst.to(TEST_DEVICE).requires_grad_()
        alpha = es.attention_softmax(graph, a, b, 0.2)
        alpha.backward(grad.to(TEST_DEVICE))
        return alpha.detach(), a.grad, b.grad

    got, again = run(), run()
    monkeypatch.setenv("FULLGRAPH_TRITON", "0")
    want = run()
    for g, w, a in zip(got, want, again):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert torch.equal(g, a)


@pytest.mark.parametrize("heads,chans", [(8, 8), (3, 5), (2, 64), (16, 16)])
def test_spmm_and_sddmm_heads_are_the_torch_ones(monkeypatch, heads, chans):
    """The multi-head weighted SpMM forward and backward (the transposed one reads
    the weights through the permutation) and the weights' gradient (SDDMM)."""
    graph = random_graph()
    assert int(graph.in_degrees().max()) > gpu_kernels.EDGES
    if heads * chans > gpu_kernels.MAX_WIDTH:  # several programs per row
        assert gpu_kernels._head_blocks(heads, chans)[0] < heads
    gen = torch.Generator().manual_seed(chans)
    x = torch.randn(graph.num_src, heads * chans, generator=gen, dtype=torch.float64)
    w = torch.rand(graph.num_edges, heads, generator=gen, dtype=torch.float64)
    grad = torch.randn(graph.num_dst, heads * chans, generator=gen, dtype=torch.float64)

    def run():
        xs, ws = x.to(TEST_DEVICE).requires_grad_(), w.to(TEST_DEVICE).requires_grad_()
        out = spmm.spmm(graph, xs, ws)
        out.backward(grad.to(TEST_DEVICE))
        return out.detach(), xs.grad, ws.grad

    got = run()
    monkeypatch.setenv("FULLGRAPH_TRITON", "0")
    want = run()
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g, wnt, rtol=1e-10, atol=1e-12)


def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    def broken():
        raise RuntimeError("no compiler here\nmore detail")

    monkeypatch.setattr(gpu_kernels, "_kernels", broken)
    x, keys = torch.randn(20, 5, device=TEST_DEVICE), torch.arange(20, device=TEST_DEVICE)
    with pytest.warns(RuntimeWarning, match=r"Triton kernel dropout failed \(RuntimeError: "
                                            r"no compiler here\); torch ops from now on"):
        y = kd._apply_mask(x, keys, 3, 0.5)
    assert not gpu_kernels.available(TEST_DEVICE)
    monkeypatch.setenv("FULLGRAPH_TRITON", "0")
    assert torch.equal(y, kd._apply_mask(x, keys, 3, 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gat_trains_as_with_torch_ops(monkeypatch, dtype):
    """A 2-layer GAT with dropout on inputs and attention (8 heads, then 1): loss and
    every parameter's gradient as with the torch ops, through the model's own stages."""
    from fullgraph.models import StageContext, build_model, propagation_inputs

    n = 40
    gen = torch.Generator().manual_seed(4)
    src, dst = torch.randint(0, n, (160,), generator=gen), torch.randint(0, n, (160,),
                                                                          generator=gen)
    graph = Graph.from_edges(src, dst, n, symmetrize=True, self_loops="keep").to(TEST_DEVICE)
    x = torch.randn(n, 10, generator=gen, dtype=dtype).to(TEST_DEVICE)
    labels = torch.arange(n, device=TEST_DEVICE) % 3

    def run(m):
        pg, norms = propagation_inputs(m, graph, dtype=dtype)
        ctx = StageContext(gids=torch.arange(n, device=pg.device), seed=3, training=True,
                           eids=torch.arange(pg.num_edges, device=pg.device))
        return m(pg, norms, x, ctx)

    def grads():
        torch.manual_seed(0)
        m = build_model("gat", x.shape[1], 4, 3, heads=8, dropout=0.5,
                        attn_dropout=0.3).to(device=TEST_DEVICE, dtype=dtype)
        loss = torch.nn.functional.cross_entropy(run(m), labels)
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    got = grads()
    monkeypatch.setenv("FULLGRAPH_TRITON", "0")
    want = grads()
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else \
        {"rtol": 1e-10, "atol": 1e-12}
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
