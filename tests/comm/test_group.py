"""ByteCounter, Comm and init_comm argument handling (no processes spawned)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from fullgraph.comm import ByteCounter, Comm, destroy_comm, init_comm, single_comm


def test_byte_counter_accumulates_per_phase():
    counter = ByteCounter()
    counter.add("halo", 100, 40, 0.5)
    counter.add("halo", 10, 4, 0.25)
    counter.add("grad-sync", 8, 8, 0.125)
    snap = counter.snapshot()
    assert snap == {"halo": {"sent": 110, "recv": 44, "calls": 2, "seconds": 0.75},
                    "grad-sync": {"sent": 8, "recv": 8, "calls": 1, "seconds": 0.125}}
    assert counter.total() == {"sent": 118, "recv": 52, "calls": 3, "seconds": 0.875}
    snap["halo"]["sent"] = 0  # a snapshot is a copy
    assert counter.snapshot()["halo"]["sent"] == 110
    counter.reset()
    assert counter.snapshot() == {} and counter.total()["calls"] == 0


def test_byte_counter_keeps_calls_once_asked_and_progress():
    counter = ByteCounter()
    counter.add("setup", 1, 1, 0.5)
    assert counter.take_calls() == []  # not recording before the first take_calls
    counter.enter("halo", "all_to_all_v")
    assert counter.inside == "all_to_all_v in phase 'halo'" and counter.entered == 1
    counter.leave()
    counter.add("halo", 10, 4, 0.25)
    counter.add("grad-sync", 8, 8, 0.125)
    assert counter.inside is None
    assert counter.take_calls() == [("halo", 0.25), ("grad-sync", 0.125)]
    assert counter.take_calls() == []


def test_single_comm():
    comm = single_comm()
    assert (comm.rank, comm.world_size, comm.group) == (0, 1, None)
    assert comm.device == torch.device("cpu") and comm.timeout > datetime.timedelta(0)
    assert single_comm().counter is not comm.counter  # no shared state
    destroy_comm(comm)
    destroy_comm(comm)


def test_comm_validates_fields():
    with pytest.raises(ValueError, match="needs a process group"):
        Comm(rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        Comm(rank=2, world_size=2, group=object())


def test_init_comm_without_launcher_is_single(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    comm = init_comm()
    assert comm.world_size == 1 and comm.group is None and not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert init_comm(timeout_s=5).world_size == 1


@pytest.mark.parametrize("kwargs, env, match", [
    (dict(world_size=2), {}, "rank None is not in"),
    (dict(world_size=2, rank=3), {}, "rank 3 is not in"),
    (dict(world_size=2, rank=0), {}, "env:// needs MASTER_ADDR, MASTER_PORT"),
    (dict(backend="mpi"), {}, "backend must be 'gloo' or 'nccl'"),
    (dict(backend="nccl", device="cpu"), {}, "needs a cuda device"),
    (dict(timeout_s=0), {}, "timeout_s must be > 0"),
    (dict(timeout_s=float("inf")), {}, "and at most 1000000 s, got inf"),
    ({}, {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
])
def test_init_comm_refuses_bad_arguments(monkeypatch, kwargs, env, match):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        init_comm(**kwargs)
    assert not dist.is_initialized()


def test_workers_sharing_a_gpu_default_to_gloo(monkeypatch):
    """More local workers than GPUs: ``cuda`` is the local rank's GPU in turn and the
    default backend is gloo (NCCL refuses two ranks on one device); a GPU each: nccl."""
    from fullgraph.comm import group

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert group._resolve_backend_device(None, "cuda") == ("gloo", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert group._resolve_backend_device(None, "cuda") == ("nccl", torch.device("cuda", 2))
    assert group._resolve_backend_device("gloo", "cuda:1") == ("gloo", torch.device("cuda", 1))


@pytest.mark.parametrize("addr, port, needle", [
    ("127.0.0.1", "notaport", "MASTER_PORT='notaport' is not a port"),
    ("127.0.0.1", "70000", "MASTER_PORT='70000' is not a port"),
    ("127.0.0.1", "0", "MASTER_PORT='0' is not a port"),
    ("no.such.host.invalid", "29500", "MASTER_ADDR='no.such.host.invalid' does not resolve"),
])
def test_a_bad_master_address_or_port_is_named_before_the_group_waits(monkeypatch, addr,
                                                                       port, needle):
    """A port that is no number came out as a traceback (exit code 1, a bug), and a host
    that does not resolve failed after twice the timeout with a hint that blamed the
    other ranks."""
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(ValueError, match=needle):
        init_comm(rank=1, world_size=2, timeout_s=5)
    assert not dist.is_initialized()


def test_a_taken_master_port_is_named(monkeypatch):
    import socket

    from fullgraph.comm import CommError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(CommError, match="MASTER_PORT is taken on rank 0's host"):
            init_comm(rank=0, world_size=2, timeout_s=5)
    assert not dist.is_initialized()


def _gpus(monkeypatch, count: int) -> None:
    """A host with ``count`` (fake) GPUs; nothing runs on them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_devices_no_host_gives_or_one_gpu_for_several_workers_are_refused(monkeypatch):
    """``cuda:5`` on a 2-GPU host failed deep in the workers ("invalid device ordinal"),
    and ``cuda:1`` for 2 workers of a host put both on GPU 1 while each communicator took
    its local rank's GPU (NCCL then fails on two ranks on one device): both are refused
    at once, naming the option. ``cuda:1`` for one worker and ``cuda`` stay."""
    from fullgraph.comm import group
    from fullgraph.errors import ConfigError

    _gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"train.device: got 'cuda:5' but this host has 2 "
                                          r"GPUs visible \(cuda:0 to cuda:1\)"):
        group.check_device("cuda:5")
    with pytest.raises(ConfigError, match="'cuda:1' names one GPU for each of this host's 2 "
                                          "workers; use --device cuda"):
        group.check_device("cuda:1", local_workers=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # a torchrun worker's host
    with pytest.raises(ConfigError, match="for each of this host's 3 workers"):
        group.resolve_device("cuda:1", 0)
    assert group.resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert group.resolve_device("auto", 2) == torch.device("cuda", 0)  # GPUs in turn
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert group.resolve_device("cuda:1", 0) == torch.device("cuda", 1)


def test_workers_sharing_a_gpu_plan_on_their_share_of_its_memory(monkeypatch):
    """Each worker sized its bins (and DepCache its fit) from the GPU's whole free
    memory, at the same moment as the others on that GPU; a worker bound to a GPU of
    its own (one visible, as a launcher's per-process binding leaves it) keeps all."""
    from types import SimpleNamespace

    from fullgraph.comm import group

    _gpus(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (12 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid=f"GPU-{device.index}"))
    comm = SimpleNamespace(rank=0, world_size=3)
    for on, share in ((["GPU-0", "GPU-1", "GPU-0"], {0: 6 << 30, 1: 12 << 30}),
                      (["GPU-0", "GPU-1", "GPU-2"], {0: 12 << 30, 1: 12 << 30})):
        monkeypatch.setattr(group.prim, "all_gather_object", lambda obj, comm, phase, on=on: on)
        for index, want in share.items():
            assert group.gpu_share(torch.device("cuda", index), comm) == want


def test_one_visible_gpu_named_for_each_worker_is_its_own(monkeypatch):
    """A launcher that binds one GPU to each process (CUDA_VISIBLE_DEVICES per rank)
    leaves each worker one device: cuda:0 there is its own GPU, not one shared."""
    from fullgraph.comm import group

    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert group.resolve_device("cuda:0", 3) == torch.device("cuda", 0)


def test_a_worker_communicates_from_the_gpu_it_computes_on(monkeypatch):
    """``--device auto`` gave the workers a CPU communicator (gloo, every exchange through
    host memory; with ``--backend nccl`` a failure about a "cpu" device nobody named),
    and ``cuda:N`` a communicator on another GPU than the model's: a worker now hands
    init_comm the device it trains on."""
    from types import SimpleNamespace

    from fullgraph import cli
    from fullgraph.comm import group

    _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    given = []

    def init_comm(**kwargs):
        given.append(kwargs["device"])
        raise KeyboardInterrupt  # (no process group here: stop at the call)

    monkeypatch.setattr(group, "init_comm", init_comm)
    for device in ("auto", "cuda"):
        cfg = SimpleNamespace(train=SimpleNamespace(device=device),
                              launch=SimpleNamespace(backend="auto", timeout_s=5.0))
        with pytest.raises(KeyboardInterrupt):
            cli._train(cfg, SimpleNamespace())
    assert given == [torch.device("cuda", 1)] * 2


def test_settle_waits_for_the_gpus_queued_kernels_and_not_on_the_cpu(monkeypatch):
    """On a GPU the step's phases measured kernel launches: the queued kernels' time
    went to whatever blocked next (``Strategy.train_step`` settles at each phase's end)."""
    from fullgraph.comm import primitives as prim

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    prim.settle(torch.device("cpu"))
    assert synced == []
    prim.settle(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]
