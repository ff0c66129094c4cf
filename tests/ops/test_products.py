"""The dense products of ``ops.dropout``: padded widths, ReLU in blocks, and the ReLU
input's gradient written over the ReLU's output; ``ops.gemm``'s measured choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from devices import TEST_DEVICE, cpu_only

from fullgraph.ops import dropout as kd
from fullgraph.ops import gemm, kernels, keyed_dropout


@pytest.fixture
def pad_on(monkeypatch):
    """Every product of at least one row and column pads its width (to 8)."""
    monkeypatch.setenv("FULLGRAPH_GEMM_PAD", "on")
    monkeypatch.setattr(gemm, "MIN_ROWS", 1)
    monkeypatch.setattr(gemm, "MIN_COLS", 1)


def _reference(x, w, add, keys, relu):
    h = x if keys is None else keyed_dropout(x, 0.4, keys, 11, True)
    y = h @ w.t() if add is None else (h @ w.t() + add)
    return torch.relu(y) if relu else y


@cpu_only("padding and the blocked ReLU are CPU paths")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("add", ["none", "bias", "rows"])
@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("needs", ["all", "x", "w"])
def test_products_equal_the_unfused_ones(dtype, add, drop, pad, relu, needs, monkeypatch,
                                         request):
    """Output and gradients of ``dropout_matmul`` / ``matmul_t`` at a padded width,
    with ReLU in blocks, equal the plain composition's, over several row blocks."""
    if relu and add == "rows":
        pytest.skip("a product with ReLU takes a bias, not an addend")
    if pad:
        request.getfixturevalue("pad_on")
    monkeypatch.setattr(kd, "ROW_BLOCK", 7)
    torch.manual_seed(0)
    x = torch.randn(40, 6, dtype=dtype, requires_grad=needs != "w")
    w = torch.randn(5, 6, dtype=dtype, requires_grad=needs != "x")
    addend = {"none": None, "bias": torch.randn(5, dtype=dtype, requires_grad=needs == "all"),
              "rows": torch.randn(40, 5, dtype=dtype, requires_grad=needs == "all")}[add]
    keys = torch.arange(100, 140) if drop else None
    ref = _reference(x, w, addend, keys, relu)
    if drop:
        dropped = keyed_dropout(x, 0.4, keys, 11, True)
        src = kd.dropped_from(dropped)
        assert src is not None
        out = kd.dropout_matmul(src, w, addend, dropped, relu=relu)
    else:
        out = kd.matmul_t(x, w, addend, relu=relu)
    assert (out.grad_fn is not None and type(out.grad_fn).__name__ == "_DropoutMatmulBackward") \
        == (pad or relu or drop)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref, **tol)
    inputs = [t for t in (x, w, addend) if t is not None and t.requires_grad]
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, inputs, grad)
    for a, b in zip(torch.autograd.grad(out, inputs, grad), expected):
        torch.testing.assert_close(a, b, **tol)


@cpu_only("the blocked ReLU is a CPU path")
def test_a_relu_product_kept_for_a_second_backward_is_left_alone():
    torch.manual_seed(1)
    x = torch.randn(30, 6, dtype=torch.float64)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda w_, b_: kd.matmul_t(x, w_, b_, relu=True), (w, b))
    y = kd.matmul_t(x, w, b, relu=True)
    kept = y.detach().clone()
    first = torch.autograd.grad(y.sum(), (w, b), retain_graph=True)
    torch.testing.assert_close(y, kept)
    for a, c in zip(torch.autograd.grad(y.sum(), (w, b)), first):
        torch.testing.assert_close(a, c)


def _two_layers(x, w1, b1, w2, keys, *, fused, sole):
    if fused:
        h = kd.matmul_t(x, w1, b1, relu=True)
    else:
        h = torch.relu(x @ w1.t() + b1)
    dropped = keyed_dropout(h, 0.5, keys, 5, True)
    if sole:
        kd.mark_sole(dropped)
    src = kd.dropped_from(dropped)
    assert src is not None
    return kd.dropout_matmul(src, w2, None, dropped)


@cpu_only("numba's kernel")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pad", [True, False])
def test_the_relu_input_gradient_written_over_its_output_is_exact(dtype, pad, monkeypatch,
                                                                  request):
    """A ReLU output read only by a dropout whose output only a product reads: the
    product's backward writes the ReLU input's gradient over the output (no new (R, D)
    tensor) and the gradients are the same bits as without that."""
    if pad:
        request.getfixturevalue("pad_on")
    monkeypatch.setattr(kd, "ROW_BLOCK", 7)
    torch.manual_seed(2)
    x = torch.randn(50, 6, dtype=dtype)
    x[0] = 0.0  # ReLU outputs of exactly 0 (no gradient through them)
    w1 = torch.randn(9, 6, dtype=dtype, requires_grad=True)
    b1 = torch.randn(9, dtype=dtype, requires_grad=True)
    w2 = torch.randn(3, 9, dtype=dtype, requires_grad=True)
    keys = torch.arange(50) * 3
    up = torch.randn(50, 3, dtype=dtype)
    ref = _two_layers(x, w1, b1, w2, keys, fused=False, sole=False)
    expected = torch.autograd.grad((ref * up).sum(), (w1, b1, w2))
    folds = []
    real = kd._can_fold

    def spy(ctx, x_, *a):  # records the backwards that write over their input
        folded = real(ctx, x_, *a)
        if folded:
            folds.append(x_.data_ptr())
        return folded

    monkeypatch.setattr(kd, "_can_fold", spy)
    out = _two_layers(x, w1, b1, w2, keys, fused=True, sole=True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref, **tol)
    folded = torch.autograd.grad((out * up).sum(), (w1, b1, w2))
    assert len(folds) == 1
    for a, b in zip(folded, expected):
        torch.testing.assert_close(a, b, **tol)
    # not sole, or a backward that keeps its graph: the plain backward, the same bits
    for sole, keep in ((False, False), (True, True)):
        folds.clear()
        out = _two_layers(x, w1, b1, w2, keys, fused=True, sole=sole)
        got = torch.autograd.grad((out * up).sum(), (w1, b1, w2), retain_graph=keep)
        assert not folds
        for a, b in zip(got, folded):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_fold_needs_a_relu_output():
    """``mark_sole`` alone does not let a product write over an input that is not a
    ReLU's output marked as such."""
    x = torch.randn(10, 4, requires_grad=True)
    h = x * 2.0
    dropped = keyed_dropout(h, 0.5, torch.arange(10), 1, True)
    kd.mark_sole(dropped)
    src = kd.dropped_from(dropped)
    assert src is not None and src.sole and not kd.relu_output(h)
    w = torch.randn(3, 4, requires_grad=True)
    (g,) = torch.autograd.grad(kd.dropout_matmul(src, w, None, dropped).sum(), x)
    expected = torch.autograd.grad((keyed_dropout(x * 2.0, 0.5, torch.arange(10), 1, True)
                                    @ w.t()).sum(), x)[0]
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(h, x.detach() * 2.0)  # h was not written over


def test_product_width_follows_the_setting_and_the_measurement(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    monkeypatch.setenv("FULLGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "_choices", {})
    calls = []

    def faster(k, cols, wide, dtype):
        calls.append((k, cols, wide))
        return cols == 47

    monkeypatch.setattr(gemm, "_padded_faster", faster)
    monkeypatch.delenv("FULLGRAPH_GEMM_PAD", raising=False)
    big = gemm.MIN_ROWS
    assert gemm.product_width(big, 256, 47, torch.float32, cpu) == 48
    assert gemm.product_width(big * 4, 256, 47, torch.float32, cpu) == 48  # cached
    assert gemm.product_width(big, 256, 41, torch.float32, cpu) == 41  # measured slower
    assert calls == [(256, 47, 48), (256, 41, 48)]
    monkeypatch.setattr(gemm, "_choices", {})  # a new process: the choices come from disk
    assert gemm.product_width(big, 256, 47, torch.float32, cpu) == 48
    assert gemm.product_width(big, 256, 41, torch.float32, cpu) == 41
    assert len(calls) == 2 and (tmp_path / gemm.CACHE_FILE).is_file()
    assert gemm.product_width(big - 1, 256, 47, torch.float32, cpu) == 47  # small
    assert gemm.product_width(big, 256, 48, torch.float32, cpu) == 48  # a multiple of 8
    assert gemm.product_width(big, 256, 7, torch.float32, cpu) == 7  # narrow
    assert gemm.product_width(big, 256, 47, torch.float32, torch.device("meta")) == 47
    monkeypatch.setenv("FULLGRAPH_GEMM_PAD", "off")
    assert gemm.product_width(big, 256, 47, torch.float32, cpu) == 47
    monkeypatch.setenv("FULLGRAPH_GEMM_PAD", "on")
    assert gemm.product_width(big, 256, 41, torch.float32, cpu) == 48
    monkeypatch.setenv("FULLGRAPH_GEMM_PAD", "sometimes")
    with pytest.raises(ValueError, match="FULLGRAPH_GEMM_PAD"):
        gemm.product_width(big, 256, 47, torch.float32, cpu)


def test_the_measurement_runs():
    """The real measurement returns a verdict (whichever it is on this machine)."""
    assert gemm._padded_faster(32, 17, 24, torch.float32) in (True, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [True, False])
def test_masked_cross_entropy_equals_torch(dtype, fused, monkeypatch):
    from fullgraph.ops import loss as kl

    if not fused:
        monkeypatch.setattr(kl, "_fused", lambda logits: False)
    elif not kernels.HAVE_NUMBA or TEST_DEVICE.type != "cpu":
        pytest.skip("the fused kernel is numba's, on the CPU")
    torch.manual_seed(3)
    logits = torch.randn(300, 7, dtype=dtype, device=TEST_DEVICE) * 4
    logits = logits.requires_grad_()
    labels = torch.randint(0, 7, (300,), device=TEST_DEVICE)
    mask = torch.rand(300, device=TEST_DEVICE) < 0.5
    labels[~mask] = -1  # unlabelled rows outside the mask are never read
    got = kl.masked_cross_entropy(logits, labels, mask) / 13
    ref = F.cross_entropy(logits[mask], labels[mask], reduction="sum") / 13
    torch.testing.assert_close(got, ref)
    up = torch.tensor(1.5, dtype=dtype, device=TEST_DEVICE)
    (g,) = torch.autograd.grad(got, logits, up, retain_graph=True)
    (r,) = torch.autograd.grad(ref, logits, up)
    torch.testing.assert_close(g, r)
    (again,) = torch.autograd.grad(got, logits, up)  # the kept graph gave a new tensor
    torch.testing.assert_close(again, r)
    none = torch.zeros(300, dtype=torch.bool, device=TEST_DEVICE)
    assert float(kl.masked_cross_entropy(logits.detach(), labels, none)) == 0.0


@pytest.mark.parametrize("fused", [True, False])
def test_masked_cross_entropy_names_a_bad_label(fused, monkeypatch):
    from fullgraph.ops import loss as kl

    if not fused:
        monkeypatch.setattr(kl, "_fused", lambda logits: False)
    logits = torch.randn(10, 3, device=TEST_DEVICE)
    labels = torch.tensor([0, 1, 2, 5, 0, 1, 2, 0, 1, 2], device=TEST_DEVICE)
    mask = torch.ones(10, dtype=torch.bool, device=TEST_DEVICE)
    with pytest.raises(ValueError, match=r"outside \[0, 3\): 5"):
        kl.masked_cross_entropy(logits, labels, mask)
    mask[3] = False
    kl.masked_cross_entropy(logits, labels, mask)  # the bad label is not trained on
    with pytest.raises(ValueError, match="boolean"):
        kl.masked_cross_entropy(logits, labels, mask.long())
    with pytest.raises(ValueError, match="takes"):
        kl.masked_cross_entropy(logits[:, 0], labels, mask)


@pytest.mark.parametrize("path", ["numba", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows", [0, 5, 3000, 2 * 8192 + 17])
@pytest.mark.parametrize("cols", [1, 47, 256])
def test_column_sums_equal_torch(dtype, rows, cols, path, monkeypatch):
    """``gemm.column_sums`` (numba's runs of rows, or GEMVs over blocks of rows without
    numba, on the CPU) equals ``sum(0)``, added into ``out`` too, also for padded rows;
    a transposed or a grad-requiring input takes torch's sum."""
    if path == "numba" and not kernels.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(gemm, "SUM_MIN_ROWS", 16)
    monkeypatch.setattr(kernels, "HAVE_NUMBA", path == "numba")
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=gen, dtype=dtype).to(TEST_DEVICE)
    exact = x.double().sum(0)
    # a float sum's error scales with the sum of the magnitudes: 1e-6 of it is far
    # above float32 rounding over 8,192 terms (4.9e-4 at worst, 1e-8 seen)
    bound = 1e-6 * x.double().abs().sum(0) + 1e-12

    def check(got, want):
        assert got.dtype == dtype and got.shape == (cols,)
        assert bool(((got.double() - want).abs() <= bound + 1e-6 * want.abs()).all())

    check(gemm.column_sums(x), exact)
    base = torch.arange(cols, dtype=dtype, device=TEST_DEVICE)
    check(gemm.column_sums(x, out=base.clone()), base.double() + exact)
    check(gemm.column_sums(x.t().contiguous().t()), exact)  # column-major: torch's sum
    wide = torch.full((rows, cols + 5), float("nan"), dtype=dtype, device=TEST_DEVICE)
    wide[:, :cols] = x
    check(gemm.column_sums(wide[:, :cols]), exact)  # padded rows: the padding unread
    other = torch.float32 if dtype == torch.float64 else torch.float64
    got = gemm.column_sums(x, out=base.to(other))  # an out of another dtype
    assert got.dtype == other
    assert bool(((got.double() - base.double() - exact).abs() <= bound + 1e-5).all())
    with pytest.raises(ValueError, match=r"out must be"):
        gemm.column_sums(x, out=torch.zeros(cols + 1, dtype=dtype, device=TEST_DEVICE))
    w = x.clone().requires_grad_()
    gemm.column_sums(w).sum().backward()
    assert w.grad is not None and bool((w.grad == 1).all())


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba is not installed")
def test_column_sums_bits_do_not_depend_on_the_thread_count(monkeypatch):
    """numba's column sums split the rows into fixed chunks, not one per thread."""
    monkeypatch.setattr(gemm, "SUM_MIN_ROWS", 16)
    x = torch.randn(50_003, 33, generator=torch.Generator().manual_seed(0))
    sums = []
    for threads in (1, 2):
        kernels.set_threads(threads)
        sums.append(gemm.column_sums(x))
    kernels.set_threads(torch.get_num_threads())
    assert torch.equal(sums[0], sums[1])


def test_add_bias_matches_the_broadcast_add():
    """``gemm.add_bias``: the output and both gradients of ``x + bias``; mismatched
    dtypes fall back to the plain add."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40000, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(40000, 7, generator=gen, dtype=torch.float64)
    out = gemm.add_bias(x, b)
    out.backward(g)
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (x2 + b2).backward(g)
    torch.testing.assert_close(out, x2 + b2, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, b2.grad)
    mixed = gemm.add_bias(x.detach().float(), b.detach())
    assert mixed.dtype == torch.float64
