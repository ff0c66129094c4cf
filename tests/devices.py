"""The device the kernel, model and exactness tests compute on.

``FULLGRAPH_TEST_DEVICE`` (``cpu`` by default; ``cuda`` or ``cuda:N``) names it, and
``pytest --device cuda`` sets that variable for the session, so spawned rank
processes read the same one. Tests that cannot run there (numba's CPU kernels, host
memory, launched CLI runs) say so with ``cpu_only``; tests that are not converted
keep computing on the CPU whatever the variable says.

This module only reads the variable: it does not touch CUDA (checking for a GPU
initialises the driver, which a process that later forks ranks must not do). The
session-start check is ``conftest.pytest_configure``'s.
"""
from __future__ import annotations

import os

import pytest
import torch

ENV = "FULLGRAPH_TEST_DEVICE"


def parse(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; anything else is refused. ``cuda`` is GPU 0,
    with its index, as the runtime names a worker's GPU (``comm.group.local_gpu``):
    the package compares devices, and ``cuda`` is not equal to ``cuda:0``."""
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{ENV}={name!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


TEST_DEVICE: torch.device = parse(os.environ.get(ENV, "cpu") or "cpu")
ON_CUDA = TEST_DEVICE.type == "cuda"


def cpu_only(reason: str):
    """Skip marker for a test that only makes sense on the CPU (``reason``: why)."""
    return pytest.mark.skipif(ON_CUDA, reason=f"cpu only: {reason}")
