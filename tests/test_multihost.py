"""Two "hosts" x two workers each, over a real network link, with torchrun.

Two Linux network namespaces joined by a veth pair stand in for two machines: each
namespace has only its loopback and its end of the link, and each node a /dev/shm of
its own (a tmpfs in a mount namespace), so every byte between the nodes crosses the
veth. Each node runs ``torchrun --nnodes 2 --nproc-per-node 2`` with
its own dataset root (as separate hosts would), and the per-epoch losses must equal a
single-process run of the same configuration.

Needs root and iproute2; skipped (with the reason) where namespaces cannot be made,
e.g. in a container without CAP_SYS_ADMIN / CAP_NET_ADMIN.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

EPOCHS = 5
TRAIN = ["train", "--epochs", str(EPOCHS), "--dropout", "0.5", "--progress", "off",
         "--timeout", "60"]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "FULLGRAPH_RUN_DIR", "FULLGRAPH_THREADS",
                "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME")

pytestmark = [pytest.mark.dist, pytest.mark.multihost]


@dataclass
class Node:
    netns: str
    veth: str
    addr: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    out = _ip(*args)
    assert out.returncode == 0, f"ip {' '.join(args)}: {out.stderr.strip()}"


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair with 10.213.<x>.1 and .2; always removed."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux ('unshare') is not installed")
    tag = secrets.token_hex(4)  # names: netns fgA-<8>, veth fgvA<8> (12 <= 15 chars)
    subnet = f"10.213.{secrets.randbelow(254) + 1}"
    nodes = [Node(f"fg{side}-{tag}", f"fgv{side}{tag}", f"{subnet}.{i + 1}")
             for i, side in enumerate("AB")]
    made: list[str] = []
    veth_made = False
    try:
        for node in nodes:
            out = _ip("netns", "add", node.netns)
            if out.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {out.stderr.strip()}")
            made.append(node.netns)
        out = _ip("link", "add", nodes[0].veth, "type", "veth", "peer", "name", nodes[1].veth)
        if out.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {out.stderr.strip()}")
        veth_made = True
        for node in nodes:
            _must("link", "set", node.veth, "netns", node.netns)
            _must("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.veth)
            _must("-n", node.netns, "link", "set", "lo", "up")
            _must("-n", node.netns, "link", "set", node.veth, "up")
        yield nodes
    finally:
        for name in made:  # deleting a namespace destroys the veth end inside it
            _ip("netns", "del", name)
        if veth_made and _ip("link", "show", nodes[0].veth).returncode == 0:
            _ip("link", "del", nodes[0].veth)  # still in the root namespace (setup failed)
        leftover = set(_ip("netns", "list").stdout.split()) & {n.netns for n in nodes}
        assert not leftover, f"namespaces left behind: {leftover}"


def _env(data_root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(FULLGRAPH_DATA=str(data_root), **extra)
    return env


def _losses(path: Path) -> list[float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if r["event"] == "epoch"]


def _tx_bytes(node: Node) -> int:
    out = _ip("-n", node.netns, "-s", "-j", "link", "show", "dev", node.veth)
    assert out.returncode == 0, out.stderr
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def test_two_nodes_two_workers_each_over_veth(two_hosts, tmp_path):
    master = two_hosts[0].addr
    port = "29500"  # the master's namespace is fresh: every port is free there
    metrics = tmp_path / "metrics.jsonl"
    procs: list[subprocess.Popen] = []
    try:
        for node_rank, node in enumerate(two_hosts):
            # each node gets a /dev/shm of its own, as a separate host has: otherwise
            # the workers would find each other's shared memory and talk through it
            cmd = ["ip", "netns", "exec", node.netns, "unshare", "--mount", "sh", "-c",
                   'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"', "node",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "2", "--node-rank", str(node_rank),
                   "--master-addr", master, "--master-port", port,
                   "-m", "fullgraph.cli", *TRAIN, "--strategy", "data",
                   "--metrics-out", str(metrics)]
            log = open(tmp_path / f"node{node_rank}.log", "w")
            procs.append(subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=_env(tmp_path / f"data-node{node_rank}", GLOO_SOCKET_IFNAME=node.veth)))
            log.close()
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:  # each node's torchrun and its workers form one session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    node0 = (tmp_path / "node0.log").read_text()
    assert "4 worker(s)" in node0 and "final test accuracy" in node0, logs
    # rank 0 reports every epoch for all four ranks
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    ranks = {(r["epoch"], r["rank"]) for r in records if r["event"] == "rank_epoch"}
    assert ranks == {(e, r) for e in range(1, EPOCHS + 1) for r in range(4)}
    # the halo and gradient traffic really crossed the link, both ways
    assert min(_tx_bytes(node) for node in two_hosts) > 100_000

    single = tmp_path / "single.jsonl"
    ref = subprocess.run([sys.executable, "-m", "fullgraph.cli", *TRAIN, "--strategy", "single",
                          "--metrics-out", str(single)], env=_env(tmp_path / "data-single"),
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    multi, alone = _losses(metrics), _losses(single)
    assert len(multi) == len(alone) == EPOCHS
    np.testing.assert_allclose(multi, alone, rtol=1e-5, atol=1e-6)
