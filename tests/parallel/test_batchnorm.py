"""GIN with batch normalisation: statistics over all vertices, exact on every strategy.

Single process: ``GlobalBatchNorm`` equals ``torch.nn.BatchNorm1d`` on the same rows
(outputs, gradients, running statistics, evaluation). Data and tensor parallelism on
1-3 workers: 3 Adam epochs with dropout give the single-process losses, owned output
rows, parameters and running statistics (float64), and so does evaluation with the
running statistics afterwards. p2p refuses the model at setup.
"""
from __future__ import annotations

import pytest
import torch
from cases import make_dataset, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.errors import ConfigError
from fullgraph.models import StageContext, build_model
from fullgraph.models.norm import GlobalBatchNorm
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.p2p import P2PParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.tensor import TensorParallel
from fullgraph.partition import PartitionOptions


def ctx_for(rows: int, training: bool) -> StageContext:
    return StageContext(torch.arange(rows), 0, training)


def test_global_batchnorm_equals_torch_batchnorm1d():
    torch.manual_seed(0)
    ours, ref = GlobalBatchNorm(6).double(), torch.nn.BatchNorm1d(6).double()
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    ref.train()
    for step in range(3):  # running statistics follow over several batches
        x = (torch.randn(40, 6, dtype=torch.float64) * 3 + step).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        proj = torch.randn(40, 6, dtype=torch.float64)
        y, y_ref = ours(x, ctx_for(40, True)), ref(x_ref)
        torch.testing.assert_close(y, y_ref)
        (y * proj).sum().backward()
        (y_ref * proj).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad)
        torch.testing.assert_close(ours.running_mean, ref.running_mean)
        torch.testing.assert_close(ours.running_var, ref.running_var)
    ref.eval()
    x = torch.randn(7, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x, ctx_for(7, False)), ref(x))


def test_global_batchnorm_uses_the_executors_row_sum():
    """With a row_sum that sums more rows than the stage holds (other workers' rows),
    the statistics are those of all rows: equal to BatchNorm1d over the union."""
    torch.manual_seed(1)
    full = torch.randn(30, 4, dtype=torch.float64)
    mine, others = full[:12], full[12:]
    bn = GlobalBatchNorm(4).double()
    mean = full.mean(0)
    calls = []

    def row_sum(x):  # the other workers' share: column sums and count, then (x - mean)^2
        calls.append(x.shape[1])
        if len(calls) == 1:
            return x.sum(0) + torch.cat([others.sum(0), torch.tensor([18.0], dtype=x.dtype)])
        return x.sum(0) + ((others - mean) ** 2).sum(0)

    ctx = StageContext(torch.arange(12), 0, True, row_sum=row_sum)
    y = bn(mine, ctx)
    ref = torch.nn.BatchNorm1d(4).double().train()(full)[:12]
    torch.testing.assert_close(y, ref)
    assert calls == [5, 4]


def make_gin(dtype=torch.float64):
    torch.manual_seed(0)
    model = build_model("gin", 9, 5, 3, num_layers=2, dropout=0.3, batch_norm=True)
    return model.to(TEST_DEVICE, dtype)


def train_and_eval(strategy, dataset, comm):
    model = make_gin()
    losses, (out, gids), plan = run_epochs(strategy, dataset, model, comm)
    model.eval()
    with torch.no_grad():
        evaluated = strategy.forward(model, plan, training=False, seed=0).logits
    return model, losses, out, gids, evaluated


def check_strategies(comm, cases):
    dataset = make_dataset()
    ref_model, ref_losses, ref_out, _, ref_eval = train_and_eval(SingleProcess(), dataset, None)
    for label, strategy in cases:
        model, losses, out, gids, evaluated = train_and_eval(strategy, dataset, comm)
        where = f"{label} rank {comm.rank}/{comm.world_size}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=where)
        torch.testing.assert_close(out, ref_out[gids], msg=where)
        torch.testing.assert_close(evaluated, ref_eval[gids], msg=where)
        for (k, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
            torch.testing.assert_close(p, q, msg=f"{where} {k}")  # parameters and running stats


def strategy_cases():
    cases = [("tensor", TensorParallel())]
    for mode, part in (("depcomm", "metis"), ("depcache", "random"), ("hybrid", "chunk")):
        opts = DataParallel.Options(mode=mode, byte_cost=1e-9, edge_cost=1e-9)
        cases.append((f"data {mode} {part}", DataParallel(opts, PartitionOptions(method=part))))
    return cases


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_batchnorm_gin_data_and_tensor_match_single(tmp_path, world_size):
    run_ranks(check_strategies, world_size, tmp_path, strategy_cases())


def test_batchnorm_changes_the_model():
    """The option is not ignored: with it the program has normalised stages and
    different outputs from the same weights."""
    dataset = make_dataset()
    plain = build_model("gin", 9, 5, 3, dropout=0.0).to(TEST_DEVICE, torch.float64)
    normed = build_model("gin", 9, 5, 3, dropout=0.0, batch_norm=True)
    normed = normed.to(TEST_DEVICE, torch.float64)
    assert normed.reduces_rows and not plain.reduces_rows
    missing = plain.load_state_dict(normed.state_dict(), strict=False)
    assert missing.unexpected_keys and not missing.missing_keys
    outs = []
    for model in (plain, normed):
        plan = SingleProcess().setup(dataset, model, TEST_DEVICE, dtype=torch.float64)
        outs.append(SingleProcess().forward(model, plan, training=True, seed=0).logits)
    assert not torch.allclose(outs[0], outs[1])


def test_p2p_refuses_batchnorm():
    with pytest.raises(ValueError, match="p2p.*batch normalisation, reduces_rows"):
        P2PParallel().setup(make_dataset(), make_gin(), TEST_DEVICE)


def test_task_recompute_refuses_batchnorm_before_launch():
    """As p2p's refusal: found by check_launch, in the launcher, not by a worker's setup."""
    from fullgraph.parallel.task import TaskParallel

    strategy = TaskParallel(TaskParallel.Options(recompute=True))
    with pytest.raises(ValueError, match="--recompute: .*reduces_rows"):
        strategy.check_launch(make_gin(), 30, 2)
    TaskParallel().check_launch(make_gin(), 30, 2)


def test_batchnorm_config_errors():
    from fullgraph.config import ModelConfig

    with pytest.raises(ConfigError, match="batch_norm"):
        ModelConfig(name="sage", batch_norm=True)
    with pytest.raises(ConfigError, match="batch_norm"):
        ModelConfig(name="gin", batch_norm=True, decoupled=True)
    with pytest.raises(ValueError, match="batch_norm"):
        build_model("gin", 9, 5, 3, batch_norm=True, decoupled=True)
    assert ModelConfig(name="gin", batch_norm=True).build_options()["batch_norm"] is True
