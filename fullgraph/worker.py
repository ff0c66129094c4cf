"""A worker's side of the launcher protocol: the files it keeps in the run directory.

A worker started by ``fullgraph train --workers N`` (or by torchrun with
``FULLGRAPH_RUN_DIR`` set) writes, in the run directory:

- ``pid-rank<R>``: its process id (a supervisor or a test can signal it);
- ``status-rank<R>``: its current phase ("setup", "epoch 3 training step", ...; the
  phases of an epoch up to one heartbeat behind);
- ``heartbeat-rank<R>``: every ``HEARTBEAT_S`` seconds, a JSON object with the time,
  the phase, how many blocking communication calls it has entered and the one it is
  in now. A worker that stops (SIGSTOP, a hang in C code) stops beating; one stuck
  in a Python loop keeps beating but its count stays behind its peers'. The launcher
  reads both to name the rank that stopped responding;
- ``failure-rank<R>.json`` when it fails: rank, phase, error, whether it is a peer's
  failure (a ``CommError``) or a user error, and a traceback for bugs.

Every file is written to a temporary name and renamed, so a reader never sees half.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, NoReturn

RUN_DIR_ENV = "FULLGRAPH_RUN_DIR"
SUPERVISED_ENV = "FULLGRAPH_SUPERVISED"
"""Set by the local launcher to its process id: it reports failures, and a worker ends
when the launcher does."""
HEARTBEAT_S = 0.5
WARNED_ENV = "FULLGRAPH_WARNED"
"""Set by the local launcher to the warnings it has shown (a JSON list of messages): its
workers run the same checks of the same options and leave those out."""

_shown: list[str] = []

FAILURE_KEY = "fullgraph/failure"
"""Where a worker under an external launcher (torchrun) publishes its failure, in the
process group's store (see ``WorkerStatus.share_failures``)."""
PROGRESS_KEY = "fullgraph/progress"
"""Where each such worker publishes its communication calls made (``entered``,
``inside``) at every poll: a rank whose collective timed out names the ranks that never
reached it, as the local launcher does from the heartbeats."""
FAILURE_POLL_S = 2.0


@contextlib.contextmanager
def warnings_recorded() -> Iterator[None]:
    """Within: every warning this process shows is also remembered (``shown_warnings``),
    for the workers it launches to leave out; forgotten after (another ``fit`` in this
    process warns again)."""
    show, start = warnings.showwarning, len(_shown)

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        _shown.append(str(message))
        show(message, *args, **kwargs)

    warnings.showwarning = record
    try:
        yield
    finally:
        warnings.showwarning = show
        del _shown[start:]


WARNINGS_ENV = "FULLGRAPH_FIT_WARNINGS"
"""Set by ``fullgraph.fit`` and ``fullgraph.check`` for their launched workers: where a
worker writes its warnings (``PREFIX-rankR.jsonl``, ``relay_warnings``), for the caller
to raise as Python warnings."""


def relay_warnings() -> None:
    """Under ``WARNINGS_ENV``: this worker's warnings go to its file, for the Python
    caller that launched it to raise (not to the console as text)."""
    prefix = os.environ.get(WARNINGS_ENV)
    if not prefix:
        return
    to_caller = Path(f"{prefix}-rank{os.environ.get('RANK', '0')}.jsonl")

    def write(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        with open(to_caller, "a") as f:
            f.write(json.dumps({"module": category.__module__,
                                "category": category.__qualname__,
                                "message": str(message)}) + "\n")

    warnings.showwarning = write


def shown_warnings() -> list[str]:
    """The messages of the warnings shown within ``warnings_recorded`` so far."""
    return list(dict.fromkeys(_shown))


def ignore_launcher_warnings() -> None:
    """In a worker of the local launcher: do not show again what the launcher showed."""
    try:
        messages = json.loads(os.environ.get(WARNED_ENV) or "[]")
    except ValueError:
        return
    for message in messages if isinstance(messages, list) else ():
        warnings.filterwarnings("ignore", message=re.escape(str(message)) + r"\Z")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name("." + path.name)
    tmp.write_text(text)
    tmp.replace(path)


SAVING_PHASE = "saving the model"
"""The phase of rank 0 while it writes ``--save-model``'s file, after the last epoch."""
EVERY_EPOCH = "epoch "
"""Phases that start so change several times an epoch: ``set_phase`` leaves their
status file to the heartbeat thread (at most ``HEARTBEAT_S`` behind). Writing the file
at each took 1.6 ms of a 9.4 ms epoch (Cora, 2 workers; a create and a rename each)."""


class WorkerStatus:
    """A worker's view of the run directory: its phase, heartbeat and failure report."""

    def __init__(self, rank: int, run_dir: str | None) -> None:
        self.rank = rank
        self.dir = Path(run_dir) if run_dir else None
        self.phase = "start-up"
        self.debug = bool(os.environ.get("FULLGRAPH_DEBUG"))  # or --log-level debug
        self.counter: Any = None
        self._store: Any = None  # the process group's, under torchrun (share_failures)
        self._failure_key = FAILURE_KEY
        self._progress_key = PROGRESS_KEY
        self._world_size = 1
        self._beats = 0  # progress reports published (share_failures)
        self._behind = ""  # the ranks that never reached this rank's timed-out collective
        self._timeout_s = 1800.0  # how long a worker outlives its run's store (share_failures)
        self._shared = False  # share_failure ran
        self._failing = False  # this worker is reporting its own failure
        self._stopped = threading.Event()  # the watch of share_failures is over
        self._cause: dict[str, Any] | None = None  # the peer's failure that broke ours
        self._lock = threading.Lock()
        self._written: str | None = None  # the phase the status file holds
        if self.dir is not None:
            write_atomic(self.dir / f"pid-rank{self.rank}", str(os.getpid()))
            self._beat()
            threading.Thread(target=self._heartbeat, name=f"fullgraph-heartbeat-{rank}",
                             daemon=True).start()

    def watch(self, counter: Any) -> None:
        """Report ``counter``'s progress (``entered``, ``inside``) in the heartbeat."""
        self.counter = counter

    def share_failures(self, store: Any, run: str, timeout_s: float = 1800.0,
                       world_size: int = 1) -> None:
        """Under torchrun nothing supervises the hosts together: publish this worker's
        failure in the process group's ``store``, and watch it for another's. A worker
        that finds one ends, naming that failure: one stuck outside any collective (in
        a model's own loop) ends too, and one whose collective broke names the cause,
        not only a closed connection. ``run`` names this run's key (the same on every
        rank, new for each start: a store may outlive a run, as torchrun's agent's does
        across restarts). A store that cannot be reached is the run ended on the host
        that served it (its workers gone, a report unread): a worker not done
        ``timeout_s`` later ends, saying so (one stuck outside any collective would
        otherwise run on). Each of the ``world_size`` workers publishes its progress
        there too, for one whose collective timed out to name those that never reached
        it."""
        self._store, self._failure_key = store, f"{FAILURE_KEY}/{run}"
        self._progress_key, self._world_size = f"{PROGRESS_KEY}/{run}", world_size
        self._timeout_s = timeout_s
        _store_call(self._publish_progress)
        threading.Thread(target=self._watch_failures, name=f"fullgraph-failures-{self.rank}",
                         daemon=True).start()

    def stop_watching(self) -> None:
        """End the watch for other workers' failures (the run is over here)."""
        self._stopped.set()

    def _published_failure(self) -> dict | None:
        """Another worker's failure report in the store, if there is one."""
        if not self._store.check([self._failure_key]):
            return None
        record = json.loads(self._store.get(self._failure_key))
        return record if record.get("rank") != self.rank else None

    def _publish_progress(self, done: bool = False) -> None:
        counter = self.counter
        self._beats += 1
        self._store.set(f"{self._progress_key}/{self.rank}", json.dumps(
            {"entered": counter.entered if counter is not None else 0,
             "inside": counter.inside if counter is not None else None,
             "beat": self._beats, "done": done}))

    def _silent(self) -> str:
        """For a collective a peer broke without reporting why (killed, its host lost):
        the ranks whose progress reports stopped, read twice a report interval apart,
        as a clause of this rank's error; "" when every peer still reports (or the
        store is gone with its host)."""
        def beats() -> dict[int, int]:
            out = {}
            for r in range(self._world_size):
                key = f"{self._progress_key}/{r}"
                if r != self.rank and self._store.check([key]):
                    seen = json.loads(self._store.get(key))
                    if not seen.get("done"):  # (a rank that finished stopped reporting)
                        out[r] = seen.get("beat", 0)
            return out

        before = _store_call(beats)
        if not before:
            return ""
        time.sleep(2.5 * FAILURE_POLL_S)  # (a live rank reports at least twice: a GIL
        # held a while, by numba compiling say, is not taken for a death)
        after = _store_call(beats) or {}
        self._cause = _store_call(self._published_failure)  # one published meanwhile:
        if self._cause is not None:  # that rank's own report is the cause to name
            return ""
        silent = [r for r, beat in before.items() if after.get(r) == beat]
        if not silent or len(after) < len(before):
            return ""
        ranks = ", ".join(map(str, silent))
        many = len(silent) > 1
        return (f"; rank{'s' if many else ''} {ranks} stopped reporting "
                f"{'their' if many else 'its'} progress (killed, or its host lost)")

    def _not_reached(self, record: dict[str, Any]) -> str:
        """For a collective of this rank that timed out (``record``): the ranks whose
        last published progress shows they never reached it (fewer calls made, none
        under way), as a clause of its error; "" when none does (or the store is gone)."""
        if not record.get("timed_out") or self._world_size < 2:
            return ""

        def read() -> list[int]:
            behind = []
            for r in range(self._world_size):
                key = f"{self._progress_key}/{r}"
                if r != self.rank and self._store.check([key]):
                    seen = json.loads(self._store.get(key))
                    if seen["inside"] is None and seen["entered"] < record["entered"]:
                        behind.append(r)
            return behind

        behind = _store_call(read) or []
        if not behind:
            return ""
        ranks = ", ".join(map(str, behind))
        return (f"; rank{'s' if len(behind) > 1 else ''} {ranks} never reached it (by "
                f"{'their' if len(behind) > 1 else 'its'} last report, every "
                f"{FAILURE_POLL_S:g} s: busy outside any collective, or stopped)")

    def _watch_failures(self) -> None:
        lost: float | None = None  # when the store was first out of reach
        while not self._stopped.wait(FAILURE_POLL_S) and self.phase != "done":
            try:
                self._publish_progress()
                record = self._published_failure()
            except Exception:  # noqa: BLE001 - the store is gone: the run (or its host) ended
                lost = lost if lost is not None else time.monotonic()
                if time.monotonic() - lost <= self._timeout_s:
                    continue  # (a worker finishing its last steps is left to finish)
                where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                self._end(f"the run's store at {where} went away {time.monotonic() - lost:.0f} "
                          "s ago (the workers of the host that served it ended) and this "
                          f"worker did not finish within --timeout {self._timeout_s:g} s", 1)
                return
            lost = None
            if record is None or self.phase.endswith(" checkpoint") or \
                    self.phase == SAVING_PHASE:
                continue  # (a file is written whole; a peer's timeout may come of it)
            behind = self.counter is not None and record.get("inside") and \
                self.counter.inside is None and self.counter.entered < record.get("entered", 0)
            self._end(f"rank {record['rank']} failed during {record['phase']}: "
                      f"{record['error']}" + (
                          f" (this rank never reached the {record['inside']} it waited in: "
                          "it was busy outside any collective)" if behind else ""),
                      2 if record.get("user_error") else 1)
            return
        if not self._failing:  # the run is over here: its peers no longer hear from it,
            _store_call(lambda: self._publish_progress(done=True))  # and know why

    def _end(self, why: str, code: int) -> None:
        """End this worker at once, saying ``why`` (unless it reports its own failure)."""
        with self._lock:  # not while this worker reports its own failure
            if self._failing or self._stopped.is_set():
                return
            print(f"fullgraph: rank {self.rank} stopped during {self.phase}: {why}",
                  file=sys.stderr, flush=True)
            from fullgraph.comm import shm

            shm.remove_files(os.getpid())
            os._exit(code)

    def set_phase(self, phase: str) -> None:
        """Enter ``phase``: written to the status file now, or for the phases of an
        epoch (``EVERY_EPOCH``) after the first by the next heartbeat."""
        self.phase = phase
        if self.dir is not None and not (phase.startswith(EVERY_EPOCH) and (
                self._written or "").startswith(EVERY_EPOCH)):  # (the first epoch phase
            # after another is written at once: a worker dying then is not "in setup")
            self._write_status()
            self._beat()  # the launcher reads the phase from the heartbeat too ("done"
            # earns the exit grace: the next beat may come only after torch's teardown)

    def _write_status(self) -> None:
        assert self.dir is not None, "a status file needs a run directory"
        with self._lock:  # the heartbeat thread writes it too (the same temporary name)
            phase = self.phase
            if phase != self._written:
                write_atomic(self.dir / f"status-rank{self.rank}", phase)
                self._written = phase

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self._write_status()
                self._beat()
            except OSError:  # the run directory is gone: the launcher has finished
                return

    def _beat(self) -> None:
        assert self.dir is not None, "heartbeats need a run directory"
        with self._lock:  # set_phase beats too: the same temporary name, and the phase read
            counter = self.counter  # under the lock, so a late beat cannot undo "done"
            record = {"time": time.time(), "phase": self.phase,
                      "entered": counter.entered if counter is not None else 0,
                      "inside": counter.inside if counter is not None else None,
                      "awaiting": counter.awaiting if counter is not None else None}
            write_atomic(self.dir / f"heartbeat-rank{self.rank}", json.dumps(record))

    def report_failure(self, exc: BaseException) -> bool:
        """Report ``exc`` (the launcher reads the file; under torchrun it is printed);
        whether it is a user's error (exit code 2) rather than a bug (1)."""
        self._mark_failing()
        record = self._record(exc)
        if self.dir is not None:
            write_atomic(self.dir / f"failure-rank{self.rank}.json", json.dumps(record))
        self.share_failure(exc, record)
        if self._behind and not record["error"].endswith(self._behind):
            record["error"] += self._behind  # (shared before, from another record)
        cause = self._cause
        if not os.environ.get(SUPERVISED_ENV):  # else the launcher says it, once
            print(f"fullgraph: rank {self.rank} failed during {self.phase}: "
                  f"{record['error']}", file=sys.stderr, flush=True)
            if record["traceback"]:
                print(record["traceback"], end="", file=sys.stderr, flush=True)
            if cause is not None:
                print(f"fullgraph: the first failure: rank {cause['rank']} failed during "
                      f"{cause['phase']}: {cause['error']}", file=sys.stderr, flush=True)
        return bool(record["user_error"])

    def share_failure(self, exc: BaseException, record: dict[str, Any] | None = None) -> None:
        """Under torchrun (``share_failures``), once: publish this worker's failure in
        the store (the first failure's wins), or, for a collective a peer broke, read the
        failure that peer published (the cause to name). Called before the process group
        is torn down, whose store may go with it, and again by ``report_failure``."""
        self._mark_failing()
        if self._store is None or self._shared:
            return
        self._shared = True
        record = record or self._record(exc)
        if record["peer_failure"]:
            self._cause = _store_call(self._published_failure)
            if self._cause is not None:
                return  # else: a peer died unreported, or never came; tell the others
                # (one may be stuck outside any collective)
        self._behind = self._not_reached(record)  # (the first to time out says it)
        if record["peer_failure"] and not record.get("timed_out"):
            self._behind = self._silent()  # a connection a peer's end closed: which
            if self._cause is not None:  # (a peer's failure published while it looked)
                return
        record["error"] += self._behind
        brief = {k: record[k] for k in ("rank", "phase", "error", "user_error", "entered",
                                        "inside")}
        _store_call(lambda: self._store.compare_set(self._failure_key, "", json.dumps(brief)))
        time.sleep(FAILURE_POLL_S + 0.5)  # stay until the others' watches have read it: the
        # store lives in rank 0's process, or in its host's torchrun agent, which ends with
        # that host's last worker

    def is_user_error(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised in this worker's phase, is a user's mistake (a bad
        option or file: one line, exit code 2) rather than a bug (its traceback, 1). A
        ValueError is an option's refusal before training; raised in an epoch, by a
        model's code say, it is a bug. An OS error on a named path is the user's (a
        directory where a file goes, ...)."""
        from fullgraph.comm.primitives import CommError
        from fullgraph.errors import FullgraphError

        return (isinstance(exc, FullgraphError) or
                isinstance(exc, ValueError) and not self.phase.startswith(EVERY_EPOCH)
                or isinstance(exc, OSError) and exc.filename is not None) and \
            not isinstance(exc, CommError)

    def _mark_failing(self) -> None:
        """From now on the failure watch leaves this worker to report its own."""
        with self._lock:
            self._failing = True

    def _record(self, exc: BaseException) -> dict[str, Any]:
        """The failure report of ``exc`` in this worker's phase."""
        from fullgraph.comm.primitives import CommError

        user_error = self.is_user_error(exc)
        comm_error = exc if isinstance(exc, CommError) else None
        record = {"rank": self.rank, "phase": self.phase, "time": time.time(),
                  "peer_failure": comm_error is not None, "user_error": user_error,
                  "timed_out": comm_error is not None and comm_error.timed_out,
                  "entered": self.counter.entered if self.counter is not None else 0,
                  "inside": (f"{comm_error.collective} in phase {comm_error.phase!r}"
                             if comm_error is not None else None),
                  "peer": comm_error.peer if comm_error is not None else None,
                  "error": f"{type(exc).__name__}: {exc}",
                  # one line for a user's error and for a peer's (not a bug here);
                  "traceback": "" if (user_error or comm_error is not None) and not self.debug
                  else "".join(traceback.format_exception(exc))}  # debug: every one
        return record


def _store_call(call: Callable[[], Any], limit_s: float = 3.0) -> Any:
    """``call()`` on a helper thread, given up after ``limit_s`` (None then, or on an
    error): a store whose host is unreachable must not hold up a failing worker."""
    out: list[Any] = [None]

    def run() -> None:
        try:
            out[0] = call()
        except Exception:  # noqa: BLE001 - best effort: the worker is failing anyway
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    return out[0]


def report_start_failure(exc: BaseException) -> bool:
    """Report ``exc``, raised before the worker's ``run_worker`` began (while its
    options were read), as ``run_worker`` reports a failure, for the launcher to name;
    whether there was a launcher's run directory to report it in."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not (os.environ.get(SUPERVISED_ENV) and run_dir):
        return False
    status = WorkerStatus(int(os.environ.get("RANK", "0")), None)  # no heartbeat: ending
    status.dir = Path(run_dir)
    if not (status.dir / f"failure-rank{status.rank}.json").exists():  # run_worker's first
        status.report_failure(exc)
    return True


def stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (a ``BrokenPipeError``
    from anything else, a FIFO given as ``--metrics-out`` say, is an error)."""
    import select
    import stat

    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return False
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # (no descriptor, no poll)
        return False


CLOSED_PIPE_EXIT = 141
"""A local launcher's worker's exit code where standard output's reader went away
(``| head``), as of a tool killed by SIGPIPE: the launcher ends as quietly. (Under
torchrun the worker reports it as a failure, which stops its peers at once.)"""


def run_worker(body: Callable[[WorkerStatus], int], debug: bool = False) -> int:
    """Run ``body`` as a worker: report a failure with rank and phase, exit non-zero (2
    for a user's error, 1 for a bug; ``debug``, as ``FULLGRAPH_DEBUG``: every failure
    is reported with its traceback).

    A failed worker leaves at once (``os._exit`` once its output is flushed): the
    interpreter's shutdown of a torch process can take seconds under load, which the
    launcher would otherwise count against the other workers' grace period.
    """
    _end_with_launcher()
    status = WorkerStatus(int(os.environ.get("RANK", "0")), os.environ.get(RUN_DIR_ENV))
    status.debug = status.debug or debug
    try:
        return body(status)
    except Exception as exc:  # noqa: BLE001 - every failure must be reported, then re-raised
        if isinstance(exc, BrokenPipeError) and os.environ.get(SUPERVISED_ENV) and \
                stdout_closed():
            leave_now(CLOSED_PIPE_EXIT)  # quietly: the reader of the output went away
        user_error = status.report_failure(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if user_error else 1)


def leave_now(code: int, flush: bool = False) -> NoReturn:
    """End this worker of the local launcher at once with exit ``code``, its
    shared-memory files and half-written outputs removed (and, with ``flush``, its
    output flushed: not from a signal handler, where a full pipe would block it): the
    interpreter's shutdown of a torch process takes seconds, which the launcher would
    count against its grace period."""
    from fullgraph.comm import shm
    from fullgraph.paths import remove_unfinished

    shm.remove_files(os.getpid())
    remove_unfinished()  # a checkpoint or model being written: no half file stays
    for stream in (sys.stdout, sys.stderr) if flush else ():
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _end_with_launcher() -> None:
    """Make a worker of the local launcher end when the launcher does, whatever ends it
    (SIGKILL too), rather than train on alone: SIGTERM on the launcher's death (Linux's
    parent-death signal). On SIGTERM the worker removes its shared-memory files and
    leaves at once (an exception could land in any finaliser, and be ignored there)."""
    import signal

    launcher = os.environ.get(SUPERVISED_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return

    def leave(signum: int, frame: Any) -> None:
        leave_now(128 + signum)

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, leave)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: the launcher's own handlers remain
        return
    if os.getppid() != int(launcher):  # the launcher ended before the line above
        sys.exit(1)
