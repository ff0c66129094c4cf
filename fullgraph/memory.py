"""Byte sizes: reading them from the command line, accounting for them on a device, and
counting the intermediate data autograd saves for the backward pass.

A ground-floor module (it imports nothing of fullgraph), so that kernels, schedules
and strategies can all use it.
"""
from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1.5G"`` or an integer -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; expected e.g. 512MB, 2GiB, 1.5G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass
class MemoryAccount:
    """Bytes on the compute device during chunked propagation.

    ``current`` / ``peak`` count what the chunks stream through the device, which
    ``budget`` bounds; ``resident`` names what stays on the device beside them for
    the whole run (e.g. the vertex rows of transform stages that run there), in bytes.
    """

    budget: int | None = None
    current: int = 0
    peak: int = 0
    resident: dict[str, int] = field(default_factory=dict)

    def reside(self, name: str, nbytes: int) -> None:
        """Record ``nbytes`` that stay on the device for the run under ``name``."""
        self.resident[name] = self.resident.get(name, 0) + int(nbytes)

    @property
    def device_peak(self) -> int:
        """Peak of the streamed working set plus everything resident."""
        return self.peak + sum(self.resident.values())

    def hold(self, *tensors: Tensor) -> int:
        nbytes = sum(int(t.numel() * t.element_size()) for t in tensors)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.current -= nbytes


class SavedBytes:
    """Counts the bytes autograd saves for the backward pass while it is active: the
    intermediate data a training step holds between its forward and its backward.

    Each saved tensor counts once (by storage address and size) however many
    operations save it; parameters and ``exclude`` tensors (the model's own state) are
    not counted. Tensors that a recomputed (checkpointed) region would save are not
    saved, so they are not counted either.

        with SavedBytes(model.parameters()) as saved:
            loss = forward()
        saved.bytes  # intermediate data held for loss.backward()
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._skip = {t.data_ptr() for t in exclude}
        self._seen: set[tuple[int, int]] = set()
        self.bytes = 0
        self._hooks: Any = None

    def _pack(self, t: Tensor) -> Tensor:
        # a sparse tensor (the graph's adjacency, kept by a sparse product) has no
        # single storage to key by, and it is the graph, not intermediate data
        if t.layout is torch.strided and t.numel() and t.data_ptr() not in self._skip:
            key = (t.data_ptr(), t.numel() * t.element_size())
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += key[1]
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def available_memory() -> int | None:
    """Bytes of memory available to new processes (MemAvailable, no more than this
    process's memory cgroup limit), or None if unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    limit = cgroup_memory_limit()
    if limit is None:
        return available
    return limit if available is None else min(available, limit)


def cgroup_memory_limit(cgroups: str = "/proc/self/cgroup",
                        root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v1 or v2), or None where none is set
    (``cgroups``: the process's cgroup list; ``root``: where the hierarchies are
    mounted)."""
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            limit_file = Path(root, path.lstrip("/"), "memory.max")
        elif "memory" in controllers.split(","):
            limit_file = Path(root, "memory", path.lstrip("/"), "memory.limit_in_bytes")
        else:
            continue
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def available_ram() -> int:
    """Memory available to new processes (``available_memory``: MemAvailable, within
    this process's cgroup limit), or physical memory where that is unknown."""
    return available_memory() or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ram_per_worker(world_size: int) -> int:
    """This worker's even share of ``available_ram`` among the workers on its host
    (``$LOCAL_WORLD_SIZE``, as the launchers set it; else ``world_size``, all on one)."""
    if world_size <= 1:  # (one process: an outer job's $LOCAL_WORLD_SIZE is not its host's)
        return available_ram()
    try:
        here = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    except ValueError:
        here = world_size
    return available_ram() // max(1, min(here, world_size))


def peak_rss_bytes() -> int:
    """This process's peak resident size: its memory's high-water mark (``VmHWM``) on
    Linux. ``getrusage``'s ``ru_maxrss`` is not that there: it keeps the size of the
    launching process at the fork that started this one (Linux carries it over the
    exec), so a worker started by a launcher holding a dataset would report the
    launcher's size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
