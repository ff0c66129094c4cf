"""Per-rank, per-epoch accounting of where time, bytes and memory went.

Each epoch a worker records: wall and CPU seconds, the seconds of every blocking
communication call (from the communication layer's counter), bytes sent and received
per phase, peak memory (RSS on CPU, the allocator's peak on GPU) and edges computed
(local and redundant). Rank 0 gathers every rank's records; ``summary_lines`` prints
them in the shape of NeutronTP's Table 2 (compute / communication max and min, total,
slowest rank).

Waiting versus transfer. A blocking call lasts from this rank's arrival until the data
is in; a rank that arrives early also waits for the last one to arrive. Every rank
makes the same collectives in the same order, and they all leave a collective at
about the same moment (when the last rank's data is in), so the rank that arrived last
blocked the shortest time, and that shortest time is the call's transfer time.
``split_waiting`` therefore takes, per call, the minimum over ranks as transfer
(``comm_s``) and each rank's excess over it as waiting for a peer (``wait_s``), per
phase. This needs no synchronised clocks and no extra barrier; it is an estimate: it
assumes the ranks leave a call together (true up to the transfer of one message) and
counts a slower peer's late sends as waiting. For an overlapped exchange only the time
blocked in ``wait()`` counts. Compute = wall - transfer - waiting: the rank's own
work. The slowest rank is the one with the largest compute; the others waited for it.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fullgraph.memory import peak_rss_bytes
from fullgraph.runlog import MIB, fmt_bytes, median_epoch, slowest

WAIT_PHASE = "wait"
"""Phase of the barrier strategies call before the gradient sync (split like any call)."""


def peak_memory_bytes(device: torch.device) -> int:
    """Peak resident memory of this process (CPU) or of the CUDA allocator (GPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


@dataclass
class EpochProfile:
    """One rank's accounting of one epoch.

    Until ``split_waiting`` has seen every rank's record, ``comm_s`` is all the time
    spent in blocking calls and ``wait_s`` is 0; ``calls`` holds each call's (phase,
    seconds) for that split, and is emptied by it (``calls_by_phase`` keeps their
    number per phase).

    The epoch's own figures leave out the traffic outside any epoch, which is recorded
    beside them: on the first epoch this run ran, ``setup_sent`` and ``setup_recv``
    (everything before it: connecting, checks, the strategy's set-up and trials); on
    the others, ``between_sent``, ``between_recv`` and ``between_s`` (from the previous
    epoch's end to this one's start: gathering the profiles, the adapters' probes and
    moves, checkpoints), by phase.
    """

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
    saved_bytes: int = 0
    edges_local: int = 0
    edges_redundant: int = 0
    edge_dims: int = 0
    comm_by_phase: dict[str, float] = field(default_factory=dict)
    wait_by_phase: dict[str, float] = field(default_factory=dict)
    waiting_split: bool = False
    calls: list[tuple[str, float]] = field(default_factory=list)
    calls_by_phase: dict[str, int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    setup_sent: dict[str, int] = field(default_factory=dict)
    setup_recv: dict[str, int] = field(default_factory=dict)
    between_sent: dict[str, int] = field(default_factory=dict)
    between_recv: dict[str, int] = field(default_factory=dict)
    between_s: float = 0.0

    def record(self) -> dict[str, Any]:
        """The metrics file's ``rank_epoch`` fields (without ``calls``, the split's
        working list)."""
        out = dataclasses.asdict(self)
        del out["calls"]
        return out


class Profiler:
    """Measures epochs of one rank; ``comm`` may be None (one process, no counters)."""

    def __init__(self, comm: Any, device: torch.device, work: Any = None):
        self.comm = comm
        self.device = device
        self.work = work
        self._start: tuple[float, float, dict[str, Any]] | None = None
        self._events: list[dict[str, Any]] = []
        self._last: tuple[float, dict[str, Any]] | None = None  # at the previous end
        self._outside: dict[str, Any] = {}  # the traffic before the epoch began

    def note(self, event: dict[str, Any]) -> None:
        """Record what a runtime adapter did or injected; it goes into the
        ``events`` of the next epoch that ends (the one it shaped)."""
        self._events.append(event)

    def begin(self) -> None:
        if self.comm is not None:
            self.comm.counter.take_calls()  # calls made between epochs are not the epoch's
        now, counters = time.perf_counter(), self._counters()
        if self._last is None:  # the first epoch this run runs: all before it is set-up
            self._outside = {"setup_sent": _delta({}, counters["sent"]),
                             "setup_recv": _delta({}, counters["recv"])}
        else:
            before_s, before = self._last
            self._outside = {"between_sent": _delta(before["sent"], counters["sent"]),
                             "between_recv": _delta(before["recv"], counters["recv"]),
                             "between_s": now - before_s}
        self._start = (now, time.process_time(), counters)

    def end(self, epoch: int) -> EpochProfile:
        assert self._start is not None, "Profiler.end without begin"
        wall0, cpu0, c0 = self._start
        wall, cpu, c1 = time.perf_counter() - wall0, time.process_time() - cpu0, self._counters()
        calls = self.comm.counter.take_calls() if self.comm is not None else []
        by_phase: dict[str, float] = {}
        count: dict[str, int] = {}
        for phase, seconds in calls:
            by_phase[phase] = by_phase.get(phase, 0.0) + seconds
            count[phase] = count.get(phase, 0) + 1
        comm = sum(by_phase.values())
        self._last = (wall0 + wall, c1)
        return EpochProfile(rank=self.comm.rank if self.comm else 0, epoch=epoch, wall_s=wall,
                            cpu_s=cpu, compute_s=max(0.0, wall - comm), comm_s=comm,
                            wait_s=0.0, bytes_sent=_delta(c0["sent"], c1["sent"]),
                            bytes_recv=_delta(c0["recv"], c1["recv"]),
                            peak_mem=peak_memory_bytes(self.device),
                            edges_local=getattr(self.work, "edges_local", 0),
                            edges_redundant=getattr(self.work, "edges_redundant", 0),
                            edge_dims=getattr(self.work, "edge_dims", 0),
                            comm_by_phase=by_phase, calls=calls, calls_by_phase=count,
                            events=self._take_events(), **self._outside)

    def _take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _counters(self) -> dict[str, Any]:
        if self.comm is None:
            return {"sent": {}, "recv": {}}
        snap = self.comm.counter.snapshot()
        return {key: {phase: v[key] for phase, v in snap.items()} for key in ("sent", "recv")}


def split_waiting(profiles: list[EpochProfile]) -> list[EpochProfile]:
    """Every rank's record of one epoch, with waiting split from transfer (module doc).

    Args:
        profiles: one record per rank, in rank order, straight from ``Profiler.end``.

    Returns:
        New records: per call, the least seconds over ranks is transfer (``comm_s``,
        ``comm_by_phase``) and each rank's excess is waiting (``wait_s``,
        ``wait_by_phase``). When the ranks made different calls (not the same phases in
        the same order) nothing can be matched: all is left as transfer and
        ``waiting_split`` stays False.
    """
    calls = [p.calls for p in profiles]
    phases = [[phase for phase, _ in c] for c in calls]
    matched = len(profiles) > 1 and all(ph == phases[0] for ph in phases)
    least = [min(column) for column in zip(*([s for _, s in c] for c in calls))] \
        if matched else []
    out = []
    for p in profiles:
        comm: dict[str, float] = {}
        wait: dict[str, float] = {}
        for k, (phase, seconds) in enumerate(p.calls):
            moved = least[k] if matched else seconds
            comm[phase] = comm.get(phase, 0.0) + moved
            wait[phase] = wait.get(phase, 0.0) + seconds - moved
        comm_s, wait_s = sum(comm.values()), sum(wait.values())
        out.append(dataclasses.replace(
            p, comm_s=comm_s, wait_s=wait_s, compute_s=max(0.0, p.wall_s - comm_s - wait_s),
            comm_by_phase=comm, wait_by_phase={k: v for k, v in wait.items() if v > 0},
            waiting_split=matched, calls=[]))
    return out


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def summary_lines(profiles: list[list[EpochProfile]]) -> list[str]:
    """Table 2-style summary over epochs: per rank its median epoch, then max / min /
    total."""
    if not profiles or not profiles[0]:
        return []
    rows = []
    for per_rank in profiles:
        med = median_epoch(per_rank, lambda p: p.wall_s)
        rows.append({"rank": per_rank[0].rank, "compute": med.compute_s,
                     "cpu": med.cpu_s, "comm": med.comm_s, "wait": med.wait_s,
                     "wall": med.wall_s,
                     "sent": sum(sum(p.bytes_sent.values()) for p in per_rank) / len(per_rank),
                     "recv": sum(sum(p.bytes_recv.values()) for p in per_rank) / len(per_rank),
                     "mem": max(p.peak_mem for p in per_rank),
                     "saved": max(p.saved_bytes for p in per_rank),
                     "edges": per_rank[-1].edges_local + per_rank[-1].edges_redundant,
                     "redundant": per_rank[-1].edges_redundant,
                     "edge_dims": per_rank[-1].edge_dims})
    lines = ["per rank, its median epoch by wall time (compute + comm + wait = wall; bytes: "
             "means, peak and saved: maxima, edges: one forward pass; an evaluated epoch's "
             "time and bytes include its evaluation; MiB = 2^20 bytes):",
             "rank  compute_s   cpu_s  comm_s  wait_s  wall_s  sent_MiB  recv_MiB peak_MiB"
             " saved_MiB     edges  redundant"]
    for r in rows:
        lines.append(f"{r['rank']:>4} {r['compute']:>9.3f} {r['cpu']:>7.3f} {r['comm']:>7.3f} "
                     f"{r['wait']:>7.3f} {r['wall']:>7.3f} {r['sent'] / MIB:>9.2f} "
                     f"{r['recv'] / MIB:>9.2f} {r['mem'] / MIB:>8.0f} "
                     f"{r['saved'] / MIB:>9.2f} {r['edges']:>9d} "
                     f"{r['redundant']:>10d}")
    comp = [r["compute"] for r in rows]
    work = [r["edge_dims"] for r in rows]
    comm = [r["comm"] for r in rows]
    lines.append(f"compute max/min {max(comp):.3f}/{min(comp):.3f} s "
                 f"({max(comp) / max(min(comp), 1e-9):.2f}x); communication max/min "
                 f"{max(comm):.3f}/{min(comm):.3f} s; bytes sent per epoch, all ranks "
                 f"{sum(r['sent'] for r in rows) / MIB:.2f} MiB")
    lines += outside_lines([[(p.setup_sent, p.between_sent, p.between_s) for p in per_rank]
                            for per_rank in profiles])
    lines += _slowest_lines(profiles, rows)
    if min(work) > 0:
        lines.append(f"aggregation work (edges x columns) max/min {max(work)}/{min(work)} "
                     f"({max(work) / min(work):.3f}x)")
    return lines + event_lines(profiles)


def outside_lines(ranks: Sequence[Sequence[tuple[Mapping[str, float], Mapping[str, float],
                                                float]]]) -> list[str]:
    """The traffic outside the epochs: ``ranks[i]`` holds rank i's epochs, each as
    (``setup_sent``, ``between_sent``, ``between_s``) (``EpochProfile``'s, or a metrics
    file's). One line each for the set-up's bytes and the means between epochs, where
    any moved."""
    setup: dict[str, float] = {}
    between: dict[str, float] = {}
    for per_rank in ranks:
        for sent, later, _ in per_rank:
            for into, what in ((setup, sent), (between, later)):
                for phase, nbytes in what.items():
                    into[phase] = into.get(phase, 0.0) + nbytes
    gaps = max((len(per_rank) for per_rank in ranks), default=0) - 1
    out = []
    if setup:
        out.append(f"set-up traffic before the first epoch, all ranks: "
                   f"{fmt_bytes(sum(setup.values()))} sent ({_by_phase(setup)})")
    if between and gaps > 0:
        seconds = sorted(s for _, _, s in ranks[0][1:])
        out.append(f"between epochs (in no epoch's figures), all ranks: "
                   f"{fmt_bytes(sum(between.values()) / gaps)} sent per epoch "
                   f"({_by_phase({k: v / gaps for k, v in between.items()})}); rank 0 "
                   f"spent a median {seconds[len(seconds) // 2]:.3f} s between epochs")
    return out


def _by_phase(nbytes: Mapping[str, float]) -> str:
    """``halo 1.2 MiB, probe 3.1 KiB``: the phases, the most bytes first."""
    return ", ".join(f"{phase} {fmt_bytes(v)}"
                     for phase, v in sorted(nbytes.items(), key=lambda kv: -kv[1]))


def event_lines(profiles: list[list[Any]]) -> list[str]:
    """What runtime adapters injected and changed, per rank: ``profiles[i]`` holds one
    rank's epochs, each with ``rank`` and ``events`` (``EpochProfile``, or the records
    of a metrics file)."""
    out = []
    for per_rank in profiles:
        slowed: dict[str, int] = {}
        switches = probes = undone = 0
        adapting = cut = False  # (an adapter ran; the starting plan was cut to its budget)
        last: tuple[Any, dict[str, Any]] | None = None  # (epoch, event) of the last switch
        partial = [e for p in per_rank for e in p.events
                   if e.get("kind") == "partial" and not e.get("sync")]
        for p in per_rank:
            for e in p.events:
                adapting |= e.get("kind") in ("adjust", "shares")
                if e.get("kind") == "inject":
                    slowed[e["what"]] = slowed.get(e["what"], 0) + 1
                elif str(e.get("at", "")).startswith("start"):
                    cut = True  # before the first epoch, not a switch between epochs
                elif e.get("kind") in ("adjust", "shares") and e.get("switched"):
                    switches += 1
                    last = (getattr(p, "epoch", None), e)
                if e.get("kind") == "shares":
                    probes += e.get("judged") == "probe kept"
                    undone += str(e.get("judged")).endswith("undone")
        rank = per_rank[0].rank
        if slowed or switches or cut:
            what = ", ".join(f"{n} epoch(s) of {k}" for k, n in sorted(slowed.items()))
            tried = f" ({probes} probe(s) that gave a worker work back and were kept; " \
                f"{undone} trial(s) undone by the switch after)" if probes or undone else ""
            start = "; the starting plan cut to the cache budget" if cut else ""
            switched = f"; plan switched {switches} time(s){tried}{_last_plan(last)}" \
                if adapting else ""
            out.append(f"adapt    rank {rank}: injected {what or 'nothing'}{start}{switched}")
        if partial:
            skipped = sum(rank in e["skipped"] for e in partial)
            stale = sum(e["stale_peers"] for e in partial)
            oldest = max(e["oldest"] for e in partial)
            out.append(f"partial  rank {rank}: {len(partial)} partial epoch(s), left out of "
                       f"{skipped} update(s); used historical rows of {stale} peer exchange(s), "
                       f"at most {oldest} epoch(s) old")
    return out


def _last_plan(last: tuple[Any, dict[str, Any]] | None) -> str:
    """``; the last for epoch 6: rows per worker 903/903/902``: what the last switch
    (epoch, event) made the plan (tensor's rows, or this rank's cached dependencies)."""
    if last is None:
        return ""
    epoch, e = last
    when = "" if epoch is None else f" for epoch {epoch}"
    if "rows" in e:
        return f"; the last{when}: rows per worker {'/'.join(map(str, e['rows']))}"
    if "cached" in e:
        return (f"; the last{when}: {e['cached']} of its {e['cached'] + e['fetched']} remote "
                "dependencies cached, the others fetched")
    return ""


def _slowest_lines(profiles: list[list[EpochProfile]], rows: list[dict[str, Any]]) -> list[str]:
    """The rank the others waited for, and where the waiting was, per phase."""
    if len(rows) < 2:
        return []
    if not all(p.waiting_split for per_rank in profiles for p in per_rank):
        return ["slowest rank unknown: the ranks' communication calls did not match, so "
                "waiting could not be told from transfer"]
    at, clear = slowest([r["compute"] for r in rows], [r["wait"] for r in rows])
    slowest_row = rows[at]
    others = [r["wait"] for r in rows if r is not slowest_row]
    if not clear:
        lines = [f"no clear slowest rank: the one with the most compute (rank "
                 f"{slowest_row['rank']}, {slowest_row['compute']:.3f} s per epoch) waited "
                 f"{slowest_row['wait']:.3f} s itself, the others {min(others):.3f}-"
                 f"{max(others):.3f} s (workers sharing cores take turns being late)"]
    else:
        lines = [f"slowest rank {slowest_row['rank']}: compute {slowest_row['compute']:.3f} "
                 f"s per epoch, the others waited {min(others):.3f}-{max(others):.3f} s for "
                 f"it (it waited {slowest_row['wait']:.3f} s)"]
    moved: dict[str, float] = {}
    waited: dict[str, float] = {}
    for per_rank in profiles:
        for p in per_rank:
            for phase, sec in p.comm_by_phase.items():
                moved[phase] = moved.get(phase, 0.0) + sec / len(per_rank)
            for phase, sec in p.wait_by_phase.items():
                waited[phase] = waited.get(phase, 0.0) + sec / len(per_rank)
    if moved:
        parts = [f"{ph} {moved[ph]:.3f}/{waited.get(ph, 0.0):.3f}"
                 for ph in sorted(moved, key=lambda ph: -(moved[ph] + waited.get(ph, 0.0)))]
        lines.append("communication per epoch by phase, transfer/waiting s summed over "
                     "ranks: " + ", ".join(parts))
    return lines
