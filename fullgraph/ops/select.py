"""What ``--spmm-backend auto`` means on this machine: measured once, then remembered.

Which CPU SpMM kernel is faster depends on the machine (cores, caches, memory
bandwidth) and on the library versions: on one 2-core host torch's CSR product was
1.5-2x faster than the numba loop, on another the numba loop was 1.9x faster. So
``auto`` times every available candidate on a fixed random sample graph (warm-up
first, then the median of ``REPEATS`` rounds in which the candidates take turns)
the first time it is needed on a
machine, picks the fastest, and stores the choice with its timings in the user
cache directory (``FULLGRAPH_CACHE_DIR``, else the platform's cache directory for
fullgraph), keyed by CPU model, thread count, torch / numba versions and the revision
of fullgraph's kernels; later runs with the same key read it back. On GPU ``auto`` is torch.

``choose`` takes the candidates as arguments, so tests can pass fakes; the run
header states the choice and why (``Choice.describe``).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.ops import kernels

SAMPLE_VERTICES, SAMPLE_DEGREE, SAMPLE_COLUMNS = 20_000, 10, 64
REPEATS = 5
CACHE_FILE = "spmm-backend.json"

Kernel = Callable[[Graph, Tensor], Tensor]


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` resolved to.

    Attributes:
        name: the backend.
        seconds: median seconds per SpMM of the sample, per candidate (empty when
            there was nothing to measure).
        source: ``measured`` (now), ``cached`` (an earlier measurement on this
            machine) or ``only candidate``.
        where: the cache file (None when not stored).
    """

    name: str
    seconds: dict[str, float] = field(default_factory=dict)
    source: str = "only candidate"
    where: str | None = None

    def describe(self) -> str:
        if not self.seconds:
            why = "numba switched off by FULLGRAPH_NO_NUMBA" if os.environ.get(
                "FULLGRAPH_NO_NUMBA") else "the only CPU backend installed"
            return f"{self.name} (auto: {why})"
        times = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in sorted(self.seconds.items(),
                                                                   key=lambda kv: kv[1]))
        return (f"{self.name} (auto, {self.source}: {times} per SpMM of a "
                f"{SAMPLE_VERTICES}-vertex sample at {torch.get_num_threads()} thread(s))")


def candidates() -> dict[str, Kernel]:
    """The CPU backends installed here, as kernels ``(graph, x) -> graph @ x``."""
    from fullgraph.ops.spmm import _aggregate_numba, _aggregate_torch

    out: dict[str, Kernel] = {"torch": lambda g, x: _aggregate_torch(g, x, None, "sum")}
    if kernels.HAVE_NUMBA:
        out["numba"] = lambda g, x: _aggregate_numba(g, x, None, "sum")
    return out


KERNELS_REVISION = 4
"""Raised when fullgraph's own CPU kernels change speed (2: the SpMM prefetches rows
ahead; 3: threads split the rows by edge count; 4: the SpMM zeroes its output rows
itself), so that a choice measured against the old ones is measured again."""


def machine_key() -> str:
    """What a measurement holds for: CPU model, threads, torch and numba versions, and
    the revision of fullgraph's kernels."""
    numba = getattr(kernels.numba, "__version__", "none") if kernels.HAVE_NUMBA else "none"
    return (f"{_cpu_model()} | threads {torch.get_num_threads()} | torch {torch.__version__} "
            f"| numba {numba} | kernels {KERNELS_REVISION}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(name: str = CACHE_FILE) -> Path:
    """Where choices are remembered (``FULLGRAPH_CACHE_DIR`` or the user cache dir)."""
    root = os.environ.get("FULLGRAPH_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("fullgraph")
    return Path(root) / name


def remembered(name: str, key: str) -> dict | None:
    """The entry stored under ``key`` in the cache file ``name``, if any."""
    entry = _read(cache_path(name)).get(key)
    return entry if isinstance(entry, dict) else None


def remember(name: str, key: str, entry: dict) -> bool:
    """Store ``entry`` under ``key`` in the cache file ``name``; False if it cannot be
    written (the choice then holds for this process only)."""
    return _write(cache_path(name), key, entry)


def sample_graph(seed: int = 0) -> tuple[Graph, Tensor]:
    """A fixed random graph and feature matrix to time kernels on."""
    gen = torch.Generator().manual_seed(seed)
    n, deg = SAMPLE_VERTICES, SAMPLE_DEGREE
    indices = torch.randint(0, n, (n * deg,), generator=gen, dtype=torch.int32)
    indptr = torch.arange(0, n * deg + 1, deg, dtype=torch.int64)
    x = torch.randn(n, SAMPLE_COLUMNS, generator=gen)
    return Graph(indptr, indices, num_src=n, validate=False), x


def measure(kernels_: dict[str, Kernel]) -> dict[str, float]:
    """Median seconds per call of each kernel on the sample, after one warm-up each.
    The candidates take turns in every round, so a change of load on a shared machine
    falls on all of them alike."""
    graph, x = sample_graph()
    for kernel in kernels_.values():
        kernel(graph, x)  # warm-up: compilation, first-touch pages
    runs: dict[str, list[float]] = {name: [] for name in kernels_}
    for _ in range(REPEATS):
        for name, kernel in kernels_.items():
            t0 = time.perf_counter()
            kernel(graph, x)
            runs[name].append(time.perf_counter() - t0)
    return {name: statistics.median(r) for name, r in runs.items()}


def choose(kernels_: dict[str, Kernel] | None = None, *, path: Path | None = None) -> Choice:
    """The fastest of ``kernels_`` (default: the installed ones) on this machine,
    from the cache file when it holds this machine's key, else measured and stored."""
    kernels_ = candidates() if kernels_ is None else kernels_
    if len(kernels_) == 1:
        return Choice(next(iter(kernels_)))
    path = cache_path() if path is None else path
    key = f"{machine_key()} | {'+'.join(sorted(kernels_))}"
    stored = _read(path).get(key)
    if stored and stored.get("backend") in kernels_:
        return Choice(stored["backend"], dict(stored["seconds"]), "cached", str(path))
    seconds = measure(kernels_)
    best = min(seconds, key=lambda n: seconds[n])
    written = _write(path, key, {"backend": best, "seconds": seconds,
                                 "date": time.strftime("%Y-%m-%d")})
    return Choice(best, seconds, "measured", str(path) if written else None)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, key: str, entry: dict) -> bool:
    """Merge ``entry`` into the cache file atomically; False if it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return True
    except OSError:
        return False
