"""The worker's status file: phases outside an epoch (and the first of an epoch after
them) are written at once, the other phases of an epoch by the heartbeat (not on the
training loop's path)."""
from __future__ import annotations

import json

import pytest

from fullgraph import worker
from fullgraph.errors import ConfigError
from fullgraph.worker import WorkerStatus


def test_epoch_phases_reach_the_status_file_with_the_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(worker, "HEARTBEAT_S", 3600.0)  # the test beats by hand
    status = WorkerStatus(3, str(tmp_path))
    path = tmp_path / "status-rank3"
    status.set_phase("setup")
    assert path.read_text() == "setup"
    status.set_phase("epoch 1 training step")  # the first after another: at once
    status.set_phase("epoch 1 evaluation")
    assert path.read_text() == "epoch 1 training step" and status.phase == "epoch 1 evaluation"
    status._write_status()  # what the heartbeat thread does every HEARTBEAT_S
    assert path.read_text() == "epoch 1 evaluation"
    status.set_phase("done")
    assert path.read_text() == "done"
    # the heartbeat says so at once: "done" earns the launcher's exit grace, and a
    # --timeout of 1 s must not kill a worker in torch's teardown before the next beat
    assert json.loads((tmp_path / "heartbeat-rank3").read_text())["phase"] == "done"
    assert not list(tmp_path.glob(".status*")) and not list(tmp_path.glob(".heart*"))


@pytest.mark.parametrize("phase,exc,user", [
    ("setup", ValueError("--chunks must be positive"), True),
    ("epoch 50 evaluation", ValueError("a bug deep in model code"), False),
    ("epoch 3 training step", ConfigError("a user's file"), True),
    ("epoch 3 training step", FileNotFoundError(2, "No such file", "/x/y"), True),
    ("setup", KeyError("x"), False),
])
def test_a_value_error_in_an_epoch_is_a_bug_with_its_traceback(tmp_path, monkeypatch, phase,
                                                                exc, user):
    """Options are refused with ValueError before training; raised in an epoch (by a
    model's code, say) it is a bug: exit code 1 and the traceback kept."""
    monkeypatch.setattr(worker, "HEARTBEAT_S", 3600.0)
    monkeypatch.setenv(worker.SUPERVISED_ENV, "1")  # the launcher prints it
    monkeypatch.delenv("FULLGRAPH_DEBUG", raising=False)
    status = WorkerStatus(1, str(tmp_path))
    status.set_phase(phase)
    try:
        raise exc
    except Exception as err:  # noqa: BLE001 - a traceback to keep
        assert status.report_failure(err) is user
    record = json.loads((tmp_path / "failure-rank1.json").read_text())
    assert record["user_error"] is user and bool(record["traceback"]) is not user
    status.debug = True  # --log-level debug: every failure keeps its traceback
    assert status.report_failure(exc) is user
    assert json.loads((tmp_path / "failure-rank1.json").read_text())["traceback"]


def test_without_a_run_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status = WorkerStatus(0, None)
    status.set_phase("epoch 2 training step")
    status.set_phase("done")
    assert status.phase == "done" and list(tmp_path.iterdir()) == []
