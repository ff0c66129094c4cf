"""Use a faster memory allocator (tcmalloc, else jemalloc) when one is installed.

Full-graph training allocates and frees large tensors every epoch; glibc's malloc
returns them to the OS and faults them in again. With Debian's libtcmalloc-minimal4
preloaded a PyG GCN epoch on a 1M-vertex / 20M-edge graph went from 16.5 s to 10.4 s
on our 2-core machine (see BENCHMARKS.md). An allocator must be loaded before the
process starts, so the CLI re-executes itself once with ``LD_PRELOAD`` set.

Set ``FULLGRAPH_ALLOCATOR=system`` to keep glibc's allocator, or to a library path
to force one.
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
    return "system malloc (install libtcmalloc-minimal4 for faster epochs)"


def reexec_with_allocator() -> None:
    """Re-execute this process with a fast allocator preloaded, at most once."""
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


def transparent_hugepages() -> str:
    """The kernel's transparent huge page mode, e.g. ``madvise``, or ``unknown``."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text.split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"
