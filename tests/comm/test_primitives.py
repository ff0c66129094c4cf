"""Smoke and accounting tests of every primitive, on gloo and without it.

One spawn per world size runs every case twice: with the backend's all-to-all and
with the isend/irecv fallback (forced through ``Comm.p2p_all_to_all``). World size 1
runs in this process with no process group, so a bypass that forgot to skip
torch.distributed fails. The CommError tests keep a peer away from a collective and
check that the waiting rank fails within its timeout, naming its rank and the phase.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from primitive_checks import (
    check_all_to_all_v,
    check_gathers,
    check_reductions,
    fresh_comm,
)
from torch.multiprocessing import ProcessRaisedException

from fullgraph.comm import (
    Comm,
    CommError,
    all_reduce_,
    all_to_all_v,
    barrier,
    shm,
    single_comm,
)


def transports(comm: Comm) -> list[Comm]:
    """``comm`` with each all-to-all path: shared memory (where open), the backend's
    all_to_all_single, and isend/irecv pairs."""
    return ([comm] if comm.shm is not None else []) + [
        dataclasses.replace(comm, p2p_all_to_all=p2p, shm=None) for p2p in (False, True)]


def check_primitives(comm: Comm) -> None:
    if comm.world_size > 1:  # gloo in torch 2.13 runs all_to_all_single: no fallback chosen
        assert comm.p2p_all_to_all is False
        # the all-to-all probe; with shared memory, its probe and its window's (2 gathers,
        # 1 all-reduce each)
        assert comm.counter.snapshot()["comm-init"]["calls"] == (
            7 if shm.supported() else 1)
        assert (comm.shm is not None and comm.shm.win is not None) == shm.supported()
        assert (comm.shm is not None) == shm.supported()
        assert comm.timeout == datetime.timedelta(seconds=120)
    assert comm.device == torch.device("cpu")
    check_into(comm)
    for c in transports(comm):
        check_all_to_all_v(c)
        check_reductions(c)
        check_gathers(c)


def check_into(comm: Comm) -> None:
    """``all_to_all_v_start(..., into=...)``: strided blocks sent, each received block
    written into its place (here: column slices of one output), on every transport."""
    from fullgraph.comm.primitives import all_to_all_v_start

    me, world = comm.rank, comm.world_size
    rows = [2 + (p * 3 + me) % 4 for p in range(world)]  # rows I send to p
    for c in transports(comm):
        for dtype in (torch.float32, torch.int64):
            wide = torch.arange(50 * 3 * world, dtype=dtype).view(50, 3 * world) + 1000 * me
            send = [wide[:rows[p], 3 * p:3 * p + 3] for p in range(world)]  # strided
            recv = [2 + (me * 3 + q) % 4 for q in range(world)]
            plain = all_to_all_v([t.contiguous() for t in send], recv, c, "into")
            out = torch.full((max(recv), 3 * world), -1, dtype=dtype)
            into = [out[:recv[q], 3 * q:3 * q + 3] for q in range(world)]
            got = all_to_all_v_start(send, recv, c, "into", into=into).wait()
            assert all(g is i for g, i in zip(got, into))
            for q in range(world):
                assert torch.equal(out[:recv[q], 3 * q:3 * q + 3], plain[q]), (me, q, dtype)
    with pytest.raises(ValueError, match="into"):
        all_to_all_v_start([torch.ones(1, 2)] * world, [1] * world, comm, "into",
                           into=[torch.ones(2, 2)] * world)


def test_primitives_world_1_make_no_dist_calls():
    assert not dist.is_initialized()
    check_primitives(single_comm())


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_primitives_gloo(tmp_path, world_size):
    run_ranks(check_primitives, world_size, tmp_path)


# ---------------------------------------------------------------- failures
SHORT = datetime.timedelta(seconds=2)


def peer_leaves(comm: Comm, tmp_path: Path) -> None:
    """Rank 1 returns (its group is destroyed, the process exits); rank 0 collects."""
    if comm.rank == 1:
        return
    c = fresh_comm(comm, timeout=SHORT)
    backend = dataclasses.replace(c, shm=None)
    # through shared memory a small reduction and a barrier are a window's fence
    shm = c.shm is not None
    calls = [("all_reduce", lambda: all_reduce_(torch.ones(3), backend, "doomed")),
             ("barrier", lambda: barrier(backend, "doomed")),
             ("window(shm)" if shm else "all_reduce",
              lambda: all_reduce_(torch.ones(3), c, "doomed")),
             ("all_to_all_v(p2p)", lambda: all_to_all_v(
                 [torch.ones(2, 2)] * 2, [2, 2],
                 dataclasses.replace(c, p2p_all_to_all=True, shm=None), "doomed")),
             ("all_to_all_v", lambda: all_to_all_v(
                 [torch.ones(2, 2)] * 2, [2, 2], dataclasses.replace(c, shm=None), "doomed")),
             ("all_to_all_v(shm)", lambda: all_to_all_v(
                 [torch.ones(2, 2)] * 2, [2, 2], c, "doomed")),
             ("window(shm)" if shm else "barrier", lambda: barrier(c, "doomed"))]
    for name, call in calls:
        start = time.perf_counter()
        with pytest.raises(CommError) as info:
            call()
        assert time.perf_counter() - start < SHORT.total_seconds() + 5
        msg = str(info.value)
        assert msg.startswith("rank 0 of 2:") and "'doomed'" in msg and name in msg, msg
        assert info.value.rank == 0 and info.value.phase == "doomed"
        assert isinstance(info.value.cause, RuntimeError)


def peer_hangs(comm: Comm, tmp_path: Path) -> None:
    """Rank 1 stays away until rank 0 has timed out; rank 0 must give up in time."""
    done = tmp_path / "rank0-done"
    if comm.rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    c = fresh_comm(comm, timeout=SHORT)
    start = time.perf_counter()
    try:
        with pytest.raises(CommError, match=r"rank 0 of 2: (all_reduce|window\(shm\)) in "
                           r"phase 'stuck'") as info:
            all_reduce_(torch.ones(3), c, "stuck")
    finally:
        done.touch()
    elapsed = time.perf_counter() - start
    assert SHORT.total_seconds() - 0.5 < elapsed < SHORT.total_seconds() + 5, elapsed
    assert "timed out" in str(info.value).lower()
    assert c.counter.snapshot() == {}  # a failed call is not counted


@pytest.mark.dist
@pytest.mark.parametrize("scenario", [peer_leaves, peer_hangs], ids=["leaves", "hangs"])
def test_comm_error_names_rank_and_phase(tmp_path, scenario):
    start = time.perf_counter()
    run_ranks(scenario, 2, tmp_path, tmp_path)
    assert time.perf_counter() - start < 20


def raises_on_rank_1(comm: Comm) -> None:
    if comm.rank == 1:
        raise ValueError("boom on rank 1")
    barrier(fresh_comm(comm, timeout=datetime.timedelta(seconds=30)), "wait")


@pytest.mark.dist
def test_harness_reports_failing_rank(tmp_path):
    with pytest.raises(ProcessRaisedException, match="boom on rank 1"):
        run_ranks(raises_on_rank_1, 2, tmp_path)


def test_comm_error_message_and_pickling():
    import pickle

    err = CommError(2, 3, "halo", "all_to_all_v", RuntimeError("Connection closed by peer"),
                    0.25, datetime.timedelta(seconds=5))
    assert str(err) == ("rank 2 of 3: all_to_all_v in phase 'halo' failed after 0.2s "
                        "(timeout 5s): RuntimeError: Connection closed by peer")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, RuntimeError) and str(again) == str(err) and again.rank == 2


def test_host_tensors_go_to_the_device_on_nccl_and_cuda_tensors_to_the_host_on_gloo(
        monkeypatch):
    """Which copy a collective makes (``_staged``): NCCL takes device memory only (the
    counts of an evaluation are host tensors), gloo runs on host copies of CUDA
    tensors; the rest is taken where it is. The NCCL groups cannot be made here."""
    from fullgraph.comm import primitives as prim

    host, gpu = torch.zeros(2), torch.zeros(2, device="meta")  # (no copy is made)
    comm = Comm(rank=0, world_size=2, group=object(), device=torch.device("cuda", 1))
    for backend, tensor, want in (("nccl", host, torch.device("cuda", 1)), ("nccl", gpu, None),
                                  ("gloo", gpu, torch.device("cpu")), ("gloo", host, None)):
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert prim._staged(comm, tensor) == want, (backend, tensor.device)
