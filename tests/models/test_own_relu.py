"""``layers.own_relu``: ReLU whose backward writes the gradient into its output."""
from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE

from fullgraph.models.layers import own_relu


def test_gradient_equals_relu_and_lives_in_the_output():
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    x = torch.randn(40, 6, dtype=torch.float64, device=TEST_DEVICE)
    x[0, :] = 0.0  # outputs of exactly 0 take no gradient, as torch.relu's
    up = torch.randn(40, 5, dtype=torch.float64, device=TEST_DEVICE)

    ref = torch.relu(x @ w)
    (ref_grad,) = torch.autograd.grad((ref * up).sum(), w)

    out = own_relu(x @ w)
    torch.testing.assert_close(out, ref)
    seen = {}

    def keep(grad):  # the gradient reaching the product, before its backward
        seen["ptr"] = grad.untyped_storage().data_ptr()

    product = x @ w
    product.register_hook(keep)
    y = own_relu(product)
    ptr = y.untyped_storage().data_ptr()
    (grad,) = torch.autograd.grad((y * up).sum(), w)
    torch.testing.assert_close(grad, ref_grad)
    assert seen["ptr"] == ptr  # no new (R, D) tensor: the output's storage carries it


def test_a_kept_graph_runs_backward_again():
    """With ``retain_graph=True`` the output is left alone: backward runs again, and
    gradcheck (which differentiates the same graph once per output) passes."""
    x = torch.randn(30, 6, dtype=torch.float64, device=TEST_DEVICE)
    w = torch.randn(6, 4, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    torch.autograd.gradcheck(lambda a: own_relu(x @ a), (w,))
    y = own_relu(x @ w)
    kept = y.detach().clone()
    first = torch.autograd.grad(y.sum(), w, retain_graph=True)
    torch.testing.assert_close(y, kept)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), w), first)


def test_a_consumer_backward_after_it_fails_loudly():
    """Whoever reads the output after its backward ran is stopped by autograd's
    in-place check, not handed gradient values."""
    w = torch.randn(4, 3, dtype=torch.float64, device=TEST_DEVICE, requires_grad=True)
    y = own_relu(torch.randn(8, 4, dtype=torch.float64, device=TEST_DEVICE) @ w)
    first, second = y * 2.0, y * y  # the second keeps y for its backward
    torch.autograd.grad(first.sum(), w)  # frees: the output now holds its gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(second.sum(), w)


def test_without_gradients_it_is_relu_in_place():
    x = torch.randn(5, 3, device=TEST_DEVICE)
    with torch.no_grad():
        y = own_relu(x)
    assert y is x and (y >= 0).all()
