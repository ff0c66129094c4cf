"""The local launcher (``fullgraph train --workers N``) and torchrun, end to end.

Every test here runs the real CLI in subprocesses: the launcher, its gloo workers,
or ``torch.distributed.run``. Failures are provoked from outside (SIGKILL through the
``pid-rank<R>`` file a worker writes) or injected with a ``sitecustomize`` module put
on the workers' PYTHONPATH, so the product code carries no test hooks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from clirun import (
    EPOCHS,
    LAUNCHER_ENV,
    TRAIN,
    clean_env,
    events,
    final_accuracy,
    free_port,
    fullgraph_cmd,
    run_cli,
    two_cores,
)
from harness import run_ranks


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """A dataset root with the built-in Cora (copied on first use) and a small SBM graph."""
    root = tmp_path_factory.mktemp("data")
    out = run_cli(["generate", "sbm", "--vertices", "2000", "--name", "toy"], root)
    assert out.returncode == 0, out.stderr
    return root


@pytest.fixture(scope="module")
def launched(data_root, tmp_path_factory):
    """One ``--strategy data --workers 2`` run on Cora, shared by several tests (with an
    option that has no effect, which warns)."""
    tmp = tmp_path_factory.mktemp("launched")
    metrics, run_dir = tmp / "metrics.jsonl", tmp / "run"
    out = run_cli(TRAIN + ["--strategy", "data", "--workers", "2", "--metrics-out", str(metrics),
                           "--run-dir", str(run_dir), "--checkpoint-every", "2"], data_root)
    return out, metrics, run_dir


@pytest.mark.dist
def test_two_workers_end_to_end(launched):
    out, metrics, run_dir = launched
    assert out.returncode == 0, out.stdout + out.stderr
    stdout = out.stdout
    for line in ("per rank, its median epoch", "compute max/min", "slowest rank",
                 "final test accuracy"):
        assert line in stdout, stdout
    final_accuracy(stdout)
    # every epoch: one record per rank
    by_epoch: dict[int, set[int]] = {}
    for r in events(metrics, "rank_epoch"):
        by_epoch.setdefault(r["epoch"], set()).add(r["rank"])
    assert by_epoch == {e: {0, 1} for e in range(1, EPOCHS + 1)}
    assert [r["epoch"] for r in events(metrics, "epoch")] == list(range(1, EPOCHS + 1))
    # rank 1 writes to its log; only rank 0 reports on the terminal (each line once)
    assert (run_dir / "rank1.log").is_file()
    assert not (run_dir / "rank0.log").exists()
    assert stdout.count("dataset  cora") == 1 and stdout.count("final test accuracy") == 1
    assert stdout.count("per rank, its median epoch") == 1
    assert "rank 1" not in out.stderr
    # a warning the launcher gave is not repeated by the workers, which check the same
    assert out.stderr.count("--checkpoint-every has no effect") == 1, out.stderr
    assert "--checkpoint-every" not in (run_dir / "rank1.log").read_text()
    assert (run_dir / "status-rank1").read_text() == "done"
    assert (run_dir / "pid-rank1").read_text().strip().isdigit()
    assert not list(run_dir.glob("failure-rank*.json"))


@pytest.mark.dist
def test_two_workers_match_single_process_losses(launched, data_root, tmp_path):
    out, metrics, _ = launched
    assert out.returncode == 0, out.stderr
    single = tmp_path / "single.jsonl"
    ref = run_cli(TRAIN + ["--strategy", "single", "--metrics-out", str(single)], data_root)
    assert ref.returncode == 0, ref.stderr
    dist_losses = [r["loss"] for r in events(metrics, "epoch")]
    single_losses = [r["loss"] for r in events(single, "epoch")]
    assert len(dist_losses) == len(single_losses) == EPOCHS
    np.testing.assert_allclose(dist_losses, single_losses, rtol=1e-5, atol=1e-6)
    assert final_accuracy(out.stdout) == final_accuracy(ref.stdout)


@pytest.mark.dist
def test_p2p_from_the_command_line_matches_single(data_root, tmp_path):
    """``--strategy p2p`` with its own flags and the partition flags, through the launcher."""
    runs = {}
    for name, extra in (("p2p", ["--strategy", "p2p", "--workers", "3", "--partitioner", "g3",
                                 "--p2p-schedule", "inter-layer", "--bin-size", "300"]),
                        ("single", ["--strategy", "single"])):
        metrics = tmp_path / f"{name}.jsonl"
        out = run_cli(TRAIN + extra + ["--metrics-out", str(metrics)], data_root)
        assert out.returncode == 0, out.stdout + out.stderr
        runs[name] = (out.stdout, [r["loss"] for r in events(metrics, "epoch")])
    stdout, losses = runs["p2p"]
    assert "p2p      schedule inter-layer, partitioner g3" in stdout
    assert "vertices per bin at most 300/300/300" in stdout
    np.testing.assert_allclose(losses, runs["single"][1], rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_thread_budget_in_header(launched, data_root, tmp_path):
    out, _, _ = launched  # two workers on (at most) two cores: one thread each
    assert re.search(r"2 worker\(s\), device cpu, 1 threads", out.stdout), out.stdout
    two = run_cli(["train", "--epochs", "1", "--progress", "off", "--strategy", "data",
                   "--workers", "2", "--threads", "2", "--run-dir", str(tmp_path / "run")],
                  data_root)
    assert two.returncode == 0, two.stderr
    assert re.search(r"2 worker\(s\), device cpu, 2 threads", two.stdout), two.stdout


@pytest.mark.dist
def test_torchrun_gives_the_same_result(launched, data_root, tmp_path):
    out, metrics, _ = launched
    assert out.returncode == 0, out.stderr
    torch_metrics = tmp_path / "torchrun.jsonl"
    run_dir = tmp_path / "run"  # --run-dir: the workers' status files (it was ignored)
    run_dir.mkdir()
    (run_dir / "failure-rank1.json").write_text("{}")  # an earlier run's: removed
    run = run_cli(["--nproc-per-node", "2", "--master-port", str(free_port()),
                   "-m", "fullgraph"] + TRAIN +
                  ["--strategy", "data", "--metrics-out", str(torch_metrics),
                   "--run-dir", str(run_dir)], data_root,
                  cmd=[sys.executable, "-m", "torch.distributed.run"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in run_dir.glob("status-rank*")) == ["status-rank0",
                                                                    "status-rank1"]
    assert not (run_dir / "failure-rank1.json").exists()
    assert final_accuracy(run.stdout) == final_accuracy(out.stdout)
    assert "per rank, its median epoch" in run.stdout
    np.testing.assert_allclose([r["loss"] for r in events(torch_metrics, "epoch")],
                               [r["loss"] for r in events(metrics, "epoch")],
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- failures

LONG_RUN = ["train", "--dataset", "toy", "--epochs", "100000", "--progress", "off"]

INJECT = textwrap.dedent('''\
    """Test-only: make chosen ranks raise or hang when they reach a chosen phase."""
    import os

    _spec = os.environ.get("FG_TEST_INJECT")  # "rank:phase:raise|hang;..."
    if _spec and "RANK" in os.environ:
        import time

        import fullgraph.launch as _launch

        _rules = {}
        for _item in _spec.split(";"):
            _rank, _phase, _action = _item.split(":")
            _rules[int(_rank)] = (_phase, _action)
        _original = _launch.WorkerStatus.set_phase

        def _set_phase(self, phase):
            _original(self, phase)
            rule = _rules.get(self.rank)
            if rule is not None and phase == rule[0]:
                if rule[1] == "raise":
                    raise RuntimeError("injected failure")
                while True:
                    time.sleep(0.5)

        _launch.WorkerStatus.set_phase = _set_phase
''')


def launcher_verdict(err: str) -> str:
    """The launcher's line naming the first real failure (rank 0's own stderr, which
    shares the terminal, may come before it)."""
    lines = [line for line in err.splitlines() if line.startswith("fullgraph: worker rank ")]
    assert len(lines) == 1, err
    return lines[0]


def _alive(pid: int) -> bool:
    """True while ``pid`` is a running (not zombie) fullgraph worker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return b"fullgraph" in cmdline and state != "Z"


def _epoch_of(run_dir: Path, rank: int) -> int:
    try:
        found = re.match(r"epoch (\d+)", (run_dir / f"status-rank{rank}").read_text())
    except FileNotFoundError:
        return 0
    return int(found.group(1)) if found else 0


def _nohup() -> None:
    """preexec_fn: two cores, and SIGHUP ignored, as under nohup."""
    two_cores()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


class LongRun:
    """A launcher running ``LONG_RUN`` in the background; kills what is left on exit."""

    def __init__(self, data_root: Path, tmp_path: Path, timeout_s: float, strategy: str,
                 workers: int, ignore_hup: bool = False, **env: str) -> None:
        self.run_dir = tmp_path / "run"
        self.ranks = range(workers)
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                fullgraph_cmd() + LONG_RUN + ["--strategy", *strategy.split(),
                                              "--workers", str(workers),
                                              "--timeout", str(timeout_s),
                                              "--run-dir", str(self.run_dir)],
                env=clean_env(data_root, **env), stdout=out, stderr=err,
                preexec_fn=_nohup if ignore_hup else two_cores)
        self.pids: dict[int, int] = {}

    def wait_for_epoch(self, epoch: int, limit_s: float = 90) -> None:
        deadline = time.monotonic() + limit_s
        while min(_epoch_of(self.run_dir, r) for r in self.ranks) < epoch:
            assert self.proc.poll() is None, self.err.read_text()
            assert time.monotonic() < deadline, "workers never reached epoch %d" % epoch
            time.sleep(0.05)
        self.load_pids()

    def load_pids(self) -> None:
        self.pids = {r: int((self.run_dir / f"pid-rank{r}").read_text()) for r in self.ranks}

    def wait(self, limit_s: float) -> tuple[int, float, str]:
        t0 = time.monotonic()
        code = self.proc.wait(timeout=limit_s)
        return code, time.monotonic() - t0, self.err.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def assert_no_worker_left(self) -> None:
        assert self.pids and not [p for p in self.pids.values() if _alive(p)]


@pytest.fixture
def long_run(data_root, tmp_path):
    runs: list[LongRun] = []

    def start(timeout_s: float, strategy: str = "data", workers: int = 2,
              ignore_hup: bool = False, **env: str) -> LongRun:
        runs.append(LongRun(data_root, tmp_path, timeout_s, strategy, workers, ignore_hup,
                            **env))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def _verdict_leads(err: str) -> str:
    """The launcher's verdict, checked to be the first line that names a rank or an error."""
    first = launcher_verdict(err)
    lines = err.splitlines()
    before = lines[:lines.index(first)]
    assert not [line for line in before if "rank" in line or "Error" in line], err
    return first


HUNG = 8  # --timeout of the hang and kill tests: short, but well above an epoch under load
PARTIAL_STRAGGLER = "sleep:p=0,s=0.2,n=100000,at=2,ranks=2"


@pytest.mark.dist
@pytest.mark.parametrize("how,strategy,victim", [  # each way, strategy and rank once
    ("kill", "data", 0), ("kill", "p2p", 2), ("hang", "tensor", 1), ("hang", "task", 2),
    # partial reduce: the survivors may go on without the dead rank for a while (it is
    # not in the ready majority), but never past the next full synchronisation
    ("kill", f"data --adapt adjust+partial --inject {PARTIAL_STRAGGLER}", 1)])
def test_dead_or_hung_worker_is_named_first(long_run, how, strategy, victim):
    """SIGKILL or SIGSTOP one of three workers mid-run: the launcher's first word names
    it (never a peer whose collective failed because of it), every worker is gone within
    the timeout plus a margin, and no traceback is printed."""
    run = long_run(HUNG, strategy=strategy, workers=3)
    run.wait_for_epoch(3)
    os.kill(run.pids[victim], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    code, took, err = run.wait(limit_s=60)
    assert code == 1, err
    first = _verdict_leads(err)
    if how == "kill":
        # (the phase of an epoch is the last its heartbeat wrote, so "or later")
        assert re.match(rf"fullgraph: worker rank {victim} failed during epoch \d+ [a-z ]+ "
                        r"or later: worker died \(signal 9\) without a report$", first), err
    else:
        assert re.match(rf"fullgraph: worker rank {victim} failed during epoch \d+ [a-z ]+: "
                        r"stopped responding \(.+\); killed by the launcher \(where a worker "
                        r"may take longer, a long epoch or checkpoint, raise --timeout\)$",
                        first), err
        assert "its process is stopped" in first or "never reached" in first, err
    survivors = [r for r in range(3) if r != victim]
    assert f"ranks {survivors} stopped after it" in err
    assert "Traceback" not in err
    # before the fix: a hang took two timeouts (the peer's collective, then the launcher's)
    assert took < HUNG + 5, (took, err)
    for r in survivors:  # the survivors saw a peer failure and said so in their reports
        report = json.loads((run.run_dir / f"failure-rank{r}.json").read_text())
        assert report["peer_failure"] is True and "CommError" in report["error"], report
    assert not (run.run_dir / f"failure-rank{victim}.json").exists()
    run.assert_no_worker_left()


@pytest.mark.dist
@pytest.mark.parametrize("peer", ["reacts", "hangs"])
def test_raising_worker_is_named_not_its_peer(long_run, tmp_path, peer):
    """Rank 1 raises at epoch 3. Its peer either fails in its next collective (a peer
    failure) or hangs outside any collective and is killed after the timeout; either
    way the launcher names rank 1 and its exception, never the peer."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(INJECT)
    rules = "1:epoch 3 training step:raise"
    if peer == "hangs":
        rules += ";0:epoch 3 training step:hang"
    # the workers import sitecustomize from site/, and fullgraph from where this test does
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    run = long_run(8, PYTHONPATH=path, FG_TEST_INJECT=rules)
    code, took, err = run.wait(limit_s=90)
    run.load_pids()
    assert code != 0, err
    assert launcher_verdict(err) == ("fullgraph: worker rank 1 failed during epoch 3 training "
                                     "step: RuntimeError: injected failure"), err
    assert "Traceback" in err and "ranks [0] stopped after it" in err
    report = json.loads((run.run_dir / "failure-rank1.json").read_text())
    assert report["peer_failure"] is False and report["phase"] == "epoch 3 training step"
    if peer == "reacts":
        assert json.loads((run.run_dir / "failure-rank0.json").read_text())["peer_failure"]
    else:  # killed by the launcher after --timeout, without a report of its own
        assert not (run.run_dir / "failure-rank0.json").exists()
        assert took >= 8
    run.assert_no_worker_left()


@pytest.mark.dist
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_their_launcher(long_run, sig):
    """SIGTERM to the launcher (systemd, a batch system, ``kill PID``) stops its workers
    and says so; SIGKILL, which it cannot catch, ends them too (the parent-death signal),
    rather than leaving them to train on alone."""
    run = long_run(30)
    run.wait_for_epoch(2)
    run.proc.send_signal(sig)
    code, _, err = run.wait(limit_s=30)
    assert code == -sig, err  # SIGTERM: the workers stopped, then the launcher's default end
    if sig == signal.SIGTERM:
        assert "fullgraph: stopped by SIGTERM; the workers were stopped; logs in" in err, err
    deadline = time.monotonic() + 10
    while [p for p in run.pids.values() if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    run.assert_no_worker_left()
    assert "Traceback" not in err, err


@pytest.mark.dist
def test_an_ignored_hangup_stays_ignored_and_a_second_signal_waits(long_run):
    """Under nohup the launcher keeps running through SIGHUP; SIGTERM, SIGTERM and Ctrl-C
    in a row stop it once, cleanly, with SIGTERM's exit status."""
    run = long_run(30, ignore_hup=True)
    run.wait_for_epoch(2)
    run.proc.send_signal(signal.SIGHUP)
    time.sleep(2)
    assert run.proc.poll() is None, run.err.read_text()
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
        run.proc.send_signal(sig)
        time.sleep(0.2)
    code, _, err = run.wait(limit_s=30)
    assert code == -signal.SIGTERM, err  # the launcher ends by the signal, as by default
    assert err.count("stopped by SIGTERM") == 1 and "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while [p for p in run.pids.values() if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    run.assert_no_worker_left()


@pytest.mark.dist
def test_workers_given_different_options_are_refused(data_root, tmp_path):
    """Under torchrun each host has its own command line: ranks given another seed (or
    model, strategy, ...) would train different models. They stop at setup, naming the
    option and the ranks; a per-host option (here --metrics-out) may differ."""
    port = free_port()
    procs = []
    for rank, seed in ((0, "1"), (1, "2")):
        env = clean_env(data_root, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            fullgraph_cmd() + TRAIN + ["--strategy", "data", "--seed", seed, "--metrics-out",
                                       str(tmp_path / f"m{rank}.jsonl")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=two_cores))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, err
        assert "the workers were given different options (train.seed: 1 on rank(s) 0, 2 on " \
               "rank(s) 1)" in err, err
        assert "metrics_out" not in err


@pytest.mark.dist
def test_under_torchrun_a_book_made_for_another_graph_is_refused(data_root, tmp_path):
    """The local launcher refused a partition file made for another graph of as many
    vertices, but torchrun's workers, which skip the launcher's checks, trained on it."""
    from fullgraph.partition import PartitionBook

    book = PartitionBook.from_assignment(np.arange(2000) % 2, 2)
    book.made_for = "0" * 32  # no graph's digest
    book.save(tmp_path / "book.npz")
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = clean_env(data_root, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            fullgraph_cmd() + TRAIN + ["--strategy", "data", "--dataset", "toy",
                                       "--partition-file", str(tmp_path / "book.npz")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=two_cores))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, err
        assert "book.npz was made for another graph of 2000 vertices" in err, err


TRAP = textwrap.dedent("""\
    import os
    import time

    from fullgraph.models import GNN, Propagate, Transform
    from fullgraph.models.layers import Dense, activation


    class Trap(Transform):
        \"\"\"A layer's activation whose rank FAIL_RANK raises at the 3rd call and whose
        other rank then sleeps outside any collective (as a model's own endless loop).\"\"\"
        calls = 0

        def __init__(self, dim, act):
            super().__init__(dim, dim)
            self.act = activation(act)

        def forward(self, x, ctx, layer_input=None):
            type(self).calls += 1
            if type(self).calls == 3:
                if os.environ["RANK"] == os.environ["FAIL_RANK"]:
                    raise ValueError("trap: a bug in the model")
                if os.environ["RANK"] == os.environ.get("KILL_RANK"):
                    os.kill(os.getpid(), 9)
                if os.environ.get("STUCK"):
                    time.sleep(600)
            return x if self.act is None else self.act(x)


    class TrapGCN(GNN):
        def conv(self, layer, in_dim, out_dim, *, act, residual):
            return [Dense(in_dim, out_dim, bias=False), Propagate(out_dim, "gcn"),
                    Trap(out_dim, act)]
""")


def _trapped_pair(data_root, tmp_path, failing: int | None, stuck: tuple[int, ...],
                  *flags: str, killed: int | None = None) -> tuple[list, list[str]]:
    """Two workers as torchrun starts them (RANK, MASTER_ADDR, ...), training the
    ``TRAP`` model: rank ``failing`` raises in its 3rd step, rank ``killed`` is killed
    there, the ``stuck`` ranks that do not fail sleep there outside any collective.
    Returns the processes and their standard errors."""
    (tmp_path / "trap.py").write_text(TRAP)
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = clean_env(data_root, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), FAIL_RANK=str(failing),
                            STUCK="1" if rank in stuck else "", FULLGRAPH_SHM="0",
                            KILL_RANK=str(killed))
            procs.append(subprocess.Popen(
                fullgraph_cmd() + TRAIN + ["--strategy", "data", *flags, "--model",
                                           f"{tmp_path / 'trap.py'}:TrapGCN"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=two_cores))
        errs = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return procs, errs


@pytest.mark.dist
@pytest.mark.parametrize("failing,stuck", [(1, False), (1, True), (0, True)])
def test_under_torchrun_a_failure_reaches_every_host(data_root, tmp_path, failing, stuck):
    """Nothing supervises torchrun's hosts together: the failed worker publishes its
    failure in the process group's store. A peer in a collective names it as the first
    failure (not only a closed connection); a peer stuck outside any collective stops
    on it within seconds (it would wait forever), also where the failed rank is rank 0,
    whose process holds the store here (no torchrun agent)."""
    procs, errs = _trapped_pair(data_root, tmp_path, failing, (0, 1) if stuck else ())
    other = 1 - failing
    for proc, err in zip(procs, errs):
        assert proc.returncode == 1, err
    cause = f"rank {failing} failed during epoch"
    assert cause in errs[failing] and "ValueError: trap" in errs[failing], errs[failing]
    assert "Traceback" in errs[failing]  # a bug: its traceback, as the launcher shows it
    if stuck:
        assert f"fullgraph: rank {other} stopped during epoch" in errs[other], errs[other]
        assert cause in errs[other], errs[other]
    else:  # (its collective broke, or its watch read the report first: named either way)
        assert f"fullgraph: the first failure: {cause}" in errs[other] or \
            f"fullgraph: rank {other} stopped during epoch" in errs[other], errs[other]
        assert cause in errs[other], errs[other]


@pytest.mark.dist
def test_under_torchrun_the_rank_that_never_reached_a_timed_out_call_is_named(data_root,
                                                                           tmp_path):
    """Under torchrun no launcher reads heartbeats: a rank whose collective timed out
    said only that, and which rank held it up was left to the reader of every host's
    log. The workers publish their progress in the store; the timed-out rank names the
    one that never reached its call, and every host's message says so."""
    procs, errs = _trapped_pair(data_root, tmp_path, None, (1,), "--timeout", "5")
    assert [proc.returncode for proc in procs] == [1, 1], errs
    said = "rank 1 never reached it (by its last report"
    assert "timed out" in errs[0].lower() and said in errs[0], errs[0]
    assert "fullgraph: rank 1 stopped during epoch" in errs[1] and said in errs[1], errs[1]


@pytest.mark.dist
def test_under_torchrun_a_killed_rank_is_named_by_its_peer(data_root, tmp_path):
    """Over gloo's sockets (separate hosts: no shared memory), a peer killed outright
    left only "Connection reset by peer" and a socket address; the survivor names the
    rank whose progress reports stopped."""
    procs, errs = _trapped_pair(data_root, tmp_path, None, (), killed=1)
    assert procs[1].returncode == -9 and procs[0].returncode == 1, errs
    assert "rank 1 stopped reporting its progress (killed, or its host lost)" in errs[0], \
        errs[0]


def _given_on_some_ranks(comm, cases: list) -> None:
    """Each case: per rank, the options given; the ConfigError expected (or None)."""
    from fullgraph.config import config_from_dict
    from fullgraph.errors import ConfigError
    from fullgraph.train import check_same_options

    for per_rank, expected in cases:
        cfg = config_from_dict(per_rank[comm.rank], source="test")
        if expected is None:
            check_same_options(cfg, comm)
            continue
        with pytest.raises(ConfigError) as err:
            check_same_options(cfg, comm)
        assert expected in str(err.value), err.value


@pytest.mark.dist
def test_a_per_host_path_given_on_some_hosts_only_is_refused(tmp_path):
    """Paths may differ per host, but a partition file given on one host only would set
    up other partitions there (the ranks then wait in different calls until the
    timeout), and an output given on hosts other than rank 0's is never written."""
    part = {"partition": {"file": "book.npz"}}
    other_part = {"partition": {"file": "elsewhere/book.npz"}}
    save = {"train": {"save_model": "model.pt"}}
    cases = [
        ([part, {}], "--partition-file given: True on rank(s) 0, False on rank(s) 1"),
        ([{}, part], "--partition-file given: False on rank(s) 0, True on rank(s) 1"),
        ([part, other_part], None),  # each host's own copy
        ([{}, save], "--save-model given on rank(s) 1 but not on rank 0, which alone writes"),
        ([save, {}], None),  # rank 0 writes it
        ([save, {"train": {"save_model": "other.pt"}}], None),
    ]
    run_ranks(_given_on_some_ranks, 2, tmp_path, cases)


# ---------------------------------------------------------------- the run directory, start-up

@pytest.fixture
def temp_root(tmp_path, monkeypatch, data_root) -> Path:
    """Where ``tempfile`` makes directories, for this test only; no launcher variables."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("FULLGRAPH_DATA", str(data_root))
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    return tmp


@pytest.mark.dist
def test_temporary_run_dir_is_removed_unless_kept_or_failed(temp_root, capsys):
    from fullgraph.launch import launch_local

    assert launch_local(["datasets"], 1, timeout_s=30, run_dir=None, threads=1) == 0
    assert list(temp_root.glob("fullgraph-run-*")) == []
    assert launch_local(["datasets"], 1, timeout_s=30, run_dir=None, threads=1,
                        keep_run_dir=True) == 0
    kept = list(temp_root.glob("fullgraph-run-*"))
    assert len(kept) == 1
    assert f"run directory kept: {kept[0]}" in capsys.readouterr().err  # where it is
    shutil.rmtree(kept[0])
    # a worker's usage error is reported, named by the launcher, and ends the run with 2
    assert launch_local(["datasets", "no-such-dataset"], 1, timeout_s=30, run_dir=None,
                        threads=1) == 2
    kept = list(temp_root.glob("fullgraph-run-*"))
    err = capsys.readouterr().err
    assert len(kept) == 1 and f"logs in {kept[0]}" in err
    assert "worker rank 0 failed during start-up" in err and "no-such-dataset" in err


def test_worker_that_cannot_start_is_one_line(temp_root, monkeypatch, capsys):
    started = []

    class FakePopen:
        def __init__(self, *args, **kwargs):
            if len(started) == 2:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            started.append(self)
            self.killed = False

        def kill(self):
            self.killed = True

        def wait(self):
            return -9

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    from fullgraph.launch import launch_local

    assert launch_local(["datasets"], 1000, timeout_s=30, run_dir=None, threads=1) == 1
    err = capsys.readouterr().err
    assert err.startswith("fullgraph: could not start worker 2 of 1000: [Errno 11]"), err
    assert len(err.strip().splitlines()) == 1 and all(p.killed for p in started)


def test_user_error_in_a_worker_is_one_line_and_exit_2(tmp_path):
    from fullgraph.launch import WorkerExit, describe_failure

    reports = {0: {"peer_failure": True, "user_error": False, "time": 2.0,
                   "error": "CommError: rank 0 of 2: broadcast failed",
                   "traceback": "Traceback (most recent call last): ..."},
               1: {"peer_failure": False, "user_error": True, "time": 3.0,
                   "error": "ValidationError: book.npz: partition book is for another graph",
                   "traceback": ""}}
    for rank, report in reports.items():
        report.update(rank=rank, phase="setup")
        (tmp_path / f"failure-rank{rank}.json").write_text(json.dumps(report))
    text, code = describe_failure([WorkerExit(0, 1), WorkerExit(1, 1)], tmp_path)
    assert code == 2
    assert text.splitlines() == [
        "fullgraph: worker rank 1 failed during setup: ValidationError: book.npz: partition "
        "book is for another graph", f"fullgraph: ranks [0] stopped after it; logs in {tmp_path}"]


def test_a_worker_ended_by_a_signal_it_handles_is_named_by_the_signal(tmp_path):
    """A worker leaves with 128 + n on SIGTERM (its handler's os._exit) and on Ctrl-C
    (130): the launcher names the signal, as it does for a SIGKILL."""
    from fullgraph.launch import WorkerExit, describe_failure

    (tmp_path / "status-rank1").write_text("setup")
    text, code = describe_failure([WorkerExit(1, 143)], tmp_path)
    assert code == 1 and text.splitlines()[0] == (
        "fullgraph: worker rank 1 failed during setup: worker died (exit code 143, on "
        "SIGTERM) without a report"), text
    text, _ = describe_failure([WorkerExit(1, 3)], tmp_path)
    assert "(exit code 3) without a report" in text, text


def test_an_interrupted_worker_of_the_launcher_leaves_at_once(monkeypatch):
    """Ctrl-C reaches every worker; one of the local launcher's leaves through
    os._exit (torch's shutdown would take seconds of the launcher's grace period)."""
    from fullgraph import cli, worker

    left = []

    def leave_now(code, flush=False):
        left.append(code)
        raise SystemExit(code)

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setenv(worker.SUPERVISED_ENV, str(os.getppid()))
    monkeypatch.setattr(worker, "leave_now", leave_now)
    monkeypatch.setitem(cli.COMMANDS, "datasets", interrupted)
    with pytest.raises(SystemExit):
        cli.main(["datasets"])
    assert left == [130]


class FakeWorker:
    """Stands for a worker process in ``Supervisor``: running until killed or given a code."""

    def __init__(self, code: int | None = None) -> None:
        self.code, self.pid = code, os.getpid()

    def poll(self) -> int | None:
        return self.code

    def kill(self) -> None:
        self.code = -9


def test_supervisor_finds_the_rank_that_never_reached_the_collective(tmp_path):
    """Rank 0 timed out in call 10; rank 1 waits in it too; rank 2 is alive but still at
    call 7 (a loop outside any collective); rank 3 stopped beating long ago."""
    from fullgraph.launch import Supervisor, describe_failure

    now = time.time()
    (tmp_path / "failure-rank0.json").write_text(json.dumps(
        {"rank": 0, "phase": "epoch 4 training step", "time": now, "peer_failure": True,
         "timed_out": True, "entered": 10, "inside": "all_reduce in phase 'grad-sync'",
         "error": "CommError: timed out", "traceback": "Traceback ..."}))
    for rank, (age, entered) in {1: (0.2, 10), 2: (0.2, 7), 3: (100.0, 9)}.items():
        (tmp_path / f"heartbeat-rank{rank}").write_text(json.dumps(
            {"time": now - age, "phase": "epoch 4 training step", "entered": entered,
             "inside": None}))
        (tmp_path / f"status-rank{rank}").write_text("epoch 4 training step")
    procs = [FakeWorker(1), FakeWorker(), FakeWorker(), FakeWorker()]
    sup = Supervisor(procs, tmp_path, timeout_s=60)
    assert sup.step()  # rank 1 still runs: it is killed after the grace period
    assert sorted(sup.failed) == [0, 2, 3] and [p.code for p in procs] == [1, None, -9, -9]
    assert sup.failed[2].hung == ("it never reached the all_reduce in phase 'grad-sync' that "
                                  "rank 0 timed out waiting in after --timeout 60 s")
    assert sup.failed[3].hung == "no heartbeat for 100 s, --timeout 60 s"
    text, code = describe_failure(list(sup.failed.values()), tmp_path)
    assert code == 1 and text.splitlines()[0] == (
        "fullgraph: worker rank 3 failed during epoch 4 training step: stopped responding "
        "(no heartbeat for 100 s, --timeout 60 s); killed by the launcher (where a worker may "
        "take longer, a long epoch or checkpoint, raise --timeout)")
    assert "Traceback" not in text


def test_supervisor_names_the_peer_a_point_to_point_wait_timed_out_on(tmp_path):
    """Under partial reduce rank 0 timed out waiting for rank 1's halo rows; rank 1 waits
    for rank 2 in a point-to-point receive of its own; rank 2 beats and waits for no one:
    it is the straggler, not rank 1. Rank 3, in a collective, is not blamed."""
    from fullgraph.launch import Supervisor, describe_failure

    now = time.time()
    (tmp_path / "failure-rank0.json").write_text(json.dumps(
        {"rank": 0, "phase": "epoch 6 start", "time": now, "peer_failure": True,
         "timed_out": True, "entered": 10, "peer": 1,
         "inside": "irecv(tag 7) with rank 1 in phase 'halo'", "error": "CommError: timed out",
         "traceback": ""}))
    for rank, (inside, awaiting) in {1: (None, 2), 2: (None, None),
                                     3: ("all_reduce in phase 'grad-sync'", None)}.items():
        (tmp_path / f"heartbeat-rank{rank}").write_text(json.dumps(
            {"time": now - 0.2, "phase": "epoch 4 training step", "entered": 12,
             "inside": inside, "awaiting": awaiting}))
        (tmp_path / f"status-rank{rank}").write_text("epoch 4 training step")
    procs = [FakeWorker(1), FakeWorker(), FakeWorker(), FakeWorker()]
    sup = Supervisor(procs, tmp_path, timeout_s=60)
    sup.step()
    assert sorted(sup.failed) == [0, 2] and procs[2].code == -9
    assert procs[1].code is None and procs[3].code is None
    text, _ = describe_failure(list(sup.failed.values()), tmp_path)
    assert text.splitlines()[0] == (
        "fullgraph: worker rank 2 failed during epoch 4 training step: stopped responding "
        "(rank 0 timed out in irecv(tag 7) with rank 1 in phase 'halo' after --timeout 60 s, "
        "and it waited for no one); killed by the launcher (where a worker may take longer, "
        "a long epoch or checkpoint, raise --timeout)")


def _awaiting_world(comm) -> None:
    import threading

    import torch

    from fullgraph.comm.tagged import post_recv, post_send

    if comm.rank == 1:
        seen: list = []
        message = post_recv((3,), torch.float32, 0, 77, comm, "test")
        look = threading.Timer(0.5, lambda: seen.append(comm.counter.awaiting))
        look.start()
        message.wait()
        look.join()
        assert seen == [0] and comm.counter.awaiting is None
    else:
        time.sleep(1.5)
        post_send(torch.ones(3), 1, 77, comm, "test").wait()


@pytest.mark.dist
def test_a_point_to_point_wait_says_whom_it_waits_for(tmp_path):
    """The heartbeat's ``awaiting`` (the launcher follows it): set while a tagged message
    is waited for, cleared after."""
    run_ranks(_awaiting_world, 2, tmp_path)


def test_a_worker_that_finished_may_be_quiet_while_it_exits(tmp_path):
    """Past its training (phase "done") a worker's interpreter shuts down without
    heartbeats for a few seconds: a short --timeout must not kill it then."""
    from fullgraph.launch import EXIT_GRACE_S, Supervisor

    now = time.time()
    for rank, (age, phase) in {0: (5.0, "done"), 1: (5.0, "epoch 9 training step"),
                               2: (EXIT_GRACE_S + 1, "done")}.items():
        (tmp_path / f"heartbeat-rank{rank}").write_text(json.dumps(
            {"time": now - age, "phase": phase, "entered": 3, "inside": None}))
    sup = Supervisor([FakeWorker(), FakeWorker(), FakeWorker()], tmp_path, timeout_s=2)
    sup.step()
    assert sorted(sup.failed) == [1, 2]


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_memory_limit_reads_v1_and_v2(tmp_path, version):
    """The limit of the process's own cgroup, in either hierarchy; none where it is
    unlimited ("max", or v1's huge default)."""
    from fullgraph.memory import cgroup_memory_limit

    cgroups = tmp_path / "cgroup"
    if version == 1:
        cgroups.write_text("9:pids:/\n4:memory:/jobs/a\n0::/\n")
        limit = tmp_path / "memory" / "jobs" / "a" / "memory.limit_in_bytes"
    else:
        cgroups.write_text("0::/jobs/a\n")
        limit = tmp_path / "jobs" / "a" / "memory.max"
    limit.parent.mkdir(parents=True)
    limit.write_text("12884901888\n")
    assert cgroup_memory_limit(str(cgroups), str(tmp_path)) == 12 << 30
    limit.write_text("max\n" if version == 2 else "9223372036854771712\n")
    assert cgroup_memory_limit(str(cgroups), str(tmp_path)) is None
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None


@pytest.mark.dist
def test_launched_workers_end_quietly_when_the_outputs_reader_goes(tmp_path):
    """`fullgraph train --workers 2 | head -2`: rank 0 finds standard output's reader
    gone; every worker stops and the run ends with 141, as a tool killed by SIGPIPE,
    without an error or a traceback."""
    proc = subprocess.Popen(fullgraph_cmd() + [*TRAIN, "--epochs", "200", "--strategy", "data",
                                               "--workers", "2"],
                            env=clean_env(tmp_path / "data"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=two_cores)
    assert proc.stdout is not None
    proc.stdout.readline()  # the run has started
    proc.stdout.close()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 141, err
    assert b"error" not in err and b"Traceback" not in err and b"failed" not in err, err


WATCHED = textwrap.dedent("""\
    import json, sys, time
    from types import SimpleNamespace
    from fullgraph.worker import WorkerStatus

    class Store:
        def __init__(self, record):
            self.record = record
        def check(self, keys):
            if self.record is None:
                raise RuntimeError("Connection reset by peer")  # its host's agent ended
            return True
        def get(self, key):
            return json.dumps(self.record)
        def set(self, key, value):  # the worker's progress
            self.check([key])

    record = json.loads(sys.argv[1])
    status = WorkerStatus(2, None)
    status.watch(SimpleNamespace(entered=3, inside=None, awaiting=None))
    status.set_phase(sys.argv[2])
    status.share_failures(Store(record), "run", timeout_s=1.0)
    time.sleep(float(sys.argv[3]))  # a model's own loop, outside any collective
""")


@pytest.mark.parametrize("record, phase, code, said", [
    (None, "epoch 5 training step", 1, "fullgraph: rank 2 stopped during epoch 5 training "
     "step: the run's store at 127.0.0.1:1 went away"),
    (None, "done", 0, ""),
    ({"rank": 0, "phase": "epoch 5 training step", "error": "CommError: timed out",
      "user_error": False, "entered": 10, "inside": "all_to_all_v in phase 'halo'"},
     "epoch 5 training step", 1, "rank 0 failed during epoch 5 training step: CommError: "
     "timed out (this rank never reached the all_to_all_v in phase 'halo' it waited in: it "
     "was busy outside any collective)"),
])
def test_a_torchrun_worker_stuck_outside_collectives_ends(tmp_path, record, phase, code, said):
    """Under torchrun with several hosts, a worker in a loop of its own ran forever: the
    peers that timed out exited at once and their host's agent took the store with them
    before its watch read their report (it then gave up silently), and a report read
    did not say which rank held the others up."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    start = time.monotonic()
    sleep = "30" if code else "6"  # (done: not ended, though its store went away)
    done = subprocess.run([sys.executable, str(script), json.dumps(record), phase, sleep],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
    assert done.returncode == code and said in done.stderr, done.stderr
    assert time.monotonic() - start < 25


def test_the_first_phase_of_an_epoch_is_written_at_once(tmp_path):
    """A worker killed early in its first epoch was reported "failed during setup": the
    phases of an epoch waited for the next heartbeat (up to 0.5 s)."""
    from fullgraph.worker import WorkerStatus

    status = WorkerStatus(0, str(tmp_path))
    status.set_phase("setup")
    status.set_phase("epoch 1 start")
    assert (tmp_path / "status-rank0").read_text() == "epoch 1 start"
    status.set_phase("epoch 1 training step")  # the next ones: by the heartbeat
    assert (tmp_path / "status-rank0").read_text() == "epoch 1 start"
