"""Start local workers, or join a torchrun job, and make failures loud and fast.

``fullgraph train --workers N`` starts N local worker processes of the very same
entry point, with the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT picked here). Under torchrun
the variables are already set, so one box and many hosts run the same code.

Before starting anything, ``check_workers`` refuses more workers than this machine
can run (more than ``WORKERS_PER_CORE`` per core, or more than the available memory
holds at ``WORKER_MEMORY_BYTES`` each) unless told to oversubscribe, and warns when
workers outnumber cores. Workers split the cores: unless ``--threads`` is given, each
uses ``max(1, cores // local workers)`` intra-op threads (oversubscription is a known
cause of several-fold slowdowns). Rank 0 prints to the terminal; other ranks write
``rank<R>.log`` in the run directory, a temporary one unless ``--run-dir`` names it,
removed after a successful run unless ``--keep-run-dir``.

The workers keep status, heartbeat and failure files there (``fullgraph.worker``).
The supervisor names the root cause of a failure, once, leading with it:

- a worker that dies (a signal, an exit without a report) or raises on its own; its
  peers then get ``timeout`` to stop before they are killed (``GRACE_S`` after a
  user's error before training, which is the cause whatever the peers do, and leaves
  no work of theirs to finish);
- a worker that stops responding: its heartbeat is older than the timeout (stopped,
  or stuck in C code), or, when a peer's collective timed out, it has entered fewer
  communication calls than that peer (it never reached the call), or a peer's
  point-to-point receive from it timed out while it waits for no one (a straggler
  under partial reduce). It is killed at once, and the others get ``GRACE_S`` (they
  have waited a timeout already);
- otherwise the earliest peer failure (``CommError``), and everything else is killed
  after ``GRACE_S``.

Its exit code is 2 when the root cause is a user error (bad option or file), else 1.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from fullgraph.comm import shm
from fullgraph.errors import ConfigError, FullgraphError
from fullgraph.memory import available_memory
from fullgraph.worker import (  # noqa: F401
    CLOSED_PIPE_EXIT,
    EVERY_EPOCH,
    HEARTBEAT_S,
    RUN_DIR_ENV,
    SUPERVISED_ENV,
    WARNED_ENV,
    WorkerStatus,
    run_worker,
    shown_warnings,
)

WORKERS_PER_CORE = 4
"""More local workers than this per core are refused without ``oversubscribe``."""
WORKER_MEMORY_BYTES = 400 * 2**20
"""A floor on one worker's memory: Python, torch and its kernels, before any data."""
GRACE_S = 5.0
"""How long the other workers get once a peer failure or a hang has been found."""
EARLY_PHASES = ("start-up", "setup")
"""The phases before training: a user's error there leaves the others nothing to do."""
RUN_FILES = ("pid-rank*", "status-rank*", "heartbeat-rank*", "failure-rank*.json",
             "rank*.log")
"""A run directory's files of one run (``*``: the rank), removed before the next."""


def under_launcher() -> bool:
    """True inside a worker (started by us or by torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def under_torchrun() -> bool:
    """True inside a worker of torchrun (or of another launcher setting RANK and
    WORLD_SIZE), not of fullgraph's own local launcher: its peers may be on other
    hosts, and nothing supervises them together."""
    return under_launcher() and not os.environ.get(SUPERVISED_ENV)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def threads_per_worker(local_workers: int) -> int:
    return max(1, available_cores() // max(1, local_workers))


def check_workers(workers: int, oversubscribe: bool) -> None:
    """Refuse a worker count this machine cannot run; warn when workers outnumber cores.

    Raises:
        ConfigError: more than ``WORKERS_PER_CORE`` workers per core, or more than the
            available memory holds, and ``oversubscribe`` is False.
    """
    cores, memory = available_cores(), available_memory()
    need = workers * WORKER_MEMORY_BYTES
    override = "or --oversubscribe to start them anyway"
    if not oversubscribe and workers > WORKERS_PER_CORE * cores:
        raise ConfigError(f"launch.workers: {workers} workers on {cores} cores is more than "
                          f"{WORKERS_PER_CORE} per core; use --workers "
                          f"{WORKERS_PER_CORE * cores} or fewer (--workers {cores} or fewer "
                          f"to give each a core), {override}")
    if not oversubscribe and memory is not None and need > memory:
        raise ConfigError(f"launch.workers: {workers} workers need at least "
                          f"{need / 2**30:.1f} GiB ({WORKER_MEMORY_BYTES // 2**20} MiB each) "
                          f"but {memory / 2**30:.1f} GiB is available; use fewer workers, "
                          f"{override}")
    if workers > cores:
        warnings.warn(f"{workers} workers on {cores} cores: they share cores and each runs "
                      "slower than it would on a core of its own", stacklevel=2)


def check_threads(threads: int | None, workers: int) -> None:
    """Warn when ``--threads`` per worker times the local workers outnumber the cores
    (each thread then waits for a core; unset, the launcher shares the cores out)."""
    cores = available_cores()
    if threads and threads * workers > cores:
        warnings.warn(f"--threads {threads} x {workers} worker(s) on {cores} cores: the "
                      "threads share cores and each runs slower; leave --threads unset to "
                      "share the cores out", stacklevel=2)


def torchrun_conflict(workers: int) -> str | None:
    """Why ``--workers`` contradicts the launcher's WORLD_SIZE, or None when it does not."""
    world = os.environ.get("WORLD_SIZE", "1")
    if workers > 1 and str(workers) != world:
        return (f"--workers {workers} conflicts with the launcher's WORLD_SIZE={world}: under "
                "torchrun the number of workers is torchrun's (--nproc-per-node, --nnodes); "
                "drop --workers")
    return None


@dataclass
class WorkerExit:
    rank: int
    returncode: int
    stopped: bool = False  # killed by the launcher, still running after the timeout
    hung: str = ""  # why the launcher found it unresponsive (it was killed for that)


def launch_local(argv: list[str], workers: int, *, timeout_s: float, run_dir: str | None,
                 threads: int | None, keep_run_dir: bool = False,
                 module: str = "fullgraph.cli") -> int:
    """Run ``python -m <module> <argv>`` as ``workers`` local processes; return the exit code.

    A temporary run directory (``run_dir`` None) is removed after success unless
    ``keep_run_dir``; after a failure it is kept and its path printed. ``module`` is the
    workers' entry point: the CLI, or the Python API's (``fullgraph.api``).
    """
    return run_local(argv, workers, timeout_s=timeout_s, run_dir=run_dir, threads=threads,
                     keep_run_dir=keep_run_dir, module=module)[0]


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (the workers started in
    it inherit them), then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def run_local(argv: list[str], workers: int, *, timeout_s: float, run_dir: str | None,
              threads: int | None, keep_run_dir: bool = False,
              module: str = "fullgraph.cli", resignal: bool = True) -> tuple[int, str]:
    """``launch_local``, returning the failure's description too ("" after success),
    as printed to stderr: its first line names the failed rank, phase and error.

    Stopped by SIGTERM or SIGHUP (exit code 128 + the signal), it sends the signal on
    to this process once the workers are stopped, unless ``resignal`` is False: the
    caller then has files of its own to remove first, and sends it itself."""
    temporary = run_dir is None
    path = Path(run_dir or tempfile.mkdtemp(prefix="fullgraph-run-"))
    path.mkdir(parents=True, exist_ok=True)
    for pattern in RUN_FILES:  # an earlier run's files would mislead the supervisor
        for old in path.glob(pattern):
            old.unlink()
    procs: list[subprocess.Popen] = []
    copies: list[threading.Thread] = []
    try:
        copies = _start(procs, [module, *argv], workers, path,
                        threads or threads_per_worker(workers))
    except OSError as err:
        for p in procs:
            p.kill()
            p.wait()
        text = f"fullgraph: could not start worker {len(procs)} of {workers}: {err}; " \
            f"logs in {path}"
        print(text, file=sys.stderr)
        return 1, text
    code, text = _supervise(procs, path, timeout_s)
    for copy in copies:  # rank 0's last lines, written out before the end is said
        copy.join(timeout=10)
    for p in procs:  # a worker that was killed left its shared-memory files behind
        shm.remove_files(p.pid)
    if code in (0, CLOSED_PIPE_EXIT) and temporary and not keep_run_dir:
        shutil.rmtree(path, ignore_errors=True)
    elif code == 0 and temporary:  # kept, but the user did not name it
        print(f"fullgraph: run directory kept: {path}", file=sys.stderr)
    if resignal and code - 128 in RESIGNALLED:  # the workers are stopped: now this
        os.kill(os.getpid(), code - 128)  # process's own handler, or its default end
    return code, text


RESIGNALLED = (signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a local run and are then sent on to the launching process."""


class SignalStop(BaseException):
    """A local run stopped by SIGTERM or SIGHUP (``signum``), its workers stopped: what
    a caller of ``run_local(resignal=False)`` raises to unwind through its own clean-up
    (temporary directories) before ``send_on``. A BaseException, as KeyboardInterrupt
    is, so that no ``except Exception`` stops it on its way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_if_signalled(code: int) -> None:
    """Raise ``SignalStop`` where ``code`` is ``run_local``'s for SIGTERM or SIGHUP."""
    if code - 128 in RESIGNALLED:
        raise SignalStop(code - 128)


def send_on(stop: SignalStop, caller: str) -> NoReturn:
    """End this process as ``stop``'s signal would (its handler, or its default end),
    once the caller has cleaned up; where a handler returns, an error saying so."""
    os.kill(os.getpid(), stop.signum)
    raise FullgraphError(f"{caller}: stopped by {signal.Signals(stop.signum).name}; the "
                         "workers were stopped")


def _start(procs: list[subprocess.Popen], argv: list[str], workers: int, run_dir: Path,
           threads: int) -> list[threading.Thread]:
    """Start the workers into ``procs``; rank 0 prints where this process prints. Its
    output goes to this process's file descriptors, unless ``sys.stdout`` or
    ``sys.stderr`` was replaced (a notebook's, ``redirect_stdout``, a test's capture):
    then it is copied there, line by line, by the threads returned."""
    port = free_port()
    copies: list[threading.Thread] = []
    for rank in range(workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
                   FULLGRAPH_THREADS=str(threads),
                   **{RUN_DIR_ENV: str(run_dir), SUPERVISED_ENV: str(os.getpid()),
                      WARNED_ENV: json.dumps(shown_warnings())})
        cmd = [sys.executable, "-m", *argv]  # argv[0]: the module to run
        if rank == 0:
            piped = {name: stream for name, stream in (("stdout", sys.stdout),
                                                       ("stderr", sys.stderr))
                     if not _is_descriptor(stream, 1 if name == "stdout" else 2)}
            proc = subprocess.Popen(cmd, env=env,
                                    stdout=subprocess.PIPE if "stdout" in piped else None,
                                    stderr=subprocess.PIPE if "stderr" in piped else None)
            procs.append(proc)
            for name, stream in piped.items():
                source = getattr(proc, name, None)  # (None from a stand-in for Popen)
                if source is not None:
                    copies.append(threading.Thread(target=_copy_lines, args=(source, stream),
                                                   daemon=True, name=f"fullgraph-{name}"))
                    copies[-1].start()
        else:
            with open(run_dir / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
    return copies


def _is_descriptor(stream: Any, fd: int) -> bool:
    """Whether writing to ``stream`` writes to this process's descriptor ``fd``."""
    try:
        return stream is not None and stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        return False


def _copy_lines(source: IO[bytes], into: Any) -> None:
    """Write what ``source`` gives into the text stream ``into`` until it closes (what
    ``into`` refuses is dropped: the worker must never block on a full pipe)."""
    with source:
        for line in iter(source.readline, b""):
            try:
                into.write(line.decode(errors="replace"))
                into.flush()
            except Exception:  # noqa: BLE001 - any stream's refusal: drained all the same
                pass


class _Stopped(Exception):
    """The launcher was sent SIGTERM or SIGHUP (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _supervise(procs: list[subprocess.Popen], run_dir: Path,
               timeout_s: float) -> tuple[int, str]:
    """Wait for all workers; on a failure, stop the rest and name the root cause (the
    exit code and the text printed).

    Ctrl-C, SIGTERM and SIGHUP stop the workers too (a signal this process ignores,
    as SIGHUP under nohup, stays ignored). Further signals wait while the workers
    stop (``run_local`` then sends SIGTERM or SIGHUP to this process again, for its own
    handler or, by default, its end).
    """
    sup = Supervisor(procs, run_dir, timeout_s)
    main_thread = threading.current_thread() is threading.main_thread()
    before: dict[int, Any] = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                before[sig] = signal.signal(sig, _stop)
    stopped_by: int | None = None
    try:
        try:
            while sup.step():
                time.sleep(0.05)
        except (KeyboardInterrupt, _Stopped) as exc:
            stopped_by = exc.signum if isinstance(exc, _Stopped) else int(signal.SIGINT)
            if main_thread:  # no second signal may cut the stop short
                for held in (int(signal.SIGINT), *before):
                    before.setdefault(held, signal.getsignal(held))
                    signal.signal(held, signal.SIG_IGN)
            _stop_workers(procs, signal.SIGINT if stopped_by == signal.SIGINT
                          else signal.SIGTERM)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    if stopped_by is not None:
        how = "interrupted" if stopped_by == signal.SIGINT else \
            f"stopped by {signal.Signals(stopped_by).name}; the workers were stopped"
        text = f"fullgraph: {how}; logs in {run_dir}"
        print(text, file=sys.stderr)
        return 128 + stopped_by, text
    for rank, p in enumerate(procs):
        if p.returncode != 0 and rank not in sup.failed:
            sup.failed[rank] = WorkerExit(rank, p.returncode, rank in sup.killed)
    if not sup.failed:
        return 0, ""
    if any(f.returncode == CLOSED_PIPE_EXIT for f in sup.failed.values()):
        return CLOSED_PIPE_EXIT, ""  # the reader of the output went away: end quietly
    text, code = describe_failure(list(sup.failed.values()), run_dir)
    print(text, file=sys.stderr)
    return code, text


def _stop_workers(procs: list[subprocess.Popen], signum: int) -> None:
    """Send ``signum`` to the running workers; kill those still running after
    ``GRACE_S``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Supervisor:
    """Watches the workers of one run: exits, heartbeats, and the deadline for the rest.

    Attributes:
        failed: rank -> how it ended, for every worker that failed or was killed.
        killed: ranks the launcher killed.
    """

    def __init__(self, procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> None:
        self.procs, self.dir, self.timeout = procs, run_dir, timeout_s
        self.grace = min(timeout_s, GRACE_S)
        self.failed: dict[int, WorkerExit] = {}
        self.killed: set[int] = set()
        self.deadline: float | None = None
        self._next_look = 0.0  # heartbeats change every HEARTBEAT_S: read them that often

    def step(self) -> bool:
        """One look at the workers; False once none is running."""
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code not in (None, 0) and rank not in self.failed:
                self.failed[rank] = WorkerExit(rank, code, rank in self.killed)
                report = read_json(self.dir / f"failure-rank{rank}.json") or {}
                on_its_own = rank not in self.killed and not report.get("peer_failure")
                early = report.get("user_error") and report.get("phase") in EARLY_PHASES
                self._arm(self.timeout if on_its_own and not early else self.grace)
        for rank, reason in self._unresponsive():
            self._kill(rank)
            self.failed[rank] = WorkerExit(rank, -signal.SIGKILL, hung=reason)
            self._arm(self.grace)
        if self.deadline is not None and time.monotonic() > self.deadline:
            for rank, p in enumerate(self.procs):
                if p.poll() is None:
                    self._kill(rank)
        return any(p.poll() is None for p in self.procs)

    def _arm(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def _kill(self, rank: int) -> None:
        self.killed.add(rank)
        self.procs[rank].kill()

    def _unresponsive(self) -> list[tuple[int, str]]:
        """Running ranks that stopped responding, with the evidence (module doc)."""
        alive = [r for r, p in enumerate(self.procs) if p.poll() is None and r not in self.failed]
        if not alive or time.monotonic() < self._next_look:
            return []
        self._next_look = time.monotonic() + HEARTBEAT_S
        reports = [read_json(self.dir / f"failure-rank{r}.json") for r in self.failed]
        timed_out = [r for r in reports if r and r.get("timed_out")]
        # a peer timed out and nothing else explains it: someone never reached the call
        waited = max(timed_out, key=lambda r: r["entered"]) if timed_out and all(
            r and r.get("peer_failure") for r in reports) else None
        # a point-to-point wait timed out on a peer: follow the waits from it to the rank
        # that waits for no one (a straggler under partial reduce)
        beats = {r: read_json(self.dir / f"heartbeat-rank{r}") for r in alive}
        awaited: dict[int, dict] = {}
        for report in (r for r in timed_out if r.get("peer") is not None):
            rank, seen = report["peer"], set()
            while rank not in seen and (beats.get(rank) or {}).get("awaiting") is not None:
                seen.add(rank)
                rank = (beats.get(rank) or {})["awaiting"]
            beat = beats.get(rank)
            if beat is not None and beat.get("inside") is None and \
                    beat.get("awaiting") is None and waited is not None:
                awaited.setdefault(rank, report)
        out = []
        for rank in alive:
            beat = beats[rank]
            if rank in awaited:
                by = awaited[rank]
                out.append((rank, f"rank {by['rank']} timed out in {by['inside']} after "
                                  f"--timeout {self.timeout:g} s, and it waited for no one"))
                continue
            age = time.time() - beat["time"] if beat else float("inf")
            silent = "no heartbeat yet" if beat is None else \
                f"no heartbeat for {age:.0f} s, --timeout {self.timeout:g} s"
            # a worker past its training may go quiet while its interpreter shuts down
            allowed = max(self.timeout, EXIT_GRACE_S) if beat and beat["phase"] == "done" \
                else self.timeout
            if beat is not None and age > allowed or waited is not None and age > 3.0:
                out.append((rank, silent + _stopped_note(self.procs[rank].pid)))
            elif waited is not None and beat is not None and beat["entered"] < waited["entered"]:
                out.append((rank, f"it never reached the {waited['inside']} that rank "
                                  f"{waited['rank']} timed out waiting in after --timeout "
                                  f"{self.timeout:g} s"))
        return out


EXIT_GRACE_S = 60.0
"""How long a worker that finished its training (phase ``done``) may send no heartbeat
while it exits (torch's teardown took 2-3 s on a 2-core VM), when ``--timeout`` is
shorter."""


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _stopped_note(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return "; its process is stopped, e.g. by SIGSTOP" if state in ("T", "t") else ""


_LEFT_ON = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
"""Signals on which a worker leaves with exit code 128 + the signal's number."""


def describe_failure(failed: list[WorkerExit], run_dir: Path) -> tuple[str, int]:
    """The root cause, named by rank and phase (with a traceback for a bug), the ranks
    that stopped after it, and the exit code: 2 for a user error, else 1."""
    reports = [_report(f, run_dir) for f in failed]
    # a worker that died, hung or raised on its own comes before its peers' reactions
    reports.sort(key=lambda r: (r.get("peer_failure", False), r.get("time", 0.0)))
    first = reports[0]
    lines = [f"fullgraph: worker rank {first['rank']} failed during {first['phase']}: "
             f"{first['error']}"]
    if first.get("traceback"):
        lines.append(first["traceback"].rstrip())
    others = sorted({r["rank"] for r in reports[1:]})
    lines.append(f"fullgraph: ranks {others} stopped after it; logs in {run_dir}" if others
                 else f"fullgraph: logs in {run_dir}")
    return "\n".join(lines), 2 if first.get("user_error") else 1


def _report(f: WorkerExit, run_dir: Path) -> dict:
    """What is known of one failed worker: its own report, else what the launcher saw."""
    report = read_json(run_dir / f"failure-rank{f.rank}.json")
    if report is not None and not f.hung:
        return report
    beat = read_json(run_dir / f"heartbeat-rank{f.rank}") or {}
    status = run_dir / f"status-rank{f.rank}"
    phase = (status.read_text().strip() if status.is_file() else "") or "start-up"
    record = {"rank": f.rank, "phase": phase, "time": 0.0, "peer_failure": False,
              "traceback": ""}
    if f.hung:
        record.update(time=beat.get("time", 0.0),
                      error=f"stopped responding ({f.hung}); killed by the launcher (where "
                            "a worker may take longer, a long epoch or checkpoint, raise "
                            "--timeout)")
    elif f.stopped:  # a reaction to the first failure, never the cause of it
        record.update(time=float("inf"), peer_failure=True,
                      error="still running after the timeout, stopped by the launcher")
    else:
        how = f"signal {-f.returncode}" if f.returncode < 0 else f"exit code {f.returncode}"
        if f.returncode - 128 in _LEFT_ON:  # a worker ends itself so on these signals
            how += f", on {signal.Signals(f.returncode - 128).name}"
        record.update(error=f"worker died ({how}) without a report")
        if phase.startswith(EVERY_EPOCH):  # written by its heartbeat: up to HEARTBEAT_S old
            record["phase"] = f"{phase} or later"
    return record
