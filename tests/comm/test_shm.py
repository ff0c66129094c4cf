"""The shared-memory all-to-all (``fullgraph.comm.shm``) on gloo ranks of one host.

``test_primitives`` runs every primitive through it; here: exchanges waited out of
order, an arena that grows and gives its old file back, a rank without room (the
exchange goes through the backend), more exchanges in flight than the control table
holds, a probe that fails where the ranks do not share the directory, and the files
left behind.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from harness import run_ranks

from fullgraph.comm import Comm, all_to_all_v, barrier
from fullgraph.comm import shm as shm_mod
from fullgraph.comm.group import open_shm
from fullgraph.comm.primitives import all_gather_object, all_to_all_v_start

pytestmark = pytest.mark.skipif(not shm_mod.supported(), reason="no shared-memory transport here")


def _block(src: int, dst: int, k: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    vals = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3) + 1000 * src + 100 * dst + k
    return vals.to(dtype) if dtype != torch.bool else (vals.long() % 3 == 0)


def _rows(src: int, dst: int, k: int) -> int:
    return 0 if src == dst else (src + 2 * dst + k) % 4 * (1 + k % 3)


def _exchange_many(comm: Comm, count: int, big: int = 0) -> None:
    """``count`` exchanges started together and waited in reverse order."""
    me, world = comm.rank, comm.world_size
    dtypes = [torch.float32, torch.float64, torch.int64, torch.bool]
    pending = []
    for k in range(count):
        dtype = dtypes[k % len(dtypes)]
        extra = big if k == count - 1 else 0
        send = [_block(me, d, k, _rows(me, d, k) + extra, dtype) for d in range(world)]
        recv = [_rows(s, me, k) + extra for s in range(world)]
        pending.append((k, dtype, extra, all_to_all_v_start(send, recv, comm, "shm-test")))
    for k, dtype, extra, p in reversed(pending):
        got = p.wait()
        for s in range(world):
            if s != me:
                want = _block(s, me, k, _rows(s, me, k) + extra, dtype)
                assert torch.equal(got[s], want), (me, s, k)


def _my_files(comm: Comm) -> list[str]:
    prefix = comm.shm.prefix
    folder = os.path.dirname(prefix)
    return sorted(f for f in os.listdir(folder) if f.startswith(os.path.basename(prefix)))


def check_exchanges(comm: Comm) -> None:
    assert comm.shm is not None
    assert _my_files(comm) == []  # the control file went once every peer had it mapped
    for _ in range(3):
        _exchange_many(comm, 9)
    assert [a.gen for a in comm.shm.arenas] == [0]
    # 4M floats: larger than the arena, so it grows; the old one goes once read
    _exchange_many(comm, 3, big=1 << 20)
    barrier(comm, "read")  # every rank has read everything: the next start frees
    _exchange_many(comm, 2)
    assert [a.gen for a in comm.shm.arenas] == [1]
    barrier(comm, "read")
    _exchange_many(comm, 1)
    assert _my_files(comm) == []  # mapped by every peer, so removed already
    assert comm.counter.snapshot()["shm-test"]["calls"] == 27 + 3 + 2 + 1
    comm.shm.close()


def check_no_room(comm: Comm) -> None:
    """Rank 1 gets no arena: every exchange goes through the backend, on every rank."""
    if comm.rank == 1:
        comm.shm._grow = lambda seq, nbytes, live: None
    _exchange_many(comm, 5)
    _exchange_many(comm, 3)
    from test_primitives import check_into

    check_into(comm)  # blocks received into their places through the backend too
    assert comm.shm.arenas == [] if comm.rank == 1 else comm.shm.arenas


def check_full_table(comm: Comm, monkeypatch_entries: int) -> None:
    """More exchanges in flight than table entries: the extra ones take the backend."""
    shm_mod.ENTRIES = monkeypatch_entries
    small = open_shm(dataclasses.replace(comm, shm=None))
    assert small is not None
    c = dataclasses.replace(comm, shm=small)
    _exchange_many(c, 3 * monkeypatch_entries)
    _exchange_many(c, 2)
    small.close()


def check_probe_fails(comm: Comm, tmp: str) -> None:
    """Ranks that do not see each other's files (as on two hosts, each with its own
    /dev/shm) agree on no transport."""
    root = Path(tmp) / f"rank{comm.rank}"
    root.mkdir()

    def gather(obj):
        from fullgraph.comm.primitives import all_gather_object
        got = all_gather_object(obj, comm, "probe")
        # the peers' files are where this rank cannot see them
        return [o if q == comm.rank else (str(root / "elsewhere" / Path(o[0]).name), *o[1:])
                for q, o in enumerate(got)]

    def agree(ok):
        from fullgraph.comm.primitives import all_reduce_
        return bool(all_reduce_(torch.tensor([int(ok)]), comm, "probe", op="min")[0])

    assert shm_mod.ShmExchange.open(comm.rank, comm.world_size, gather, agree,
                                    root=str(root)) is None
    assert list(root.iterdir()) == []  # its own files removed again
    out = all_to_all_v([torch.ones(1, 2)] * comm.world_size, [1] * comm.world_size, comm, "x")
    assert len(out) == comm.world_size


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_exchanges_waited_out_of_order_and_a_growing_arena(tmp_path, world_size):
    run_ranks(check_exchanges, world_size, tmp_path)


@pytest.mark.dist
def test_a_rank_without_room_sends_every_exchange_through_the_backend(tmp_path):
    run_ranks(check_no_room, 3, tmp_path)


@pytest.mark.dist
def test_more_exchanges_in_flight_than_the_table_holds(tmp_path):
    run_ranks(check_full_table, 2, tmp_path, 4)


@pytest.mark.dist
def test_ranks_that_cannot_share_files_use_the_backend(tmp_path):
    run_ranks(check_probe_fails, 2, tmp_path, str(tmp_path))


def test_switched_off_and_leftovers(monkeypatch, tmp_path):
    monkeypatch.setenv(shm_mod.ENV, "0")
    assert not shm_mod.supported()
    for name in ("fullgraph-4242-ab-control", "fullgraph-4242-ab-g0", "fullgraph-42-x"):
        (tmp_path / name).write_bytes(b"x")
    assert shm_mod.remove_files(4242, root=str(tmp_path)) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["fullgraph-42-x"]


def test_a_file_without_room_is_not_left_behind(monkeypatch, tmp_path):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        shm_mod._map(str(tmp_path / "fullgraph-1-x-g0"), 1 << 20, create=True)
    assert list(tmp_path.iterdir()) == []


def _window_files() -> list[str]:
    return sorted(f for f in os.listdir(shm_mod.ROOT) if f.startswith(f"fullgraph-{os.getpid()}-"))


def check_windows(comm: Comm) -> None:
    """Each rank writes a block into every peer's window; each reads its own in place;
    a use waits for the last one's release; a window too small is replaced by a
    larger one; out-of-range blocks are refused."""
    from fullgraph.comm import primitives as prim

    me, world = comm.rank, comm.world_size
    win = prim.window(comm, 64)
    assert win is not None and win.capacity >= 64
    assert prim.window(comm, 32) is win  # room enough: the same window, no collective
    for use, size in enumerate([2, 5, 300, 3]):  # rows of 3 float64 from each peer
        win = prim.window(comm, size * 3 * 8 * world)
        assert win is not None and win.capacity >= size * 3 * 8 * world
        peers = [q for q in range(world) if q != me]
        prim.window_begin(win, peers, comm, "win")
        for q in peers:
            at = me * size * 3 * 8  # the block from rank p sits at p's place
            win.slot(q, at, size * 24).view(torch.float64).view(size, 3).copy_(
                _block(me, q, use, size, torch.float64))
        prim.window_fence(win, comm, "win", len(peers) * size * 24, len(peers) * size * 24)
        got = win.inbox(world * size * 24).view(torch.float64).view(world, size, 3)
        for p in peers:
            torch.testing.assert_close(got[p], _block(p, me, use, size, torch.float64),
                                       rtol=0, atol=0)
        win.release()
    assert comm.counter.snapshot()["win"]["calls"] == 4
    assert not any(f.endswith("-w") for f in _window_files())  # mapped, so removed
    with pytest.raises(ValueError, match="window of"):
        win.slot((me + 1) % world, win.capacity - 8, 16)
    # a use waits for the peer it writes to: rank 1 holds its inbox unreleased (the
    # barriers go through the backend: a barrier is a use of the window too)
    backend = dataclasses.replace(comm, shm=None)
    win.begin([], 1.0)
    barrier(backend, "held")
    if me == 0:
        with pytest.raises(TimeoutError, match="until rank 1 has read use"):
            win.begin([1], 0.05)
    barrier(backend, "tried")
    if me == 1:
        win.release()
    barrier(backend, "released")
    if me == 0:
        win.uses -= 1  # the failed begin counted a use
        win.begin([1], 1.0)
    comm.shm.close()


def check_window_without_room(comm: Comm) -> None:
    """A rank that cannot make its window: no window on any rank, then or later."""
    from fullgraph.comm import primitives as prim

    assert prim.window(comm, 128) is comm.shm.win is not None  # opened with the group
    if comm.rank == 1:
        comm.shm.root = "/nonexistent-fullgraph-dir"
    assert prim.window(comm, 1 << 20) is None  # to grow it, rank 1 would need a file
    assert prim.window(comm, 8) is None and comm.shm.window_failed
    comm.shm.close()


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_windows_take_blocks_in_place_and_grow(tmp_path, world_size):
    run_ranks(check_windows, world_size, tmp_path)


@pytest.mark.dist
def test_no_window_anywhere_when_a_rank_has_no_room(tmp_path):
    run_ranks(check_window_without_room, 2, tmp_path)


def test_a_window_fence_names_a_peer_that_exited_or_never_came(tmp_path):
    """Waiting on a peer's counter: a peer whose process has exited is named within a
    liveness check, one that runs but never arrives at the timeout; a fence the peer
    has reached returns at once."""
    import subprocess
    import time

    size = shm_mod._WIN_HEAD + 64
    paths = [str(tmp_path / f"w{r}") for r in range(2)]
    wins = [shm_mod.ShmWindow(r, 2, paths[r], shm_mod._map(paths[r], size, create=True))
            for r in range(2)]
    for r in range(2):
        wins[r].peer_data[1 - r] = shm_mod._map(paths[1 - r], size, create=False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    wins[0].peer_pid[1] = gone.pid
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(process {gone.pid}\) exited"):
        wins[0].fence(30.0)
    assert time.monotonic() - start < 5.0
    wins[1].fence(1.0)  # rank 0 has arrived already
    wins[0].peer_pid[1] = None  # not visible from here: only the timeout bounds it
    with pytest.raises(TimeoutError, match="until rank 1 has finished use 0"):
        wins[0].fence(0.05)
    assert shm_mod._running(os.getpid()) and not shm_mod._running(gone.pid)
    for w in wins:
        w.close()


def check_close_waits_for_a_late_reader(comm: Comm) -> None:
    """Rank 0 closes right after an exchange that made its first arena; rank 1 only
    then waits for it: the arena is kept until rank 1 has mapped and read it."""
    import time

    send = [torch.full((3, 2), float(comm.rank))] * comm.world_size
    pending = all_to_all_v_start(send, [3] * comm.world_size, comm, "late")
    if comm.rank == 0:
        pending.wait()
        comm.shm.close()
    else:
        time.sleep(0.3)
        got = pending.wait()
        torch.testing.assert_close(got[0], torch.zeros(3, 2))


@pytest.mark.dist
def test_close_keeps_an_arena_a_peer_has_yet_to_read(tmp_path):
    run_ranks(check_close_waits_for_a_late_reader, 2, tmp_path)


def check_window_reductions(comm: Comm) -> None:
    """Through the window: an empty tensor (the backend's), a scalar, and a tensor too
    large for the window path (the backend's ring) all reduce; the window's reduction
    gives every rank the same bits."""
    from fullgraph.comm.primitives import SHM_REDUCE_BYTES, all_reduce_

    empty = torch.zeros(0)
    assert all_reduce_(empty, comm, "r") is empty
    scalar = torch.tensor(float(comm.rank) + 0.1, dtype=torch.float64)
    all_reduce_(scalar, comm, "r")
    big = torch.full((SHM_REDUCE_BYTES // 4 + 1,), float(comm.rank + 1))
    all_reduce_(big, comm, "r")
    assert float(big[0]) == sum(range(1, comm.world_size + 1))
    mixed = torch.rand(5000, generator=torch.Generator().manual_seed(comm.rank))
    all_reduce_(mixed, comm, "r")
    every = all_gather_object((float(scalar), mixed.numpy().tobytes()), comm, "r")
    assert all(e == every[0] for e in every)
    assert comm.counter.snapshot()["r"]["calls"] == 4 + 2  # 4 reductions, 1 gather


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_window_reductions_agree_on_every_rank(tmp_path, world_size):
    run_ranks(check_window_reductions, world_size, tmp_path)


def test_an_exchange_waits_on_posted_counters_and_names_a_dead_peer(tmp_path):
    """Without a backend signal, a receiver waits on its peers' ``posted`` counters:
    bounded by the timeout and by a liveness check that names a peer whose process
    has exited; once the peer posts, its block is read."""
    import subprocess
    import time

    ex = [shm_mod.ShmExchange(r, 2, str(tmp_path / f"x{r}"), root=str(tmp_path))
          for r in range(2)]
    for r in range(2):
        ex[r].peer_prefix[1 - r] = ex[1 - r].prefix
        ex[r].peer_control[1 - r] = ex[1 - r].control

    def backend(blocks):
        raise AssertionError("every rank had room: nothing goes through the backend")

    def send(r):
        return [torch.empty(0), torch.full((2, 3), 5.0)] if r == 0 else \
            [torch.full((4,), 7.0), torch.empty(0)]

    finish0 = ex[0].start(send(0), [0, 16], 0.05, backend)
    gone = subprocess.Popen(["true"])
    gone.wait()
    ex[0].peer_pid[1] = gone.pid
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(process {gone.pid}\) exited before it "
                                           "posted exchange 1"):
        ex[0].start(send(0), [0, 16], 30.0, backend)()
    assert time.monotonic() - start < 5.0
    ex[0].peer_pid[1] = None  # not visible from here: only the timeout bounds it
    with pytest.raises(TimeoutError, match="until rank 1 has posted exchange 0"):
        finish0()
    finish1 = ex[1].start(send(1), [24, 0], 1.0, backend)
    got = finish1()  # rank 0 posted long ago
    assert torch.equal(got[0].view(torch.float32), torch.full((6,), 5.0))
    got = finish0()
    assert torch.equal(got[1].view(torch.float32), torch.full((4,), 7.0))
    for e in ex:
        e.close()
