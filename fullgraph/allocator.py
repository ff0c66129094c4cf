"""Use a faster memory allocator (tcmalloc, else jemalloc) when one is installed.

Full-graph training allocates and frees large tensors every epoch; glibc's malloc
returns them to the OS and faults them in again. With Debian's libtcmalloc-minimal4
preloaded a PyG GCN epoch on a 1M-vertex / 20M-edge graph went from 16.5 s to 10.4 s
on our 2-core machine (see BENCHMARKS.md). An allocator must be loaded before the
process starts, so the CLI re-executes itself once with ``LD_PRELOAD`` set.

Set ``FULLGRAPH_ALLOCATOR=system`` to keep glibc's allocator, or to a library path
to force one.

Where the kernel offers transparent huge pages (mode ``madvise`` or ``always``), the
CLI also sets PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` before torch is loaded: torch then
advises its allocations of 2 MB or more onto huge pages (a 64 MB tensor takes about
600 page faults instead of 16,400; ``tests/test_allocator.py``). An epoch of GCN on a
200,000-vertex R-MAT took 13x fewer page faults and 0.89x the time, at the same peak
memory on a 1M-vertex graph (BENCHMARKS.md). ``FULLGRAPH_HUGEPAGES=0``, or
``THP_MEM_ALLOC_ENABLE`` set by the user, leaves it alone.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    ("tcmalloc", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")),
    ("jemalloc", ("libjemalloc.so.2",)),
)
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib")
_MARK = "FULLGRAPH_ALLOCATOR_ACTIVE"


def find_allocator() -> tuple[str, str] | None:
    """(name, path) of the first installed fast allocator, honouring FULLGRAPH_ALLOCATOR."""
    choice = os.environ.get("FULLGRAPH_ALLOCATOR", "auto")
    if choice == "system":
        return None
    if choice not in ("auto", ""):
        return (Path(choice).name, choice) if Path(choice).is_file() else None
    for name, files in CANDIDATES:
        for directory in LIB_DIRS:
            for file in files:
                path = Path(directory) / file
                if path.is_file():
                    return name, str(path)
    return None


def active_allocator() -> str:
    """A one-line description of the allocator this process runs with."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name, files in CANDIDATES:
        if any(f.split(".so")[0] in preload for f in files):
            return f"{name} ({preload})"
    choice = os.environ.get("FULLGRAPH_ALLOCATOR", "auto")
    if choice not in ("auto", "", "system"):
        if choice in preload:
            return f"{Path(choice).name} ({preload})"
        return (f"system malloc (FULLGRAPH_ALLOCATOR={choice} is no file; give a library's "
                "path, system or auto)")
    return "system malloc (install libtcmalloc-minimal4 for faster epochs)"


def use_hugepages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for torch (before it is imported) where the kernel
    has transparent huge pages on request; whether this process's torch uses them."""
    if ("THP_MEM_ALLOC_ENABLE" not in os.environ and os.environ.get("FULLGRAPH_HUGEPAGES") != "0"
            and "torch" not in sys.modules and transparent_hugepages() in ("madvise", "always")):
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def memory_line() -> str:
    """The run header's line on the allocator and huge pages."""
    thp = transparent_hugepages()
    torch_thp = (", torch tensors of 2 MB+ on huge pages (THP_MEM_ALLOC_ENABLE=1)"
                 if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and thp != "never" else "")
    return f"memory   allocator {active_allocator()}, transparent huge pages {thp}{torch_thp}"


def reexec_with_allocator() -> None:
    """Re-execute this process with a fast allocator preloaded, at most once (and ask
    torch for huge pages first, see ``use_hugepages``)."""
    use_hugepages()
    if os.environ.get(_MARK) or sys.platform != "linux":
        return
    found = find_allocator()
    os.environ[_MARK] = "1"
    if found is None or found[1] in os.environ.get("LD_PRELOAD", ""):
        return
    preload = ":".join(p for p in (found[1], os.environ.get("LD_PRELOAD", "")) if p)
    env = dict(os.environ, LD_PRELOAD=preload)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fullgraph.cli", *sys.argv[1:]], env)


def reexec_for_hugepages(module: str, on: bool, argv: list[str]) -> None:
    """Run ``python -m module argv`` again in this process's place with torch's huge
    pages on (where the kernel offers them) or off, unless they already are as asked:
    a benchmark that has imported torch, which reads ``THP_MEM_ALLOC_ENABLE`` when it
    loads. At most once per process tree."""
    want = "1" if on and transparent_hugepages() in ("madvise", "always") else "0"
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == want or os.environ.get(_THP_MARK):
        return
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE=want, **{_THP_MARK: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


_THP_MARK = "FULLGRAPH_HUGEPAGES_SET"


def transparent_hugepages() -> str:
    """The kernel's transparent huge page mode, e.g. ``madvise``, or ``unknown``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text.split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"
