"""All-to-all between workers on this host: shared memory against gloo (a script).

Starts ``--workers`` gloo ranks (one thread each) and times ``all_to_all_v`` with
``--mb`` MiB per peer, through the shared-memory transport (``fullgraph.comm.shm``)
and through gloo's ``all_to_all_single``, alternating, ``--repeats`` times each after
a barrier; the median of the slowest rank's time per call, and the rate at which one
rank sends to its peers in GiB/s (MiB and GiB as ``fullgraph train`` prints them).

    python -m fullgraph.bench.exchange --workers 2 --mb 1 4 16 64
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fullgraph.bench import entry_point
from fullgraph.runlog import MIB


def _rank(rank: int, world: int, store: str, sizes: list[float], repeats: int,
          out: str) -> None:
    from fullgraph.comm import all_reduce_, all_to_all_v, barrier, destroy_comm, init_comm

    torch.set_num_threads(1)
    comm = init_comm(backend="gloo", init_method=f"file://{store}", rank=rank,
                     world_size=world, timeout_s=120)
    try:
        paths = {"shm": comm, "gloo": dataclasses.replace(comm, shm=None)}
        if comm.shm is None:
            paths.pop("shm")
        lines = []
        for mb in sizes:
            rows = max(1, int(mb * MIB / 4 / 256))
            send = [torch.randn(rows, 256) for _ in range(world)]
            times: dict[str, list[float]] = {k: [] for k in paths}
            for _ in range(repeats + 1):
                for name, c in paths.items():
                    barrier(comm, "bench")
                    t0 = time.perf_counter()
                    all_to_all_v(send, [rows] * world, c, "bench")
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    times[name].append(float(all_reduce_(dt, comm, "bench", op="max")[0]))
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            peer_mb = rows * 256 * 4 / MIB
            row = [f"{peer_mb:.1f}"]
            for name in ("shm", "gloo"):
                if name in med:
                    gibs = peer_mb * (world - 1) / 1024 / med[name]  # (MiB -> GiB)
                    row.append(f"{med[name] * 1e3:.2f} ms ({gibs:.2f} GiB/s)")
                else:
                    row.append("-")
            row.append(f"{med['gloo'] / med['shm']:.1f}x" if "shm" in med else "-")
            lines.append("| " + " | ".join(row) + " |")
        if rank == 0:
            Path(out).write_text("\n".join(lines) + "\n")
    finally:
        destroy_comm(comm)


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fullgraph-bench-exchange-") as tmp:
        out = str(Path(tmp) / "table.md")
        mp.spawn(_rank, args=(args.workers, str(Path(tmp) / "store"), args.mb, args.repeats,
                              out), nprocs=args.workers, join=True)
        table = Path(out).read_text()
    print(f"<!-- {datetime.date.today()} {platform.node()}, {args.workers} workers x 1 "
          f"thread, median of {args.repeats}, slowest rank -->\n")
    print("| MiB per peer | shared memory | gloo | gloo / shared memory |")
    print("| --- | --- | --- | --- |")
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
