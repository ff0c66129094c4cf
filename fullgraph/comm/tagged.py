"""Tagged point-to-point messages that may complete late, and store agreements.

The exchanges of ``primitives`` are collectives: every rank meets every other at each
call. Partial reduce (NeutronCloud §5) must go on without a slow rank, so it needs
messages that are matched by tag rather than by call order, that can be left in
flight past a deadline and completed later, and a way for a changing subset of
ranks to agree on something without a collective. All of it is torch.distributed:

- ``post_send`` / ``post_recv``: ``isend`` / ``irecv`` with a tag, each returning a
  ``Tagged`` handle that can be polled (``done``), waited on until a deadline
  (``wait_until``) or waited on within the communicator's timeout (``wait``). A
  handle keeps its buffer alive until the message completes. Bytes are counted under
  the handle's phase when it completes, with the seconds spent blocked on it.
- ``Outbox``: sends whose completion nobody waits for now (kept until they finish).
- ``agree``: the first value a rank proposes for a key of the process group's
  store wins (``compare_set``); every rank reads the same value.

The tags need a backend that matches messages by tag (gloo; ``require_tagged``
refuses the others). A handle that does not complete within the timeout raises a
``CommError`` naming the peer, so a dead rank is never waited on forever.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from fullgraph.comm.primitives import CommError, _peer

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

POLL_S = 0.0005
"""Seconds between two polls of an unfinished message or store key."""
TAG_BASE = 1 << 20
"""Tags below this are left to other point-to-point users (``all_to_all_v(p2p)``)."""


def tagged_messages(comm: Comm) -> bool:
    """Whether ``comm``'s backend matches messages by tag (gloo; NCCL matches by order)."""
    return comm.world_size == 1 or dist.get_backend(comm.group) == "gloo"


def require_tagged(comm: Comm, what: str) -> None:
    """Raise if ``comm``'s backend cannot match messages by tag (NCCL matches by order)."""
    if not tagged_messages(comm):
        raise ValueError(f"{what} needs messages matched by tag, which the "
                         f"{dist.get_backend(comm.group)} backend does not do; run it on gloo")


class Tagged:
    """One tagged message in flight (``post_send`` / ``post_recv``).

    gloo's work objects report completion only once ``wait`` returned, so a
    background thread waits (releasing the GIL) and sets an event; ``done`` and
    ``wait_until`` read the event and never block on the backend.
    """

    def __init__(self, work: Any, buffer: Tensor, peer: int, tag: int, comm: Comm,
                 phase: str, sending: bool) -> None:
        self.work, self.buffer, self.peer, self.tag = work, buffer, peer, tag
        self.comm, self.phase, self.sending = comm, phase, sending
        self.blocked_s = 0.0
        self._counted = False
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._posted = time.perf_counter()
        self._event = threading.Event()
        if sending:  # counted as it leaves (a late completion may fall in a later epoch)
            comm.counter.add_sent(phase, buffer.numel() * buffer.element_size())
        threading.Thread(target=self._wait_in_background, daemon=True,
                         name=f"fullgraph-tag{tag}").start()

    def _wait_in_background(self) -> None:
        start = self._posted
        try:
            self.work.wait(timeout=self.comm.timeout)
        except BaseException as err:  # noqa: BLE001 - re-raised by the owner's wait
            self._error = err
        self._seconds = time.perf_counter() - start
        self._event.set()

    @property
    def seconds(self) -> float:
        """From posting to completion (valid once ``done``)."""
        return self._seconds

    def done(self) -> bool:
        """True once the message completed (counted then); never blocks."""
        if not self._counted and self._event.is_set():
            self._finish()
        return self._counted

    def wait_until(self, deadline: float) -> bool:
        """Wait until the message completes or ``time.perf_counter()`` passes
        ``deadline``; True if it completed. Raises ``CommError`` if it failed."""
        start = time.perf_counter()
        if not self._event.is_set():
            counter = self.comm.counter  # (the heartbeat says whom this rank waits for)
            counter.awaiting = _peer(self.comm, self.peer)
            try:
                self._event.wait(max(0.0, deadline - start))
            finally:
                counter.awaiting = None
        self.blocked_s += time.perf_counter() - start
        return self.done()

    def wait(self) -> Tensor:
        """Block until complete (within the communicator's timeout); the buffer."""
        self.wait_until(time.perf_counter() + self.comm.timeout.total_seconds() + 5.0)
        if not self._counted:
            self._error = self._error or TimeoutError("no completion")
            self._finish()
        return self.buffer

    def _finish(self) -> None:
        if self._error is not None:
            what = "isend" if self.sending else "irecv"
            raise CommError(self.comm.rank, self.comm.world_size, self.phase,
                            f"{what}(tag {self.tag}) with rank {self.peer}", self._error,
                            self._seconds, self.comm.timeout,
                            peer=_peer(self.comm, self.peer))
        recv = 0 if self.sending else self.buffer.numel() * self.buffer.element_size()
        self.comm.counter.add(self.phase, 0, recv, self.blocked_s)  # (sent: when posted)
        self._counted = True


def post_send(tensor: Tensor, peer: int, tag: int, comm: Comm, phase: str) -> Tagged:
    """Start sending ``tensor`` to group rank ``peer`` under ``tag``."""
    buffer = tensor.contiguous()
    with _posting(comm, phase, "isend", peer, tag):
        work = dist.isend(buffer, _peer(comm, peer), group=comm.group, tag=tag)
    return Tagged(work, buffer, peer, tag, comm, phase, sending=True)


def post_recv(shape: Sequence[int], dtype: torch.dtype, peer: int, tag: int, comm: Comm,
              phase: str) -> Tagged:
    """Start receiving a tensor of ``shape`` from group rank ``peer`` under ``tag``."""
    buffer = torch.empty(tuple(shape), dtype=dtype, device=comm.device)
    with _posting(comm, phase, "irecv", peer, tag):
        work = dist.irecv(buffer, _peer(comm, peer), group=comm.group, tag=tag)
    return Tagged(work, buffer, peer, tag, comm, phase, sending=False)


@contextlib.contextmanager
def _posting(comm: Comm, phase: str, what: str, peer: int, tag: int) -> Iterator[None]:
    """A backend failure while posting (the peer's connection is gone) as a CommError
    that names the peer."""
    try:
        yield
    except (RuntimeError, OSError) as err:
        raise CommError(comm.rank, comm.world_size, phase, f"{what}(tag {tag}) with rank "
                        f"{peer}", err, 0.0, comm.timeout) from err


class Outbox:
    """Sends nobody waits for now: kept alive until they complete."""

    def __init__(self) -> None:
        self.pending: list[Tagged] = []

    def add(self, message: Tagged) -> None:
        self.pending.append(message)
        self.reap()

    def reap(self) -> None:
        """Forget the sends that completed."""
        self.pending = [m for m in self.pending if not m.done()]

    def flush(self) -> None:
        """Wait for every send (each within the timeout)."""
        for message in self.pending:
            message.wait()
        self.pending = []


def store_of(comm: Comm) -> Any:
    """The key-value store of ``comm``'s process group (the one it rendezvoused on)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError) as err:  # torch internals moved
        raise RuntimeError(f"rank {comm.rank}: no process-group store to agree through "
                           f"({err})") from err


def agree(store: Any, key: str, propose: Callable[[], str | None], comm: Comm, phase: str,
          waiting_on: Callable[[], str]) -> str:
    """The value every rank reads for ``key``: the first proposal set wins.

    Polls (every ``POLL_S``, backing off to ``10 * POLL_S``) until the key holds a
    value; each poll first calls ``propose()``, which returns this rank's proposal when
    it has one (then ``compare_set`` stores it unless another rank's came first) or
    None. Raises ``CommError`` when nothing is agreed within the timeout (the message
    says what was awaited, ``waiting_on()``) or when the store fails (its host, rank
    0, is gone).
    """
    start = time.perf_counter()
    limit = comm.timeout.total_seconds()
    pause = POLL_S
    while True:
        try:
            proposal = propose()
            if proposal is not None:
                return _text(store.compare_set(key, "", proposal))
            if store.check([key]):
                return _text(store.get(key))
        except (RuntimeError, OSError) as err:
            if isinstance(err, CommError):
                raise
            raise CommError(comm.rank, comm.world_size, phase, f"agree({key}) through the "
                            f"store of rank 0", err, time.perf_counter() - start,
                            comm.timeout) from err
        if time.perf_counter() - start > limit:
            raise CommError(comm.rank, comm.world_size, phase, f"agree({key})",
                            TimeoutError(f"nothing agreed; waiting on {waiting_on()}"),
                            time.perf_counter() - start, comm.timeout)
        time.sleep(pause)
        pause = min(10 * POLL_S, 1.5 * pause)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_PROBES = [0]


def probe_links(comm: Comm, nbytes: int, phase: str = "link-probe") -> list[float]:
    """Seconds until ``nbytes`` from each peer arrived (0 for this rank), every rank
    sending to every other at once right after a barrier (collective).

    The seconds per peer tell the links apart where a collective exchange cannot:
    NeutronCloud's per-peer transfer cost T_c,i,j. Counted under ``phase``.
    """
    from fullgraph.comm.primitives import barrier

    if comm.world_size == 1:
        return [0.0]
    require_tagged(comm, "probe_links")
    _PROBES[0] += 1
    tag = TAG_BASE // 2 + _PROBES[0] % (TAG_BASE // 2)
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=comm.device)
    barrier(comm, phase)
    peers = [p for p in range(comm.world_size) if p != comm.rank]
    recvs = {p: post_recv((nbytes,), torch.uint8, p, tag, comm, phase) for p in peers}
    sends = [post_send(payload, p, tag, comm, phase) for p in peers]
    out = [0.0] * comm.world_size
    for p, message in recvs.items():
        message.wait()
        out[p] = message.seconds
    for message in sends:
        message.wait()
    return out
