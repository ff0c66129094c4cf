"""Start local workers, or join a torchrun job, and make failures loud and fast.

``fullgraph train --workers N`` starts N local worker processes of the very same
entry point, with the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT picked here). Under torchrun
the variables are already set, so one box and many hosts run the same code.

Workers split the cores: unless ``--threads`` is given, each uses
``max(1, cores // local workers)`` intra-op threads (oversubscription is a known
cause of several-fold slowdowns). Rank 0 prints to the terminal; other ranks write
``rank<R>.log`` in the run directory. A worker that fails writes
``failure-rank<R>.json`` (rank, phase, error, traceback) and exits non-zero; a
worker that dies leaves only its ``status-rank<R>`` file (its last phase). The
launcher then stops the others within the timeout and prints the first real
failure: the earliest one that is not a peer's reaction to it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

RUN_DIR_ENV = "FULLGRAPH_RUN_DIR"


def under_launcher() -> bool:
    """True inside a worker (started by us or by torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def threads_per_worker(local_workers: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_workers))


@dataclass
class WorkerExit:
    rank: int
    returncode: int
    stopped: bool = False  # killed by the launcher, still running after the timeout


def launch_local(argv: list[str], workers: int, *, timeout_s: float, run_dir: Path | None,
                 threads: int | None) -> int:
    """Run ``fullgraph <argv>`` as ``workers`` local processes; return the exit code."""
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fullgraph-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    per_worker = threads or threads_per_worker(workers)
    procs = []
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(per_worker),
                   FULLGRAPH_THREADS=str(per_worker), **{RUN_DIR_ENV: str(run_dir)})
        cmd = [sys.executable, "-m", "fullgraph.cli", *argv]
        if rank == 0:
            procs.append(subprocess.Popen(cmd, env=env))
        else:
            log = open(run_dir / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return _supervise(procs, run_dir, timeout_s)


def _supervise(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> int:
    """Wait for all workers; on the first failure give the rest ``timeout_s``, then kill."""
    deadline = None
    failed: list[WorkerExit] = []
    stopped: set[int] = set()
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and all(f.rank != rank for f in failed):
                    failed.append(WorkerExit(rank, code, rank in stopped))
                    deadline = deadline or time.monotonic() + timeout_s
            if deadline is not None and time.monotonic() > deadline:
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        stopped.add(rank)
                        p.kill()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    for rank, p in enumerate(procs):
        if p.returncode != 0 and all(f.rank != rank for f in failed):
            failed.append(WorkerExit(rank, p.returncode, rank in stopped))
    if not failed:
        return 0
    print(describe_failure(failed, run_dir), file=sys.stderr)
    return 1


def describe_failure(failed: list[WorkerExit], run_dir: Path) -> str:
    """The first real failure, named by rank and phase, with its traceback."""
    reports = []
    for f in failed:
        path = run_dir / f"failure-rank{f.rank}.json"
        if path.is_file():
            reports.append(json.loads(path.read_text()))
        else:
            status = run_dir / f"status-rank{f.rank}"
            phase = (status.read_text().strip() if status.is_file() else "") or "start-up"
            how = f"signal {-f.returncode}" if f.returncode < 0 else f"exit code {f.returncode}"
            if f.stopped:  # a reaction to the first failure, never the cause of it
                reports.append({"rank": f.rank, "phase": phase, "time": float("inf"),
                                "peer_failure": True, "error": "still running after the "
                                "timeout, stopped by the launcher", "traceback": ""})
                continue
            reports.append({"rank": f.rank, "phase": phase, "time": 0.0, "peer_failure": False,
                            "error": f"worker died ({how}) without a report",
                            "traceback": ""})
    # a worker that died or raised on its own comes before its peers' reactions to it
    reports.sort(key=lambda r: (r.get("peer_failure", False), r.get("time", 0.0)))
    first = reports[0]
    lines = [f"fullgraph: worker rank {first['rank']} failed during {first['phase']}: "
             f"{first['error']}"]
    if first.get("traceback"):
        lines.append(first["traceback"].rstrip())
    others = sorted({r["rank"] for r in reports[1:]})
    if others:
        lines.append(f"fullgraph: ranks {others} stopped after it; logs in {run_dir}")
    return "\n".join(lines)


class WorkerStatus:
    """A worker's view of the run directory: its phase, and its failure report."""

    def __init__(self, rank: int, run_dir: str | None) -> None:
        self.rank = rank
        self.dir = Path(run_dir) if run_dir else None
        self.phase = "start-up"
        if self.dir is not None:
            # lets a supervisor (or a test) find and signal this very worker
            (self.dir / f"pid-rank{self.rank}").write_text(str(os.getpid()))

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.dir is not None:
            # write-then-rename: a worker killed mid-write must not leave an empty status
            tmp = self.dir / f".status-rank{self.rank}"
            tmp.write_text(phase)
            tmp.replace(self.dir / f"status-rank{self.rank}")

    def report_failure(self, exc: BaseException) -> None:
        from fullgraph.comm.primitives import CommError
        from fullgraph.errors import FullgraphError

        # a user's mistake (bad option, bad file) is one line; a bug keeps its traceback
        user_error = isinstance(exc, (FullgraphError, ValueError)) and \
            not isinstance(exc, CommError) and not os.environ.get("FULLGRAPH_DEBUG")
        record = {"rank": self.rank, "phase": self.phase, "time": time.time(),
                  "peer_failure": isinstance(exc, CommError),
                  "error": f"{type(exc).__name__}: {exc}",
                  "traceback": "" if user_error else "".join(traceback.format_exception(exc))}
        if self.dir is not None:
            tmp = self.dir / f".failure-rank{self.rank}.json"
            tmp.write_text(json.dumps(record))
            tmp.replace(self.dir / f"failure-rank{self.rank}.json")
        print(f"fullgraph: rank {self.rank} failed during {self.phase}: {record['error']}",
              file=sys.stderr, flush=True)


def run_worker(body: Callable[[WorkerStatus], int]) -> int:
    """Run ``body`` as a worker: report a failure with rank and phase, exit non-zero."""
    status = WorkerStatus(int(os.environ.get("RANK", "0")), os.environ.get(RUN_DIR_ENV))
    try:
        return body(status)
    except Exception as exc:  # noqa: BLE001 - every failure must be reported, then re-raised
        status.report_failure(exc)
        if os.environ.get("FULLGRAPH_DEBUG"):
            raise
        return 1
