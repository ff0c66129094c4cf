"""What the CPU's matrix library does that some tests depend on."""
from __future__ import annotations

import functools

import torch


@functools.cache
def width_independent(dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` gives an output column the same bits at 47 and at 48 output
    columns (the 48th from a zero weight row), in the forward product and in both of
    its gradients' products, at a few shapes: then rows padded to 48 columns
    (``ops.padded``) compute the unpadded layout's bits. MKL did on the Intel hosts; on
    an AMD EPYC (Zen 4) it sums 47 and 48 columns in other orders, in float64 in every
    product and in float32 in some (the input gradient at 11 columns): one product
    that differs makes the answer False."""
    gen = torch.Generator().manual_seed(0)
    for rows, cols in ((150, 11), (150, 47), (1000, 20)):
        x = torch.randn(rows, cols, generator=gen, dtype=dtype)
        g = torch.randn(rows, 47, generator=gen, dtype=dtype)
        w = torch.randn(47, cols, generator=gen, dtype=dtype)
        gw, ww = torch.zeros(rows, 48, dtype=dtype), torch.zeros(48, cols, dtype=dtype)
        gw[:, :47], ww[:47] = g, w
        if not (torch.equal(x @ w.t(), (x @ ww.t())[:, :47]) and torch.equal(g @ w, gw @ ww)
                and torch.equal(g.t() @ x, (gw.t() @ x)[:47])):
            return False
    return True
