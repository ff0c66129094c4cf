"""Without numba every op falls back to torch and trains to the numba path's losses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fullgraph.ops import kernels

# Trains GCN and GAT (dropout on, so the keyed-dropout kernels run too) and prints the
# per-epoch losses as JSON; the parent compares the two processes' numbers.
SCRIPT = """
import json
from fullgraph.ops import kernels
from fullgraph.config import Config, ModelConfig, TrainConfig, RuntimeConfig
from fullgraph.graph.synthetic import sbm
from fullgraph.train import train
ds = sbm(200, 3, num_features=8, seed=1)
backend = "numba" if kernels.HAVE_NUMBA else "torch"
losses = {}
for model in ("gcn", "gat"):
    extra = {"heads": 2} if model == "gat" else {}
    res = train(ds, Config(model=ModelConfig(name=model, dropout=0.5, **extra),
                           train=TrainConfig(epochs=5, seed=3),
                           runtime=RuntimeConfig(spmm_backend=backend)))
    losses[model] = [e.loss for e in res.epochs]
refused = None
if not kernels.HAVE_NUMBA:
    from fullgraph.ops.spmm import set_backend
    try:
        set_backend("numba")
    except ImportError as exc:
        refused = str(exc)
print(json.dumps({"have_numba": kernels.HAVE_NUMBA, "losses": losses, "refused": refused}))
"""


def _run(tmp_path, no_numba: bool) -> dict:
    env = dict(os.environ)
    env.pop("FULLGRAPH_NO_NUMBA", None)
    if no_numba:
        env["FULLGRAPH_NO_NUMBA"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="needs numba for the reference run")
def test_training_without_numba_matches_numba(tmp_path):
    without = _run(tmp_path, no_numba=True)
    with_numba = _run(tmp_path, no_numba=False)
    assert without["have_numba"] is False and with_numba["have_numba"] is True
    assert "numba, which is not installed: pip install 'fullgraph[fast]'" in without["refused"]
    for model in ("gcn", "gat"):
        ref = torch.tensor(with_numba["losses"][model], dtype=torch.float64)
        got = torch.tensor(without["losses"][model], dtype=torch.float64)
        assert ref.shape == (5,) and bool(torch.isfinite(ref).all())
        assert not bool((ref == ref[0]).all()), f"{model}: the loss never moved"
        # Same seed, same dropout bits: only the summation order may differ.
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=model)
