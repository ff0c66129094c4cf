"""Early stopping (``--patience``): where a run stops, what it keeps and writes, resume,
every rank stopping at the same epoch, and the refusals."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from harness import run_ranks

from fullgraph import checkpoint
from fullgraph.config import Config, ModelConfig, RuntimeConfig, TrainConfig
from fullgraph.errors import ConfigError
from fullgraph.graph.synthetic import sbm
from fullgraph.train import check_before_launch, check_patience, train

EPOCHS = 60
MODEL = ModelConfig(name="gcn", hidden=8, dropout=0.5)


def make_dataset():
    return sbm(90, 3, avg_degree=5.0, num_features=12, seed=5)


def config(epochs: int = EPOCHS, patience: int | None = None, strategy: str = "single",
           **train_options) -> Config:
    return Config(model=MODEL, runtime=RuntimeConfig(strategy=strategy),
                  train=TrainConfig(epochs=epochs, lr=0.05, patience=patience, **train_options))


def expected_stop(result, patience: int) -> int:
    """The first evaluated epoch at least ``patience`` after the best one before it."""
    best_val, best_epoch = -math.inf, 0
    for rec in result.epochs:
        if math.isnan(rec.val_acc):
            continue
        if rec.val_acc > best_val:
            best_val, best_epoch = rec.val_acc, rec.epoch
        elif rec.epoch - best_epoch >= patience:
            return rec.epoch
    raise AssertionError(f"the full run never waited {patience} epochs for a better model")


@pytest.fixture(scope="module")
def full():
    return train(make_dataset(), config())


@pytest.mark.parametrize("patience,eval_every", [(4, 1), (5, 3)])
def test_the_run_stops_where_the_validation_accuracy_stalled(full, tmp_path, patience,
                                                             eval_every):
    ds = make_dataset()
    reference = full if eval_every == 1 else train(ds, config(eval_every=eval_every))
    stop = expected_stop(reference, patience)
    assert stop < EPOCHS
    early = train(ds, config(patience=patience, eval_every=eval_every,
                             checkpoint_dir=str(tmp_path), checkpoint_every=1000))
    assert [r.epoch for r in early.epochs] == list(range(1, stop + 1))
    assert [r.loss for r in early.epochs] == [r.loss for r in reference.epochs[:stop]]
    best = max((r for r in early.epochs if not math.isnan(r.val_acc)),
               key=lambda r: (r.val_acc, -r.epoch))
    assert early.best_epoch == best.epoch and stop - best.epoch >= patience
    saved = checkpoint.read(tmp_path)  # the stop is the run's end: its checkpoint is written
    assert saved["epoch"] == stop and saved["best"]["epoch"] == early.best_epoch


def test_resume_after_an_early_stop(tmp_path):
    ds = make_dataset()
    first = train(ds, config(patience=3, checkpoint_dir=str(tmp_path / "a")))
    stop = first.epochs[-1].epoch
    assert stop < EPOCHS
    again = train(ds, config(patience=3, resume=str(tmp_path / "a")))
    assert again.epochs == first.epochs  # it had stopped: no epoch runs
    assert again.best_epoch == first.best_epoch
    # more patience continues, as a run that had it from the start
    longer = train(ds, config(patience=12, resume=str(tmp_path / "a")))
    direct = train(ds, config(patience=12))
    assert [r.loss for r in longer.epochs] == [r.loss for r in direct.epochs]
    assert longer.best_epoch == direct.best_epoch


def test_the_summary_says_why_the_run_stopped(tmp_path):
    from fullgraph.report import Reporter

    metrics = tmp_path / "m.jsonl"
    reporter = Reporter(EPOCHS, metrics_out=str(metrics), verbose=False)
    result = train(make_dataset(), config(patience=3, metrics_out=str(metrics)),
                   reporter=reporter)
    reporter.close()
    summary = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert summary["event"] == "summary" and summary["stopped_early"] is True
    assert summary["epochs"] == len(result.epochs) < EPOCHS


def _ranks(comm, out: str) -> None:
    ds, record = make_dataset(), {}
    for strategy in ("data", "tensor"):
        result = train(ds, config(patience=4, strategy=strategy), comm=comm)
        record[strategy] = [r.loss for r in result.epochs]
    Path(out, f"rank{comm.rank}.json").write_text(json.dumps(record))


@pytest.mark.dist
def test_every_rank_stops_at_the_single_process_epoch(full, tmp_path):
    run_ranks(_ranks, 3, tmp_path, str(tmp_path))
    stop = expected_stop(full, 4)
    for rank in range(3):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for strategy, losses in record.items():
            assert len(losses) == stop, (rank, strategy)
            torch.testing.assert_close(losses, [r.loss for r in full.epochs[:stop]],
                                       rtol=1e-5, atol=1e-6)


def test_patience_needs_validation_vertices(tmp_path):
    ds = make_dataset()
    ds.data.val_mask = torch.zeros_like(ds.data.val_mask)
    with pytest.raises(ConfigError, match="train.patience: .* no validation vertices"):
        check_before_launch(config(patience=3), ds, 1)
    with pytest.raises(ConfigError, match="no validation vertices"):
        train(ds, config(patience=3))
    assert len(train(ds, config(epochs=3)).epochs) == 3  # without it, the last model is kept
    # per-part shards keep the whole graph's masks: refused there too
    from fullgraph.checkpoint import dataset_fingerprint
    from fullgraph.graph.store import load_shard
    from fullgraph.partition import partition
    from fullgraph.partition.shards import write_shards

    write_shards(ds, partition(ds.graph, 2, "chunk"), tmp_path / "shards", 0,
                 dataset_fingerprint(ds))
    with pytest.raises(ConfigError, match="no validation vertices"):
        check_patience(config(patience=3), load_shard(tmp_path / "shards", 1))


@pytest.mark.parametrize("bad", [0, -2])
def test_patience_below_one_is_refused(bad):
    with pytest.raises(ConfigError, match=f"train.patience: got {bad}"):
        TrainConfig(patience=bad)


def test_check_refuses_patience():
    from fullgraph.exactness import check_config

    with pytest.raises(ConfigError, match="--patience"):
        check_config(Config(train=TrainConfig(patience=5)))
