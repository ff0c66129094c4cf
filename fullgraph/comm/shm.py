"""All-to-all through shared memory between the workers of one host.

gloo moves every byte over TCP, also between processes on one host: about 1 GB/s per
rank over loopback on a 2-core VM where a memory copy runs at 13 GB/s. When every rank
of a group can open every other rank's files in one shared-memory directory (the
probe in ``ShmExchange.open``: the same host and the same ``/dev/shm``), the group's
``all_to_all_v`` copies each rank's outgoing blocks into a segment of its own and each
receiver copies its blocks straight out of its peers' segments: two memory copies
instead of a socket round trip.

Per exchange (sequence number k, the same on every rank: exchanges are started in the
same order everywhere, as every collective must be):

- ``start``: the sender copies its blocks into a free region of its arena (a
  shared-memory file; a larger one is made when it fills, and the old one is removed
  once nothing in it is still to be read), writes where each block lies into entry
  ``k mod ENTRIES`` of its control table, then sets its ``posted`` counter to k + 1.
- ``wait``: once every peer's ``posted`` has reached k + 1 (no backend call: the
  wait is bounded by the timeout and by a check that the peer's process still runs,
  as a window's fence), the receiver copies its block out of each peer's region,
  then advances its ``done`` counter (every exchange below it read).
- reuse: a sender writes over a region, or over a table entry, only after every
  peer's ``done`` has passed the exchanges that used it. Where the counters are read
  stale, a region is only reused later, never early: a reader's loads from the
  region come before its store to ``done``, and the writer's load of ``done`` before
  its stores to the region, and x86-64 never moves a store ahead of an earlier load
  (the transport is used only there). For the same reason a reader that sees a
  peer's ``posted`` sees its entry and its blocks.

Where a rank cannot get the room (the directory full, or its table entry for k still
unread by a peer: more exchanges in flight than ``ENTRIES``), it advances ``posted``
without writing the entry. A peer that finds ``posted`` past k and no entry k
knows, and every rank, seeing the same entries, then runs that one exchange through
the backend's ``all_to_all_single`` in ``wait``, as ``Comm.p2p_all_to_all`` does. (A
peer's entry k cannot change while this rank waits for exchange k: the next write
to it needs this rank's ``done`` past k.)

Files are named ``fullgraph-<pid>-<random>-...`` and removed as soon as every peer has
them mapped: the control file right after the probe, an arena once every peer has
finished the first exchange placed in it (``wait`` maps each peer's newest arena,
whether or not it reads from it). The mappings live on, so a killed worker leaves at
most an arena made in its last exchange; the launcher removes those too
(``remove_files``). Set ``FULLGRAPH_SHM=0`` to keep every exchange on the backend.

Windows (``ShmWindow``): where ``start`` copies each block twice (into the sender's
arena, out of it at the receiver), a window takes it once. Each rank maps a window of
every peer; a sender writes its rows straight into the receiver's window (as the
output of a gather or of a kernel), and the receiver reads them there, as one
contiguous buffer. ``ShmExchange.window`` keeps one per group, opened with it and
grown when an exchange needs more; ``comm.halo.WindowedHalo`` lays a halo exchange
out in it, and ``primitives`` its small all-reduces, object gathers and barriers.
``close`` keeps an arena a peer has not mapped yet for up to ``LINGER_S``.

This module calls torch.distributed only through the callables ``primitives`` gives it.
"""
from __future__ import annotations

import atexit
import glob
import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

ENV = "FULLGRAPH_SHM"
ROOT = "/dev/shm"
ENTRIES = 256
"""Control-table entries: exchanges that may be started and not yet read by every peer."""
MIN_ARENA = 8 << 20
_ALIGN = 64
"""Blocks start on cache lines (and so on their dtype's alignment)."""
LINGER_S = 2.0
"""How long ``close`` keeps an arena a peer has not mapped yet (see there)."""
FREE_MARGIN = 64 << 20
"""Room left free in the directory when an arena grows."""
_HEAD = 3  # control words before the table: done, the probe's token, posted
_DONE, _TOKEN, _POSTED = 0, 1, 2
_LIVENESS_S = 0.05
"""How often a rank waiting on a peer's counter checks that the peer still runs."""


def supported() -> bool:
    """Whether this machine may use the transport (x86-64 memory order, a /dev/shm,
    and not switched off with FULLGRAPH_SHM=0)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(ROOT) \
        and os.access(ROOT, os.W_OK)


def remove_files(pid: int, root: str = ROOT) -> int:
    """Remove the shared-memory files of the worker process ``pid``; how many."""
    n = 0
    for path in glob.glob(os.path.join(root, f"fullgraph-{int(pid)}-*")):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def _map(path: str, nbytes: int, create: bool) -> Tensor:
    """A (nbytes,) uint8 tensor over the file ``path`` (MAP_SHARED)."""
    if not create:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS on a later write
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        _unlink(path)  # nothing half-made is left behind
        raise


@dataclass
class _Arena:
    gen: int
    path: str
    data: Tensor
    first: int  # the first exchange placed in it
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> [start, stop)
    unlinked: bool = False

    @property
    def capacity(self) -> int:
        return self.data.numel()


class ShmExchange:
    """One rank's side of the shared-memory all-to-all of one group (see the module).

    Made by ``open`` (collective); ``start`` and the function it returns replace the
    backend's ``all_to_all_single`` for CPU tensors.
    """

    def __init__(self, rank: int, world_size: int, prefix: str, root: str = ROOT) -> None:
        self.rank, self.world_size, self.root = rank, world_size, root
        self.prefix = prefix
        self.width = 3 + 2 * world_size  # seq + 1, gen, base, offsets, sizes
        self.entries = ENTRIES
        words = _HEAD + self.entries * self.width
        self.control_path = f"{prefix}-control"
        control = _map(self.control_path, 8 * words, create=True)
        self.control = control.view(torch.int64)
        self.control.zero_()
        self.arenas: list[_Arena] = []
        self.next_gen = 0
        self.seq = 0  # the next exchange's number
        self.read: set[int] = set()  # exchanges read above ``done``
        self.peer_prefix: list[str] = [""] * world_size
        self.peer_control: list[Tensor | None] = [None] * world_size
        self.peer_pid: list[int | None] = [None] * world_size  # None: not visible here
        # per peer: gen -> (its arena, an exchange seen in it)
        self.peer_arenas: list[dict[int, tuple[Tensor, int]]] = [
            {} for _ in range(world_size)]
        self.closed = False
        self.win: ShmWindow | None = None  # see ``window``
        self.window_failed = False
        # per exchange table (by id, dropped with the table): what ``comm.halo``'s
        # windowed exchanges keep of it
        self.layouts: dict[int, list[list[int]] | None] = {}
        atexit.register(self.close)

    # ------------------------------------------------------------ set-up
    @classmethod
    def open(cls, rank: int, world_size: int,
             gather: Callable[[object], list[object]],
             agree: Callable[[bool], bool], root: str = ROOT) -> ShmExchange | None:
        """The group's transport, or None where some rank cannot reach another's files.

        Collective: ``gather`` is an all-gather of a small object, ``agree`` the
        logical and of a flag over the group. Every rank writes a random token into
        its control file and reads every peer's back from theirs."""
        mine: ShmExchange | None = None
        token = secrets.randbits(62)

        def make() -> object:
            nonlocal mine
            mine = cls(rank, world_size,
                       os.path.join(root, f"fullgraph-{os.getpid()}-{secrets.token_hex(4)}"),
                       root)
            mine.control[_TOKEN] = token
            mine.peer_prefix[rank] = mine.prefix
            return (mine.prefix, token, os.getpid())

        def attach(q: int, got: object) -> bool:
            assert mine is not None and isinstance(got, tuple)
            prefix, tok, pid = got
            ctl = _map(f"{prefix}-control", 8 * (_HEAD + mine.entries * mine.width),
                       create=False).view(torch.int64)
            mine.peer_prefix[q], mine.peer_control[q] = prefix, ctl
            mine.peer_pid[q] = pid if _running(pid) else None
            return int(ctl[_TOKEN]) == tok

        if not _open_together(rank, make, attach, gather, agree):
            if mine is not None:
                mine.close()
            return None
        assert mine is not None
        _unlink(mine.control_path)  # every peer has it mapped: nothing left to clean up
        return mine

    def window(self, capacity: int, gather: Callable[[object], list[object]],
               agree: Callable[[bool], bool]) -> ShmWindow | None:
        """The group's window (``ShmWindow``), with room for ``capacity`` bytes on every
        rank; None where none could be opened (then never again). Every rank asks for
        the same capacity at the same point: when the window is too small, a new one
        a quarter larger than asked replaces it (collective)."""
        if self.window_failed:
            return None
        if self.win is None or self.win.capacity < capacity:
            old, self.win = self.win, None
            size = max(int(capacity) * 5 // 4, 4096)
            self.win = ShmWindow.open(self.rank, self.world_size, size, gather, agree,
                                      self.root)
            if old is not None:
                old.close()
            self.window_failed = self.win is None
        return self.win

    def close(self) -> None:
        """Unmap everything and remove this rank's files (safe to call twice). An arena
        some peer has yet to map (its last exchange's, made new: a peer maps it when
        it waits for that exchange) is kept up to ``LINGER_S`` for it first."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + LINGER_S
        while (any(not a.unlinked and a.first >= self._peers_done() for a in self.arenas)
               and time.monotonic() < deadline):
            time.sleep(1e-3)
        if self.win is not None:
            self.win.close()
            self.win = None
        self.layouts.clear()
        for arena in self.arenas:
            if not arena.unlinked:
                _unlink(arena.path)
        _unlink(self.control_path)
        self.arenas.clear()
        self.peer_arenas = [{} for _ in range(self.world_size)]
        self.peer_control = []

    # ------------------------------------------------------------ one exchange
    def start(self, send: Sequence[Tensor], recv_bytes: Sequence[int],
              timeout_s: float, fallback: Callable[[list[Tensor]], list[Tensor]],
              into: Sequence[Tensor] | None = None) -> Callable[[], list[Tensor | None]]:
        """Post this rank's blocks; the returned function waits (at most ``timeout_s``
        from when it is called) until every peer has posted its own, and gives the
        received blocks (uint8, one per rank; this rank's empty; None for a block
        written into its place in ``into``). It raises TimeoutError naming a peer that
        did not post in time, RuntimeError one whose process exited first.

        Args:
            send: one CPU tensor per rank, of one dtype, any shape and strides (this
                rank's empty): the block to send there. Copied before this returns.
            recv_bytes: bytes to receive from each rank.
            timeout_s: how long to wait for the peers.
            fallback: the backend's all-to-all of byte blocks, for an exchange some
                rank had no room for.
            into: where each received block goes (any strides, the sender's dtype), or
                None to return it.
        """
        seq = self.seq
        self.seq += 1
        blocks = [t if t.numel() and p != self.rank else None for p, t in enumerate(send)]
        sizes = [0 if b is None else b.numel() * b.element_size() for b in blocks]
        spans = [(s + _ALIGN - 1) // _ALIGN * _ALIGN for s in sizes]
        placed = self._place(seq, sum(spans))
        if placed is None:  # no room: this exchange goes through the backend
            sent = [_bytes_of(b) for b in blocks]
        else:
            arena, offset = placed
            offsets = []
            for b, span in zip(blocks, spans):
                offsets.append(offset)
                if b is not None:
                    assert arena is not None
                    _typed(arena.data, offset, b).copy_(b)
                    offset += span
            entry = self._entry(self.control, seq)
            w = self.world_size
            entry[3:3 + w] = torch.tensor(offsets, dtype=torch.int64)
            entry[3 + w:3 + 2 * w] = torch.tensor(sizes, dtype=torch.int64)
            entry[1], entry[2] = -1 if arena is None else arena.gen, offsets[0]
            entry[0] = seq + 1  # 0: never posted
            # the posted copies: what the backend sends should another rank lack room
            sent = [torch.empty(0, dtype=torch.uint8) if arena is None or not n else
                    arena.data[o:o + n] for o, n in zip(offsets, sizes)]
        self.control[_POSTED] = seq + 1  # after the entry and the blocks (module doc)

        def finish() -> list[Tensor | None]:
            deadline = time.monotonic() + timeout_s
            entries: list[Tensor | None] = [None] * self.world_size
            missing = placed is None
            for q in range(self.world_size):
                if q != self.rank:
                    ctl = self.peer_control[q]
                    assert ctl is not None
                    _await(ctl, _POSTED, seq + 1, deadline, q, self.peer_pid[q],
                           "shared-memory exchange", f"has posted exchange {seq}")
                    entries[q] = self._posted(q, seq)
                    missing = missing or entries[q] is None
            # some rank had no room: every rank sees it, and takes the backend
            got: list[Tensor | None]
            if missing:
                got = list(fallback(sent))
            else:
                got = [self._read(q, seq, int(n), entries[q],
                                  None if into is None else into[q])
                       if q != self.rank and n else torch.empty(0, dtype=torch.uint8)
                       for q, n in enumerate(recv_bytes)]
            self._mark_read(seq)
            return got

        return finish

    def _posted(self, q: int, seq: int) -> Tensor | None:
        """Rank q's table entry of exchange ``seq``, once its ``posted`` is past it
        (None where q wrote none: it had no room); its arena is mapped here now,
        whether or not this rank reads from it, so that q may remove the file once
        every peer is past ``seq``."""
        ctl = self.peer_control[q]
        assert ctl is not None
        entry = self._entry(ctl, seq).clone()
        if int(entry[0]) != seq + 1:
            return None
        gen = int(entry[1])
        maps = self.peer_arenas[q]
        if gen >= 0 and gen not in maps:
            path = f"{self.peer_prefix[q]}-g{gen}"
            maps[gen] = (_map(path, os.stat(path).st_size, create=False), seq)
        return entry

    def _read(self, q: int, seq: int, n: int, entry: Tensor | None,
              dst: Tensor | None) -> Tensor | None:
        """Rank q's block for this rank: into ``dst`` (then None), else a copy."""
        assert entry is not None
        w = self.world_size
        offset, size = int(entry[3 + self.rank]), int(entry[3 + w + self.rank])
        if size != n:
            raise RuntimeError(f"shared-memory exchange {seq}: rank {q} sent {size} bytes "
                               f"here, {n} were expected")
        data = self.peer_arenas[q][int(entry[1])][0]
        if dst is None:
            return data[offset:offset + n].clone()
        dst.copy_(_typed(data, offset, dst))
        return None

    def _mark_read(self, seq: int) -> None:
        self.read.add(seq)
        done = int(self.control[_DONE])
        while done in self.read:
            self.read.discard(done)
            done += 1
        self.control[_DONE] = done
        # a peer's arenas are used in order of exchange: once an exchange seen in a
        # newer one is read, with everything before it, the older ones are not needed
        for maps in self.peer_arenas:
            newest = max((g for g, (_, seen) in maps.items() if seen < done), default=None)
            for g in [g for g in maps if newest is not None and g < newest]:
                del maps[g]

    def _entry(self, control: Tensor, seq: int) -> Tensor:
        start = _HEAD + (seq % self.entries) * self.width
        return control[start:start + self.width]

    # ------------------------------------------------------------ the arena
    def _peers_done(self) -> int:
        return min(int(c[_DONE]) for q, c in enumerate(self.peer_control) if q != self.rank
                   and c is not None)

    def _place(self, seq: int, nbytes: int) -> tuple[_Arena | None, int] | None:
        """Room for ``nbytes`` for exchange ``seq``: (arena, offset); (None, 0) for
        nothing to send; None where there is no room."""
        done = self._peers_done()
        if seq - done >= self.entries:  # its table entry is still to be read by a peer
            return None
        for arena in self.arenas:
            for s in [s for s in arena.live if s < done]:
                del arena.live[s]
            if not arena.unlinked and arena.first < done:  # every peer has it mapped
                _unlink(arena.path)
                arena.unlinked = True
        # older arenas nothing reads any more
        self.arenas = [a for a in self.arenas[:-1] if a.live] + self.arenas[-1:]
        if not nbytes:
            return None, 0
        cur = self.arenas[-1] if self.arenas else None
        base = None if cur is None else _first_fit(cur, nbytes)
        if base is None:
            live = 0 if cur is None else sum(b - a for a, b in cur.live.values())
            cur = self._grow(seq, nbytes, live)
            if cur is None:
                return None
            base = 0
        assert cur is not None
        cur.live[seq] = (base, base + nbytes)
        return cur, base

    def _grow(self, seq: int, nbytes: int, live: int) -> _Arena | None:
        """A new current arena with room for ``nbytes`` beside the ``live`` bytes of
        the old one (a quarter more: what is in flight at once is about steady from
        one epoch to the next, so an arena stays near the largest exchanges in flight
        rather than doubling)."""
        size = max(MIN_ARENA, (live + nbytes) * 5 // 4)
        size = (size + 4095) // 4096 * 4096
        try:
            st = os.statvfs(self.root)
            if st.f_bavail * st.f_frsize < size + FREE_MARGIN:
                return None
            path = f"{self.prefix}-g{self.next_gen}"
            data = _map(path, size, create=True)
        except (OSError, RuntimeError):  # no room after all, or the map failed
            return None
        arena = _Arena(self.next_gen, path, data, seq)
        self.next_gen += 1
        self.arenas.append(arena)
        return arena


def _open_together(rank: int, make: Callable[[], object],
                   attach: Callable[[int, object], bool],
                   gather: Callable[[object], list[object]],
                   agree: Callable[[bool], bool]) -> bool:
    """The collective open of a shared-memory file on every rank: ``make()`` creates
    this rank's and returns what a peer needs to map it (raising OSError or
    RuntimeError where it cannot); every rank gathers those, and ``attach(q, info)``
    maps rank q's and says whether the token written there is the one gathered (the
    same directory on the same host). True on every rank where every rank made its
    file and mapped every peer's."""
    try:
        info: object = make()
    except (OSError, RuntimeError):  # no room, no such directory, a failed map
        info = None
    everyone = gather(info)
    ok = info is not None and all(i is not None for i in everyone)
    if ok:
        try:
            for q, got in enumerate(everyone):
                if q != rank:
                    ok = attach(q, got) and ok
        except (OSError, RuntimeError):
            ok = False
    return agree(ok)


def _running(pid: int) -> bool:
    """Whether process ``pid`` is visible here and has not exited (a zombie, exited
    and not yet reaped by its parent, counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _await(counters: Tensor, word: int, target: int, deadline: float, q: int,
           pid: int | None, name: str, what: str) -> None:
    """Until rank q's counter ``counters[word]`` (int64, in shared memory, written by
    q alone) reaches ``target``: yield the core a few times (the peer may need it),
    then sleep in growing steps up to 0.2 ms. Raises TimeoutError after ``deadline``
    (``time.monotonic``), RuntimeError as soon as a check every ``_LIVENESS_S`` finds
    that q's process ``pid`` has exited (None: not visible here, unchecked)."""
    tries, pause, check = 0, 1e-5, time.monotonic() + _LIVENESS_S
    while int(counters[word]) < target:
        tries += 1
        if tries < 32:
            os.sched_yield()
            continue
        time.sleep(pause)
        pause = min(pause * 2, 2e-4)
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{name}: timed out waiting until rank {q} {what}")
        if now > check:
            check = now + _LIVENESS_S
            if pid is not None and not _running(pid):
                raise RuntimeError(f"{name}: rank {q} (process {pid}) exited before it "
                                   f"{what.replace('has ', '', 1)}")


def _typed(data: Tensor, offset: int, like: Tensor) -> Tensor:
    """The bytes of ``data`` at ``offset`` seen as a contiguous tensor shaped ``like``."""
    n = like.numel() * like.element_size()
    return data[offset:offset + n].view(like.dtype).view(like.shape)


def _bytes_of(t: Tensor | None) -> Tensor:
    """A contiguous uint8 copy of ``t`` (empty for None)."""
    if t is None:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _first_fit(arena: _Arena, nbytes: int) -> int | None:
    """The lowest offset of ``arena`` with ``nbytes`` free after it, or None."""
    at = 0
    for start, stop in sorted(arena.live.values()):
        if start - at >= nbytes:
            return at
        at = max(at, stop)
    return at if arena.capacity - at >= nbytes else None


def _unlink(path: str) -> None:
    try:
        Path(path).unlink()
    except OSError:
        pass


# ---------------------------------------------------------------- windows
_WIN_HEAD = 64
"""Bytes before a window's data: its counters and the probe's token."""
_RELEASED, _WIN_TOKEN, _ARRIVED = 0, 1, 2


class ShmWindow:
    """One rank's window of shared memory that its peers write into, one use after
    another (MPI's one-sided ``put`` into a window, closed by a fence).

    Where ``ShmExchange`` copies a block twice (into the sender's arena, out of it
    into the receiver's buffer), a window takes it once: the sender writes its rows
    straight into the receiver's window (``slot``), as the output of a gather or of a
    kernel, and the receiver reads them there (``inbox``), as the input of its own
    kernel. Where each sender's block lies is the caller's to say, per use.

    Per use k (1, 2, ...; every rank of the group uses its window in the same order):
    - ``begin``: wait until every peer this rank writes to has released use k - 1
      (its ``released`` counter; between two uses of a training step the other
      collectives have nearly always ordered it already), then write the ``slot``s;
    - ``fence``: say that this rank's writes are done (its ``arrived`` counter) and
      wait until every peer has said so; then read the ``inbox``;
    - ``release``: the inbox is read; peers may write use k + 1.
    On x86-64 stores are seen in the order they were made and loads are not moved
    ahead of earlier loads: a reader that sees a peer's ``arrived`` sees its rows, and
    a writer that sees a peer's ``released`` writes after that peer's reads. The
    counters are written by their own rank alone.

    Waiting on a peer's counter has no backend call behind it, so it keeps its own
    bounds: the caller's timeout, and every ``_LIVENESS_S`` a check that the peer's
    process still runs (its pid, gathered at ``open``, where this rank can see it),
    so a dead peer is named at once rather than at the timeout.

    Made by ``open`` (collective; ``ShmExchange.window`` keeps one per group); the
    file is removed as soon as every peer has it mapped.
    """

    def __init__(self, rank: int, world_size: int, path: str, data: Tensor) -> None:
        self.rank, self.world_size, self.path, self.data = rank, world_size, path, data
        self.uses = 0
        self.fences = 0
        self.peer_data: list[Tensor | None] = [None] * world_size
        self.peer_pid: list[int | None] = [None] * world_size  # None: not visible here
        self.closed = False

    @property
    def capacity(self) -> int:
        return self.data.numel() - _WIN_HEAD

    @classmethod
    def open(cls, rank: int, world_size: int, capacity: int,
             gather: Callable[[object], list[object]], agree: Callable[[bool], bool],
             root: str = ROOT) -> ShmWindow | None:
        """A window of ``capacity`` bytes on every rank, each mapping every peer's;
        None on every rank where some rank cannot make or map one (no room, another
        host). Collective."""
        mine: ShmWindow | None = None
        token = secrets.randbits(62)
        size = _WIN_HEAD + int(capacity)

        def make() -> object:
            nonlocal mine
            st = os.statvfs(root)
            if st.f_bavail * st.f_frsize < size + FREE_MARGIN:
                raise OSError(f"{root} has no room for a {size}-byte window")
            path = os.path.join(root, f"fullgraph-{os.getpid()}-{secrets.token_hex(4)}-w")
            mine = cls(rank, world_size, path, _map(path, size, create=True))
            mine.data[:_WIN_HEAD].view(torch.int64)[_WIN_TOKEN] = token
            return (path, token, os.getpid())

        def attach(q: int, got: object) -> bool:
            assert mine is not None and isinstance(got, tuple)
            data = _map(got[0], size, create=False)
            mine.peer_data[q] = data
            mine.peer_pid[q] = got[2] if _running(got[2]) else None
            return int(data[:_WIN_HEAD].view(torch.int64)[_WIN_TOKEN]) == got[1]

        if not _open_together(rank, make, attach, gather, agree):
            if mine is not None:
                mine.close()
            return None
        assert mine is not None
        _unlink(mine.path)  # every peer has it mapped
        return mine

    def begin(self, peers: Sequence[int], timeout_s: float) -> None:
        """Start the next use, writing to ``peers``: wait (at most ``timeout_s``) until
        each has released the last one. Raises TimeoutError naming the peer, or
        RuntimeError where its process has exited."""
        self.uses += 1
        deadline = time.monotonic() + timeout_s
        for q in peers:
            self._wait(q, _RELEASED, self.uses - 1, deadline, f"has read use {self.uses - 1}")

    def fence(self, timeout_s: float) -> None:
        """Say that this rank's writes of this use are done, and wait (at most
        ``timeout_s``) until every peer's are. Raises as ``begin``."""
        self.fences += 1
        self.data[:_WIN_HEAD].view(torch.int64)[_ARRIVED] = self.fences
        deadline = time.monotonic() + timeout_s
        for q in range(self.world_size):
            if q != self.rank:
                self._wait(q, _ARRIVED, self.fences, deadline, f"has finished use {self.uses}")

    def _wait(self, q: int, word: int, target: int, deadline: float, what: str) -> None:
        peer = self.peer_data[q]
        assert peer is not None, "a window's own rank is not its peer"
        _await(peer[:_WIN_HEAD].view(torch.int64), word, target, deadline, q,
               self.peer_pid[q], "shared-memory window", what)

    def slot(self, q: int, offset: int, nbytes: int) -> Tensor:
        """Bytes ``offset`` to ``offset + nbytes`` of rank q's window (uint8)."""
        peer = self.peer_data[q]
        if peer is None or offset < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"shared-memory window: bytes {offset} to {offset + nbytes} of "
                             f"rank {q}'s window of {self.capacity}")
        return peer[_WIN_HEAD + offset:_WIN_HEAD + offset + nbytes]

    def inbox(self, nbytes: int) -> Tensor:
        """The first ``nbytes`` of this rank's own window (uint8)."""
        if nbytes > self.capacity:
            raise ValueError(f"shared-memory window: {nbytes} bytes of {self.capacity}")
        return self.data[_WIN_HEAD:_WIN_HEAD + nbytes]

    def release(self) -> None:
        """The inbox of this use is read: peers may write the next."""
        self.data[:_WIN_HEAD].view(torch.int64)[_RELEASED] = self.uses

    def close(self) -> None:
        """Unmap the peers' windows and remove this rank's file (safe to call twice)."""
        if not self.closed:
            self.closed = True
            _unlink(self.path)
            self.peer_data = [None] * self.world_size
