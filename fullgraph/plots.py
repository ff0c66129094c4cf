"""``fullgraph report``: PNG figures and a one-page HTML summary of a run's metrics file.

Figures (``FIGURES``), each ``FIGURE_PX`` pixels: loss and accuracy per epoch
(the best-validation epoch marked), per-rank compute / transfer / waiting time per
epoch as stacked bars (each rank's median epoch; the slowest rank, the one the others
waited for, outlined and labelled), bytes sent per epoch by communication phase
(stacked by rank), and epoch time over the run (log scale when the first epochs
are much slower than the rest). ``index.html`` shows the run header, the final
numbers, the per-rank table and the figures.

matplotlib is an optional extra (``pip install 'fullgraph[plots]'``); it is drawn
through ``matplotlib.figure.Figure`` only, never pyplot, so a notebook's pyplot
state is left alone.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from fullgraph.errors import ConfigError
from fullgraph.runlog import (
    MIB,
    RankRow,
    RunLog,
    fmt_bytes,
    phases,
    rank_rows,
    read_run_log,
    slowest_rank,
    waiting_split,
)

FIGURE_PX = (960, 480)
DPI = 100
FIGURES = ("training.png", "ranks.png", "bytes.png", "epoch_time.png")
COLORS = {"compute": "#4c72b0", "transfer": "#dd8452", "waiting": "#c44e52",
          "train": "#55a868", "val": "#8172b3", "test": "#dd8452"}


def require_matplotlib() -> None:
    """Raise a one-line error naming the extra when matplotlib is missing.

    Raises:
        ConfigError: matplotlib cannot be imported.
    """
    from fullgraph.extras import MissingExtraError, require

    try:
        require("matplotlib", "fullgraph report")
    except MissingExtraError as err:  # a usage error of this command: exit code 2
        raise ConfigError(str(err)) from None


def write_report(metrics: str | Path, out: str | Path) -> list[Path]:
    """Write the figures and ``index.html`` of the run in ``metrics`` into ``out``.

    Returns:
        The files written, the page last.

    Raises:
        ConfigError: matplotlib is not installed.
        DataError: ``metrics`` is not a readable metrics file.
    """
    require_matplotlib()
    log = read_run_log(metrics)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = rank_rows(log)
    slow = slowest_rank(log, rows)
    drawers = (_training, _ranks, _bytes, _epoch_time)
    written = []
    for name, draw in zip(FIGURES, drawers):
        fig = _figure()
        draw(fig, log, rows, slow)
        fig.savefig(out / name, dpi=DPI)
        written.append(out / name)
    page = out / "index.html"
    # other characters (a path, a dataset's name) as references: ASCII bytes, valid UTF-8
    page.write_bytes(render_page(log, rows, slow).encode("ascii", "xmlcharrefreplace"))
    return written + [page]


def _figure() -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(FIGURE_PX[0] / DPI, FIGURE_PX[1] / DPI), dpi=DPI,
                  layout="constrained")


def _training(fig: Any, log: RunLog, rows: list[RankRow], slow: int | None) -> None:
    loss_ax, acc_ax = fig.subplots(1, 2, sharex=True)  # (the loss's range: the run's too)
    epochs = [e["epoch"] for e in log.epochs]
    loss_ax.plot(epochs, [e["loss"] for e in log.epochs], color=COLORS["compute"],
                 marker="." if len(epochs) <= 60 else None)
    loss_ax.set(title="training loss", xlabel="epoch", ylabel="loss")
    bad = [e["epoch"] for e in log.epochs if not math.isfinite(e["loss"])]
    for i, epoch in enumerate(bad):  # (a line has no point there to draw)
        loss_ax.axvline(epoch, color="tab:red", linestyle=":", linewidth=1.5,
                        label="loss not finite: diverged" if i == 0 else None)
    if bad:
        loss_ax.legend(loc="upper right")
    for split in ("train", "val", "test"):
        points = [(e["epoch"], 100 * e[f"{split}_acc"]) for e in log.epochs
                  if not math.isnan(e[f"{split}_acc"])]
        if points:
            acc_ax.plot(*zip(*points), label=split, color=COLORS[split],
                        marker="." if len(points) <= 60 else None)
    summary = log.summary or {}
    best = summary.get("best_epoch")
    if best:
        what = "model kept: the last" if math.isnan(summary.get("best_val", 0.0)) else \
            "best validation"  # (no validation vertices: the last epoch's model is kept)
        for ax in (loss_ax, acc_ax):
            ax.axvline(best, color="grey", linestyle="--", linewidth=1,
                       label=f"{what} (epoch {best})")
    acc_ax.set(title="accuracy", xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100))
    acc_ax.legend(loc="lower right")
    for ax in (loss_ax, acc_ax):
        _integer_epochs(ax, epochs)
        ax.grid(alpha=0.3)


def _integer_epochs(ax: Any, epochs: list[int]) -> None:
    """Epoch ticks at whole epochs (one epoch: that one, centred, not 0.95-1.05)."""
    from matplotlib.ticker import MaxNLocator

    if len(set(epochs)) == 1:
        ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
        ax.set_xticks(epochs[:1])
        return
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _ranks(fig: Any, log: RunLog, rows: list[RankRow], slow: int | None) -> None:
    ax = fig.subplots()
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for label, key in (("compute", "compute_s"), ("transfer", "comm_s"),
                       ("waiting", "wait_s")):
        values = [1e3 * getattr(r, key) for r in rows]
        ax.bar(x, values, bottom=bottom, width=0.6, label=label, color=COLORS[label])
        bottom = [b + v for b, v in zip(bottom, values)]
    for k, (row, total) in enumerate(zip(rows, bottom)):
        text = f"{total:.1f} ms"
        if row.rank == slow:
            ax.bar([k], [total], width=0.6, fill=False, edgecolor="black", linewidth=2)
            text += ", slowest rank\n(the others wait for it)"
        ax.annotate(text, (k, total), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom")
    ax.set_xticks(x, [f"rank {r.rank}" for r in rows])
    ax.set_ylim(0, 1.25 * max(bottom + [1e-9]))
    note = (" (no epoch ran: no per-rank records)" if not rows else
            " (one worker: all compute)" if len(rows) < 2 else "" if slow is not None else
            " (waiting not split: the ranks' calls differed)" if not waiting_split(log) else
            " (no one rank held the others up)")
    ax.set(title="time per epoch by rank (each rank's median epoch)" + note,
           ylabel="milliseconds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)


def _bytes(fig: Any, log: RunLog, rows: list[RankRow], slow: int | None) -> None:
    ax = fig.subplots()
    names = phases(rows)
    if not names:
        why = ("one worker" if int(log.run.get("workers", 1)) < 2 else
               "no epoch ran" if not rows else "none recorded")
        ax.text(0.5, 0.5, f"no communication ({why})", ha="center", va="center",
                transform=ax.transAxes, fontsize=14)
        ax.set_axis_off()
        return
    y = list(range(len(names)))
    left = [0.0] * len(names)
    for row in rows:
        values = [row.sent.get(p, 0.0) / MIB for p in names]
        ax.barh(y, values, left=left, height=0.6, label=f"rank {row.rank}")
        left = [a + v for a, v in zip(left, values)]
    for k, total in enumerate(left):
        ax.annotate(fmt_bytes(total * MIB), (total, k), xytext=(4, 0), textcoords="offset points",
                    va="center")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(left))
    ax.set(title="bytes sent per epoch by phase (mean over epochs, all ranks)",
           xlabel="MiB per epoch")
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)


def _epoch_time(fig: Any, log: RunLog, rows: list[RankRow], slow: int | None) -> None:
    ax = fig.subplots()
    epochs = [e["epoch"] for e in log.epochs]
    times = [e["epoch_s"] for e in log.epochs]
    marker = "." if len(epochs) <= 60 else None
    for rank, recs in sorted(log.ranks.items()):  # rank 0's wall time is the epoch time
        ax.plot([r["epoch"] for r in recs], [r["wall_s"] for r in recs], marker=marker,
                linewidth=1, label=f"rank {rank}")
    if not log.ranks:
        ax.plot(epochs, times, color="black", marker=marker, label="epoch")
    restored = len(log.epochs) - len(log.ran)  # (they come first)
    if restored:  # timed by the run checkpointed, maybe under another strategy
        ax.axvspan(0.5, restored + 0.5, color="grey", alpha=0.12, linewidth=0,
                   label="restored from a checkpoint")
    ran = sorted(e["epoch_s"] for e in log.ran) or sorted(times)  # (none: resumed at its end)
    median = ran[len(ran) // 2]  # the median the run's summary gives
    if log.ran:
        ax.axhline(median, color="grey", linestyle="--", linewidth=1,
                   label=f"median {median * 1e3:.1f} ms")
    slowed, switched = adapt_epochs(log)
    for i, epoch in enumerate(slowed):
        ax.axvspan(epoch - 0.5, epoch + 0.5, color="tab:orange", alpha=0.15, linewidth=0,
                   label="slowdown injected" if i == 0 else None)
    for i, epoch in enumerate(switched):
        ax.axvline(epoch - 0.5, color="tab:purple", linestyle=":", linewidth=1,
                   label="plan switched" if i == 0 else None)
    for i, epoch in enumerate(left_out_epochs(log)):
        ax.axvline(epoch, color="tab:red", linestyle="-.", linewidth=1, alpha=0.6,
                   label="a worker left out of the update (partial reduce)" if i == 0
                   else None)
    drawn = [r["wall_s"] for recs in log.ranks.values() for r in recs] or times
    if log.ranks and restored:  # (their rank records, where carried, are another run's:
        # the epoch time it recorded is drawn, as that run's rank 0 saw it)
        back = log.epochs[:restored]
        ax.plot([e["epoch"] for e in back], [e["epoch_s"] for e in back], color="grey",
                marker=marker, linewidth=1, label="restored epochs (their run's time)")
        drawn += [e["epoch_s"] for e in back]
    title = "epoch time over the run"
    if max(drawn) > 10 * median:
        ax.set_yscale("log")
        title += " (log scale: some epochs, often the first, are much slower)"
    ax.set(title=title, xlabel="epoch", ylabel="seconds")
    _integer_epochs(ax, epochs)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3, which="both")


def adapt_epochs(log: RunLog) -> tuple[list[int], list[int]]:
    """The epochs in which a slowdown was injected on some rank, and those that were
    the first on a plan an adapter switched to (``--inject``, ``--adapt``): an
    adapter's event is kept in the record of the epoch it shaped, the one after the
    adapter ran."""
    slowed, switched = set(), set()
    for recs in [*log.restored_ranks.values(), *log.ranks.values()]:
        for r in recs:
            for e in r.get("events", ()):
                if e.get("kind") == "inject":
                    slowed.add(int(r["epoch"]))
                elif e.get("kind") in ("adjust", "shares") and e.get("switched"):
                    switched.add(int(r["epoch"]))
    return sorted(slowed), sorted(switched)


def left_out_epochs(log: RunLog) -> list[int]:
    """The epochs in which partial reduce updated without some worker's gradient."""
    return sorted({int(r["epoch"]) for recs in [*log.restored_ranks.values(),
                                                 *log.ranks.values()]
                   for r in recs for e in r.get("events", ())
                   if e.get("kind") == "partial" and e.get("skipped")})


def adapt_lines(log: RunLog) -> list[str]:
    """The run summary's lines on what was injected and adapted, per rank."""
    from types import SimpleNamespace

    from fullgraph.profile import event_lines

    both = {rank: [*log.restored_ranks.get(rank, []), *log.ranks.get(rank, [])]
            for rank in sorted({*log.ranks, *log.restored_ranks})}  # (restored: before)
    return event_lines([[SimpleNamespace(rank=rank, epoch=r.get("epoch"),
                                         events=r.get("events", [])) for r in recs]
                        for rank, recs in both.items() if recs])


def outside(log: RunLog) -> list[str]:
    """The summary's lines on the traffic outside the epochs (``profile.outside_lines``)."""
    from fullgraph.profile import outside_lines

    return outside_lines([[(r.get("setup_sent", {}), r.get("between_sent", {}),
                            r.get("between_s", 0.0)) for r in recs]
                          for _, recs in sorted(log.ranks.items())])


def header_lines(log: RunLog) -> list[str]:
    """The run header: dataset, model, run (strategy, workers, device, training options)."""
    ds, cfg = log.run.get("dataset", {}), log.run.get("config", {})
    restored = len(log.epochs) - len(log.ran)
    model, train = cfg.get("model", {}), cfg.get("train", {})
    return [
        f"dataset {ds.get('name', '?')}: {ds.get('vertices', '?')} vertices, "
        f"{ds.get('edges', '?')} edges, {ds.get('features', '?')} features, "
        f"{ds.get('classes', '?')} class{'' if ds.get('classes') == 1 else 'es'} (train "
        f"{ds.get('train', '?')} / val {ds.get('val', '?')} / test {ds.get('test', '?')})",
        f"model {model.get('name', '?')}: {model.get('layers', '?')} layers, hidden "
        f"{model.get('hidden', '?')}, dropout {model.get('dropout', '?')}, stages "
        f"{log.run.get('program', '?')}",
        f"run strategy {log.config('runtime', 'strategy', '?')}, "
        f"{log.run.get('workers', '?')} worker(s), device {log.run.get('device', '?')}, "
        f"{log.run.get('threads', '?')} threads, {len(log.epochs)} epochs"
        + (f" ({restored} of them restored from a checkpoint, which another strategy or "
           "worker count may have run)" if restored else "") + ", lr "
        f"{train.get('lr', '?')}, weight decay {train.get('weight_decay', '?')}, seed "
        f"{train.get('seed', '?')}, setup {log.run.get('setup_s', float('nan')):.2f} s",
    ] + _adapt_header(log)


def _adapt_header(log: RunLog) -> list[str]:
    """``adapt ...``: the runtime adaptation of the run, and whether it is approximate."""
    mode, inject = log.config("adapt", "mode", "off"), log.config("adapt", "inject", None)
    if mode in (None, "off") and not inject:
        return []
    staleness = log.config("adapt", "staleness", 3)
    kind = "" if mode != "adjust+partial" else \
        f" (approximate: partial reduce, K={staleness})" if staleness and staleness > 1 \
        else " (exact with K=1)"
    return [f"adapt --adapt {mode}{kind}" + (f", --inject {inject}" if inject else "")]


def final_lines(log: RunLog) -> list[str]:
    """The final numbers, from the summary record (or the last epoch if unfinished)."""
    s = log.summary
    if s is None:
        last = log.epochs[-1]
        of = log.config("train", "epochs")
        line = (f"unfinished run: last epoch {last['epoch']}"
                + (f" of {of}" if of else "") + f", loss {last['loss']:.4f}")
        seen = [e for e in log.epochs if math.isfinite(e["val_acc"])]
        if seen:
            top = max(seen, key=lambda e: e["val_acc"])  # (the first of equals, as a run)
            line += (f"; best validation so far at epoch {top['epoch']}: validation "
                     f"{top['val_acc']:.2%}, test {top['test_acc']:.2%}")
        return [line]
    restored = len(log.epochs) - len(log.ran)
    early = f", stopped early (patience {log.config('train', 'patience')})" \
        if s.get("stopped_early") else ""
    if s.get("diverged_at") is not None:
        early = f", stopped at epoch {s['diverged_at']}: its loss is not finite (the " \
            "training diverged)"
    if restored == len(log.epochs):  # resumed after its last epoch (or its early stop)
        ran = f"no epoch ran after the {restored} restored from a checkpoint{early}"
    else:
        count = len(log.epochs) - restored
        ran = f"{count} epoch{'' if count == 1 else 's'} in {s['total_s']:.2f} s" + (
            f" after {restored} restored from a checkpoint" if restored else "") + early + \
            f", median epoch {s['median_epoch_s'] * 1e3:.1f} ms"
    if math.isnan(s["best_val"]):  # as the run says it: nothing chose an epoch
        kept = (f"no validation vertices: the model kept is the last epoch's (epoch "
                f"{s['best_epoch']}): test accuracy {s['test_acc']:.2%}, train "
                f"{s['train_acc']:.2%}")
    else:
        kept = (f"test accuracy {s['test_acc']:.2%} at the best-validation epoch "
                f"{s['best_epoch']} (validation {s['best_val']:.2%}, train "
                f"{s['train_acc']:.2%})")
    return [kept, f"final loss {log.epochs[-1]['loss']:.4f}; {ran}"]


def render_page(log: RunLog, rows: list[RankRow], slow: int | None) -> str:
    """The one-page HTML summary; the figures are files beside it."""
    esc = html.escape
    strategy = log.config("runtime", "strategy", "?")
    title = (f"{log.run.get('dataset', {}).get('name', '?')} / "
             f"{log.config('model', 'name', '?')} / {strategy}")
    table = ["<tr><th>rank</th><th>compute ms</th><th>transfer ms</th><th>waiting ms</th>"
             "<th>wall ms</th><th>sent MiB</th><th>recv MiB</th><th>peak MiB</th></tr>"]
    for r in rows:
        mark = " (slowest)" if r.rank == slow else ""
        cells = [f"{r.rank}{mark}"] + [f"{1e3 * v:.1f}" for v in
                                       (r.compute_s, r.comm_s, r.wait_s, r.wall_s)]
        cells += [f"{sum(d.values()) / MIB:.3f}" for d in (r.sent, r.recv)]
        cells.append(f"{r.peak_mem / MIB:.0f}" if r.peak_mem else "-")
        table.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        table.append('<tr><td colspan="8">no per-rank records: no epoch ran</td></tr>')
    figures = "\n".join(f'<img src="{name}" alt="{name}" width="{FIGURE_PX[0]}">'
                        for name in FIGURES)
    items = "".join(f"<li>{esc(line)}</li>" for line in header_lines(log))
    final = "".join(f"<li>{esc(line)}</li>"
                    for line in final_lines(log) + outside(log) + adapt_lines(log))
    config = esc(json.dumps(log.run.get("config", {}), indent=1))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>fullgraph run: {esc(title)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}}
td,th{{padding:2px 10px;text-align:right}} img{{max-width:100%}}</style></head>
<body><h1>fullgraph run: {esc(title)}</h1>
<p>from {esc(str(log.source))}</p>
<h2>Run</h2><ul>{items}</ul>
<h2>Result</h2><ul>{final}</ul>
<h2>Per rank (its median epoch)</h2><table>{"".join(table)}</table>
<details><summary>complete configuration</summary><pre>{config}</pre></details>
<h2>Figures</h2>
{figures}
</body></html>
"""
