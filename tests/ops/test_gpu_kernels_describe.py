"""The run header's words for the GPU kernels (``gpu_kernels.describe``): what serves
dropout and GAT on a device, and why the torch ops do where they do."""
from __future__ import annotations

import pytest
import torch

from fullgraph.ops import gpu_kernels

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "_FAILED", [])
    monkeypatch.delenv("FULLGRAPH_TRITON", raising=False)


def test_triton_with_its_version_where_it_serves_the_device(monkeypatch):
    monkeypatch.setattr(gpu_kernels, "HAVE_TRITON", True)
    monkeypatch.setattr(gpu_kernels.importlib.metadata, "version", lambda name: "9.8.7")
    assert gpu_kernels.describe(CUDA) == "Triton 9.8.7"
    monkeypatch.setenv("FULLGRAPH_TRITON", "interpret")
    assert gpu_kernels.describe(torch.device("cpu")) == "Triton 9.8.7 (interpreter)"


@pytest.mark.parametrize("mode", ["0", "off", "No"])
def test_the_torch_ops_and_why(monkeypatch, mode):
    monkeypatch.setattr(gpu_kernels, "HAVE_TRITON", False)
    assert gpu_kernels.describe(CUDA) == "torch ops (Triton is not installed)"
    monkeypatch.setattr(gpu_kernels, "HAVE_TRITON", True)
    monkeypatch.setenv("FULLGRAPH_TRITON", mode)
    assert gpu_kernels.describe(CUDA) == f"torch ops (FULLGRAPH_TRITON={mode})"
    monkeypatch.setenv("FULLGRAPH_TRITON", "auto")
    monkeypatch.setattr(gpu_kernels, "_FAILED", ["attention"])
    assert gpu_kernels.describe(CUDA) == "torch ops (Triton kernel attention failed)"
    monkeypatch.setattr(gpu_kernels, "_FAILED", [])
    assert gpu_kernels.describe(torch.device("cpu")) == (
        "torch ops (Triton kernels run on CUDA devices)")
