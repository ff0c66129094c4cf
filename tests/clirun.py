"""Running the real CLI in subprocesses, for the launcher and CLI tests."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

EPOCHS = 5
TRAIN = ["train", "--epochs", str(EPOCHS), "--dropout", "0.5", "--progress", "off",
         "--timeout", "60"]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "FULLGRAPH_RUN_DIR", "FULLGRAPH_THREADS",
                "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID")


def fullgraph_cmd() -> list[str]:
    """The installed ``fullgraph`` script next to this interpreter, else ``-m``."""
    script = Path(sys.executable).with_name("fullgraph")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fullgraph.cli"]


def clean_env(data_root: Path, **extra: str) -> dict[str, str]:
    """This environment without launcher variables (pytest itself may run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(FULLGRAPH_DATA=str(data_root), **extra)
    return env


def two_cores() -> None:
    """preexec_fn: at most two CPUs, so the thread budget is the same on any machine."""
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[:2])


def run_cli(args: list[str], data_root: Path, *, timeout: float = 180,
            cmd: list[str] | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run((cmd or fullgraph_cmd()) + args, env=clean_env(data_root, **extra_env),
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=two_cores)


def events(path: Path, kind: str) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == kind]


def final_accuracy(stdout: str) -> str:
    found = re.findall(r"final test accuracy ([0-9.]+%)", stdout)
    assert len(found) == 1, stdout
    return found[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_line_error(capsys, *needles: str) -> str:
    """The captured stderr, checked to be one line without a traceback, holding each
    of ``needles``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err
