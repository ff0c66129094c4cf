"""Resource fluctuation injected into a run, seeded and the same on every run.

NeutronCloud (§2.1, §6.1 "Heterogeneity Simulation") makes a worker slow by adding
sleep to some epochs: each worker, each epoch, with probability p, a slowdown starts
and lasts n epochs. Two kinds are injected here, both from one spec string
(``--inject``), items separated by ``;``:

- ``sleep:p=0.1,s=auto,n=5`` the paper's method: ``s`` seconds added to every epoch
  of the slowdown, half before the forward pass and half at the start of the
  backward pass (so both passes' exchanges wait for it); ``s=auto`` (default) is
  twice this worker's mean epoch time over the epochs without injection before it,
  the first epoch run left out unless it is the only one (its one-off setup costs
  made it 10x a later epoch on Cora; after a resume, the checkpoint's epochs count
  too);
- ``cpu:p=0.1,load=1,n=5`` a throttle that really takes CPU away: for the
  slowdown's epochs ``load`` busy processes run pinned to the worker's core, so the
  worker's measured per-vertex and per-edge costs change, not only its wall clock
  (with ``load`` busy processes the worker gets about 1 / (load + 1) of its core);
- ``net:rate=50mbit,p=0.1,n=5`` the worker's network link slowed: for the
  slowdown's epochs its own interface (the one ``GLOO_SOCKET_IFNAME`` names) sends
  through a ``tc`` token bucket at ``rate`` (or a ``netem`` queue when a
  ``delay=10ms`` is asked for, which needs the kernel's sch_netem), then gets its
  previous queue back. It needs root, iproute2 and a worker that owns its interface,
  as the emulated hosts of ``fullgraph.bench.cloud --link`` do (several workers
  behind one emulated host share its link: give the item to one of them).

Common keys: ``n`` epochs per slowdown (default 5), ``p`` start probability per
epoch (default 0.1, or 0 where ``at`` is given), ``ranks=1+3`` the workers it applies
to (default all), ``at=4+9`` epochs where a slowdown starts for certain (with random
ones besides only where ``p`` is given too),
``seed`` (default 0). Slowdowns start at epoch 2 or later (epoch 1 is the baseline)
and do not overlap within one item: while one lasts, no other starts.

``schedule`` is a pure function of (spec, rank, epochs): the same on every run.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from fullgraph.fields import SEED_RANGE, is_seed

KINDS = ("sleep", "cpu", "net")
_COMMON = {"p", "n", "ranks", "at", "seed"}
_KEYS = {"sleep": _COMMON | {"s"}, "cpu": _COMMON | {"load"}, "net": _COMMON | {"rate", "delay"}}
_TC_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?(bit|bps))$", re.I)
_TC_TIME = re.compile(r"^\d+(\.\d+)?(s|ms|us)$")


@dataclass(frozen=True)
class InjectSpec:
    """One ``--inject`` item (see the module docstring for the keys)."""

    kind: str
    p: float = 0.1
    seconds: float | None = None
    epochs: int = 5
    load: int = 1
    rate: str | None = None
    delay: str | None = None
    ranks: tuple[int, ...] | None = None
    at: tuple[int, ...] = ()
    seed: int = 0

    def describe(self) -> str:
        if self.kind == "sleep":
            seconds = "auto (2x mean epoch)" if self.seconds is None else f"{self.seconds} s"
            what = f"sleep {seconds}"
        elif self.kind == "cpu":
            what = f"cpu throttle, {self.load} busy process(es)"
        else:
            what = f"link at {self.rate or 'full rate'}, delay {self.delay or '0'}"
        where = "every rank" if self.ranks is None else \
            "rank " + ",".join(str(r) for r in self.ranks)
        forced = f", forced at epoch {','.join(map(str, self.at))}" if self.at else ""
        return f"{what}, p={self.p} per epoch for {self.epochs} epochs on {where}{forced}, " \
               f"seed {self.seed}"


def parse(text: str) -> list[InjectSpec]:
    """Parse an ``--inject`` string; raise ValueError naming the bad part."""
    specs = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        kind, _, rest = item.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"--inject {item!r}: unknown kind {kind!r}; expected one of "
                             f"{', '.join(KINDS)}")
        specs.append(_parse_item(kind, rest, item))
    if not specs:
        raise ValueError(f"--inject {text!r}: no item (expected e.g. 'sleep:p=0.1,n=5')")
    return specs


def _parse_item(kind: str, rest: str, item: str) -> InjectSpec:
    values: dict[str, str] = {}
    for pair in (t.strip() for t in rest.split(",") if t.strip()):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS[kind]:
            raise ValueError(f"--inject {item!r}: bad key {pair!r}; {kind} takes "
                             f"{', '.join(sorted(_KEYS[kind]))} as key=value")
        if key in values:
            raise ValueError(f"--inject {item!r}: {key} given twice")
        values[key] = value.strip()
    def number(key: str, default: str, kind: type = int) -> Any:
        text = values.get(key, default)
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"--inject {item!r}: {key}={text!r} is not {what}") from None

    def numbers(key: str) -> tuple[int, ...]:  # 1+3: a list of integers
        if key not in values:
            return ()
        try:
            return tuple(int(t) for t in values[key].split("+"))
        except ValueError:
            raise ValueError(f"--inject {item!r}: {key}={values[key]!r} is not integers "
                             f"joined by '+' (e.g. {key}=1+3)") from None

    spec = InjectSpec(
        kind, p=number("p", "0" if "at" in values else "0.1", float),
        seconds=None if values.get("s", "auto") == "auto" else number("s", "", float),
        epochs=number("n", "5"), load=number("load", "1"),
        rate=values.get("rate"), delay=values.get("delay"),
        ranks=numbers("ranks") if "ranks" in values else None, at=numbers("at"),
        seed=number("seed", "0"))
    _check(spec, item)
    return spec


MAX_LOAD = 64
"""The most busy processes a ``cpu`` slowdown starts per worker."""


def _check(spec: InjectSpec, item: str) -> None:
    problems = []
    if not 0.0 <= spec.p <= 1.0:
        problems.append(f"p={spec.p} is not a probability")
    if spec.seconds is not None and not (spec.seconds >= 0 and math.isfinite(spec.seconds)):
        problems.append(f"s={spec.seconds} must be seconds >= 0 or auto")
    if spec.epochs < 1:
        problems.append(f"n={spec.epochs} must be >= 1")
    if spec.load < 1:
        problems.append(f"load={spec.load} must be >= 1")
    elif spec.load > MAX_LOAD:
        problems.append(f"load={spec.load} would start that many busy processes; at most "
                        f"{MAX_LOAD} (a load of L leaves the worker about 1 / (L + 1) of "
                        "its core)")
    if spec.ranks is not None and min(spec.ranks) < 0:
        problems.append(f"ranks={'+'.join(map(str, spec.ranks))} must be >= 0")
    if spec.kind == "net" and spec.rate is None and spec.delay is None:
        problems.append("net needs rate=... (e.g. 50mbit) or delay=... (e.g. 10ms)")
    if spec.rate is not None and not _TC_RATE.match(spec.rate):
        problems.append(f"rate={spec.rate} is not a tc rate such as 50mbit")
    if spec.delay is not None and not _TC_TIME.match(spec.delay):
        problems.append(f"delay={spec.delay} is not a tc time such as 10ms")
    if spec.at and min(spec.at) < 2:
        problems.append(f"at={'+'.join(map(str, spec.at))}: slowdowns start at epoch 2 or "
                        "later")
    if not is_seed(spec.seed):
        problems.append(f"seed={spec.seed} must be {SEED_RANGE}")
    if problems:
        raise ValueError(f"--inject {item!r}: {'; '.join(problems)}")


def check_world(specs: list[InjectSpec], world_size: int, epochs: int | None = None) -> None:
    """Raise if an item names a rank the run does not have, or (``epochs`` given) forces
    a slowdown at an epoch it does not run."""
    for spec in specs:
        bad = [r for r in spec.ranks or () if r >= world_size]
        if bad:
            raise ValueError(f"--inject {spec.kind}: ranks {bad} do not exist with "
                             f"{world_size} worker(s)")
        late = [e for e in spec.at if epochs is not None and e > epochs]
        if late:
            raise ValueError(f"--inject {spec.kind}: at={'+'.join(map(str, late))} is past "
                             f"the run's last epoch ({epochs})")


def schedule(spec: InjectSpec, rank: int, epochs: int) -> list[tuple[int, int]]:
    """The slowdowns of ``rank`` over epochs 1..``epochs``: (first, last) epochs.

    One draw per epoch from a generator seeded by (seed, rank, kind), whether or not a
    slowdown is on, so the schedule of one epoch does not depend on earlier ones.
    """
    if spec.ranks is not None and rank not in spec.ranks:
        return []
    rng = np.random.default_rng([spec.seed, rank, KINDS.index(spec.kind)])
    draws = rng.random(epochs + 1)
    out: list[tuple[int, int]] = []
    for epoch in range(2, epochs + 1):
        if out and epoch <= out[-1][1]:
            continue
        if draws[epoch] < spec.p or epoch in spec.at:
            out.append((epoch, min(epochs, epoch + spec.epochs - 1)))
    return out


_SPIN = ("import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
         "    for _ in range(200000):\n        pass\n")


class Throttle:
    """Busy processes pinned to this worker's core while a cpu slowdown lasts.

    The worker's threads are pinned to one core (``core``) for the slowdown and
    released after; each busy process exits by itself if the worker dies.
    """

    def __init__(self, core: int) -> None:
        self.core = core
        self.load = 0
        self._procs: list[subprocess.Popen] = []
        self._saved: dict[int, set[int]] = {}

    @property
    def active(self) -> bool:
        return bool(self._procs)

    def start(self, load: int) -> None:
        if self._procs:
            return
        self.load = load
        cores = {self.core}
        for tid in _threads():
            try:
                self._saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cores)
            except OSError:  # a thread that ended meanwhile
                pass
        for _ in range(load):
            proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())],
                                    stdin=subprocess.DEVNULL)
            os.sched_setaffinity(proc.pid, cores)
            self._procs.append(proc)

    def stop(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs, self.load = [], 0
        for tid, cores in self._saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass
        self._saved = {}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def core_for(rank: int) -> int:
    """The core a worker's throttle pins to: rank-th of the cores it may use."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


class LinkShaper:
    """This worker's own interface sent through ``tc`` while a net slowdown lasts.

    ``start`` remembers the interface's root queue (a ``tbf`` shaper, as the emulated
    hosts have, or the kernel default) and puts a new one in its place; ``stop`` puts
    the old one back. Each change deletes the root queue and adds a fresh one: changing
    a ``tbf`` in place (``tc qdisc replace`` of a tbf by a tbf) while packets were
    queued left the queue stalled with its backlog on this machine's kernel, and every
    TCP stream through it backed off until the workers' collective timeout
    (``bench.cloud --link``: 2 of 3 runs hung).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self._restore: list[str] | None = None  # the old root queue; [] = the default

    @property
    def active(self) -> bool:
        return self._restore is not None

    def start(self, rate: str | None, delay: str | None) -> None:
        if self._restore is not None:
            return
        shown = _tc("qdisc", "show", "dev", self.device).split()
        if len(shown) > 1 and shown[1] == "tbf":
            opts = dict(zip(shown[shown.index("rate"):][::2], shown[shown.index("rate"):][1::2]))
            restore = ["tbf", "rate", opts["rate"], "burst", opts.get("burst", "256Kb"),
                       "latency", opts.get("lat", "50ms")]
        elif len(shown) > 2 and shown[2] != "0:":
            raise RuntimeError(f"--inject net: {self.device} has a root queue of its own "
                               f"({' '.join(shown[1:3])}) that the injection could not put "
                               "back; only a tbf shaper or the kernel's default is replaced")
        else:
            restore = []
        if delay is None:  # rate only: a token bucket, in every kernel
            queue = ["tbf", "rate", str(rate), "burst", "32kb", "latency", "400ms"]
        else:  # netem: delay, and rate if given (sch_netem must be available)
            queue = ["netem", "delay", delay] + (["rate", rate] if rate else [])
        try:
            self._set_root(queue)
        except RuntimeError as exc:
            with contextlib.suppress(RuntimeError):  # the first error is the one to show
                self._set_root(restore)
            raise RuntimeError(f"--inject net: {exc} (a delay needs the kernel's netem "
                               "queue, sch_netem; a rate alone does not)") from None
        self._restore = restore

    def stop(self) -> None:
        if self._restore is not None:
            self._set_root(self._restore)
            self._restore = None

    def _set_root(self, queue: list[str]) -> None:
        """A fresh root queue ``queue`` ([]: the kernel's default) on the interface."""
        shown = _tc("qdisc", "show", "dev", self.device).split()
        if len(shown) > 2 and shown[2] != "0:":  # handle 0: is the kernel's default
            _tc("qdisc", "del", "dev", self.device, "root")
        if queue:
            _tc("qdisc", "add", "dev", self.device, "root", *queue)


def link_device() -> str:
    """The interface a net slowdown shapes; raise ValueError saying why there is none."""
    device = os.environ.get("GLOO_SOCKET_IFNAME")
    why = ("GLOO_SOCKET_IFNAME does not name this worker's interface" if not device else
           "it needs root" if os.geteuid() != 0 else
           "iproute2's 'tc' is not installed" if shutil.which("tc") is None else "")
    if why:
        raise ValueError(f"--inject net: {why}; net slowdowns shape a worker's own network "
                         "interface, as in `python -m fullgraph.bench.cloud --link 1gbit`")
    assert device is not None
    return device


def _tc(*args: str) -> str:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout
