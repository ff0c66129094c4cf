"""Run a test function on several gloo ranks (STYLE.md section 6).

``run_ranks(fn, world_size, tmp_path, *args)`` spawns ``world_size`` processes with
``torch.multiprocessing.spawn(..., join=True)``; each one limits itself to one thread,
builds its ``Comm`` with ``init_comm`` (gloo, ``file://{tmp_path}/store``), calls
``fn(comm, *args)`` and destroys the group in ``finally``. A rank that raises makes
``spawn`` raise ``ProcessRaisedException`` carrying that rank's traceback, and the
other ranks are terminated; a rank failing with ``CommError`` (typically because a
peer died) waits ``ECHO_DELAY_S`` before exiting, so the root cause is the one
reported. ``fn`` and ``args`` must be picklable (``fn`` defined at module level).
World size 1 spawns one process with no process group at all, so any
torch.distributed call that a bypass forgot fails loudly.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from fullgraph.comm import CommError, destroy_comm, init_comm, shm

ECHO_DELAY_S = 1.0
"""How long a rank that failed with CommError waits before exiting (see _rank_main)."""
DIST_MARKED: bool | None = None
"""Whether the running test is marked ``dist`` (set by conftest; None outside pytest)."""


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, store: str,
               timeout_s: float, args: tuple[Any, ...]) -> None:
    from fullgraph.ops import kernels

    kernels.set_threads(1)  # numba's pool first: starting it resets OpenMP's count
    torch.set_num_threads(1)
    comm = init_comm(backend="gloo", init_method=f"file://{store}", rank=rank,
                     world_size=world_size, timeout_s=timeout_s)
    try:
        fn(comm, *args)
    except CommError:
        # Usually the echo of another rank's failure (its exit closed our connections).
        # spawn reports the first rank to exit, so let the root cause exit first.
        time.sleep(ECHO_DELAY_S)
        raise
    finally:
        destroy_comm(comm)


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path | str, *args: Any,
              timeout_s: float = 120) -> None:
    """Call ``fn(comm, *args)`` on ``world_size`` spawned gloo ranks; raise if any fails.

    Args:
        fn: module-level function taking the rank's ``Comm`` first.
        world_size: number of ranks to spawn.
        tmp_path: a fresh directory for the file store (pytest's ``tmp_path``).
        *args: picklable arguments passed to ``fn`` after ``comm``.
        timeout_s: the process-group and per-collective timeout (default: 120).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised; carries its traceback.
        torch.multiprocessing.ProcessExitedException: a rank died without raising.
    """
    if DIST_MARKED is False:
        raise RuntimeError("run_ranks in a test not marked dist: add @pytest.mark.dist "
                           "(or a module's pytestmark), so -m 'not dist' leaves it out")
    store = Path(tmp_path) / "store"
    if store.exists():  # a stale file store would hang the rendezvous
        os.remove(store)
    ctx = mp.start_processes(_rank_main, args=(fn, world_size, str(store), timeout_s, args),
                             nprocs=world_size, join=False, start_method=START_METHOD)
    try:
        while not ctx.join():
            pass
    finally:  # a rank terminated mid-exchange leaves its shared-memory arena behind
        for proc in ctx.processes:
            shm.remove_files(proc.pid)


START_METHOD = os.environ.get("FULLGRAPH_TEST_START", "forkserver")
"""How rank processes start. ``forkserver``: forked from one server process per test
session that has already imported torch (and the parts of it that the optimisers
import on first use) and fullgraph, so a rank starts in milliseconds instead of
paying those imports again; ``spawn`` (``FULLGRAPH_TEST_START=spawn``): a fresh
interpreter per rank."""
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "fullgraph.train", "fullgraph.cli",
           "harness"]
if START_METHOD == "forkserver":
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
