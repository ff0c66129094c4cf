"""The communication handle: who this worker is, its process group, timeout and byte counter.

Every communicating function in fullgraph takes a ``Comm`` argument; there is no
module-level group, rank or counter. A ``Comm`` of world size 1
has ``group=None`` and never touches ``torch.distributed``: every primitive is then an
identity or a no-op, so single-process runs need no process group at all.

``Comm.split`` / ``Comm.subgroup`` make child handles for disjoint sub-groups of
the world (``subgroup.py`` documents them); ``global_ranks`` and ``name`` say which.

The process-group lifecycle (``init_comm`` / ``destroy_comm``) lives here; the actual
``torch.distributed`` calls are made in ``primitives.py`` (collectives, groups) and
``tagged.py`` (tagged point-to-point messages and the process group's store, through
torch's private ``_get_default_store``), the two modules that call it.
This module must not import ``parallel``, ``models`` or anything above ``comm``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fullgraph.comm import primitives as prim
from fullgraph.comm import shm as shm_transport
from fullgraph.errors import ConfigError
from fullgraph.fields import TIMEOUT_MAX_S

DEFAULT_TIMEOUT_S = 300.0
"""Default limit in seconds on every blocking collective (and on process-group setup)."""


@dataclass
class PhaseCount:
    """Traffic of one phase on one rank.

    Attributes:
        sent: bytes this rank sent to other ranks.
        recv: bytes this rank received from other ranks.
        calls: number of primitive calls made in the phase.
        seconds: wall-clock seconds spent inside those calls.
    """

    sent: int = 0
    recv: int = 0
    calls: int = 0
    seconds: float = 0.0


class ByteCounter:
    """Bytes, calls and seconds per phase name, as seen by this rank.

    ``sent`` and ``recv`` count only bytes that cross to another rank: a rank's
    copy to itself (e.g. ``send[rank]`` of an all-to-all) is never counted. How each
    collective is counted is documented in ``primitives.py``.

    Once ``take_calls`` has been called, it also keeps the (phase, seconds) of each call
    made since the last ``take_calls`` (the profiler compares them across ranks to split
    waiting from transfer; before that nothing is kept), and progress:
    ``entered`` blocking calls so far and the one this rank is ``inside`` (or None), which
    a launcher's heartbeat reports so that a rank that never reached a call is found.
    """

    def __init__(self) -> None:
        self._phases: dict[str, PhaseCount] = {}
        self._calls: list[tuple[str, float]] | None = None  # None: not recording
        self.entered = 0
        self.inside: str | None = None
        self.awaiting: int | None = None  # the global rank a point-to-point wait waits for

    def enter(self, phase: str, collective: str) -> None:
        """Note that this rank is now blocked in ``collective`` of ``phase``."""
        self.entered += 1
        self.inside = f"{collective} in phase {phase!r}"

    def leave(self) -> None:
        """Note that the call entered last has returned (or failed)."""
        self.inside = None

    def add(self, phase: str, sent: int, recv: int, seconds: float) -> None:
        """Record one call of ``phase`` that sent ``sent`` and received ``recv`` bytes."""
        count = self._phases.setdefault(phase, PhaseCount())
        count.sent += int(sent)
        count.recv += int(recv)
        count.calls += 1
        count.seconds += float(seconds)
        if self._calls is not None:
            self._calls.append((phase, float(seconds)))

    def add_sent(self, phase: str, sent: int) -> None:
        """Record bytes handed over for sending in ``phase`` by a call not yet complete
        (its completion is then recorded with ``add`` and no bytes), so that they count
        when they leave, not when the send is known to be done."""
        self._phases.setdefault(phase, PhaseCount()).sent += int(sent)

    def take_calls(self) -> list[tuple[str, float]]:
        """The (phase, seconds) of every call since the previous ``take_calls``, in order
        (none the first time: this call starts the recording)."""
        calls, self._calls = self._calls or [], []
        return calls

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """A copy: phase -> {"sent", "recv", "calls", "seconds"}."""
        return {phase: {"sent": c.sent, "recv": c.recv, "calls": c.calls, "seconds": c.seconds}
                for phase, c in self._phases.items()}

    def total(self) -> dict[str, Any]:
        """The sum over all phases, with the same keys as one phase of ``snapshot``."""
        return sum_phases(self.snapshot())

    def reset(self) -> None:
        """Forget every phase and call."""
        self._phases.clear()
        self._calls = None

    def __repr__(self) -> str:
        return f"ByteCounter({self.snapshot()!r})"

    def discard_prefix(self, prefix: str) -> None:
        """Forget the phases whose names start with ``prefix`` (one sub-group's)."""
        for phase in [p for p in self._phases if p.startswith(prefix)]:
            del self._phases[phase]


def sum_phases(snapshot: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The sum of a ``ByteCounter.snapshot``'s phases: {"sent", "recv", "calls", "seconds"}."""
    out: dict[str, Any] = {"sent": 0, "recv": 0, "calls": 0, "seconds": 0.0}
    for counts in snapshot.values():
        for key in out:
            out[key] += counts[key]
    return out


@dataclass
class Comm:
    """Explicit communication handle passed to every communicating function.

    Attributes:
        rank: this worker's rank in ``group``.
        world_size: number of workers in ``group``.
        group: the ``torch.distributed`` ProcessGroup, or None when ``world_size == 1``.
        timeout: limit on every blocking call made through ``primitives``.
        counter: bytes / calls / seconds per phase on this rank (a sub-group's is a
            ``subgroup.GroupCounter`` that records into the world's counter).
        device: where collective buffers live (cpu for gloo, cuda for nccl).
        p2p_all_to_all: run all-to-all as isend/irecv pairs instead of the
            backend's all_to_all_single (default: False; ``init_comm`` sets it when
            the backend lacks all-to-all).
        global_ranks: the world rank of each rank of ``group``, in group-rank order
            (default: ``0 .. world_size - 1``, the world itself).
        name: "" for the world; a sub-group's name (see ``split``), which prefixes
            its phases in the world's counter and appears in its CommErrors.
        shm: the group's shared-memory all-to-all (``fullgraph.comm.shm``) where
            every rank is on one host, else None (default: None; ``init_comm`` opens
            it).
    """

    rank: int
    world_size: int
    group: Any = None
    timeout: datetime.timedelta = field(
        default_factory=lambda: datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    counter: ByteCounter = field(default_factory=ByteCounter)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    p2p_all_to_all: bool = False
    global_ranks: tuple[int, ...] = ()
    name: str = ""
    shm: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Comm: rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"Comm: world_size {self.world_size} needs a process group, got None")
        self.device = torch.device(self.device)
        self.global_ranks = tuple(int(g) for g in self.global_ranks) or tuple(
            range(self.world_size))
        if len(self.global_ranks) != self.world_size \
                or len(set(self.global_ranks)) != self.world_size:
            raise ValueError(f"Comm: global_ranks {list(self.global_ranks)} must be "
                             f"world_size={self.world_size} distinct ranks")

    @property
    def global_rank(self) -> int:
        """This worker's rank in the world (equals ``rank`` on the world Comm)."""
        return self.global_ranks[self.rank]

    def split(self, groups: Sequence[Sequence[int]],
              names: Sequence[str] | None = None) -> Comm | None:
        """This worker's Comm among disjoint sub-groups of world ranks, or None.

        Every rank of this (world) Comm must call it with the same arguments;
        see ``fullgraph.comm.subgroup`` for the semantics.
        """
        from fullgraph.comm.subgroup import split_comm  # subgroup imports this module
        return split_comm(self, groups, names)

    def subgroup(self, ranks: Sequence[int], name: str | None = None) -> Comm | None:
        """``split([ranks])``: the Comm of one sub-group, None on ranks outside it."""
        return self.split([ranks], None if name is None else [name])


def single_comm(device: str | torch.device = "cpu") -> Comm:
    """A world-size-1 handle; no ``torch.distributed`` call is ever made through it."""
    return Comm(rank=0, world_size=1, group=None, device=torch.device(device))


def init_comm(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              init_method: str | None = None, rank: int | None = None,
              world_size: int | None = None, device: str | torch.device | None = None,
              p2p_all_to_all: bool | None = None, shm: bool | None = None) -> Comm:
    """Initialise the default process group and return this worker's ``Comm``.

    Arguments left as None are read from the torchrun environment (RANK, WORLD_SIZE,
    LOCAL_RANK; MASTER_ADDR and MASTER_PORT for the default ``env://`` method). With
    neither arguments nor environment, or a world size of 1, no process group is
    created and the result equals ``single_comm(device)``.

    Args:
        backend: "gloo" or "nccl" (default: nccl when ``device`` is cuda and every
            local worker has a GPU of its own, else gloo).
        timeout_s: limit on setup and on every blocking call (default: 300).
        init_method: torch.distributed URL, e.g. ``file:///tmp/x/store`` (default: env://).
        rank: this worker's rank (default: $RANK).
        world_size: number of workers (default: $WORLD_SIZE, else 1).
        device: where collective buffers live (default: cuda:$LOCAL_RANK for nccl, else
            cpu); ``cuda`` without an index means the local rank's GPU.
        p2p_all_to_all: force (True) or forbid (False) the isend/irecv all-to-all
            (default: None, probe the backend once and fall back only if it lacks all-to-all).
        shm: with gloo, exchange all-to-all blocks of CPU tensors through shared memory
            where every rank can reach the others' (one host): True to try, False never
            (default: None, try unless FULLGRAPH_SHM=0; ``fullgraph.comm.shm``).

    Raises:
        ValueError: inconsistent arguments or a missing environment variable.
        CommError: the backend failed while setting up.
    """
    if not 0 < timeout_s <= TIMEOUT_MAX_S:
        raise ValueError(f"init_comm: timeout_s must be > 0 and at most {TIMEOUT_MAX_S:.0f} s, "
                         f"got {timeout_s}")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1) or 1
    backend, dev = _resolve_backend_device(backend, device)
    if world_size == 1:
        return single_comm(dev)
    rank = rank if rank is not None else _env_int("RANK", None)
    if rank is None or not 0 <= rank < world_size:
        raise ValueError(f"init_comm: rank {rank} is not in [0, world_size={world_size}); "
                         "pass rank= or launch with torchrun (sets RANK)")
    assert rank is not None
    if init_method is None:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"init_comm: env:// needs {', '.join(missing)} in the environment; "
                             "launch with torchrun or pass init_method=")
        init_method = "env://"
        check_master(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if backend == "nccl":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    group = prim.init_default_group(backend, init_method, rank, world_size, timeout)
    comm = Comm(rank=rank, world_size=world_size, group=group, timeout=timeout, device=dev)
    comm.p2p_all_to_all = (not prim.probe_all_to_all(comm) if p2p_all_to_all is None
                           else p2p_all_to_all)
    if backend == "gloo" and (shm or (shm is None and shm_transport.supported())):
        comm.shm = open_shm(comm)  # (NCCL moves GPU tensors itself, over NVLink or PCIe)
    return comm


def check_master(addr: str, port: str) -> None:
    """Refuse a ``MASTER_PORT`` that is no port and a ``MASTER_ADDR`` this host cannot
    resolve, naming the variable (the process group failed on them after its timeout,
    with a traceback and a hint that blamed the other ranks).

    Raises:
        ValueError: naming the variable and its value.
    """
    import socket

    if not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"MASTER_PORT={port!r} is not a port (an integer 1-65535)")
    try:
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"MASTER_ADDR={addr!r} does not resolve on this host ({err}): give "
                         "rank 0's host name or address") from None


WINDOW_BYTES = 256 << 10
"""The shared-memory window a group opens with (``fullgraph.comm.shm.ShmWindow``)."""


def open_shm(comm: Comm) -> shm_transport.ShmExchange | None:
    """``comm``'s shared-memory transport, or None where some rank cannot reach the
    others' files (collective; counted under phase "comm-init")."""
    if comm.world_size == 1:
        return None

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        return bool(prim.all_reduce_(flag, comm, "comm-init", op="min")[0])

    shm = shm_transport.ShmExchange.open(
        comm.rank, comm.world_size, lambda o: prim.all_gather_object(o, comm, "comm-init"),
        agree)
    if shm is not None:
        # its window now, so that small reductions and barriers take it from the start
        # (it grows where a halo exchange needs more)
        prim.window(dataclasses.replace(comm, shm=shm), WINDOW_BYTES)
    return shm


def destroy_comm(comm: Comm) -> None:
    """Tear down ``comm``'s process group (nothing for world size 1); safe to call twice."""
    if comm.shm is not None:
        comm.shm.close()
        comm.shm = None
    if comm.group is not None:
        prim.destroy_group(comm.group)
        comm.group = None


def check_device(name: str, option: str = "train.device", flag: str = "--device",
                 local_workers: int | None = None) -> None:
    """Refuse a CUDA device this torch build or machine cannot give (``option``, as
    ``section.key``, and ``flag``: where it was named), and one GPU named for each of
    ``local_workers`` workers of this host (default: $LOCAL_WORLD_SIZE, else 1): they
    would all compute on it while their communicators took a GPU each.

    Raises:
        ConfigError: ``name`` is cuda or cuda:N and CUDA is not available, or N is no
            GPU of this host, or cuda:N is given to several workers of this host.
    """
    if not name.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise ConfigError(f"{option}: got {name!r} but {why}; use {flag} cpu")
    try:
        index = torch.device(name).index
    except RuntimeError:
        raise ConfigError(f"{option}: {name!r} is no device; use {flag} cuda or cuda:N") \
            from None
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(f"{option}: got {name!r} but this host has {count} GPU"
                          f"{'s' if count != 1 else ''} visible (cuda:0"
                          f"{f' to cuda:{count - 1}' if count > 1 else ''})")
    workers = local_workers if local_workers is not None else \
        _env_int("LOCAL_WORLD_SIZE", 1) or 1
    if index is not None and workers > 1 and count > 1:  # (one GPU visible, as a launcher
        # that binds a GPU to each process leaves it: cuda:0 is each worker's own)
        raise ConfigError(f"{option}: {name!r} names one GPU for each of this host's "
                          f"{workers} workers; use {flag} cuda (each worker takes its local "
                          "rank's GPU) and choose the GPUs with CUDA_VISIBLE_DEVICES")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device a worker of this host computes on: ``auto`` means CUDA when
    available; ``cuda`` means the local rank's GPU (GPUs taken in turn when the host
    runs more workers than it has). Refused as ``check_device`` refuses."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name)
    if name == "cuda":
        return local_gpu(local_rank)
    return torch.device(name)


def local_gpu(local_rank: int) -> torch.device:
    """The GPU of the worker with this local rank: GPUs in turn when there are fewer
    GPUs than workers on the host."""
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def gpus_shared() -> bool:
    """True when this host runs more workers ($LOCAL_WORLD_SIZE) than it has GPUs:
    NCCL refuses two ranks on one device, so the default backend is then gloo, with
    CUDA tensors staged through host memory (``fullgraph.comm.primitives``)."""
    return (_env_int("LOCAL_WORLD_SIZE", 1) or 1) > torch.cuda.device_count()


def gpu_share(device: torch.device, comm: Comm) -> int:
    """Bytes of ``device``'s free memory that are this worker's: the free memory over
    the workers that compute on the same GPU (by its UUID: a launcher may bind one GPU
    to each process, or leave a host's GPUs to all of its workers), which plan on it
    at the same moment (collective)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    sharing = prim.all_gather_object(uuid, comm, "setup").count(uuid) or 1
    return torch.cuda.mem_get_info(device)[0] // sharing


def env_int(name: str, default: int) -> int:
    """The integer environment variable ``name`` (``default`` where unset).

    Raises:
        ValueError: it is set to something else than an integer (naming it).
    """
    value = _env_int(name, default)
    assert value is not None
    return value


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") \
            from None


def _resolve_backend_device(backend: str | None,
                            device: str | torch.device | None) -> tuple[str, torch.device]:
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"init_comm: backend must be 'gloo' or 'nccl', got {backend!r}")
    if device is None:
        if backend == "nccl":
            device = torch.device("cuda", _env_int("LOCAL_RANK", 0) or 0)
        else:
            device = torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # the local rank's GPU
        dev = local_gpu(_env_int("LOCAL_RANK", 0) or 0)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" and not gpus_shared() else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"init_comm: backend 'nccl' needs a cuda device, got {dev}")
    return backend, dev
