"""Communication primitives: the only module of fullgraph that calls torch.distributed.

Every primitive takes an explicit ``Comm`` and a ``phase`` name, waits at most
``comm.timeout``, turns any backend failure (dead peer, timeout, mismatched call)
into one ``CommError`` naming this rank, the phase and the collective, and records
the call in ``comm.counter``. With ``world_size == 1`` every primitive is an
identity or a no-op, makes no torch.distributed call and records nothing.

Byte accounting, per rank and per call (R = world size, B = the tensor's bytes):

- ``all_to_all_v``: exactly the bytes sent to / received from other ranks; the
  rank's own block is a local copy and is not counted.
- ``all_reduce_``: the bandwidth-optimal ring volume, 2 (R - 1) B / R (floored)
  sent and the same received; the backend's actual algorithm may differ.
- ``broadcast_``: logical volume; ``src`` sends (R - 1) B, every other rank receives B.
- ``all_gather_rows`` / ``all_gather_object``: built on ``all_to_all_v``: a rank
  sends (R - 1) times its own block and receives every other rank's block.
- ``barrier``: no bytes, one call.

gloo in torch 2.13 supports ``all_to_all_single`` with uneven splits (its list form
``all_to_all`` needs equal sizes, so it is not used); ``Comm.p2p_all_to_all``
switches ``all_to_all_v`` to isend/irecv pairs for backends that lack it. Where the
group's ranks share one host, ``Comm.shm`` carries ``all_to_all_v`` of CPU tensors
through shared memory instead (``fullgraph.comm.shm``: no backend call, unless a
rank had no room for the exchange), and its window (``window``,
``window_begin``, ``window_fence``) lets ranks write rows straight into each other's
memory: small all-reduces of CPU tensors (``SHM_REDUCE_BYTES``), ``all_gather_object``
and ``barrier`` then make no backend call at all (their bytes are counted as
above, under the collective name ``window(shm)``).

CUDA tensors on a gloo group (several workers sharing one GPU, where NCCL refuses
two ranks on one device) are staged through host memory: each primitive copies its
buffer to the host, runs the collective there and copies the result back. gloo runs
only broadcast and all-reduce on CUDA tensors itself, and through host memory too.
The other way round, host tensors on an NCCL group (the counts, sizes and rates of
setup, evaluation and the runtime) are staged through ``comm.device``, since NCCL
takes device memory only.

Sub-groups (``fullgraph.comm.subgroup``) use the same primitives: ``comm.rank``,
``src`` and block indices are ranks in ``comm.group``; the p2p paths translate them
to the world ranks torch.distributed's isend/irecv/broadcast take (``_peer``).

This module imports nothing from fullgraph at run time.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import os
import pickle
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

_UNSUPPORTED_HINTS = ("not supported", "does not support", "not implemented", "unsupported")


class CommError(RuntimeError):
    """A collective failed or timed out on this rank.

    Attributes:
        rank: this worker's rank in the failing call's group.
        phase: the phase name the call was made under.
        collective: the primitive that failed, e.g. "all_reduce".
        cause: the backend's original exception.
        seconds: how long the call had waited when it failed.
        timed_out: it failed because it waited (about) the whole timeout, not because
            a peer's connection broke.
        peer: the global rank a point-to-point call waited for (None for collectives,
            which wait for every rank of the group).

    On a sub-group the message says which one and this worker's world rank:
    "rank 0 of 3 in group 'P' (global rank 1): ...".
    """

    def __init__(self, rank: int, world_size: int, phase: str, collective: str,
                 cause: BaseException, seconds: float, timeout: datetime.timedelta,
                 where: str = "", hint: str = "", peer: int | None = None) -> None:
        self.rank = rank
        self.peer = peer
        self.phase = phase
        self.collective = collective
        self.cause = cause
        self.seconds = seconds
        self.timed_out = seconds >= 0.9 * timeout.total_seconds()
        self._args = (rank, world_size, phase, collective, cause, seconds, timeout, where,
                      hint, peer)
        super().__init__(
            f"rank {rank} of {world_size}{where}: {collective} in phase {phase!r} failed after "
            f"{seconds:.1f}s (timeout {timeout.total_seconds():g}s): "
            f"{type(cause).__name__}: {cause}" + (f" ({hint})" if hint else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes
        return (type(self), self._args)


class ReduceOp(str, Enum):
    """Reductions ``all_reduce_`` accepts (the string values work too)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


def _dist_op(op: ReduceOp | str) -> Any:
    try:
        red = ReduceOp(op)
    except ValueError:
        raise ValueError(f"all_reduce_: op must be one of {[o.value for o in ReduceOp]}, "
                         f"got {op!r}") from None
    return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}[red]


def settle(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (a GPU runs them after the host moved
    on), so that a host clock read next covers them; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _guarded(comm: Comm, phase: str, collective: str, sent: int, recv: int) -> Iterator[None]:
    """Time one call, count its bytes, and re-raise backend failures as CommError. (On
    a GPU the kernels queued before it are not waited for first: that would stall the
    host at every pipelined exchange; their time may land in the call's.)"""
    start = time.perf_counter()
    comm.counter.enter(phase, collective)
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, TimeoutError) as err:
        raise CommError(comm.rank, comm.world_size, phase, collective, err,
                        time.perf_counter() - start, comm.timeout, _where(comm)) from err
    finally:
        comm.counter.leave()
    comm.counter.add(phase, sent, recv, time.perf_counter() - start)


def _where(comm: Comm) -> str:
    """The sub-group part of a CommError message ("" on the world Comm)."""
    if not getattr(comm, "name", ""):
        return ""
    return f" in group {comm.name!r} (global rank {comm.global_rank})"


def _wait(work: Any, comm: Comm) -> None:
    work.wait(timeout=comm.timeout)


def _peer(comm: Comm, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``comm.group`` (p2p calls take global ranks)."""
    if comm.group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(comm.group, group_rank)


def _staged(comm: Comm, tensor: Tensor) -> torch.device | None:
    """The device ``comm``'s backend needs ``tensor``'s copy on, None where it takes the
    tensor where it is: the host for a CUDA tensor on gloo, ``comm.device`` for a host
    tensor on NCCL (see the module docstring)."""
    backend = dist.get_backend(comm.group)
    if tensor.device.type != "cpu" and backend == "gloo":
        return torch.device("cpu")
    if tensor.device.type == "cpu" and backend == "nccl":
        return comm.device
    return None


def _on(tensor: Tensor, device: torch.device | None) -> Tensor:
    """``tensor`` on ``device`` (itself where None: not staged)."""
    return tensor if device is None else tensor.to(device)


def _require_contiguous(tensor: Tensor, name: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: the tensor is updated in place and must be contiguous; "
                         "call .contiguous() first")


# ---------------------------------------------------------------- process group lifecycle
def init_default_group(backend: str, init_method: str, rank: int, world_size: int,
                       timeout: datetime.timedelta) -> Any:
    """Create the default process group and return it (used by ``group.init_comm``)."""
    _import_before_process_group()
    if dist.is_initialized():
        raise RuntimeError(f"rank {rank}: the default process group is already initialised; "
                           "call destroy_comm on the old Comm first")
    start = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    except (RuntimeError, TimeoutError, ValueError) as err:
        seconds = time.perf_counter() - start
        text = str(err)
        stopped = ("a rank that stopped before it (a command line that differs between "
                   "hosts, an error at start-up) says why in its own output")
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            hint = f"MASTER_PORT is taken on rank 0's host ({where}): give a free port"
        elif "trying to connect to" in text or "Connection refused" in text:
            hint = (f"this rank could not connect to rank 0 at {where}: check that rank 0 "
                    f"runs there and is reachable from this host; {stopped}")
        elif "likely closed" in text or "Failed to recv" in text:
            hint = f"rank 0's side closed the connection: {stopped}"
        elif seconds >= 0.9 * timeout.total_seconds():
            hint = f"not every rank joined within the timeout: {stopped}"
        else:
            hint = ""
        raise CommError(rank, world_size, "comm-init", "init_process_group", err, seconds,
                        timeout, hint=hint) from err
    return dist.group.WORLD


def _import_before_process_group() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated at import.
    torch imports it lazily (``torch._dynamo``, loaded by the first optimizer step, pulls
    it in through fsdp), i.e. after ``init_process_group``: the defaults then hold the
    default group forever, ``destroy_process_group`` cannot free it, and its gloo threads
    outlive it into interpreter shutdown, where one that drops a finished work object
    aborts the process ("terminate called without an active exception", SIGABRT) after
    a successful run. Imported first, the defaults are None and the group is freed.
    """
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:
        pass


_HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def new_group(ranks: Sequence[int], comm: Comm) -> Any:
    """Create the process group of world ranks ``ranks``; group rank i is ``ranks[i]``.

    Every rank of the world ``comm`` must call it, in the same order, members or not
    (``torch.distributed.new_group`` requires it). The group has ``comm``'s backend and
    timeout. Returns the group on its members, None on the other ranks.
    """
    start = time.perf_counter()
    try:
        # sort_ranks keeps the order given; a torch without it (2.11) sorts the ranks,
        # and the order check below refuses an unsorted list
        keep_order: dict[str, Any] = {"sort_ranks": False} if _HAS_SORT_RANKS else {}
        group = dist.new_group(list(ranks), timeout=comm.timeout, **keep_order)
    except (RuntimeError, TimeoutError, ValueError) as err:
        raise CommError(comm.rank, comm.world_size, "comm-init", f"new_group({list(ranks)})",
                        err, time.perf_counter() - start, comm.timeout) from err
    if group is dist.GroupMember.NON_GROUP_MEMBER or group is None:
        return None
    actual = dist.get_process_group_ranks(group)
    if actual != list(ranks):  # group ranks must index ``ranks`` (p2p translates through it)
        raise RuntimeError(f"new_group: torch ordered the group as {actual}, asked for "
                           f"{list(ranks)}")
    return group


def destroy_group(group: Any) -> None:
    """Destroy ``group`` (the default group destroys them all); no-op if already gone."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def probe_all_to_all(comm: Comm) -> bool:
    """True when the backend runs ``all_to_all_single`` (one int64 per peer, counted
    under phase "comm-init"); False when it reports the call unsupported."""
    if comm.world_size == 1:
        return True
    send = torch.zeros(comm.world_size, dtype=torch.int64, device=comm.device)
    out = torch.empty_like(send)
    nbytes = 8 * (comm.world_size - 1)
    try:
        with _guarded(comm, "comm-init", "all_to_all_single", nbytes, nbytes):
            _wait(dist.all_to_all_single(out, send, group=comm.group, async_op=True), comm)
    except CommError as err:
        if isinstance(err.cause, NotImplementedError) or any(
                h in str(err.cause).lower() for h in _UNSUPPORTED_HINTS):
            return False
        raise
    return True


# ---------------------------------------------------------------- collectives
def all_reduce_(tensor: Tensor, comm: Comm, phase: str, op: ReduceOp | str = "sum") -> Tensor:
    """Reduce ``tensor`` over all ranks, in place; returns it.

    Args:
        tensor: contiguous tensor of the same shape and dtype on every rank.
        comm: the communication handle.
        phase: name the bytes are counted under.
        op: "sum", "max", "min" or "product" (default: "sum").
    """
    dist_op = _dist_op(op)
    if comm.world_size == 1:
        return tensor
    _require_contiguous(tensor, "all_reduce_")
    if _window_reduce(tensor, comm, phase, ReduceOp(op)):
        return tensor
    return _backend_all_reduce(tensor, comm, phase, dist_op)


def _backend_all_reduce(tensor: Tensor, comm: Comm, phase: str, dist_op: Any) -> Tensor:
    nbytes = 2 * (comm.world_size - 1) * tensor.nbytes // comm.world_size
    buf = _on(tensor, _staged(comm, tensor))
    with _guarded(comm, phase, "all_reduce", nbytes, nbytes):
        _wait(dist.all_reduce(buf, op=dist_op, group=comm.group, async_op=True), comm)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


SHM_REDUCE_BYTES = 1 << 20
"""CPU tensors are reduced through the group's shared-memory window, where it has one,
when each rank writes at most this many bytes into its peers' windows (its tensor
once per peer): latency, not bandwidth, is what such a reduction costs, and a window
fence takes microseconds where a gloo round trip takes a fraction of a millisecond.
Larger ones keep the backend's bandwidth-optimal algorithm."""


def _window_reduce(tensor: Tensor, comm: Comm, phase: str, op: ReduceOp) -> bool:
    """``all_reduce_`` through the window: each rank writes its tensor into every
    peer's window, at its place, and reduces the blocks in rank order, so every rank
    computes the same values in the same order. False (nothing done, on every rank)
    where the group has no window or the tensor is not a small one in host memory."""
    if (tensor.dtype == torch.bool or not tensor.numel()
            or tensor.nbytes * (comm.world_size - 1) > SHM_REDUCE_BYTES):
        return False
    world, me, flat = comm.world_size, comm.rank, tensor.view(-1)
    ring = 2 * (world - 1) * tensor.nbytes // world
    put = _window_put_all(flat, [flat.numel()] * world, comm, phase, ring, ring)
    if put is None:
        return False
    win, inbox = put
    blocks = inbox.view(world, -1)
    blocks[me].copy_(flat)  # (its own place in its own window is free)
    acc = blocks[0].clone()
    for r in range(1, world):
        if op is ReduceOp.SUM:
            acc += blocks[r]
        elif op is ReduceOp.PRODUCT:
            acc *= blocks[r]
        elif op is ReduceOp.MAX:
            torch.maximum(acc, blocks[r], out=acc)
        else:
            torch.minimum(acc, blocks[r], out=acc)
    win.release()
    flat.copy_(acc)
    return True


def broadcast_(tensor: Tensor, src: int, comm: Comm, phase: str) -> Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; returns it."""
    if not 0 <= src < comm.world_size:
        raise ValueError(f"broadcast_: src {src} is not in [0, {comm.world_size})")
    if comm.world_size == 1:
        return tensor
    _require_contiguous(tensor, "broadcast_")
    sent = (comm.world_size - 1) * tensor.nbytes if comm.rank == src else 0
    recv = 0 if comm.rank == src else tensor.nbytes
    buf = _on(tensor, _staged(comm, tensor))
    with _guarded(comm, phase, "broadcast", sent, recv):
        work = dist.broadcast(buf, src=_peer(comm, src), group=comm.group, async_op=True)
        _wait(work, comm)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def barrier(comm: Comm, phase: str) -> None:
    """Block until every rank has reached this barrier (or the timeout passes); a fence
    of the group's shared-memory window where it has one."""
    if comm.world_size == 1:
        return
    win = window(comm, 0)
    if win is not None:
        window_begin(win, [], comm, phase)
        window_fence(win, comm, phase, 0, 0)
        win.release()
        return
    with _guarded(comm, phase, "barrier", 0, 0):
        _wait(dist.barrier(group=comm.group, async_op=True), comm)


def all_to_all_v(send: Sequence[Tensor], recv_rows: Sequence[int], comm: Comm,
                 phase: str) -> list[Tensor]:
    """Send ``send[p]`` to rank p and receive ``recv_rows[p]`` rows from each rank p.

    Every block has the trailing shape, dtype and device of ``send[comm.rank]``;
    blocks may have 0 rows and uneven sizes. ``send[comm.rank]`` is returned as
    is, without communication or counting. ``recv_rows[p]`` on this rank must
    equal ``send[this rank].shape[0]`` on rank p (a mismatch is a CommError or a
    timeout on some rank).

    Args:
        send: ``world_size`` tensors of shape (rows_p, *F).
        recv_rows: ``world_size`` row counts to receive.
        comm: the communication handle.
        phase: name the bytes are counted under.

    Returns:
        ``world_size`` tensors; entry p has shape (recv_rows[p], *F).
    """
    return all_to_all_v_start(send, recv_rows, comm, phase).wait()


def all_to_all_sized(send: Sequence[Tensor], comm: Comm, phase: str) -> list[Tensor]:
    """``all_to_all_v`` where the receivers do not know the sizes: one all-to-all of
    the row counts, then the rows (``send[p]`` to rank p; the blocks received, in rank
    order)."""
    counts = all_to_all_v([torch.tensor([t.shape[0]]) for t in send], [1] * comm.world_size,
                          comm, phase)
    return all_to_all_v(send, [int(c) for c in counts], comm, phase)


class PendingExchange:
    """An all-to-all in flight; ``wait()`` returns what ``all_to_all_v`` would.

    The bytes are counted, and the seconds spent blocked in ``wait`` timed, when it
    completes, so time hidden behind computation is not counted as communication.
    """

    def __init__(self, comm: Comm, phase: str, name: str, sent: int, recv: int,
                 finish: Any) -> None:
        self.comm, self.phase, self.name = comm, phase, name
        self.sent, self.recv, self._finish = sent, recv, finish
        self._result: list[Tensor] | None = None

    def wait(self) -> list[Tensor]:
        if self._result is None:
            if self.comm.world_size == 1:  # nothing crossed: nothing to count
                self._result = self._finish()
            else:
                with _guarded(self.comm, self.phase, self.name, self.sent, self.recv):
                    self._result = self._finish()
        return self._result


def all_to_all_v_start(send: Sequence[Tensor], recv_rows: Sequence[int], comm: Comm,
                       phase: str, into: Sequence[Tensor] | None = None) -> PendingExchange:
    """Start ``all_to_all_v`` without waiting for it (overlap it with computation).

    ``into``: one tensor per rank, of shape (recv_rows[p], *F), of any strides (views
    of one output, typically): the block from rank p is written into ``into[p]``
    (``send[comm.rank]`` into this rank's, unless it is that tensor) and ``wait``
    returns ``into``. Through shared memory the blocks go straight from the peers'
    arenas to their places, and strided ``send`` blocks straight into this rank's
    arena: no intermediate copy on either side.
    """
    trailing = _check_all_to_all(send, recv_rows, comm)
    mine = send[comm.rank]
    if into is not None:
        _check_into(into, recv_rows, trailing, mine, comm)
        return exchange_blocks_start(send, into, comm, phase)
    if comm.world_size == 1:
        return PendingExchange(comm, phase, "all_to_all_v", 0, 0, lambda: [mine])
    row_numel = math.prod(trailing)
    shm, flat = _sends(send, comm)
    recv_numel = [0 if p == comm.rank else int(n) * row_numel for p, n in enumerate(recv_rows)]
    itemsize = mine.element_size()
    sent, recv = sum(t.numel() for t in flat) * itemsize, sum(recv_numel) * itemsize
    name, finish = _launch(flat, recv_numel, comm, phase, shm, None)

    def done() -> list[Tensor]:
        return [mine if p == comm.rank else r.view(int(n), *trailing)
                for p, (r, n) in enumerate(zip(finish(), recv_rows))]

    return PendingExchange(comm, phase, name, sent, recv, done)


def exchange_blocks_start(send: Sequence[Tensor], into: Sequence[Tensor], comm: Comm,
                          phase: str) -> PendingExchange:
    """Send ``send[p]`` to rank p and write the block from rank q into ``into[q]``.

    Blocks of any shapes and strides and one dtype and device: ``into[q]`` on this
    rank has as many elements as ``send[this rank]`` on rank q, taken in row-major
    order; ``send[comm.rank]`` is copied into ``into[comm.rank]`` (unless they are one
    tensor). ``wait`` returns ``into``. Through shared memory a block goes from its
    source to its place with one copy on each side; on the backend it is made
    contiguous to send and received into a buffer first. Bytes as ``all_to_all_v``.
    """
    if len(send) != comm.world_size or len(into) != comm.world_size:
        raise ValueError(f"exchange_blocks: need world_size={comm.world_size} blocks to send "
                         f"and to fill, got {len(send)} and {len(into)}")
    mine = send[comm.rank]
    for what, blocks in (("send", send), ("into", into)):
        for p, t in enumerate(blocks):
            if t.dtype != mine.dtype or t.device != mine.device:
                raise ValueError(f"exchange_blocks: {what}[{p}] is {t.dtype} on {t.device}; "
                                 f"expected {mine.dtype} on {mine.device} like "
                                 f"send[{comm.rank}]")
    if comm.world_size == 1:
        return PendingExchange(comm, phase, "all_to_all_v", 0, 0,
                               lambda: _place_own(into, mine, 0))
    shm, flat = _sends(send, comm)
    recv_numel = [0 if q == comm.rank else t.numel() for q, t in enumerate(into)]
    itemsize = mine.element_size()
    sent, recv = sum(t.numel() for t in flat) * itemsize, sum(recv_numel) * itemsize
    name, finish = _launch(flat, recv_numel, comm, phase, shm, into)

    def done() -> list[Tensor]:
        for q, r in enumerate(finish()):
            if q != comm.rank and r is not None and r.numel():  # (shm: already there)
                into[q].copy_(r.view(into[q].shape))
        return _place_own(into, mine, comm.rank)

    return PendingExchange(comm, phase, name, sent, recv, done)


def _sends(send: Sequence[Tensor], comm: Comm) -> tuple[bool, list[Tensor]]:
    """Whether the exchange goes through shared memory, and the blocks to send: as
    they are for shared memory (copied straight into the arena), else flattened
    contiguous; this rank's own block empty (it is not sent)."""
    mine = send[comm.rank]
    shm = comm.shm is not None and mine.device.type == "cpu"
    empty = torch.empty(0, dtype=mine.dtype, device=mine.device)
    return shm, [empty if p == comm.rank else (t if shm else t.contiguous().reshape(-1))
                 for p, t in enumerate(send)]


def _launch(flat: list[Tensor], recv_numel: list[int], comm: Comm, phase: str, shm: bool,
            into: Sequence[Tensor] | None) -> tuple[str, Any]:
    """Start the exchange on its path: shared memory, the backend's all_to_all_single,
    or isend/irecv pairs (which have no asynchronous form: all of it runs in wait)."""
    if comm.p2p_all_to_all and not shm:
        return "all_to_all_v(p2p)", lambda: _all_to_all_p2p(flat, recv_numel, comm)
    name = "all_to_all_v(shm)" if shm else "all_to_all_v"
    start = time.perf_counter()
    try:
        return name, (_start_shm(flat, recv_numel, comm, into) if shm else
                      _start_collective(flat, recv_numel, comm))
    except (RuntimeError, TimeoutError) as err:  # counted once, when waited for
        raise CommError(comm.rank, comm.world_size, phase, f"{name}(start)", err,
                        time.perf_counter() - start, comm.timeout, _where(comm)) from err


def _check_into(into: Sequence[Tensor], recv_rows: Sequence[int], trailing: tuple[int, ...],
                mine: Tensor, comm: Comm) -> None:
    if len(into) != comm.world_size:
        raise ValueError(f"all_to_all_v: into needs world_size={comm.world_size} tensors, "
                         f"got {len(into)}")
    for p, (t, n) in enumerate(zip(into, recv_rows)):
        if tuple(t.shape) != (int(n), *trailing) or t.dtype != mine.dtype \
                or t.device != mine.device:
            raise ValueError(f"all_to_all_v: into[{p}] is {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}; expected ({int(n)}, {trailing}) {mine.dtype} on "
                             f"{mine.device}")


def _place_own(into: Sequence[Tensor], mine: Tensor, rank: int) -> list[Tensor]:
    if into[rank] is not mine and mine.numel():
        if into[rank].numel() != mine.numel():
            raise ValueError(f"exchange_blocks: into[{rank}] holds {into[rank].numel()} "
                             f"elements, send[{rank}] has {mine.numel()}")
        into[rank].copy_(mine.reshape(into[rank].shape))
    return list(into)


def _start_collective(flat: list[Tensor], recv_numel: list[int], comm: Comm) -> Any:
    """Issue the byte-view all_to_all_single; return a function that waits and splits."""
    dtype, device = flat[0].dtype, flat[0].device
    itemsize = flat[0].element_size()
    as_bytes = [t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                    device=device) for t in flat]
    inp = torch.cat(as_bytes)
    inp = _on(inp, _staged(comm, inp))
    staged = inp.device != device
    out = torch.empty(sum(recv_numel) * itemsize, dtype=torch.uint8, device=inp.device)
    work = dist.all_to_all_single(out, inp, output_split_sizes=[n * itemsize for n in recv_numel],
                                  input_split_sizes=[t.numel() for t in as_bytes],
                                  group=comm.group, async_op=True)

    def finish() -> list[Tensor]:
        _wait(work, comm)
        got = out.to(device) if staged else out
        return [c.view(dtype) for c in torch.split(got, [n * itemsize for n in recv_numel])]

    return finish


def _start_shm(flat: list[Tensor], recv_numel: list[int], comm: Comm,
               into: Sequence[Tensor] | None) -> Any:
    """The exchange through the group's shared memory (``fullgraph.comm.shm``): no
    backend call unless some rank had no room for it. Received blocks with a place in
    ``into`` are written there and come back as None."""
    dtype, itemsize = flat[0].dtype, flat[0].element_size()
    recv_bytes = [n * itemsize for n in recv_numel]

    def fallback(blocks: list[Tensor]) -> list[Tensor]:
        if comm.p2p_all_to_all:
            return _all_to_all_p2p(blocks, recv_bytes, comm)
        return _start_collective(blocks, recv_bytes, comm)()

    finish = comm.shm.start(flat, recv_bytes, comm.timeout.total_seconds(), fallback, into)
    return lambda: [None if b is None else b.view(dtype) for b in finish()]


def window(comm: Comm, capacity: int) -> Any:
    """``comm``'s shared-memory window (``fullgraph.comm.shm.ShmWindow``) with room for
    ``capacity`` bytes on every rank, or None where the group has no shared memory or
    no window could be opened. Every rank asks for the same capacity at the same
    point; collective where a window is (re)opened (counted under "comm-init")."""
    if comm.shm is None or comm.world_size == 1:
        return None

    def agree(ok: bool) -> bool:  # (the backend's: no window is there to reduce through)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        return bool(_backend_all_reduce(flag, comm, "comm-init", dist.ReduceOp.MIN)[0])

    backend = dataclasses.replace(comm, shm=None)  # (no arena for the handful of bytes)
    return comm.shm.window(capacity, lambda o: all_gather_object(o, backend, "comm-init"), agree)


def window_begin(win: Any, peers: Sequence[int], comm: Comm, phase: str) -> None:
    """Start a use of ``win`` that writes to ``peers``: wait until they have read the
    last one (at most ``comm.timeout``; a CommError naming the peer after that, or as
    soon as its process has exited)."""
    start = time.perf_counter()
    try:
        win.begin(peers, comm.timeout.total_seconds())
    except (TimeoutError, RuntimeError) as err:
        raise CommError(comm.rank, comm.world_size, phase, "window(shm)", err,
                        time.perf_counter() - start, comm.timeout, _where(comm)) from err


def window_fence(win: Any, comm: Comm, phase: str, sent: int, recv: int) -> None:
    """Say that this rank's writes into its peers' windows are done and wait until
    every peer's are, through the window's counters (no backend call); counts
    ``sent`` and ``recv`` bytes under ``phase``. Bounded as ``window_begin``."""
    with _guarded(comm, phase, "window(shm)", sent, recv):
        win.fence(comm.timeout.total_seconds())


def _check_all_to_all(send: Sequence[Tensor], recv_rows: Sequence[int],
                      comm: Comm) -> tuple[int, ...]:
    if len(send) != comm.world_size or len(recv_rows) != comm.world_size:
        raise ValueError(f"all_to_all_v: need world_size={comm.world_size} send blocks and "
                         f"row counts, got {len(send)} and {len(recv_rows)}")
    mine = send[comm.rank]
    if mine.dim() == 0:
        raise ValueError("all_to_all_v: blocks need a row dimension, got a 0-dim tensor")
    trailing = tuple(mine.shape[1:])
    for p, t in enumerate(send):
        if tuple(t.shape[1:]) != trailing or t.dtype != mine.dtype or t.device != mine.device:
            raise ValueError(f"all_to_all_v: send[{p}] is {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}; expected (rows, {trailing}) {mine.dtype} on "
                             f"{mine.device} like send[{comm.rank}]")
    if any(int(n) < 0 for n in recv_rows):
        raise ValueError(f"all_to_all_v: recv_rows must be >= 0, got {list(recv_rows)}")
    return trailing


def _all_to_all_collective(flat: list[Tensor], recv_numel: list[int],
                           comm: Comm) -> list[Tensor]:
    """One all_to_all_single on byte views (so any dtype, bool included, goes through)."""
    return _start_collective(flat, recv_numel, comm)()


def _all_to_all_p2p(flat: list[Tensor], recv_numel: list[int], comm: Comm) -> list[Tensor]:
    """The same exchange as isend/irecv pairs; empty blocks send no message."""
    dtype, device = flat[0].dtype, flat[0].device
    where = _staged(comm, flat[0])
    staged = where is not None
    flat = [_on(t, where) for t in flat]
    out = [torch.empty(n, dtype=dtype, device=flat[0].device) for n in recv_numel]
    ops = []
    for p in range(comm.world_size):
        if p == comm.rank:
            continue
        if recv_numel[p]:
            ops.append(dist.P2POp(dist.irecv, out[p], _peer(comm, p), comm.group))
        if flat[p].numel():
            ops.append(dist.P2POp(dist.isend, flat[p], _peer(comm, p), comm.group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        _wait(work, comm)
    return [t.to(device) for t in out] if staged else out


def all_gather_rows(tensor: Tensor, rows_per_rank: Sequence[int], comm: Comm,
                    phase: str) -> list[Tensor]:
    """Every rank's ``tensor`` (rows_per_rank[p] rows from rank p), in rank order.

    Built on ``all_to_all_v``; entry ``comm.rank`` is ``tensor`` itself.
    """
    if len(rows_per_rank) != comm.world_size or tensor.dim() == 0 \
            or tensor.shape[0] != rows_per_rank[comm.rank]:
        raise ValueError(f"all_gather_rows: rank {comm.rank} holds {tuple(tensor.shape)} but "
                         f"rows_per_rank is {list(rows_per_rank)}")
    return all_to_all_v([tensor] * comm.world_size, rows_per_rank, comm, phase)


def all_gather_object(obj: Any, comm: Comm, phase: str) -> list[Any]:
    """Every rank's picklable ``obj`` (small metadata), in rank order.

    Two counted calls: the pickled sizes, then the pickled bytes. Only for objects
    from fullgraph's own ranks: the bytes are unpickled.
    """
    if comm.world_size == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(comm.device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=comm.device)
    world = comm.world_size
    sizes = _window_gather(size, [1] * world, comm, phase)
    if sizes is None:
        sizes = all_gather_rows(size, [1] * world, comm, phase)
    rows = [int(s.item()) for s in sizes]
    small = max(rows) * (world - 1) <= SHM_REDUCE_BYTES
    chunks = _window_gather(data, rows, comm, phase) if small else None
    if chunks is None:
        chunks = all_gather_rows(data, rows, comm, phase)
    return [pickle.loads(c.cpu().numpy().tobytes()) for c in chunks]


def _window_gather(tensor: Tensor, rows: list[int], comm: Comm, phase: str) -> list[Tensor] | None:
    """``all_gather_rows`` of a 1-D host tensor through the group's window; None
    (nothing done, on every rank) where the group has no window. Bytes as
    ``all_gather_rows``."""
    mine = tensor.numel() * tensor.element_size()
    put = _window_put_all(tensor, rows, comm, phase, (comm.world_size - 1) * mine,
                          (sum(rows) - rows[comm.rank]) * tensor.element_size())
    if put is None:
        return None
    win, inbox = put
    starts = [sum(rows[:r]) for r in range(comm.world_size)]
    got = [tensor if r == comm.rank else inbox[starts[r]:starts[r] + rows[r]].clone()
           for r in range(comm.world_size)]
    win.release()
    return got


def _window_put_all(tensor: Tensor, rows: list[int], comm: Comm, phase: str, sent: int,
                    recv: int) -> tuple[Any, Tensor] | None:
    """Write the 1-D host ``tensor`` (rank r's has ``rows[r]`` elements) into every
    peer's window, at this rank's place (the ranks' blocks in rank order), and fence:
    (the window, this rank's inbox as ``sum(rows)`` elements), to be read and then
    released. None (nothing done, on every rank) where the group has no window."""
    if comm.shm is None or tensor.device.type != "cpu":
        return None
    item, me = tensor.element_size(), comm.rank
    win = window(comm, sum(rows) * item)
    if win is None:
        return None
    peers = [q for q in range(comm.world_size) if q != me]
    window_begin(win, peers, comm, phase)
    for q in peers:
        win.slot(q, sum(rows[:me]) * item, rows[me] * item).view(tensor.dtype).copy_(tensor)
    window_fence(win, comm, phase, sent, recv)
    return win, win.inbox(sum(rows) * item).view(tensor.dtype)
