"""Keyed dropout: the mask is a function of (seed, row key, column) only."""
from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE, cpu_only

from fullgraph.ops import dropout as kd
from fullgraph.ops import kernels, keyed_dropout, keyed_uniform


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
def test_numba_and_torch_paths_agree(monkeypatch):
    keys = torch.tensor([0, 1, 5, 2**31 + 3, 2**40 + 17])
    fast = keyed_uniform(keys, 33, seed=987654321)
    monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
    slow = keyed_uniform(keys, 33, seed=987654321)
    assert torch.equal(fast, slow)


def test_mask_depends_on_keys_not_on_row_order():
    keys = torch.arange(100, device=TEST_DEVICE)
    full = keyed_uniform(keys, 8, seed=3)
    perm = torch.randperm(100, device=TEST_DEVICE)
    torch.testing.assert_close(keyed_uniform(keys[perm], 8, seed=3), full[perm], rtol=0, atol=0)
    assert not torch.equal(keyed_uniform(keys, 8, seed=4), full)


def test_rate_and_scaling():
    x = torch.ones(2000, 50, device=TEST_DEVICE)
    y = keyed_dropout(x, 0.3, torch.arange(2000, device=TEST_DEVICE), seed=11, training=True)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.01
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    assert keyed_dropout(x, 0.3, torch.arange(2000, device=TEST_DEVICE), seed=11,
                         training=False) is x


def test_uniformity():
    u = keyed_uniform(torch.arange(10000, device=TEST_DEVICE), 10, seed=1)
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
def test_fused_kernel_matches_torch_path(monkeypatch):
    x = torch.randn(300, 17, dtype=torch.float64)
    keys = torch.arange(300) * 3
    fast = keyed_dropout(x, 0.4, keys, seed=5, training=True)
    monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
    torch.testing.assert_close(keyed_dropout(x, 0.4, keys, seed=5, training=True), fast)


def test_backward_reapplies_the_mask():
    x = torch.randn(40, 6, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    keys = torch.arange(40, device=TEST_DEVICE)
    assert torch.autograd.gradcheck(lambda x: keyed_dropout(x, 0.3, keys, 2, True), (x,))
    y = keyed_dropout(x, 0.3, keys, 2, True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y.detach() != 0).double() / 0.7)


def _saved_storages(fn):
    """Data pointers of every tensor autograd saves while ``fn`` runs, and its result."""
    ptrs: list[int] = []

    def pack(t):
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return ptrs, out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("add", ["none", "bias", "rows"])
@pytest.mark.parametrize("needs", ["both", "x", "w", "add", "both-torch"])
def test_dropout_matmul_equals_the_unfused_product_and_keeps_no_dropped_copy(dtype, add, needs,
                                                                             monkeypatch):
    """Outputs and gradients equal the unfused product's, whichever of the input, the
    weight and the addend need one, with the numba kernels and without ("-torch")."""
    monkeypatch.setattr(kd, "ROW_BLOCK", 7)  # several row blocks in the backward
    if needs == "add" and add == "none":
        pytest.skip("nothing needs a gradient")
    if needs.endswith("-torch"):
        monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
        monkeypatch.setattr(kd, "MASK_BLOCK", 20)  # masks hashed a few rows at a time
    torch.manual_seed(0)
    on = dict(dtype=dtype, device=TEST_DEVICE)
    x = torch.randn(40, 6, **on, requires_grad=needs not in ("w", "add"))
    w = torch.randn(3, 6, **on, requires_grad=needs not in ("x", "add"))
    addend = {"none": None, "bias": torch.randn(3, **on, requires_grad=True),
              "rows": torch.randn(40, 3, **on, requires_grad=True)}[add]
    keys = torch.arange(100, 140, device=TEST_DEVICE)
    dropped = keyed_dropout(x, 0.4, keys, 11, True)
    src = kd.dropped_from(dropped)
    assert src is not None and src.x is x
    plain = dropped @ w.t() if addend is None else torch.addmm(addend, dropped, w.t())
    ptrs, fused = _saved_storages(lambda: kd.dropout_matmul(src, w, addend, dropped))
    assert dropped.untyped_storage().data_ptr() not in ptrs  # x, not its dropped copy
    grad = torch.randn_like(plain)
    inputs = [t for t in (x, w, addend) if t is not None and t.requires_grad]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(fused, plain, **tol)
    for a, b in zip(torch.autograd.grad(fused, inputs, grad),
                    torch.autograd.grad(plain, inputs, grad)):
        torch.testing.assert_close(a, b, **tol)


def test_only_a_two_dimensional_dropout_output_is_marked():
    x, keys = torch.randn(5, 4, device=TEST_DEVICE), torch.arange(5, device=TEST_DEVICE)
    assert kd.dropped_from(keyed_dropout(x, 0.5, keys, 1, False)) is None  # no-op
    assert kd.dropped_from(keyed_dropout(x[:, 0], 0.5, keys, 1, True)) is None
    assert kd.dropped_from(x @ torch.eye(4, device=TEST_DEVICE)) is None


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_keeps_exactly_the_entries_whose_hash_reaches_p(dtype):
    """The kernel compares integer hashes with ceil(p * 2**32): an entry is kept iff
    hash * 2**-32 >= p, exactly, also where the two are equal; kept values are
    x * scale in x's own precision."""
    keys, seed = torch.arange(40) * 7 + 2**33, 4242
    h = kd.entry_hashes(kd.row_hashes(keys, seed)[:, None], torch.arange(13)[None, :])
    x = torch.randn(40, 13, dtype=dtype)
    for p in (h[3, 4].item() * 2.0**-32, (h[5, 6].item() + 1) * 2.0**-32, 0.3, 0.0):
        keep = h.to(torch.float64) * 2.0**-32 >= p
        out = keyed_dropout(x, p, keys, seed=seed, training=True)
        assert torch.equal(out != 0, keep & (x != 0)), p
        scale = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
        assert torch.equal(out[keep], x[keep] * scale), p
    assert keyed_dropout(x, h[3, 4].item() * 2.0**-32, keys, seed=seed, training=True)[3, 4] != 0


@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
def test_torch_mask_in_row_blocks_equals_the_whole_mask(monkeypatch, mode):
    """The torch path (GPUs, or no numba) hashes a block of rows at a time
    (``MASK_BLOCK`` entries): the same result as one mask over the whole tensor, into
    a new tensor, into ``out`` or in place; and the backward's blocks on a GPU are
    at least the CPU's."""
    monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
    monkeypatch.setattr(kd, "MASK_BLOCK", 20)  # 3 rows of 6 columns per block
    torch.manual_seed(0)
    x = torch.randn(17, 6, dtype=torch.float64, device=TEST_DEVICE)
    keys = torch.arange(50, 67, device=TEST_DEVICE)
    want = x * (kd.keyed_uniform(keys, 6, 9).to(x.device) >= 0.3).to(x.dtype) / 0.7
    if mode == "new":
        got = kd._apply_mask(x, keys, 9, 0.3)
    elif mode == "out":
        got = torch.full_like(x, float("nan"))
        kd._apply_mask(x, keys, 9, 0.3, out=got)
    else:
        got = x.clone()
        kd._apply_mask(got, keys, 9, 0.3, inplace=True)
    torch.testing.assert_close(got, want)
    assert kd._block_rows(256, torch.device("cpu")) == kd.ROW_BLOCK
    assert kd._block_rows(256, torch.device("cuda", 0)) >= kd.ROW_BLOCK


@cpu_only("numba's kernels")
@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("rows,cols", [(3000, 7), (5, 20000), (4100, 1), (3, 0)])
def test_kernels_in_row_blocks_match_the_torch_hashes(monkeypatch, rows, cols):
    """The numba kernels hash a row's columns into a buffer a block of rows at a time
    (about 16k entries a block): the torch path's bits at every width, across blocks,
    and for p within 2**-32 of 1, where no hash reaches the threshold."""
    torch.manual_seed(1)
    keys = torch.arange(rows) * 5 + 2**35
    x = torch.randn(rows, cols)
    for p in (0.5, 0.0, 1.0 - 2.0**-40):
        fast = keyed_dropout(x, p, keys, seed=77, training=True)
        g = torch.randn(rows, cols)
        g_fast, out = g.clone(), torch.empty_like(x)
        kd._masked_pair(x, g_fast, keys, 77, p, out)
        with monkeypatch.context() as m:
            m.setattr(kd.kernels, "HAVE_NUMBA", False)
            slow = keyed_dropout(x, p, keys, seed=77, training=True)
            g_slow = kd._apply_mask(g, keys, 77, p)
        assert torch.equal(fast, slow), p
        assert torch.equal(out, slow) and torch.equal(g_fast, g_slow), p
    fast_u = keyed_uniform(keys, cols, 3)
    monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
    assert torch.equal(fast_u, keyed_uniform(keys, cols, 3))


def test_int32_hashes_are_the_int64_ones():
    """The torch path's int32 hashes hold the reference hashes' bits, keys past 2**32
    and columns past 2**16 included."""
    keys = torch.tensor([0, 1, 7, 2**31 - 1, 2**31, 2**32 + 5, 2**40 + 17, 2**62],
                        device=TEST_DEVICE)
    rh = kd.row_hashes(keys, 123456789)
    cols = 70_000
    want = kd.entry_hashes(rh[:, None], torch.arange(cols, device=TEST_DEVICE)[None, :])
    got = kd.entry_hashes32(rh, cols)
    assert got.dtype == torch.int32
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_torch_mask_decides_as_the_kernel_at_the_threshold(monkeypatch, offset):
    """p a hash's exact value (or one off it): the torch path keeps exactly the entries
    whose hash * 2**-32 >= p, as the numba kernel does (comparing float32 uniforms
    with p would round some of them across it)."""
    keys, seed = torch.arange(64, device=TEST_DEVICE) * 3 + 11, 99
    h = kd.entry_hashes(kd.row_hashes(keys, seed)[:, None],
                        torch.arange(9, device=TEST_DEVICE)[None, :])
    p = (h[10, 4].item() + offset) * 2.0**-32
    want = h >= kd.keep_threshold(p)
    assert bool(want[10, 4]) == (offset <= 0)
    monkeypatch.setattr(kd.kernels, "HAVE_NUMBA", False)
    assert torch.equal(kd.keep_mask(keys, 9, seed, p), want)
    x = torch.ones(64, 9, device=TEST_DEVICE)
    assert torch.equal(keyed_dropout(x, p, keys, seed, True) != 0, want)
    assert not kd.keep_mask(keys, 9, seed, 1.0 - 2.0**-40).any()
