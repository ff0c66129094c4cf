"""An emulated two-host network for benchmarks: two namespaces, one shaped veth link.

Two Linux network namespaces stand in for two machines: each has only its loopback
and its end of a veth pair (``10.217.<x>.1`` and ``.2``), and the pair's egress on
both ends can be limited with ``tc`` (``tbf``: a token bucket at ``rate``, each
direction on its own, like a full-duplex Ethernet link). Worker processes are started
with ``ip netns exec``; rank ``r`` runs in namespace ``r % 2`` with
``GLOO_SOCKET_IFNAME`` set to that namespace's veth, so gloo binds to the veth
address: ranks in different namespaces talk across the shaped link, ranks in the same
namespace through the kernel's local route (not shaped, as on one host). The file
system is shared, so a ``file://`` store works across the namespaces.

This is an emulation: the "hosts" share this machine's cores and memory, and the
link is a token bucket, not a switch. It only makes every byte between the two
groups of workers pay a known bandwidth.

Needs root and iproute2 (``ip``, ``tc``). Everything made is removed on exit from
``two_hosts`` (also on errors, Ctrl-C and SIGTERM), after the processes started in
the namespaces have been killed.

    python -m fullgraph.bench.netlink --rate 1gbit      # measure the shaped link
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fullgraph.bench import entry_point

SUBNET_PREFIX = "10.217"
PROBE_PORT = 29611
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


@dataclass
class Host:
    """One emulated host: a namespace, its end of the veth pair and that end's address."""

    netns: str
    veth: str
    addr: str


@dataclass
class Link:
    """Two hosts joined by one veth pair, shaped to ``rate`` (None: not shaped)."""

    hosts: list[Host]
    rate: str | None
    burst: str
    latency: str

    def host_of(self, rank: int) -> Host:
        """The namespace rank ``rank`` runs in: ranks alternate between the two."""
        return self.hosts[rank % 2]

    def describe(self) -> str:
        shaping = (f"tc tbf rate {self.rate} burst {self.burst} latency {self.latency} on the "
                   "egress of both ends (each direction limited on its own)"
                   if self.rate else "no tc shaping (veth at memory speed)")
        return (f"two network namespaces ({self.hosts[0].netns}, {self.hosts[1].netns}) "
                f"joined by a veth pair ({self.hosts[0].addr} <-> {self.hosts[1].addr}), "
                f"{shaping}")


def rate_bits(rate: str) -> float | None:
    """A tc rate (``1gbit``, ``500mbit``, ``100mbps``...) in bit/s; None if not parsed."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    if not m:
        return None
    unit = m.group(2).lower() or "bit"
    return float(m.group(1)) * _UNITS[unit] if unit in _UNITS else None


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)


def _must(cmd: Sequence[str]) -> None:
    out = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can, as far as we can tell)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's '{tool}' is not installed"
    return None


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread for the block (so finally runs)."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def two_hosts(rate: str | None, burst: str = "256kb", latency: str = "50ms",
              prefix: str = "fgb") -> Iterator[Link]:
    """Make two namespaces joined by a veth pair, shaped to ``rate``; always removed.

    Names: namespaces ``<prefix>A-<6 hex>`` / ``B``, veth ends ``<prefix>vA<6 hex>``
    (at most 15 characters). Raises RuntimeError when a step fails (after cleaning up).
    """
    why = available()
    if why:
        raise RuntimeError(f"cannot emulate a network link: {why}")
    tag = secrets.token_hex(3)
    subnet = f"{SUBNET_PREFIX}.{secrets.randbelow(254) + 1}"
    hosts = [Host(f"{prefix}{side}-{tag}", f"{prefix}v{side}{tag}", f"{subnet}.{i + 1}")
             for i, side in enumerate("AB")]
    made: list[str] = []
    veth_made = False
    with _sigterm_as_exit():
        try:
            for h in hosts:
                _must(["ip", "netns", "add", h.netns])
                made.append(h.netns)
            _must(["ip", "link", "add", hosts[0].veth, "type", "veth", "peer", "name",
                   hosts[1].veth])
            veth_made = True
            for h in hosts:
                _must(["ip", "link", "set", h.veth, "netns", h.netns])
                _must(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.veth])
                _must(["ip", "-n", h.netns, "link", "set", "lo", "up"])
                _must(["ip", "-n", h.netns, "link", "set", h.veth, "up"])
                if rate:
                    _must(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.veth,
                           "root", "tbf", "rate", rate, "burst", burst, "latency", latency])
            yield Link(hosts, rate, burst, latency)
        finally:
            cleanup(hosts, made, veth_made)


def cleanup(hosts: list[Host], made: list[str], veth_made: bool) -> None:
    """Delete the namespaces (and with them the veth ends); warn about anything left."""
    for name in made:
        _ip("netns", "del", name)
    if veth_made and _ip("link", "show", hosts[0].veth).returncode == 0:
        _ip("link", "del", hosts[0].veth)  # still in the root namespace (setup failed)
    left = set(_ip("netns", "list").stdout.split()) & {h.netns for h in hosts}
    left |= {h.veth for h in hosts if _ip("link", "show", h.veth).returncode == 0}
    if left:
        print(f"netlink: WARNING, left behind: {sorted(left)}", file=sys.stderr, flush=True)


def tx_bytes(link: Link) -> list[int]:
    """Bytes sent so far by each veth end (host A, host B), headers included."""
    out = []
    for h in link.hosts:
        res = _ip("-n", h.netns, "-s", "-j", "link", "show", "dev", h.veth)
        out.append(int(json.loads(res.stdout)[0]["stats64"]["tx"]["bytes"])
                   if res.returncode == 0 else -1)
    return out


# ------------------------------------------------------------------ processes
def netns_cmd(host: Host, cmd: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", host.netns, *cmd]


def run_ranks(link: Link, world: int, cmd_for_rank: Callable[[int], list[str]],
              env: dict[str, str] | None = None, timeout_s: float | None = None,
              master_port: int | None = None) -> list[int]:
    """Run rank r's command in namespace r % 2 with GLOO_SOCKET_IFNAME; exit codes.

    With ``master_port``, each rank also gets the environment torchrun gives its
    workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR = host A's address).

    Every rank is its own session (killed as a group). When one rank fails the others
    are killed (they would only wait for it until the collective timeout), and so are
    all of them when this function is left early (Ctrl-C, SIGTERM, timeout).
    Children's stdout goes to this process's stderr (stdout is the report).
    """
    base = {k: v for k, v in (env or os.environ).items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}
    procs: list[subprocess.Popen] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for r in range(world):
            host = link.host_of(r)
            rank_env = {} if master_port is None else {
                "RANK": str(r), "LOCAL_RANK": str(r // 2), "WORLD_SIZE": str(world),
                "MASTER_ADDR": link.hosts[0].addr, "MASTER_PORT": str(master_port)}
            procs.append(subprocess.Popen(
                netns_cmd(host, cmd_for_rank(r)), stdout=sys.stderr, start_new_session=True,
                env={**base, **rank_env, "GLOO_SOCKET_IFNAME": host.veth}))
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return [int(c) for c in codes]  # type: ignore[arg-type]
            if any(c not in (None, 0) for c in codes):
                bad = next(r for r, c in enumerate(codes) if c not in (None, 0))
                print(f"netlink: rank {bad} exited with {codes[bad]}; stopping the others",
                      file=sys.stderr, flush=True)
                _kill(procs)
                return [int(p.wait()) for p in procs]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"netlink: ranks still running after {timeout_s} s")
            time.sleep(0.2)
    finally:
        _kill(procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=30)


# ---------------------------------------------------------------------- probe
_SERVER = r"""
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += k
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}), flush=True)
"""
_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
block = b"\0" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    k = min(left, len(block)); c.sendall(block[:k]); left -= k
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def probe(link: Link, nbytes: int | None = None, both_ways: bool = True) -> dict[str, Any]:
    """Measure the link with TCP streams: A -> B alone, then A -> B and B -> A at once.

    Returns Gbit/s per stream as measured by the receivers (first byte to end of
    stream), with the bytes sent. ``nbytes`` defaults to about 1.5 s at the shaped
    rate (64 MB unshaped).
    """
    bits = rate_bits(link.rate) if link.rate else None
    if nbytes is None:
        nbytes = int(bits * 1.5 / 8) if bits else 64 << 20
        nbytes = max(4 << 20, min(nbytes, 512 << 20))
    py = sys.executable

    def streams(pairs: list[tuple[Host, Host]]) -> list[float]:
        servers, clients = [], []
        try:
            for i, (_, dst) in enumerate(pairs):
                srv = subprocess.Popen(netns_cmd(dst, [py, "-c", _SERVER, dst.addr,
                                                       str(PROBE_PORT + i)]),
                                       stdout=subprocess.PIPE, text=True, start_new_session=True)
                servers.append(srv)
                assert srv.stdout is not None
                if srv.stdout.readline().strip() != "ready":
                    raise RuntimeError("netlink probe: the receiver did not start")
            for i, (src, dst) in enumerate(pairs):
                clients.append(subprocess.Popen(
                    netns_cmd(src, [py, "-c", _CLIENT, dst.addr, str(PROBE_PORT + i),
                                    str(nbytes)]), start_new_session=True))
            rates = []
            for srv in servers:
                out, _ = srv.communicate(timeout=120)
                rec = json.loads(out.strip().splitlines()[-1])
                rates.append(rec["bytes"] * 8 / rec["seconds"] / 1e9)
            for c in clients:
                c.wait(timeout=30)
            return rates
        finally:
            _kill(servers + clients)

    a, b = link.hosts
    out: dict[str, Any] = {"bytes_per_stream": nbytes, "one_way_gbit_s": streams([(a, b)])[0]}
    if both_ways:
        out["both_ways_gbit_s"] = streams([(a, b), (b, a)])
    return out


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default=None, help="tc rate, e.g. 1gbit (default: not shaped)")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--latency", default="50ms")
    p.add_argument("--bytes", type=int, default=None, help="bytes per TCP stream")
    args = p.parse_args(argv)
    with two_hosts(args.rate, args.burst, args.latency) as link:
        print(link.describe())
        print(json.dumps(probe(link, args.bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
