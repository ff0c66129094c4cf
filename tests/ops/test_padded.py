"""Rows padded to cache lines (``ops.padded``): which widths are padded, which tensors
are taken for padded, and the operators that read and write them (the dense product,
the SpMM and its transpose, the bias, the loss) giving the bits of the unpadded
layout."""
from __future__ import annotations

import blas
import pytest
import torch
from devices import cpu_only

from fullgraph.graph.csr import Graph
from fullgraph.ops import dropout as kd
from fullgraph.ops import gemm, padded
from fullgraph.ops.loss import masked_cross_entropy
from fullgraph.ops.spmm import spmm, transposed_aggregate

pytestmark = cpu_only("padded rows are a CPU layout")
CPU = torch.device("cpu")


def test_widths(monkeypatch):
    f32, f64 = torch.float32, torch.float64
    assert [padded.width(c, f32, CPU) for c in (47, 100, 172, 121, 40, 41, 64, 7, 16)] == \
        [48, 112, 176, 128, 40, 41, 64, 7, 16]
    assert [padded.width(c, f64, CPU) for c in (47, 9, 7, 20)] == [48, 9, 7, 20]
    assert padded.width(47, torch.bfloat16, CPU) == 47
    assert padded.width(47, f32, torch.device("meta")) == 47
    monkeypatch.setenv(padded.ENV, "0")
    assert padded.width(47, f32, CPU) == 47


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (R, 47) copied into padded rows (zero padding)."""
    full = torch.zeros(x.shape[0], padded.width(x.shape[1], x.dtype, CPU), dtype=x.dtype)
    full[:, :x.shape[1]] = x
    return padded.rows_of(full, x.shape[1])


def test_what_is_taken_for_padded():
    x = torch.randn(5, 47)
    assert padded.widen(x) is None  # contiguous
    p = _padded(x)
    assert p._base is None and p.stride() == (48, 1) and torch.equal(p, x)
    wide = padded.widen(p)
    assert wide is not None and wide.shape == (5, 48) and wide.data_ptr() == p.data_ptr()
    assert padded.widen(torch.randn(5, 64)[:, :10]) is None  # not the padded width
    assert padded.widen(torch.randn(5, 48)[:, 1:]) is None  # padding on the left
    short = torch.randn(5 * 48 - 1)  # the last row's padding lies past the storage
    assert padded.widen(short.as_strided((5, 47), (48, 1))) is None
    assert padded.widen(p.t()) is None and padded.widen(p[:0]) is None


def _graph(n: int = 60, e: int = 400) -> Graph:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    return Graph.from_edges(src, dst, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_spmm_and_its_backward_keep_padded_rows(dtype, weighted):
    graph = _graph()
    x = torch.randn(60, 47, dtype=dtype)
    w = torch.rand(graph.num_edges, dtype=dtype) if weighted else None
    g = torch.randn(60, 47, dtype=dtype)
    a = x.clone().requires_grad_(True)
    ref = spmm(graph, a, w)
    ref.backward(g)
    b = _padded(x).requires_grad_(True)
    out = spmm(graph, b, w)
    assert padded.widen(out) is not None and torch.equal(out, ref)
    assert torch.equal(padded.widen(out)[:, 47:], torch.zeros(60, 1, dtype=dtype))
    out.backward(_padded(g))
    assert torch.equal(b.grad, a.grad)
    back = transposed_aggregate(graph, _padded(g), w, "sum")  # (a leaf's .grad is dense)
    assert padded.widen(back) is not None and torch.equal(back, a.grad)
    out.detach().relu_()  # not a view made inside the autograd function


def test_bias_and_loss_keep_padded_rows():
    torch.manual_seed(0)
    x, bias = torch.randn(1500, 47), torch.randn(47)
    labels = torch.randint(0, 47, (1500,))
    mask = torch.rand(1500) < 0.6
    grads = []
    for rows in (x, _padded(x)):
        leaf = rows.clone() if rows.is_contiguous() else _padded(x)
        leaf.requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        y = gemm.add_bias(leaf, b)
        assert (padded.widen(y) is not None) == (not rows.is_contiguous())
        y.relu_()  # in place on the function's output
        loss = masked_cross_entropy(y, labels, mask)
        loss.backward()
        grads.append((float(loss.detach()), leaf.grad, b.grad))
    assert grads[0][0] == grads[1][0]
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])


def test_loss_gradient_is_padded_with_zeros():
    x = torch.randn(30, 47)
    labels = torch.randint(0, 47, (30,))
    mask = torch.rand(30) < 0.5
    mask[0] = True
    leaf = _padded(x).requires_grad_(True)
    seen = []
    leaf.register_hook(seen.append)  # the gradient as it comes (a leaf's .grad is dense)
    masked_cross_entropy(leaf, labels, mask).backward()
    wide = padded.widen(seen[0])
    assert wide is not None and torch.equal(wide[:, 47:], torch.zeros(30, 1))


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("drop", [False, True])
def test_products_write_padded_rows(relu, drop, monkeypatch):
    """A product to 47 columns writes padded rows, with the unpadded layout's bits
    forward where the BLAS computes a column whatever the output's width
    (``blas.width_independent``), and its gradients (over several row blocks)."""
    monkeypatch.setattr(kd, "ROW_BLOCK", 64)
    torch.manual_seed(0)
    x, w, bias = torch.randn(300, 20), torch.randn(47, 20), torch.randn(47)
    keys = torch.arange(300)
    g = torch.randn(300, 47)
    results = []
    for pad in ("0", "1"):
        monkeypatch.setenv(padded.ENV, pad)
        a = x.clone().requires_grad_(True)
        wa, ba = w.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        if drop:
            dropped = kd.keyed_dropout(a, 0.4, keys, 3, True)
            src = kd.dropped_from(dropped)
            assert src is not None
            y = kd.dropout_matmul(src, wa, ba, dropped, relu=relu)
        else:
            y = kd.matmul_t(a, wa, ba, relu=relu)
        assert (padded.widen(y) is not None) == (pad == "1")
        y.backward(g)
        results.append((y.detach(), a.grad, wa.grad, ba.grad))
    (y0, *grads0), (y1, *grads1) = results
    if blas.width_independent(torch.float32):
        assert torch.equal(y0, y1)
    torch.testing.assert_close(y0, y1)
    for u, v in zip(grads0, grads1):
        # unpadded, a plain product has torch's backward: one product over the 300
        # rows where the padded one sums blocks of 64, so float32 rounds otherwise
        scale = float(u.abs().max()) * 300 ** 0.5
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6 * scale)
