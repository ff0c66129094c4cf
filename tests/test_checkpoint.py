"""Checkpoints: exact resume for every strategy, resume on another strategy or worker
count, refusal of another run's checkpoint, and atomic writes.

The distributed runs share two spawns: one of 2 workers (every strategy: uninterrupted,
stopped after 2 epochs, resumed; and data -> tensor), one of 3 workers (resuming the
2-worker data checkpoint). Rank 0 writes its losses to ``losses.json``; parameters are
compared through the checkpoints themselves.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from harness import run_ranks

from fullgraph import checkpoint
from fullgraph.config import Config, ModelConfig, RuntimeConfig, TrainConfig
from fullgraph.errors import ConfigError
from fullgraph.graph.synthetic import sbm
from fullgraph.train import build, check_before_launch, train

EPOCHS, STOP = 4, 2
MODEL = ModelConfig(name="gat", hidden=5, heads=2, dropout=0.5, attn_dropout=0.3)
STRATEGIES = ("data", "tensor", "p2p")


def make_dataset():
    return sbm(67, 3, avg_degree=5.0, num_features=9, seed=11)


def config(strategy: str, epochs: int, out: Path | None, resume: Path | None = None,
           every: int = 1, model: ModelConfig = MODEL) -> Config:
    where = {} if out is None else {"checkpoint_dir": str(out), "checkpoint_every": every}
    return Config(model=model, runtime=RuntimeConfig(strategy=strategy),
                  train=TrainConfig(epochs=epochs, lr=0.05, **where,
                                    resume=None if resume is None else str(resume)))


def losses(result) -> list[float]:
    return [r.loss for r in result.epochs]


def assert_same_params(dir_a: Path, dir_b: Path, exact: bool = True) -> None:
    a, b = checkpoint.read(dir_a), checkpoint.read(dir_b)
    assert a["epoch"] == b["epoch"] and a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        if exact:
            assert torch.equal(value, b["model"][key]), key
        else:
            torch.testing.assert_close(value, b["model"][key], rtol=1e-4, atol=1e-6)
    if exact:  # the Adam state too
        for i, state in a["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(value, b["optimizer"]["state"][i][name]), (i, name)


def test_single_process_resume_is_bit_equal(tmp_path):
    ds = make_dataset()
    full = train(ds, config("single", EPOCHS, tmp_path / "full", every=3))
    first = train(ds, config("single", STOP, tmp_path / "part", every=3))
    assert checkpoint.read(tmp_path / "part")["epoch"] == STOP  # the end is always written
    resumed = train(ds, config("single", EPOCHS, tmp_path / "part", resume=tmp_path / "part"))
    assert losses(resumed) == losses(full) and losses(first) == losses(full)[:STOP]
    assert resumed.epochs[:STOP] == first.epochs  # the history is kept, timings included
    assert (resumed.best_epoch, resumed.best_val, resumed.test_at_best) == (
        full.best_epoch, full.best_val, full.test_at_best)
    for (ka, va), (kb, vb) in zip(full.model.state_dict().items(),
                                  resumed.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka  # the best-validation model
    assert_same_params(tmp_path / "full", tmp_path / "part")


def _two_workers(comm, out: str) -> None:
    """Every strategy: uninterrupted, stopped after STOP epochs, resumed; data -> tensor."""
    out_dir, ds, record = Path(out), make_dataset(), {}
    for s in STRATEGIES:
        record[f"{s} full"] = losses(train(ds, config(s, EPOCHS, out_dir / f"{s}-full"), comm=comm))
        train(ds, config(s, STOP, out_dir / f"{s}-part"), comm=comm)
        if s == "data" and comm.rank == 0:  # kept for the 3-worker resume
            shutil.copytree(out_dir / "data-part", out_dir / "stop2")
        if s == "data":  # another strategy resumes the data checkpoint (written elsewhere)
            cross = train(ds, config("tensor", EPOCHS, out_dir / "data-to-tensor",
                                     resume=out_dir / "data-part"), comm=comm)
            record["data -> tensor"] = losses(cross)
        resumed = train(ds, config(s, EPOCHS, out_dir / f"{s}-part", resume=out_dir / f"{s}-part"),
                        comm=comm)
        record[f"{s} resumed"] = losses(resumed)
    if comm.rank == 0:
        (out_dir / "losses.json").write_text(json.dumps(record))


def _three_workers(comm, out: str) -> None:
    out_dir, ds = Path(out), make_dataset()
    # data-part was resumed in place to EPOCHS: use the copy saved after STOP epochs
    resumed = train(ds, config("data", EPOCHS, out_dir / "data-3", resume=out_dir / "stop2"),
                    comm=comm)
    if comm.rank == 0:
        (out_dir / "losses3.json").write_text(json.dumps(losses(resumed)))


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt2")
    run_ranks(_two_workers, 2, out, str(out))
    return out, json.loads((out / "losses.json").read_text())


@pytest.fixture(scope="module")
def single_losses():
    return losses(train(make_dataset(), config("single", EPOCHS, None)))


@pytest.mark.dist
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_distributed_resume_is_bit_equal(two_worker_runs, strategy):
    out, record = two_worker_runs
    assert len(record[f"{strategy} full"]) == EPOCHS
    assert record[f"{strategy} resumed"] == record[f"{strategy} full"]
    assert_same_params(out / f"{strategy}-full", out / f"{strategy}-part")


@pytest.mark.dist
def test_resume_with_another_strategy(two_worker_runs, single_losses):
    out, record = two_worker_runs
    torch.testing.assert_close(record["data -> tensor"], single_losses, rtol=1e-5, atol=1e-6)
    assert checkpoint.read(out / "data-to-tensor")["run"]["strategy"] == "tensor"
    assert_same_params(out / "data-to-tensor", out / "data-full", exact=False)


@pytest.mark.dist
def test_resume_on_another_worker_count(two_worker_runs, single_losses, tmp_path):
    out, _ = two_worker_runs
    saved = checkpoint.read(out / "stop2")
    assert (saved["epoch"], saved["run"]["workers"]) == (STOP, 2)
    run_ranks(_three_workers, 3, tmp_path, str(out))
    three = json.loads((out / "losses3.json").read_text())
    torch.testing.assert_close(three, single_losses, rtol=1e-5, atol=1e-6)
    assert checkpoint.read(out / "data-3")["run"]["workers"] == 3
    assert_same_params(out / "data-3", out / "data-full", exact=False)


def test_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path):
    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path))
    other_model = dataclasses.replace(MODEL, hidden=7)
    with pytest.raises(ConfigError, match=r"^train.resume: .*: the checkpoint is of another "
                       r"model: model.hidden: 5 in the checkpoint, 7 here$"):
        train(ds, config("single", EPOCHS, None, resume=tmp_path, model=other_model))
    other_data = make_dataset()
    other_data.data.labels[0] = (other_data.data.labels[0] + 1) % 3
    with pytest.raises(ConfigError, match=r"another dataset: dataset.labels: '[0-9a-f]+' in the "
                       r"checkpoint, '[0-9a-f]+' here$"):
        train(other_data, config("single", EPOCHS, None, resume=tmp_path))
    other_data = make_dataset()
    other_data.data.features.mul_(2)  # as other --normalize-features would give
    with pytest.raises(ConfigError, match=r"dataset.feature values: .* here \(the features' "
                       r"values differ: .*--normalize-features or --feature-dtype"):
        train(other_data, config("single", EPOCHS, None, resume=tmp_path))
    # found before any worker starts, too; another strategy or worker count is no mismatch
    with pytest.raises(ConfigError, match=r"is at epoch 2, past train.epochs 1$"):
        check_before_launch(config("data", 1, None, resume=tmp_path), ds, 2)
    check_before_launch(config("data", EPOCHS, None, resume=tmp_path), ds, 2)
    with pytest.raises(ConfigError, match=r"no checkpoint in .*nowhere \(checkpoint.pt not found"):
        train(ds, config("single", EPOCHS, None, resume=tmp_path / "nowhere"))


def test_parameters_of_another_program_are_refused_naming_them(tmp_path):
    """A checkpoint or saved model whose parameters were written for another build of
    the same model (options equal, layers laid out otherwise, as by an earlier
    fullgraph) is refused with one message naming the names that differ."""
    from fullgraph import saved

    ds = make_dataset()
    model_path = tmp_path / "model.pt"
    cfg = config("single", STOP, tmp_path / "ckpt")
    train(ds, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                 save_model=str(model_path))))
    path = tmp_path / "ckpt" / checkpoint.FILE_NAME
    payload = torch.load(path, weights_only=True)
    first = next(iter(payload["model"]))
    payload["model"]["stages.99.weight"] = payload["model"].pop(first)
    torch.save(payload, path)
    with pytest.raises(ConfigError, match=r"^train.resume: .*ckpt: its parameters do not fit "
                       rf"this model's program \(missing {re.escape(first)}; not in this model "
                       r"stages.99.weight\); .*train anew$"):
        train(ds, config("single", EPOCHS, None, resume=tmp_path / "ckpt"))
    model = torch.load(model_path, weights_only=True)
    key = next(k for k, v in model["state_dict"].items() if v.dim() == 2)
    model["state_dict"][key] = torch.zeros(3, 3)
    torch.save(model, model_path)
    with pytest.raises(ConfigError, match=rf"^model: .*model.pt: .*shapes differ: "
                       rf"{re.escape(key)} \(3, 3\) there"):
        saved.load_model(model_path)


def test_checkpoint_every_without_a_directory_warns():
    with pytest.warns(UserWarning,
                      match="--checkpoint-every has no effect without --checkpoint-dir"):
        TrainConfig(checkpoint_every=5)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A write that dies after part of the file leaves the previous checkpoint whole."""
    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path))
    before = (tmp_path / checkpoint.FILE_NAME).read_bytes()
    real_save = torch.save

    def partial_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # half-written, then the writer dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", partial_save)
    with pytest.raises(KeyboardInterrupt):
        train(ds, config("single", EPOCHS, tmp_path, resume=tmp_path))
    assert (tmp_path / checkpoint.FILE_NAME).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE_NAME]
    assert checkpoint.read(tmp_path)["epoch"] == STOP


def test_a_full_disk_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """torch.save reports a failed write as its own RuntimeError with the OS error only
    chained; the writer raises the OS error, naming the file (one line, exit 2), and
    leaves no temporary file."""
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from exc

    monkeypatch.setattr(torch, "save", full_disk)
    path = tmp_path / checkpoint.FILE_NAME
    with pytest.raises(OSError) as err:
        checkpoint.write_atomic(path, {"x": torch.ones(3)})
    assert err.value.errno == 28 and err.value.filename == str(path), err.value
    assert list(tmp_path.iterdir()) == []


def test_a_write_under_way_is_removed_by_remove_unfinished(tmp_path, monkeypatch):
    """A worker ended by SIGTERM leaves at once (os._exit, past write_atomic's clean-up):
    its signal handler removes the temporary file of the write under way."""
    from fullgraph import paths

    def killed(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        paths.remove_unfinished()  # what the handler does, then os._exit
        raise SystemExit(143)

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(SystemExit):
        checkpoint.write_atomic(tmp_path / checkpoint.FILE_NAME, {})
    assert list(tmp_path.iterdir()) == []
    assert not paths._UNFINISHED


def test_a_directory_in_place_of_the_checkpoint_file_is_named(tmp_path):
    (tmp_path / checkpoint.FILE_NAME).mkdir()
    with pytest.raises(ConfigError, match="checkpoint.pt is a directory, not a checkpoint"):
        checkpoint.read(tmp_path)


def _mixed_starts(comm, out: str) -> None:
    """Rank 0 resumes the 2-worker checkpoint; rank 1 starts afresh, then resumes a copy
    whose parameters differ (another host's checkpoint of the same epoch)."""
    out_dir, ds = Path(out), make_dataset()
    for other in (None, out_dir / "stop2-other"):
        mine = out_dir / "stop2" if comm.rank == 0 else other
        with pytest.raises(ConfigError) as err:
            train(ds, config("data", EPOCHS, None, resume=mine), comm=comm)
        want = ("a fresh start on rank(s) 1" if other is None else
                f"a checkpoint of epoch {STOP} (")
        assert "the workers start from different points" in str(err.value), err.value
        assert want in str(err.value) and "give every worker the same --resume" in str(
            err.value), err.value


@pytest.mark.dist
def test_workers_resuming_from_different_points_are_refused(two_worker_runs, tmp_path):
    """Under torchrun each host names its own checkpoint: a worker given none, or one
    holding other parameters, would average its gradients into another model."""
    out, _ = two_worker_runs
    saved = checkpoint.read(out / "stop2")
    first = next(iter(saved["model"]))
    saved["model"][first] = saved["model"][first] + 1.0
    checkpoint.write_atomic(out / "stop2-other" / checkpoint.FILE_NAME, saved)
    run_ranks(_mixed_starts, 2, tmp_path, str(out))


def test_damaged_checkpoint_is_refused_not_resumed(tmp_path):
    """Bytes flipped inside a tensor leave a valid zip that torch.load reads: the CRC-32
    written with each part finds them."""
    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path))
    path = tmp_path / checkpoint.FILE_NAME
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"checkpoint.pt is not a readable checkpoint: "
                                          r"damaged \(its part .* does not match the checksum"):
        checkpoint.read(tmp_path)


@pytest.mark.parametrize("change,needle", [
    (lambda c: c.pop("optimizer"), r"\(no optimizer\)"),
    (lambda c: c.update(epoch=-4), r"\(epoch -4 with 2 epoch records;"),
    (lambda c: c.update(records=c["records"][:1]), r"\(epoch 2 with 1 epoch records;"),
    (lambda c: c.update(epoch="2"), r"\(epoch is a str\)"),
    (lambda c: c["best"].pop("params"), r"\(its best state lacks params\)"),
    (lambda c: c["records"].__setitem__(1, 1), r"\(the record of epoch 2 is not an epoch"),
    (lambda c: c["records"][0].pop("loss"), r"\(the record of epoch 1 is not an epoch"),
    (lambda c: c.update(run={}), r"\(its run facts lack strategy, workers\)"),
])
def test_a_checkpoint_changed_by_hand_is_one_clear_error(tmp_path, change, needle):
    """A file of the right format and version whose parts another program changed (the
    checksums are written again with it) is refused before anything is restored."""
    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path))
    saved = checkpoint.read(tmp_path)
    assert saved["epoch"] == STOP == 2
    change(saved)
    checkpoint.write_atomic(tmp_path / checkpoint.FILE_NAME, saved)
    with pytest.raises(ConfigError, match=r"checkpoint.pt is not a whole checkpoint " + needle):
        train(ds, config("single", EPOCHS, None, resume=tmp_path))


def test_rank_0_is_done_after_saving_the_model(tmp_path):
    """The launcher gives a worker in phase "done" its exit grace, and the failure watch
    stops there: saving the model ends in "done" again."""
    from fullgraph.worker import WorkerStatus

    status = WorkerStatus(0, None)
    phases = []
    real = status.set_phase
    status.set_phase = lambda phase: (phases.append(phase), real(phase))[1]
    cfg = config("single", 1, None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, save_model=str(tmp_path / "model.pt")))
    train(make_dataset(), cfg, status=status)
    assert phases[-2:] == ["saving the model", "done"] and status.phase == "done"
    assert (tmp_path / "model.pt").is_file()


def test_a_new_run_does_not_replace_a_checkpoint_it_was_not_told_to_resume(tmp_path):
    """The same command run again without --resume would start at epoch 0 and write its
    first checkpoint over the one it meant to continue."""
    from fullgraph.train import check_outputs

    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path / "ck", every=1))
    with pytest.raises(ConfigError, match=rf"holds a checkpoint after epoch {STOP}, which this "
                       r"new run would replace: continue it with --resume"):
        check_outputs(config("single", EPOCHS, tmp_path / "ck"))
    check_outputs(config("single", EPOCHS, tmp_path / "ck", resume=tmp_path / "ck"))
    check_outputs(config("single", EPOCHS, tmp_path / "ck",
                         resume=tmp_path / "ck" / checkpoint.FILE_NAME))  # (the file itself)
    check_outputs(config("single", EPOCHS, tmp_path / "elsewhere"))
    train(ds, config("single", 1, tmp_path / "other", every=1))  # resumed from another run's:
    with pytest.raises(ConfigError, match=r"which this run \(resumed from .*other\) would "
                       "replace"):  # still not the one it continues
        check_outputs(config("single", EPOCHS, tmp_path / "ck", resume=tmp_path / "other"))
    (tmp_path / "ck" / checkpoint.FILE_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="holds checkpoint.pt, which"):  # still not its own
        check_outputs(config("single", EPOCHS, tmp_path / "ck"))


def test_resume_auto_starts_anew_then_continues_from_the_checkpoint_dir(tmp_path):
    """One command for a job's first launch and its requeues."""
    def auto(epochs: int) -> Config:
        cfg = config("single", epochs, tmp_path / "ck", every=1)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="auto"))

    ds = make_dataset()
    first = checkpoint.resolve_resume(auto(STOP))
    assert first.train.resume is None
    train(ds, first)
    again = checkpoint.resolve_resume(auto(EPOCHS))
    assert again.train.resume == str(tmp_path / "ck")
    resumed = train(ds, again)
    assert losses(resumed) == losses(train(ds, config("single", EPOCHS, None)))
    with pytest.raises(ConfigError, match="'auto' resumes from --checkpoint-dir"):
        TrainConfig(resume="auto")


def test_a_model_with_non_finite_parameters_is_never_the_one_kept():
    """NaN logits still give classes (argmax: the first), and so an accuracy: on Cora
    at lr 1e30 the NaN parameters of epoch 2 scored 12.2 % against epoch 1's 11.6 %
    and were kept, saved and returned."""
    import math

    import fullgraph

    with pytest.warns(UserWarning, match="diverged"):
        result = fullgraph.fit("cora", epochs=10, lr=1e30)
    assert not math.isfinite(result.history[-1]["loss"])
    assert result.best_epoch < len(result.history)
    assert all(torch.isfinite(v).all() for v in result.model.state_dict().values()
               if v.is_floating_point())


def test_without_validation_vertices_a_diverged_run_keeps_the_last_finite_model():
    """The model kept there is the last epoch's: it was the diverged one, NaN."""
    import math

    ds = make_dataset()
    ds.data.val_mask[:] = False
    cfg = config("single", 10, None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1e30))
    with pytest.warns(UserWarning, match="diverged"):
        result = train(ds, cfg)
    assert not math.isfinite(result.epochs[-1].loss) and math.isnan(result.best_val)
    assert result.best_epoch < result.epochs[-1].epoch
    assert all(torch.isfinite(v).all() for v in result.model.state_dict().values()
               if v.is_floating_point())


def test_a_checkpoint_dir_with_a_tilde_is_one_place_for_every_use(tmp_path, monkeypatch):
    """A config file's '~/ck' was written as ./~/ck and looked for in $HOME/ck: --resume
    auto never resumed and the refusal never fired."""
    from fullgraph.train import check_outputs

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ds = make_dataset()
    cfg = config("single", STOP, Path("~/ck"), every=1)
    train(ds, cfg)
    assert (tmp_path / "ck" / checkpoint.FILE_NAME).is_file() and not (tmp_path / "~").exists()
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="auto",
                                                              epochs=EPOCHS))
    assert checkpoint.resolve_resume(auto).train.resume == "~/ck"
    assert checkpoint.read("~/ck")["epoch"] == STOP
    with pytest.raises(ConfigError, match=f"holds a checkpoint after epoch {STOP}"):
        check_outputs(cfg)


def test_a_write_removes_the_temporaries_of_writers_killed_outright(tmp_path):
    """A worker SIGKILLed while writing --save-model left ``.m.pt.<pid>.tmp`` for good
    (the checkpoint's were removed by the next checkpoint; the model file's never)."""
    import subprocess
    import sys

    from fullgraph.paths import process_space

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    here = process_space()
    dead = tmp_path / f".m.pt.{here}-{int(gone.stdout)}.tmp"  # (that pid is free now, or
    live = tmp_path / f".m.pt.{here}-{os.getppid()}.tmp"  # reused: another one writing)
    other = tmp_path / f".other.pt.{here}-{int(gone.stdout)}.tmp"
    elsewhere = tmp_path / f".m.pt.0123456789ab-{int(gone.stdout)}.tmp"  # another host's
    for f in (dead, live, other, elsewhere):
        f.write_bytes(b"part of a model")
    checkpoint.write_atomic(tmp_path / "m.pt", {"x": torch.ones(2)})
    assert not dead.exists() and live.exists() and other.exists() and elsewhere.exists()
    assert torch.load(tmp_path / "m.pt")["x"].tolist() == [1.0, 1.0]


def test_a_resumed_run_names_the_options_it_changed(tmp_path):
    """The checkpoint kept the whole config, and nothing read it: a resume that
    changed --epochs, the strategy or --eval-every went on without a word. The header
    now lists what differs (where it reads and writes aside)."""
    ds = make_dataset()
    train(ds, config("single", STOP, tmp_path / "part"))
    cfg = config("single", EPOCHS, tmp_path / "part", resume=tmp_path / "part")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=2))
    state = checkpoint.Checkpointer(ds, cfg, 0, torch.float32, {})
    model = build(ds, cfg)
    state.resume(model, torch.optim.Adam(model.parameters(), lr=0.05))
    assert state.header_lines()[1] == (
        f"resume   options other than the checkpoint's run had: train.epochs {STOP} -> "
        f"{EPOCHS}; train.eval_every 1 -> 2")
    same = config("single", STOP, tmp_path / "other", resume=tmp_path / "part")
    state = checkpoint.Checkpointer(ds, same, 0, torch.float32, {})
    state.resume(model, torch.optim.Adam(model.parameters(), lr=0.05))
    assert len(state.header_lines()) == 1  # another checkpoint directory: no change


def _hosts(comm, base: str) -> None:
    """Rank 0 on "host 0", ranks 1 and 2 on "host 1": a --checkpoint-dir of the same
    name that is another folder on each (hosts without shared storage); then one
    folder for all (shared storage)."""
    got = []
    for host in (min(comm.rank, 1), 0):
        cfg = Config(train=TrainConfig(checkpoint_dir=f"{base}/host{host}/ck"))
        ckpt = checkpoint.Checkpointer(None, cfg, comm.rank, torch.float32, {})
        ckpt.find_other_hosts(comm)
        got.append([ckpt.writer, ckpt.other_writers])
    Path(f"{base}/rank{comm.rank}.json").write_text(json.dumps(got))


@pytest.mark.dist
def test_a_host_that_does_not_see_rank_0s_checkpoint_dir_writes_its_own(tmp_path):
    """Under torchrun only rank 0 wrote: a host without shared storage had no
    checkpoint, so `--resume auto` after a requeue refused to start (the workers start
    from different points)."""
    run_ranks(_hosts, 3, tmp_path, str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [g[0] for g in got] == [[True, [1]], [True, [1]], [False, [1]]]  # one on host 1
    assert [g[1] for g in got] == [[True, []], [False, []], [False, []]]  # shared: rank 0
    assert list((tmp_path / "host0" / "ck").iterdir()) == []  # rank 0's marker removed


def test_a_checkpoint_due_on_a_partial_reduce_epoch_waits_for_a_synchronised_one(tmp_path):
    """Under partial reduce a checkpoint written at a partial epoch lost the workers'
    records of the epochs since the last synchronised one (they travel at the next):
    a requeued run's report had no per-rank records for them."""
    ds = make_dataset()
    cfg = config("single", 10, tmp_path / "ck", every=2)
    ckpt = checkpoint.Checkpointer(ds, cfg, 0, torch.float32, {})
    model = build(ds, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    best = (0.0, 1, 0.0, 0.0, None)
    written = []
    for epoch, ready in ((1, True), (2, False), (3, False), (4, True), (5, True), (6, True)):
        ckpt.after_epoch(epoch, model, opt, best, [], ready=ready)
        if checkpoint.checkpoint_file(tmp_path / "ck").is_file():
            written.append(torch.load(checkpoint.checkpoint_file(tmp_path / "ck"),
                                      weights_only=False)["epoch"])
    assert written == [4, 4, 6]  # due at 2 (partial): written at 4; then at 6
