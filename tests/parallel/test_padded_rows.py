"""Rows padded to cache lines (``ops.padded``) in training: 47 hidden columns and 47
classes, which the layout pads to 48, give the same run as the unpadded layout, in
the single process bit for bit where the CPU's matrix library computes each output
column independently of the output's width (MKL on the Intel hosts; not MKL's float64
kernels on an AMD EPYC, where 47 and 48 columns sum in another order: there to float
rounding), and in every strategy as in the single process (float64, dropout on).
GCN and GraphSAGE: their dense stages are ours (``ops.dropout``); GIN's and GAT's
products are torch's, whose rows are not padded."""
from __future__ import annotations

import blas
import pytest
import torch
from cases import run_epochs
from devices import TEST_DEVICE, cpu_only
from harness import run_ranks

from fullgraph.graph.synthetic import sbm
from fullgraph.models import build_model
from fullgraph.ops import padded
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.p2p import P2PParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.task import TaskParallel
from fullgraph.parallel.tensor import TensorParallel

WIDTH = 47  # float64 rows of 47 columns are padded to 48 (one 64-byte line per 8)


def _dataset():
    return sbm(150, WIDTH, avg_degree=6.0, num_features=11, seed=5)


def _model(name: str):
    torch.manual_seed(0)
    model = build_model(name, 11, WIDTH, WIDTH, num_layers=2, dropout=0.3)
    return model.to(TEST_DEVICE, torch.float64)


def _counting(monkeypatch) -> list[int]:
    """Count the padded matrices the kernels were given."""
    seen = [0]
    widen = padded.widen

    def counted(x):
        wide = widen(x)
        seen[0] += wide is not None
        return wide

    monkeypatch.setattr(padded, "widen", counted)
    return seen


@cpu_only("padded rows are a CPU layout")
@pytest.mark.parametrize("name", ["gcn", "sage"])
def test_padded_rows_train_as_the_unpadded_layout(name, monkeypatch):
    dataset = _dataset()
    monkeypatch.setenv(padded.ENV, "0")
    ref_model = _model(name)
    ref = run_epochs(SingleProcess(), dataset, ref_model, None)
    monkeypatch.delenv(padded.ENV)
    seen = _counting(monkeypatch)
    model = _model(name)
    got = run_epochs(SingleProcess(), dataset, model, None)
    assert seen[0] > 0, "nothing was padded"
    same = torch.equal if blas.width_independent(torch.float64) else torch.allclose
    losses = [torch.tensor(v, dtype=torch.float64) for v in (got[0], ref[0])]
    assert same(*losses), (got[0], ref[0])
    assert same(got[1][0], ref[1][0])
    for (k, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert same(p, q), k


def check_strategies(comm, refs):
    dataset = _dataset()
    strategies = {"data": lambda: DataParallel(DataParallel.Options(mode="depcomm")),
                  "tensor": TensorParallel, "p2p": P2PParallel,
                  "task": lambda: TaskParallel(TaskParallel.Options(split="1:1"))}
    if comm.world_size != 2:
        del strategies["task"]
    for name, (ref_losses, ref_out, ref_params) in refs.items():
        for label, make in strategies.items():
            model = _model(name)
            losses, (out, gids), _ = run_epochs(make(), dataset, model, comm)
            where = f"{name} {label} rank {comm.rank}/{comm.world_size}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
            torch.testing.assert_close(out, ref_out[gids], msg=where)
            for (k, p), q in zip(model.named_parameters(), ref_params):
                torch.testing.assert_close(p, q, msg=f"{where} parameter {k}")


@cpu_only("padded rows are a CPU layout")
@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_strategy_with_padded_rows_matches_single(tmp_path, world_size):
    refs = {}
    for name in ("gcn", "sage"):
        model = _model(name)
        losses, (out, _), _ = run_epochs(SingleProcess(), _dataset(), model, None)
        refs[name] = (losses, out, [p.detach().clone() for p in model.parameters()])
    run_ranks(check_strategies, world_size, tmp_path, refs)
