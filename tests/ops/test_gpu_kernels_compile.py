"""Every launch the GPU kernels' wrappers make compiles for a Hopper GPU (sm_90, the
H100 / H200), on a machine without one (``tests/gpu_compile.py``, in a process of its
own).

Triton's interpreter (``test_gpu_kernels.py``) runs the kernels' Python on the CPU and
is lenient where the compiler is not: a loop-carried accumulator whose dtype changes
(a float32 accumulator in a float64 run passes the interpreter and fails here), a
``constexpr`` used as a value, an integer's width."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (torch's CPU build)")

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_compile.py"


def test_every_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    compiled = int(run.stdout.strip().splitlines()[-1].split()[-1])
    assert compiled >= 20, run.stdout
