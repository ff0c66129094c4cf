"""Per-rank, per-epoch accounting of where time, bytes and memory went.

Each epoch a worker records: wall and CPU seconds, communication seconds (time
inside collectives, from the communication layer's counter), waiting seconds (the
barrier before the gradient sync, i.e. waiting for slower workers), compute =
wall - communication - waiting, bytes sent and received per phase, peak memory (RSS
on CPU, the allocator's peak on GPU) and edges computed (local and redundant).
Rank 0 gathers every rank's records; ``summary_lines`` prints them in the shape of
NeutronTP's Table 2 (compute / communication max and min, total, slowest rank).
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

WAIT_PHASE = "wait"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak resident memory of this process (CPU) or of the CUDA allocator (GPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class EpochProfile:
    """One rank's accounting of one epoch."""

    rank: int
    epoch: int
    wall_s: float
    cpu_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_recv: dict[str, int] = field(default_factory=dict)
    peak_mem: int = 0
    edges_local: int = 0
    edges_redundant: int = 0
    edge_dims: int = 0


class Profiler:
    """Measures epochs of one rank; ``comm`` may be None (one process, no counters)."""

    def __init__(self, comm: Any, device: torch.device, work: Any = None):
        self.comm = comm
        self.device = device
        self.work = work
        self._start: tuple[float, float, dict[str, Any]] | None = None

    def begin(self) -> None:
        self._start = (time.perf_counter(), time.process_time(), self._counters())

    def end(self, epoch: int) -> EpochProfile:
        assert self._start is not None, "Profiler.end without begin"
        wall0, cpu0, c0 = self._start
        wall, cpu, c1 = time.perf_counter() - wall0, time.process_time() - cpu0, self._counters()
        seconds = {k: c1["seconds"].get(k, 0.0) - c0["seconds"].get(k, 0.0) for k in c1["seconds"]}
        wait = seconds.pop(WAIT_PHASE, 0.0)
        comm = sum(seconds.values())
        sent = _delta(c0["sent"], c1["sent"])
        recv = _delta(c0["recv"], c1["recv"])
        return EpochProfile(rank=self.comm.rank if self.comm else 0, epoch=epoch, wall_s=wall,
                            cpu_s=cpu, compute_s=max(0.0, wall - comm - wait), comm_s=comm,
                            wait_s=wait, bytes_sent=sent, bytes_recv=recv,
                            peak_mem=peak_memory_bytes(self.device),
                            edges_local=getattr(self.work, "edges_local", 0),
                            edges_redundant=getattr(self.work, "edges_redundant", 0),
                            edge_dims=getattr(self.work, "edge_dims", 0))

    def _counters(self) -> dict[str, Any]:
        if self.comm is None:
            return {"sent": {}, "recv": {}, "seconds": {}}
        snap = self.comm.counter.snapshot()
        return {key: {phase: v[key] for phase, v in snap.items()}
                for key in ("sent", "recv", "seconds")}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _medians(profiles: list[EpochProfile], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = sorted(getattr(p, key) for p in profiles)
        out[key] = values[len(values) // 2]
    return out


def summary_lines(profiles: list[list[EpochProfile]]) -> list[str]:
    """Table 2-style summary over epochs: per rank medians, then max / min / total."""
    if not profiles or not profiles[0]:
        return []
    rows = []
    for per_rank in profiles:
        med = _medians(per_rank, ("compute_s", "cpu_s", "comm_s", "wait_s", "wall_s"))
        rows.append({"rank": per_rank[0].rank, "compute": med["compute_s"],
                     "cpu": med["cpu_s"], "comm": med["comm_s"], "wait": med["wait_s"],
                     "wall": med["wall_s"],
                     "sent": sum(sum(p.bytes_sent.values()) for p in per_rank) / len(per_rank),
                     "recv": sum(sum(p.bytes_recv.values()) for p in per_rank) / len(per_rank),
                     "mem": max(p.peak_mem for p in per_rank),
                     "edges": per_rank[-1].edges_local + per_rank[-1].edges_redundant,
                     "redundant": per_rank[-1].edges_redundant,
                     "edge_dims": per_rank[-1].edge_dims})
    lines = ["per-rank medians per epoch:",
             "rank  compute_s   cpu_s  comm_s  wait_s  wall_s   sent_MB   recv_MB  peak_MB"
             "     edges  redundant"]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['compute']:>9.3f} {r['cpu']:>7.3f} {r['comm']:>7.3f} "
                     f"{r['wait']:>7.3f} {r['wall']:>7.3f} {r['sent'] / 1e6:>9.2f} "
                     f"{r['recv'] / 1e6:>9.2f} {r['mem'] / 2**20:>8.0f} {r['edges']:>9d} "
                     f"{r['redundant']:>10d}")
    comp = [r["compute"] for r in rows]
    work = [r["edge_dims"] for r in rows]
    comm = [r["comm"] for r in rows]
    slowest = max(rows, key=lambda r: r["compute"] + r["comm"])
    lines.append(f"compute max/min {max(comp):.3f}/{min(comp):.3f} s "
                 f"({max(comp) / max(min(comp), 1e-9):.2f}x); communication max/min "
                 f"{max(comm):.3f}/{min(comm):.3f} s; bytes sent per epoch, all ranks "
                 f"{sum(r['sent'] for r in rows) / 1e6:.2f} MB; slowest rank {slowest['rank']}")
    if min(work) > 0:
        lines.append(f"aggregation work (edges x columns) max/min {max(work)}/{min(work)} "
                     f"({max(work) / min(work):.3f}x)")
    return lines
