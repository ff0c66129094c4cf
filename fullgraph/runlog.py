"""Reading a run's metrics file (``--metrics-out``) back, for ``fullgraph report``.

The file holds JSON lines (``fullgraph.report.Reporter``): one ``run`` record (the
config, the dataset's counts, device, workers, threads, setup time), one ``epoch``
record per epoch, with several workers one ``rank_epoch`` record per rank and epoch
(``fullgraph.profile.EpochProfile`` with waiting split from transfer), and a final
``summary`` record. Records of other kinds are skipped, so a newer writer's extra
records do not break the report.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fullgraph.errors import DataError

T = TypeVar("T")

KNOWN_EVENTS = ("run", "epoch", "rank_epoch", "summary")

MIB = 2**20
"""Bytes in a MiB, the unit of every byte and memory figure a run prints."""


def fmt_bytes(n: float) -> str:
    """``512 B``, ``3.2 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class RunLog:
    """One run's metrics file, by record kind.

    Attributes:
        source: the file.
        run: the ``run`` record.
        epochs: the ``epoch`` records, in order.
        ranks: rank -> its ``rank_epoch`` records in epoch order (empty for one worker),
            of the epochs this run ran.
        summary: the ``summary`` record, or None for a run that did not finish.
        restored_ranks: rank -> the ``rank_epoch`` records of restored epochs, carried
            from the file of the run that checkpointed them (``"restored": true``; that
            run's workers, maybe under another strategy or worker count).
    """

    source: Path
    run: dict[str, Any]
    epochs: list[dict[str, Any]]
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    restored_ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def config(self, section: str, key: str, default: Any = None) -> Any:
        """One option of the run's config (``default`` when the file lacks it)."""
        return self.run.get("config", {}).get(section, {}).get(key, default)

    @property
    def ran(self) -> list[dict[str, Any]]:
        """The ``epoch`` records of the epochs this run ran: not those a checkpoint
        brought (``"restored": true``), which another strategy may have timed."""
        return [e for e in self.epochs if not e.get("restored")]


@dataclass
class RankRow:
    """One rank's median epoch (seconds: ``median_epoch``) and means per epoch (bytes)."""

    rank: int
    compute_s: float
    comm_s: float
    wait_s: float
    wall_s: float
    sent: dict[str, float]
    recv: dict[str, float]
    peak_mem: int


REQUIRED = {
    "epoch": ("epoch", "loss", "train_acc", "val_acc", "test_acc", "epoch_s"),
    "rank_epoch": ("rank", "epoch", "compute_s", "comm_s", "wait_s", "wall_s"),
    "summary": ("best_epoch", "best_val", "test_acc", "train_acc", "total_s",
                "median_epoch_s"),
}
"""The keys of each record kind that the report reads (every version wrote them)."""


def read_run_log(path: str | Path) -> RunLog:
    """Parse a metrics file.

    Raises:
        DataError: the file is missing or not text, a line is not a JSON object or
            lacks a key of its kind (``REQUIRED``), it has no ``run`` record or no
            ``epoch`` record, or a second ``run`` record (the message names file and
            line).
    """
    path = Path(path)
    if path.is_dir():
        raise DataError("is a directory, not a metrics file", source=path,
                        hint="give the file `fullgraph train --metrics-out FILE` wrote")
    if not path.is_file():
        raise DataError("metrics file not found", source=path,
                        hint="write one with `fullgraph train --metrics-out FILE`")
    run: dict[str, Any] | None = None
    run_line = 0
    log = RunLog(path, {}, [])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError("not a metrics file: not text (a checkpoint or a model file?)",
                        source=path, hint="give the file `fullgraph train --metrics-out "
                        "FILE` wrote") from None
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not text.endswith("\n"):  # a run stopped mid-write
                warnings.warn(f"{path}: line {n} was cut off (the run stopped while writing "
                              f"it); read up to line {n - 1}", stacklevel=2)
                break
            raise DataError("not a JSON line", source=path, line=n, found=str(exc)) from None
        if not isinstance(record, dict) or "event" not in record:
            raise DataError("not a metrics record", source=path, line=n,
                            expected='a JSON object with an "event" key')
        event = record.pop("event")
        lacks = [k for k in REQUIRED.get(event, ()) if k not in record]
        if lacks:
            raise DataError(f"a {event!r} record without {', '.join(map(repr, lacks))}",
                            source=path, line=n, hint="a file fullgraph wrote has them; was "
                            "it edited, or written by another tool?")
        if event == "run":
            if run is not None:
                raise DataError(f"a second run starts here (the first at line {run_line}): the "
                                "file holds several runs", source=path, line=n,
                                hint="give each run its own --metrics-out file")
            run, run_line = record, n
        elif event == "epoch":
            log.epochs.append(record)
        elif event == "rank_epoch":
            into = log.restored_ranks if record.get("restored") else log.ranks
            into.setdefault(int(record["rank"]), []).append(record)
        elif event == "summary":
            log.summary = record
    if run is None:
        raise DataError("no run record: not a complete fullgraph metrics file",
                        source=path, hint="write one with `fullgraph train --metrics-out FILE`")
    if not log.epochs:
        what = ", ".join(f"{k} {v}" for k, v in (
            ("strategy", run.get("config", {}).get("runtime", {}).get("strategy")),
            ("dataset", run.get("dataset", {}).get("name"))) if v)
        raise DataError(f"no epoch record: the run{f' ({what})' if what else ''} stopped "
                        "before its first epoch ended", source=path,
                        hint="its output (or a launcher's run directory) says why")
    log.run = run
    return log


def median_epoch(epochs: Sequence[T], wall: Callable[[T], float]) -> T:
    """Of one rank's ``epochs``, the one of median ``wall`` time (the later of the middle
    two for an even count): its compute, transfer and waiting add up to its wall time,
    where medians taken apart would not."""
    return sorted(epochs, key=wall)[len(epochs) // 2]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _mean_by_phase(records: list[dict[str, Any]], key: str) -> dict[str, float]:
    total: dict[str, float] = {}
    for rec in records:
        for phase, nbytes in rec.get(key, {}).items():
            total[phase] = total.get(phase, 0.0) + nbytes
    return {phase: v / len(records) for phase, v in total.items()}


def rank_rows(log: RunLog) -> list[RankRow]:
    """Per rank, its median epoch (``median_epoch``) as ``fullgraph.profile.summary_lines``
    takes it.

    A one-worker run has no per-rank records: its one row is the epoch time, all
    compute. A run without them otherwise (resumed after its last epoch, so that none
    ran) has no rows.
    """
    if not log.ranks and (int(log.run.get("workers", 1)) > 1 or not log.ran):
        return []
    if not log.ranks:
        wall = _median([e["epoch_s"] for e in log.ran])
        return [RankRow(0, wall, 0.0, 0.0, wall, {}, {}, 0)]
    rows = []
    for rank, recs in sorted(log.ranks.items()):
        med = median_epoch(recs, lambda r: r["wall_s"])
        rows.append(RankRow(rank, med["compute_s"], med["comm_s"], med["wait_s"], med["wall_s"],
                            _mean_by_phase(recs, "bytes_sent"), _mean_by_phase(recs, "bytes_recv"),
                            max(r.get("peak_mem", 0) for r in recs)))
    return rows


SLOWEST_MARGIN = 0.5
"""The rank with the most compute is the one the others waited for only where it
waited less than this fraction of the least any other rank waited."""


def slowest(compute: Sequence[float], wait: Sequence[float]) -> tuple[int, bool]:
    """Of ranks with these median compute and waiting seconds: the index of the one
    with the most compute, and whether it is the one the others waited for (False
    where it waited at least ``SLOWEST_MARGIN`` as long as another: workers sharing
    cores take turns being late, and a pipeline makes every rank wait alike, so no one
    rank holds the others up)."""
    i = max(range(len(compute)), key=lambda r: compute[r])
    others = [w for r, w in enumerate(wait) if r != i]
    return i, not (others and min(others) > 0 and wait[i] >= SLOWEST_MARGIN * min(others))


def waiting_split(log: RunLog) -> bool:
    """Whether waiting was told from transfer in every per-rank record (the ranks'
    communication calls matched)."""
    return all(r.get("waiting_split", False) for recs in log.ranks.values() for r in recs)


def slowest_rank(log: RunLog, rows: list[RankRow]) -> int | None:
    """The rank the others waited for (largest compute), or None.

    None with one worker, when waiting could not be told from transfer (the ranks'
    communication calls did not match; ``waiting_split`` is False), or when the rank
    with the most compute waited as long as another (no one rank held the others up,
    as ``profile.summary_lines`` says).
    """
    if len(rows) < 2:
        return None
    if not waiting_split(log):
        return None
    at, clear = slowest([r.compute_s for r in rows], [r.wait_s for r in rows])
    return rows[at].rank if clear else None


def phases(rows: list[RankRow]) -> list[str]:
    """Communication phases, the most bytes first."""
    total: dict[str, float] = {}
    for row in rows:
        for phase, nbytes in row.sent.items():
            total[phase] = total.get(phase, 0.0) + nbytes
    return sorted(total, key=lambda p: -total[p])
