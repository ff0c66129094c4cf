"""What a run shows: a header, a progress bar on a terminal, a per-epoch table, a
JSON-lines metrics file and a final summary.

The table goes to stdout (so it can be piped and kept); the progress bar goes to
stderr and only when stderr is a terminal; the metrics file gets one JSON object per
line: a ``run`` record, one ``epoch`` record per epoch and a ``summary`` record.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any


@dataclass
class EpochRecord:
    """One epoch of training, as reported."""

    epoch: int
    loss: float
    train_acc: float
    val_acc: float
    test_acc: float
    epoch_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    eval_s: float = 0.0
    """The evaluation after the step (0 on epochs without one); ``epoch_s`` counts it."""
    sync_s: float = 0.0
    """Making the gradients global after the backward, the barrier before it included."""
    other_s: float = 0.0
    """What the columns before leave of ``epoch_s``: zeroing gradients, reducing the
    loss for the report (partial reduce reduces it with the gradients: in ``sync_s``
    then), the runtime adapters' hooks in the epoch, bookkeeping."""


# (header, width, format) of each table column
TABLE_COLUMNS = (("epoch", 5, "d"), ("loss", 8, ".4f"), ("train", 7, ".2%"), ("val", 7, ".2%"),
                 ("test", 7, ".2%"), ("epoch_s", 8, ".3f"), ("fwd_s", 7, ".3f"),
                 ("bwd_s", 7, ".3f"), ("sync_s", 7, ".3f"), ("opt_s", 7, ".3f"),
                 ("eval_s", 7, ".3f"), ("other_s", 7, ".3f"))


class Reporter:
    """Writes the run's output; every method is a no-op on non-reporting ranks.

    Args:
        total_epochs: for the progress bar.
        metrics_out: path of the JSON-lines file, or None.
        progress: ``"auto"`` (bar when stderr is a terminal), ``"on"`` or ``"off"``.
        enabled: False on workers other than rank 0 (default: True).
        verbose: print the header, table and summary; False (``--quiet``) leaves only
            the metrics file (default: True).
        stream: where the table goes (default: stdout).
    """

    def __init__(self, total_epochs: int, *, metrics_out: str | None = None,
                 progress: str = "auto", enabled: bool = True, stream: IO[str] | None = None,
                 verbose: bool = True):
        self.total = total_epochs
        self.enabled = enabled
        self.out = stream or sys.stdout
        self.verbose = verbose
        self.bar = enabled and verbose and (
            progress == "on" or (progress == "auto" and sys.stderr.isatty()))
        self.metrics: IO[str] | None = None
        # opened at the first record (the run's header, after its checks): a run refused
        # before it leaves an earlier run's file as it was
        self._metrics_path = Path(metrics_out).expanduser() if enabled and metrics_out \
            else None
        self.start = time.perf_counter()
        self.first = 1  # the first epoch this process runs
        # epoch -> (loss, rank records) of the file this run replaces: a resumed run
        # carries those of its restored epochs over (a requeued job writes the same file)
        self._earlier: dict[int, tuple[float, list[dict[str, Any]]]] = {}
        self.resumed_after = 0  # the checkpoint's epoch (set before the header)

    def header(self, lines: list[str], record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._print(*lines, " ".join(f"{name:>{width}}" for name, width, _ in TABLE_COLUMNS))
        self._write({"event": "run", **record})

    def restored(self, records: list[EpochRecord]) -> None:
        """The epochs a checkpoint brought, into the metrics file only (marked
        ``"restored": true``), so that a resumed run's file holds the whole history."""
        if not self.enabled:
            return
        for rec in records:
            self._write({"event": "epoch", **asdict(rec), "restored": True})
            loss, ranks = self._earlier.get(rec.epoch, (None, []))
            if loss is not None and (loss == rec.loss or math.isnan(loss) and math.isnan(rec.loss)):
                for r in ranks:  # the same run's epoch (the requeued job's own file)
                    self._write({"event": "rank_epoch", **r, "restored": True})
        self.first = len(records) + 1

    def epoch(self, rec: EpochRecord) -> None:
        if not self.enabled:
            return
        values = (rec.epoch, rec.loss, rec.train_acc, rec.val_acc, rec.test_acc, rec.epoch_s,
                  rec.forward_s, rec.backward_s, rec.sync_s, rec.optimizer_s, rec.eval_s,
                  rec.other_s)
        row = " ".join(_fmt(width, f, v, name != "loss")  # a NaN loss is not a gap
                       for (name, width, f), v in zip(TABLE_COLUMNS, values))
        if self.bar:
            sys.stderr.write("\r\033[K")
        self._print(row)
        if self.bar:
            done = rec.epoch / self.total
            fill = int(30 * done)
            elapsed = time.perf_counter() - self.start
            # from the epochs run here (after a resume, not the restored ones)
            here = (rec.epoch - self.first + 1) / max(1, self.total - self.first + 1)
            eta = elapsed / here - elapsed if here > 0 else 0.0
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (30 - fill)}] {rec.epoch}/{self.total} "
                             f"loss {rec.loss:.4f} val {rec.val_acc:.2%} eta {eta:.0f}s")
            sys.stderr.flush()
        self._write({"event": "epoch", **asdict(rec)})

    def ranks(self, profiles: list[dict[str, Any]]) -> None:
        """One metrics line per rank for the epoch just reported."""
        for prof in profiles:
            self._write({"event": "rank_epoch", **prof})

    def summary(self, lines: list[str], record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self._print(*lines)
        self._write({"event": "summary", **record})

    def _print(self, *lines: str) -> None:
        if self.verbose:
            for line in lines:
                print(line, file=self.out)
            self.out.flush()

    def close(self) -> None:
        self._metrics_path = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _write(self, record: dict[str, Any]) -> None:
        if self.metrics is None and self._metrics_path is not None:
            if self.resumed_after:
                self._earlier = _earlier_epochs(self._metrics_path, self.resumed_after)
            self._metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self.metrics = self._metrics_path.open("w")
            self._metrics_path = None
        if self.metrics is not None:
            self.metrics.write(json.dumps(record, default=str) + "\n")
            self.metrics.flush()


def _earlier_epochs(path: Path, upto: int) -> dict[int, tuple[float, list[dict[str, Any]]]]:
    """Of the metrics file at ``path`` (if any), its epochs up to ``upto``: epoch ->
    (its loss, its ranks' records without their event key). Lines that are not records
    are passed over."""
    out: dict[int, tuple[float, list[dict[str, Any]]]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    except (OSError, UnicodeDecodeError):
        return out
    ranks: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("epoch"), int) \
                or rec["epoch"] > upto:
            continue
        event = rec.pop("event", None)
        rec.pop("restored", None)
        if event == "epoch" and isinstance(rec.get("loss"), float):
            out[rec["epoch"]] = (rec["loss"], ranks.setdefault(rec["epoch"], []))
        elif event == "rank_epoch":
            ranks.setdefault(rec["epoch"], []).append(rec)
    return out


def _fmt(width: int, fmt: str, value: float, gap: bool = True) -> str:
    if value != value and gap:  # NaN: an epoch without evaluation
        return f"{'-':>{width}}"
    text = f"{value:>{width}{fmt}}"
    if len(text) > width and fmt.endswith("f"):  # (a diverging loss, a stalled epoch)
        for digits in range(max(0, width - 6), -1, -1):  # in its column, so the rows
            text = f"{value:>{width}.{digits}e}"  # line up: 3.4e+13
            if len(text) <= width:
                break
        else:  # (-1e+100 in 7 columns)
            text = f"{'>' if value > 0 else '<'}{'9' * (width - 1)}"
    return text
