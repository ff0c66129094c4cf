"""The worker's status file: phases outside an epoch are written at once, the phases of
an epoch by the heartbeat (not on the training loop's path)."""
from __future__ import annotations

from fullgraph import worker
from fullgraph.worker import WorkerStatus


def test_epoch_phases_reach_the_status_file_with_the_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(worker, "HEARTBEAT_S", 3600.0)  # the test beats by hand
    status = WorkerStatus(3, str(tmp_path))
    path = tmp_path / "status-rank3"
    status.set_phase("setup")
    assert path.read_text() == "setup"
    status.set_phase("epoch 1 training step")
    status.set_phase("epoch 1 evaluation")
    assert path.read_text() == "setup" and status.phase == "epoch 1 evaluation"
    status._write_status()  # what the heartbeat thread does every HEARTBEAT_S
    assert path.read_text() == "epoch 1 evaluation"
    status.set_phase("done")
    assert path.read_text() == "done"
    assert not list(tmp_path.glob(".status*"))  # no temporary file left behind


def test_without_a_run_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status = WorkerStatus(0, None)
    status.set_phase("epoch 2 training step")
    status.set_phase("done")
    assert status.phase == "done" and list(tmp_path.iterdir()) == []
