"""Tables of the G3 benchmark (``fullgraph.bench.p2p``): per-configuration summaries,
Fig. 16 and Fig. 17 in markdown, the byte and loss agreement checks, and the side by
side ratios of world sizes and links. Pure functions of the per-rank records.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any, TypeGuard

import torch

from fullgraph.bench.tensor import CLASSES, _mb, _ratio
from fullgraph.runlog import MIB

PARTITIONERS = ("random", "chunk", "metis", "g3")
SCHEDULES = ("sequential", "inter-layer", "intra-layer", "multi-level")
FIG16_SCHEDULE = "multi-level"  # Fig. 16 varies the partitioner under this schedule
FIG17_PARTITIONER = "g3"  # Fig. 17 varies the schedule on this partition
VERTEX_PHASES = ("push", "push-grad")  # the p2p strategy's vertex data
LOSS_TOL = 1e-4
HOST = "host"  # --link-rate: every rank on this host, gloo over the loopback (mp.spawn)
VETH = "veth"  # --link-rate: two namespaces joined by a veth pair, not shaped


def link_label(link: str) -> str:
    if link == HOST:
        return "one host (loopback)"
    if link == VETH:
        return "2 namespaces, veth not shaped"
    return f"2 namespaces, veth shaped to {link}"


def config_name(partitioner: str, schedule: str) -> str:
    return f"{partitioner}/{schedule}"


def bin_size(args: argparse.Namespace, world: int) -> int:
    if args.bin_size:
        return args.bin_size
    return max(1, math.ceil(args.vertices / (world * args.bins_per_worker)))


def _phase_sum(phases: dict[str, Any], names: tuple[str, ...], key: str) -> float:
    return sum(phases.get(n, {}).get(key, 0) for n in names)


def summarise(partitioner: str, schedule: str, world: int,
              ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's record from its per-rank results."""
    head = {"config": config_name(partitioner, schedule), "workers": world,
            "partitioner": partitioner, "schedule": schedule}
    if any("error" in r for r in ranks):
        return {**head, "error": next(r["error"] for r in ranks if "error" in r)}
    med = statistics.median
    num_epochs = len(ranks[0]["epochs"])
    cpu = [med(e["cpu_s"] for e in r["epochs"]) for r in ranks]
    wall = med(max(r["epochs"][i]["wall_s"] for r in ranks) for i in range(num_epochs))

    def per_rank(fn: Any) -> list[float]:
        return [med(fn(e["phases"]) for e in r["epochs"]) for r in ranks]

    vertex_moved = per_rank(lambda ph: _phase_sum(ph, VERTEX_PHASES, "sent")
                            + _phase_sum(ph, VERTEX_PHASES, "recv"))
    all_moved = per_rank(lambda ph: sum(v["sent"] + v["recv"] for v in ph.values()))
    blocked = per_rank(lambda ph: _phase_sum(ph, VERTEX_PHASES, "seconds"))
    barrier = per_rank(lambda ph: _phase_sum(ph, ("wait",), "seconds"))
    push_sent = [int(med(e["phases"].get("push", {}).get("sent", 0) for e in r["epochs"]))
                 for r in ranks]
    grad_sent = [int(med(e["phases"].get("push-grad", {}).get("sent", 0) for e in r["epochs"]))
                 for r in ranks]
    edge_dims = [r["edge_dims"] for r in ranks]
    partition_s = [r["partition_s"] for r in ranks if r["partition_s"] is not None]
    limits = ranks[0]["plan"]["limits"]
    return {**head, "bin_size": limits[0] if limits else None,
            "bins_per_rank": [r["plan"]["bins"] for r in ranks],
            "rounds": ranks[0]["plan"]["rounds"],
            "owned_per_rank": [r["plan"]["owned"] for r in ranks],
            "rows_sent_per_rank": [r["plan"]["rows_sent"] for r in ranks],
            "wall_s": wall, "wall_s_epochs": [max(r["epochs"][i]["wall_s"] for r in ranks)
                                              for i in range(num_epochs)],
            "cpu_s_per_rank": cpu, "cpu_s_median": med(cpu), "cpu_s_max": max(cpu),
            "cpu_s_min": min(cpu), "cpu_max_min": _ratio(cpu),
            "edge_dims_per_rank": edge_dims, "edge_dims_max_min": _ratio(edge_dims),
            "bytes_vertex_per_rank": vertex_moved, "bytes_vertex_max_min": _ratio(vertex_moved),
            "bytes_all_per_rank": all_moved, "bytes_all_max_min": _ratio(all_moved),
            "push_sent_per_rank": push_sent, "push_grad_sent_per_rank": grad_sent,
            "bytes_push_total": sum(push_sent), "bytes_push_grad_total": sum(grad_sent),
            "bytes_vertex_total": sum(push_sent) + sum(grad_sent),
            "blocked_s_per_rank": blocked, "blocked_s_median": med(blocked),
            "blocked_s_max": max(blocked), "barrier_s_per_rank": barrier,
            "barrier_s_max": max(barrier),
            "partition_s": max(partition_s) if partition_s else None,
            "setup_s_max": max(r["setup_s"] for r in ranks),
            "losses": [e["loss"] for e in ranks[0]["epochs"]],
            "rss_mib_max": max(r["rss_mib"] for r in ranks)}


# ---------------------------------------------------------------- report
def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": len(os.sched_getaffinity(0)), "cpu_model": model,
            "torch": torch.__version__, "python": platform.python_version(),
            "host_cpus": os.cpu_count()}


def _find(rows: list[dict[str, Any]], partitioner: str, schedule: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["partitioner"] == partitioner
                 and r["schedule"] == schedule), None)


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_fig16(rows: list[dict[str, Any]], args: argparse.Namespace, world: int,
                where: str = "") -> None:
    print(f"\n### Fig. 16, {world} workers{where}: partitioners under the {FIG16_SCHEDULE} "
          "schedule\n")
    print("| partitioner | epoch wall s | CPU s/rank, median | max | CPU max/min "
          "| edges x cols max/min | vertex bytes/rank max/min | vertex MiB/epoch, all ranks "
          "| push MiB | push-grad MiB | partition s | setup s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in args.partitioners:
        r = _find(rows, p, FIG16_SCHEDULE)
        if r is None:
            continue
        if "error" in r:
            print(f"| {p} | error: {r['error']} |||||||||||")
            continue
        print(f"| {p} | {r['wall_s']:.2f} | {r['cpu_s_median']:.2f} | {r['cpu_s_max']:.2f} "
              f"| {r['cpu_max_min']:.2f} | {r['edge_dims_max_min']:.2f} "
              f"| {r['bytes_vertex_max_min']:.2f} | {_mb(r['bytes_vertex_total'])} "
              f"| {_mb(r['bytes_push_total'])} | {_mb(r['bytes_push_grad_total'])} "
              f"| {_s(r['partition_s'])} | {r['setup_s_max']:.2f} |")
    ok = [r for r in rows if r["schedule"] == FIG16_SCHEDULE and "error" not in r]
    if ok:
        print("\nPer rank (CPU s; vertex MiB sent+received; vertices owned):")
        for r in ok:
            print(f"- {r['partitioner']}: CPU {[round(c, 2) for c in r['cpu_s_per_rank']]}, "
                  f"MiB {[_mb(b) for b in r['bytes_vertex_per_rank']]}, "
                  f"owned {r['owned_per_rank']}")


def print_fig17(rows: list[dict[str, Any]], args: argparse.Namespace, world: int,
                where: str = "") -> None:
    print(f"\n### Fig. 17, {world} workers{where}: schedules on the {FIG17_PARTITIONER} "
          "partition\n")
    print("| schedule | bins/worker per phase (rank 0) | epoch wall s | CPU s/rank, median "
          "| max | blocked in push waits s/rank, median | max | barrier wait s max "
          "| vertex MiB/epoch | wall / sequential | CPU max / sequential |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    seq = _find(rows, FIG17_PARTITIONER, "sequential")
    seq = None if seq is None or "error" in seq else seq
    for s in args.schedules:
        r = _find(rows, FIG17_PARTITIONER, s)
        if r is None:
            continue
        if "error" in r:
            print(f"| {s} | error: {r['error']} ||||||||||")
            continue
        ratio = f"{r['wall_s'] / seq['wall_s']:.2f}" if seq else "n/a"
        cpu_ratio = f"{r['cpu_s_max'] / seq['cpu_s_max']:.2f}" if seq else "n/a"
        print(f"| {s} | {r['bins_per_rank'][0]} | {r['wall_s']:.2f} | {r['cpu_s_median']:.2f} "
              f"| {r['cpu_s_max']:.2f} | {r['blocked_s_median']:.2f} | {r['blocked_s_max']:.2f} "
              f"| {r['barrier_s_max']:.2f} | {_mb(r['bytes_vertex_total'])} | {ratio} "
              f"| {cpu_ratio} |")


def check_bytes(rows: list[dict[str, Any]]) -> bool:
    """Print whether each partitioner's p2p bytes per rank are equal across schedules."""
    ok = True
    for p in dict.fromkeys(r["partitioner"] for r in rows):
        same = [r for r in rows if r["partitioner"] == p and "error" not in r]
        if len(same) < 2:
            continue
        keys = {r["schedule"]: (tuple(r["push_sent_per_rank"]),
                                tuple(r["push_grad_sent_per_rank"])) for r in same}
        equal = len(set(keys.values())) == 1
        ok &= equal
        push, grad = next(iter(keys.values()))
        print(f"\nCheck: {p} partition, p2p bytes identical across schedules "
              f"({', '.join(keys)}): {'yes' if equal else 'NO'}"
              f" (push sent per rank {list(push)}, push-grad {list(grad)})"
              + ("" if equal else f"; per schedule {keys}"))
    return ok


def check_losses(rows: list[dict[str, Any]]) -> bool:
    ok_rows = [r for r in rows if "error" not in r]
    if len(ok_rows) < 2:
        return True
    ref = ok_rows[0]["losses"]
    diff = max(abs(a - b) for r in ok_rows for a, b in zip(ref, r["losses"]))
    same = diff < LOSS_TOL
    print(f"Check: losses agree across all configurations (max |diff| {diff:.2e} < {LOSS_TOL}):"
          f" {'yes' if same else 'NO'} {[round(x, 5) for x in ref]}")
    return same


def print_header(args: argparse.Namespace, info: dict[str, Any], machine: dict[str, Any],
                 links: dict[str, dict[str, Any]]) -> None:
    print(f"\n## G3 Fig. 16 / Fig. 17 at small scale (P2P hybrid parallelism)\n\n"
          f"Command: `{info['command']}`  \n"
          f"Date: {info['date']}  \n"
          f"Machine: {machine['cores']} cores available ({machine['host_cpus']} on the host), "
          f"{machine['cpu_model']}; torch {machine['torch']}, Python {machine['python']}\n\n"
          f"R-MAT {info['vertices']} vertices, {info['edges']} edges (symmetrised, "
          f"deduplicated; +self-loops for GCN), coupled GCN {args.features}-{args.hidden}-"
          f"{CLASSES}, dropout 0.5, Adam; gloo workers x 1 thread; {args.warmup} warm-up + "
          f"{args.epochs} timed epochs, medians; bins of "
          + (f"{args.bin_size} vertices" if args.bin_size else
             f"ceil(vertices / (workers x {args.bins_per_worker})) vertices")
          + f"; partitioner seed {args.seed}.")
    for name, link in links.items():
        print(f"\nLink `{name}`: {link['description']}.", end="")
        if link.get("probe"):
            pr = link["probe"]
            both = " and ".join(f"{x:.3f}" for x in pr.get("both_ways_gbit_s", []))
            print(f" Measured TCP payload rate (bench.netlink.probe, "
                  f"{pr['bytes_per_stream'] / MIB:.0f} MiB per stream): one way "
                  f"{pr['one_way_gbit_s']:.3f} Gbit/s" + (f"; both ways at once {both} Gbit/s"
                                                          if both else "") + ".", end="")
        print()


def print_world(rows: list[dict[str, Any]], args: argparse.Namespace, world: int,
                cores: int, load: tuple[float, float], link: str = HOST,
                link_info: dict[str, Any] | None = None) -> None:
    where = f", {link_label(link)}"
    print(f"\n## {world} workers{where}\n")
    print(f"Bin size {bin_size(args, world)} vertices; 1-minute load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after (shared machine: load above {cores} means other jobs ran).")
    if link != HOST:
        cross = sum(1 for i in range(world) for j in range(i + 1, world) if i % 2 != j % 2)
        print(f"\nRanks {list(range(0, world, 2))} in namespace A, {list(range(1, world, 2))} "
              f"in B: {cross} of {world * (world - 1) // 2} rank pairs cross the link.", end="")
        tx = (link_info or {}).get("tx_bytes")
        if tx:
            print(f" Bytes sent over the veth during this world size's whole run (setup, "
                  f"warm-up and timed epochs of every configuration, frame headers "
                  f"included): A->B {tx[0] / MIB:.0f} MiB, B->A {tx[1] / MIB:.0f} MiB.", end="")
        print()
    if world > cores:
        print(f"\nNOTE: {world} workers x 1 thread > {cores} cores: workers time-share the "
              "cores, so wall time and blocked seconds are inflated and noisy; per-rank CPU "
              "time (process_time, includes gloo's and the loader's threads) is the compute "
              "measure.")
    print_fig16(rows, args, world, where)
    print_fig17(rows, args, world, where)
    check_bytes(rows)
    check_losses(rows)


def print_side_by_side(by_run: dict[tuple[str, int], list[dict[str, Any]]],
                       args: argparse.Namespace) -> None:
    if len(by_run) < 2:
        return
    runs = list(by_run)
    only_host = all(link == HOST for link, _ in runs)
    cols = " | ".join(f"{w} workers" if only_host else f"{w} workers, {link_label(link)}"
                      for link, w in runs)
    sep = "|---|" + "---:|" * len(runs)
    print("\n## World sizes side by side\n" if only_host else
          "\n## World sizes and links side by side\n")
    print(f"Fig. 16, epoch wall s / CPU s max per rank ({FIG16_SCHEDULE}):\n")
    print(f"| partitioner | {cols} |\n{sep}")
    for p in args.partitioners:
        cells = [_cell(_find(by_run[w], p, FIG16_SCHEDULE),
                       lambda r: f"{r['wall_s']:.2f} / {r['cpu_s_max']:.2f}") for w in runs]
        print(f"| {p} | {' | '.join(cells)} |")
    print(f"\nFig. 17, epoch wall time / sequential's ({FIG17_PARTITIONER}):\n")
    print(f"| schedule | {cols} |\n{sep}")
    for s in args.schedules:
        cells = []
        for w in runs:
            seq = _find(by_run[w], FIG17_PARTITIONER, "sequential")
            r = _find(by_run[w], FIG17_PARTITIONER, s)
            cells.append(f"{r['wall_s'] / seq['wall_s']:.2f}" if _ok(r) and _ok(seq) else "n/a")
        print(f"| {s} | {' | '.join(cells)} |")
    print(f"\nFig. 17, epoch wall s / blocked in push waits s, max over ranks "
          f"({FIG17_PARTITIONER}):\n")
    print(f"| schedule | {cols} |\n{sep}")
    for s in args.schedules:
        cells = [_cell(_find(by_run[w], FIG17_PARTITIONER, s),
                       lambda r: f"{r['wall_s']:.2f} / {r['blocked_s_max']:.2f}") for w in runs]
        print(f"| {s} | {' | '.join(cells)} |")


def _ok(record: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Whether a configuration ran (it is neither missing nor failed)."""
    return record is not None and "error" not in record


def _cell(record: dict[str, Any] | None, fmt: Any) -> str:
    """``fmt(record)``, or n/a for a configuration that is missing or failed."""
    return fmt(record) if _ok(record) else "n/a"
